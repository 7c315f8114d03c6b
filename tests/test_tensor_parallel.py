"""Tensor parallel (--tp, parallel/tensor_parallel.py), proven equal to one process: 2 ranks, and 2 replicas x 2 ranks
(losses, val losses, clipping's norms, final weights within 1e-5; the exported checkpoint in transformers); checkpoints
that cross layouts both ways; c_attn's regrouping of q, k and v by heads; the plan line's parameters per rank; the
layouts refused with one line.

The tiny model (2 heads, 32 wide): with --tp 2 each rank computes one head and 64 of the MLP's 128 columns.
"""
import re

import pytest
import torch

from plumbing import checkpoints
from model import GPTConfig, GPT, load_model
from tokenizer import PADDED_VOCAB_SIZE
from conftest import (LIMIT, TINY_MODEL, assert_resumes_across, assert_same_run, assert_trains_as_one_process,
                      clean_env, final_weights_diff, printed_norms, refused, run_launched, run_rank_script, run_train,
                      stopped_after_step_3, tiny_run_args, torchrun)
from parallel import tensor_parallel

TOL = 1e-5
EAGER = ["--no-compile"]  # (the one-process reference: test_compiled_parts_equal_eager compiles the parts)
REFERENCE = EAGER  # (conftest's single: one process's run)


@pytest.fixture(scope="module")
def tp2(data, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("tp2") / "log"
    return log_dir, run_launched(tiny_run_args(data, log_dir, "--tp", "2", *EAGER), torchrun(2), clean_env())


def tiny_shares(tp):
    """(parameters on each rank, in all) of the tiny model under --tp, counted from a one-process GPT: every block's
    c_attn, c_fc (weights and biases) and both c_proj weights are split, everything else is whole."""
    n_layer, n_head, n_embd, block_size = (int(v) for v in TINY_MODEL[1::2])
    model = GPT(GPTConfig(block_size=block_size, vocab_size=PADDED_VOCAB_SIZE,
                                                n_layer=n_layer, n_head=n_head, n_embd=n_embd))
    split = sum(p.numel() for n, p in model.named_parameters()
                if re.search(r"attn\.c_attn\.|mlp\.c_fc\.|c_proj\.weight", n))
    total = sum(p.numel() for p in model.parameters())
    return total - split + split // tp, total


@pytest.mark.xdist_group("multiprocess-2")
# (2 replicas x 2 ranks in the main lane: on task data, below)
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.long)], ids=["tp2", "dp2xtp2"])
def test_tensor_parallel_equals_one_process(data, single, tp2, tmp_path, ranks):
    """The losses of 6 steps, the val losses, the gradient norms (clipping's: split gradients summed over the ranks,
    replicated ones counted once) and the final weights of one process; the run's end check has found the replicas
    equal (it stops the run otherwise); its last checkpoint, exported, is the trained model in transformers."""
    if ranks == 2:
        log_dir, proc = tp2
    else:
        log_dir = tmp_path / "log"
        proc = run_launched(tiny_run_args(data, log_dir, "--tp", "2", *EAGER), torchrun(ranks), clean_env())
    assert f"tensor parallel: 2 ranks x {ranks // 2} data-parallel replica(s)" in proc.stdout
    mine, total = tiny_shares(2)
    assert f"each rank: {mine / 1e6:.2f}M of {total / 1e6:.2f}M parameters" in proc.stdout
    worst = assert_trains_as_one_process(single, log_dir, proc, ranks, TOL)
    print(f"{ranks} ranks --tp 2 vs 1 process: largest train loss difference {worst:.1e}")
    assert_exported_equals_trained(log_dir, single[0], tmp_path / "hf")


def assert_exported_equals_trained(log_dir, single_dir, out):
    """The run's last checkpoint through export_hf.py: transformers' GPT2LMHeadModel gives the logits (and greedy
    tokens) of our model from that checkpoint, and the logits of the one-process run's last checkpoint. (The second
    is what catches a c_attn left in the ranks' order: our model and the export would read it alike, both wrong.)"""
    from transformers import GPT2LMHeadModel
    from test_export import assert_same_as_transformers, run_export
    ckpt = checkpoints.list_checkpoints(str(log_dir))[-1]
    proc = run_export(ckpt, out)
    assert proc.returncode == 0, proc.stderr
    assert_same_as_transformers(load_model(ckpt)[0], str(out))
    one_process = load_model(checkpoints.list_checkpoints(str(single_dir))[-1])[0].eval()
    idx = torch.randint(0, 50257, (2, one_process.config.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs, (mine, _) = GPT2LMHeadModel.from_pretrained(str(out)).eval()(idx).logits, one_process(idx)
    diff = (theirs - mine[..., :50257]).abs().max().item()
    print(f"exported --tp checkpoint vs the one-process run, in transformers: max abs logit difference {diff:.1e}")
    assert diff <= TOL


@pytest.mark.xdist_group("multiprocess-2")
def test_checkpoints_cross_layouts(single, tp2, tmp_path):
    """A --tp checkpoint is a .dcp folder each rank wrote its share of, in the whole model's names and places (c_attn's
    rows as their q, k and v blocks): it resumes on one process, and one process's .pt resumes under --tp 2, each
    continuing the uninterrupted run."""
    assert_resumes_across(tp2[0], single[0], tmp_path, ["--tp", "2"], "tensor parallel: 2 ranks", EAGER)


@pytest.mark.xdist_group("multiprocess-2")
@pytest.mark.parametrize("ranks", [4, pytest.param(8, marks=pytest.mark.long)], ids=["pp2xtp2", "dp2xpp2xtp2"])
def test_pipeline_of_split_stages_equals_one_process(data, single, tmp_path, ranks):
    """--pp 2 --tp 2 on one (dp, pp, tp) mesh: each stage's block split over 2 ranks, the activations passed from each
    tensor-parallel rank to its peer of the next stage, the tied weight's gradients summed per peer pair, clipping's
    norm summed over the split, the stages and the replicas. Losses, norms and final weights as one process."""
    log_dir = tmp_path / "log"
    proc = run_launched(tiny_run_args(data, log_dir, "--pp", "2", "--tp", "2", "--batch_size", "2", *EAGER),
                        torchrun(ranks), clean_env())
    assert (f"pipeline: 2 stages x {ranks // 4} data-parallel replica(s), each stage's blocks split over 2 "
            "tensor-parallel ranks") in proc.stdout
    assert_trains_as_one_process(single, log_dir, proc, ranks, TOL)


@pytest.mark.long  # (the main lane: a .pt cut by each stage, test_pipeline.py; by each share, cross_layouts below)
@pytest.mark.xdist_group("multiprocess-2")
def test_a_one_process_checkpoint_resumes_on_split_stages(single, tmp_path):
    """A one-process .pt resumes under --pp 2 --tp 2, each rank cutting its part from it: the uninterrupted run."""
    resumed = stopped_after_step_3(single[0], tmp_path / "resumed")
    proc = run_launched(["--resume", "--log_dir", resumed, "--pp", "2", "--tp", "2", "--batch_size", "2"],
                        torchrun(4), clean_env())
    assert "model_00003.pt at step 3" in proc.stdout
    assert_same_run(single[0], resumed)
    assert final_weights_diff(single[0], resumed) <= TOL


@pytest.mark.xdist_group("multiprocess-2")
@pytest.mark.parametrize("flags", [["--tp", "2"], pytest.param(["--pp", "2", "--tp", "2", "--batch_size", "2"],
                                                                  marks=pytest.mark.long)],
                         ids=["tp2", "pp2xtp2"])
def test_compiled_parts_equal_eager(data, single, tmp_path, flags):
    """Compiled as one process is (the default): tensor parallel's split model, and a pipeline's stages with their
    split blocks (the stage's forward and its loss, one graph each; DTensor's collectives inside them). The same run
    as eager one process within fp32 rounding (the compiled kernels sum in another order)."""
    ranks = 2 * (1 + ("--pp" in flags))
    log_dir = tmp_path / "log"
    proc = run_launched(tiny_run_args(data, log_dir, *flags, "--compile"), torchrun(ranks),
                        clean_env(TORCH_COMPILE_DISABLE="0"))  # (conftest turns compiling off for every other test)
    assert "compile: torch.compile" in proc.stdout and "compile: took about" in proc.stdout
    from conftest import read_log
    for kind in ("train", "val"):
        ref, got = read_log(single[0], kind), read_log(log_dir, kind)
        assert sorted(got) == sorted(ref) and max(abs(ref[s] - got[s]) for s in ref) <= 1e-4, (kind, ref, got)
    assert final_weights_diff(single[0], log_dir) <= 1e-4


@pytest.mark.xdist_group("multiprocess-2")
def test_tensor_parallel_on_task_data_equals_one_process(tmp_path):
    """Packed task rows with answers of uneven length, on 2 replicas x 2 ranks: attention inside each example on the
    rank's heads, and each micro-batch's loss weighed by its share of the step's targets (2 micro-batches of one row
    a step on each replica)."""
    from conftest import read_log
    from test_finetune_train import task_run_args, uneven_task
    task = uneven_task(tmp_path)
    equal = ["--batch_size", "1", "--total_batch_size", "256", *EAGER]
    single = run_train(task_run_args(task, tmp_path / "single", *equal), env=clean_env(), timeout=LIMIT)
    proc = run_launched(task_run_args(task, tmp_path / "tp", *equal, "--tp", "2"), torchrun(4), clean_env())
    assert "tensor parallel: 2 ranks x 2 data-parallel replica(s)" in proc.stdout
    ref, got = read_log(tmp_path / "single", "train"), read_log(tmp_path / "tp", "train")
    assert sorted(got) == sorted(ref) == [0, 1, 2, 3]
    assert max(abs(ref[s] - got[s]) for s in ref) <= TOL, (ref, got)
    # a uniform scale error on the gradient would keep the losses close (AdamW and clipping hide it): the norms show it
    norms, reference = printed_norms(proc.stdout), printed_norms(single.stdout)
    assert len(norms) == 4 and max(abs(a - b) for a, b in zip(norms, reference)) <= 2e-4, (norms, reference)
    assert final_weights_diff(tmp_path / "single", tmp_path / "tp") <= TOL


def test_c_attn_rows_grouped_by_heads():
    """Rank r's rows of the regrouped c_attn are the q, k and v rows of its own heads, in that order; undone exactly."""
    C, tp = 8, 2  # rows 0-7 are q, 8-15 k, 16-23 v; rank 0's heads are columns 0-3 of each, rank 1's 4-7
    order = tensor_parallel.rank_order(C, tp)
    assert order.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    w = torch.randn(3 * C, 5)
    assert torch.equal(tensor_parallel.to_rank_order(tensor_parallel.to_rank_order(w, C, tp), C, tp, inverse=True), w)


def test_parallel_tp_forces_tensor_parallel_over_every_rank():
    from train_args import build_parser, resolve_layout
    args = build_parser().parse_args(["--parallel", "tp"])
    resolve_layout(args, {"parallel": "tp"}, 4)
    assert (args.shard, args.pp, args.tp) == ("none", 1, 4)
    args = build_parser().parse_args(["--tp", "2"])
    resolve_layout(args, {"tp": 2}, 4)
    assert args.parallel == "flags"  # --tp given: a layout forced, not one for --parallel auto to choose


def test_bad_layouts_are_one_line(data, tmp_path):
    from train_args import build_parser, check_args
    assert "--tp 3: the world size 4 is not a multiple of it" in refused(data, 4, "--tp", "3")
    assert "--tp 2 does not divide the model's 3 heads (--n_head)" in refused(data, 2, "--tp", "2", "--n_head", "3",
                                                                               "--n_embd", "96")
    check_args(build_parser().parse_args(["--data_dir", data, "--tp", "2", "--pp", "2"]), 4)  # (combined: accepted)
    assert "--pp 2: the world size 3 is not a multiple" in refused(data, 6, "--tp", "2", "--pp", "2")
    assert "--tp 2 with --shard: not yet combined" in refused(data, 2, "--tp", "2", "--shard", "full")
    assert "--tp 2 with --lora: not yet combined" in refused(data, 2, "--tp", "2", "--lora", "4")
    proc = run_train(tiny_run_args(data, tmp_path / "log", "--tp", "2"), check=False)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error: --tp 2: the world size 1")
    assert "Traceback" not in proc.stderr


TRAFFIC = '''
import json, sys, torch, torch.distributed as dist
from types import SimpleNamespace
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, sys.argv[1])
from model import GPT, GPTConfig
from parallel import tensor_parallel
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
config = GPTConfig(block_size=16, vocab_size=128, n_layer=2, n_head=2, n_embd=8)
seen = []
class Record(TorchDispatchMode):  # every collective the step makes: DTensor's (functional) ones and ours
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in str(func):
            seen.append([str(func), str(args[0].dtype) if hasattr(args[0], "dtype") else "",
                         list(getattr(args[0], "shape", []))])
        return func(*args, **(kwargs or {}))
out = {}
for dtype in ("fp32", "bf16"):
    split = tensor_parallel.TensorParallel(GPT(config), SimpleNamespace(tp=2, batch_size=2, seq_len=16),
                                           SimpleNamespace(world_size=2, rank=dist.get_rank(), device="cpu"), 3,
                                           lambda *a: None, dtype)
    x = torch.randint(0, 128, (2, 16))
    seen.clear()
    with Record():
        split.step([(x, x, None)] * 3, None, 1.0)
    out[dtype] = {"seen": list(seen), "plan": tensor_parallel.rank_plan(config, 2, 1, 2, 16, 3, dtype)[1]}
if dist.get_rank() == 0:
    print(json.dumps(out))
del split  # the model goes before the group (world.leave_process_group says why)
from parallel import world
world.leave_process_group()
'''


@pytest.mark.xdist_group("multiprocess-2")
def test_traffic_is_the_plan_lines(tmp_path):
    """What --tp sends, recorded during a step of 3 micro-batches through 2 blocks: per micro-batch and block 2
    all-reduces of (B, T, C) forward, in the forward's dtype, and 2 backward, in fp32; their bytes (2 (N-1)/N of each
    tensor from each rank) are the plan line's. Beside them, only clipping's one all-reduce of a number."""
    import json
    script = tmp_path / "traffic.py"
    script.write_text(TRAFFIC)
    proc = run_rank_script(script, 2)
    for dtype, got in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        activations = [(d, s) for f, d, s in got["seen"] if "_c10d_functional.all_reduce" in f]
        forward = "torch.bfloat16" if dtype == "bf16" else "torch.float32"
        assert activations == 3 * ([(forward, [2, 16, 8])] * 4 + [("torch.float32", [2, 16, 8])] * 4), got["seen"]
        sends = ("all_reduce", "allreduce", "gather", "scatter", "broadcast", "send", "recv")  # (not waits, wrappers)
        rest = [f for f, d, s in got["seen"] if any(w in f for w in sends) and "_c10d_functional.all_reduce" not in f]
        assert len(rest) == 1 and "allreduce" in rest[0], rest  # the clipping norm's squares
        sent = sum(2 * 16 * 8 * (2 if d == "torch.bfloat16" else 4) for d, _ in activations) * 2 * (2 - 1) / 2
        assert got["plan"] == sent, (dtype, got["plan"], sent)
