"""Pipeline parallel (--pp, parallel/pipeline.py), proven equal to one process: 2 and 3 stages, 2 replicas x 2 stages,
checkpoints that cross layouts, the stage split, and the layouts refused with one line.

A 4-block tiny model, so that 3 stages have blocks to hold (one stage gets two); 384 tokens a step = 2 rows x 32 tokens
x 6 micro-batches (3 on each of 2 replicas): the same data and the same mean gradient as one process, whose losses and
final weights they match to about 1e-6.
"""
import os

import pytest

from model import GPTConfig
from conftest import (LIMIT, RECORDING_RANK, assert_resumes_across, assert_same_run, assert_trains_as_one_process,
                      clean_env, final_weights_diff, make_shards, printed_norms, read_log, refused, run_launched,
                      run_rank_script, run_train, stopped_after_step_3, tiny_run_args, torchrun)
from parallel import sizes, stage_split

pytestmark = pytest.mark.xdist_group("multiprocess")

TOL = 1e-5
EQUAL = ["--batch_size", "2", "--total_batch_size", "384", "--n_layer", "4"]
REFERENCE = EQUAL  # (conftest's single: one process's run)


@pytest.fixture(scope="module")
def pp2(data, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("pp2") / "log"
    return log_dir, run_launched(tiny_run_args(data, log_dir, *EQUAL, "--pp", "2"), torchrun(2), clean_env())


@pytest.fixture(scope="module")
def pp2_full(data, tmp_path_factory):
    """2 replicas x 2 stages, each stage sharded over its replicas (FSDP, ZeRO-3)."""
    log_dir = tmp_path_factory.mktemp("pp2_full") / "log"
    return log_dir, run_launched(tiny_run_args(data, log_dir, *EQUAL, "--pp", "2", "--shard", "full"), torchrun(4),
                                 clean_env())


# (the long lane adds ZeRO-2 stages under GPipe; the main lane sees GPipe on 2 ranks, ZeRO-2 stages' traffic below)
@pytest.mark.parametrize("ranks,flags", [(2, ["--pp", "2"]), (3, ["--pp", "3"]),
                                         (2, ["--pp", "2", "--pp_schedule", "gpipe"]),
                                         (4, ["--pp", "2"]), (4, ["--pp", "2", "--shard", "full"]),
                                         pytest.param(4, ["--pp", "2", "--shard", "grads", "--pp_schedule", "gpipe"],
                                                      marks=pytest.mark.long)],
                         ids=["pp2", "pp3", "pp2-gpipe", "dp2xpp2", "dp2xpp2-full", "dp2xpp2-grads-gpipe"])
def test_pipeline_equals_one_process(data, single, pp2, pp2_full, tmp_path, ranks, flags):
    """The losses of 6 steps, the val losses, the gradient norms (clipping's: the tied weight counted once) and the
    final weights of one process, on every layout; the run's own end check has found the replicas of each stage
    and the tied weight's two copies equal (it stops the run otherwise)."""
    if flags == ["--pp", "2"] and ranks == 2:
        log_dir, proc = pp2
    elif "full" in flags:
        log_dir, proc = pp2_full
    else:
        log_dir = tmp_path / "log"
        proc = run_launched(tiny_run_args(data, log_dir, *EQUAL, *flags), torchrun(ranks), clean_env())
    pp, dp = int(flags[1]), ranks // int(flags[1])
    assert f"pipeline: {pp} stages x {dp} data-parallel replica(s)" in proc.stdout
    assert f"bubble (N-1)/(M+N-1) = {(pp - 1) / (6 // dp + pp - 1):.1%}" in proc.stdout
    worst = assert_trains_as_one_process(single, log_dir, proc, ranks, TOL)
    print(f"{ranks} ranks {' '.join(flags)} vs 1 process: largest train loss difference {worst:.1e}")


def test_checkpoints_cross_layouts(data, single, pp2, tmp_path):
    """A pipeline's checkpoint is a .dcp folder each stage wrote its part of, in the whole model's names: it resumes on
    one process, and one process's .pt resumes on a pipeline, each continuing the uninterrupted run (sample.py and
    export_hf.py read one: test_parts.py)."""
    assert sorted(os.listdir(pp2[0])) == ["args.json", "lock", "log.txt", "model_00003.dcp", "model_00006.dcp",
                                          "report.md", "report.png"]
    assert_resumes_across(pp2[0], single[0], tmp_path, ["--pp", "2"], "pipeline: 2 stages")


def test_a_stage_reads_only_its_own_tensors_of_a_one_process_checkpoint(single, tmp_path):
    """A one-process .pt resumed on 2 stages is mapped, not read: each stage reads, and checks against its checksum, the
    tensors it holds. Block 3's c_fc weight damaged (stage 1's: blocks 2-3): rank 1 refuses it in one line, and rank 0,
    which never read it, has nothing to say (had it read the whole file, its own line would come first)."""
    import torch
    log = stopped_after_step_3(single[0], tmp_path / "log")
    ckpt = torch.load(log / "model_00003.pt", weights_only=True)
    ckpt["model"]["transformer.h.3.mlp.c_fc.weight"][0, 0] += 1.0  # (its checksum left as it was)
    torch.save(ckpt, log / "model_00003.pt")
    proc = run_launched(["--resume", "--log_dir", log, "--pp", "2"], torchrun(2), clean_env(), check=False)
    assert proc.returncode != 0 and "step " not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: rank 1: checkpoint {log / 'model_00003.pt'} is damaged: tensor "
                      "model/transformer.h.3.mlp.c_fc.weight does not match its checksum"], proc.stderr


def test_sharded_stages_checkpoint_resumes_on_one_process(single, pp2_full, tmp_path):
    """Stages sharded over their replicas write their pieces of the weights and AdamW moments (no rank gathers them):
    the .dcp resumes on one process and continues the uninterrupted run."""
    assert "model_00003.dcp" in os.listdir(pp2_full[0]) and "each stage sharded over its replicas" in pp2_full[1].stdout
    to_one = stopped_after_step_3(pp2_full[0], tmp_path / "to_one")
    proc = run_train(["--resume", "--log_dir", to_one], env=clean_env(), timeout=LIMIT)
    assert "model_00003.dcp at step 3" in proc.stdout and "pipeline:" not in proc.stdout
    assert sorted(read_log(to_one, "train")) == [0, 1, 2, 3, 4, 5]
    assert_same_run(single[0], to_one)
    assert final_weights_diff(single[0], to_one) <= TOL


def test_ddp_checkpoint_resumes_on_a_pipeline(data, single, tmp_path):
    """DDP's checkpoint (2 ranks, stopped after step 3) resumes on 2 stages and continues the uninterrupted run: the
    losses after resuming and the final weights are one process's."""
    ddp = tmp_path / "ddp"
    run_launched(tiny_run_args(data, ddp, *EQUAL), torchrun(2), clean_env())
    resumed = stopped_after_step_3(ddp, tmp_path / "ddp_to_pp")
    proc = run_launched(["--resume", "--log_dir", resumed, "--pp", "2"], torchrun(2), clean_env())
    assert "model_00003.pt at step 3" in proc.stdout and "pipeline: 2 stages" in proc.stdout
    assert sorted(read_log(resumed, "train")) == [0, 1, 2, 3, 4, 5]
    assert_same_run(single[0], resumed)
    assert final_weights_diff(single[0], resumed) <= TOL


@pytest.mark.long  # (the main lane: a .dcp of --shard full resumed on 2 stages, test_parts.py)
def test_sharded_checkpoint_resumes_on_dp2_x_pp2(data, single, tmp_path):
    """--shard full's .dcp checkpoint (2 ranks, stopped after step 3) resumes on 2 replicas x 2 stages (DDP, then
    sharded stages), each stage reading its part (the last stage's lm_head and its AdamW moments from the tied
    weight's one entry), and continues the uninterrupted run: the losses after resuming and the final weights are one
    process's."""
    sharded = tmp_path / "sharded"
    run_launched(tiny_run_args(data, sharded, *EQUAL, "--shard", "full"), torchrun(2), clean_env())
    resumed = stopped_after_step_3(sharded, tmp_path / "sharded_to_pp")
    proc = run_launched(["--resume", "--log_dir", resumed, "--pp", "2", "--shard", "none"], torchrun(4), clean_env())
    assert "model_00003.dcp at step 3" in proc.stdout and "pipeline: 2 stages x 2 data-parallel" in proc.stdout
    assert_same_run(single[0], resumed)
    assert final_weights_diff(single[0], resumed) <= TOL
    # and onto stages that are themselves sharded (--shard full, from the checkpoint's arguments): DCP reads the pieces
    resumed = stopped_after_step_3(sharded, tmp_path / "sharded_to_sharded_pp")
    proc = run_launched(["--resume", "--log_dir", resumed, "--pp", "2"], torchrun(4), clean_env())
    assert ("model_00003.dcp at step 3" in proc.stdout
            and "each stage sharded over its replicas (--shard full)" in proc.stdout)
    assert_same_run(single[0], resumed)
    assert final_weights_diff(single[0], resumed) <= TOL


def test_split_balances_compute():
    """Contiguous runs of at least one block each, the largest stage cost as small as it can be: lm_head (here worth
    3 blocks) pushes blocks toward the first stages."""
    assert stage_split.split_blocks(12, 3, 1.0, 3.0) == [(0, 5), (5, 10), (10, 12)]
    assert stage_split.split_blocks(4, 3, 1.0, 0.0) in ([(0, 2), (2, 3), (3, 4)], [(0, 1), (1, 2), (2, 4)],
                                                        [(0, 1), (1, 3), (3, 4)])
    assert stage_split.split_blocks(4, 4, 1.0, 100.0) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    config = GPTConfig(n_layer=12, n_embd=768, vocab_size=50304)
    bounds = stage_split.split_blocks(12, 3, *stage_split.stage_costs(config, 1024))
    # GPT-2 (124M): lm_head costs about 4.5 blocks, so the last stage gets 1 (cost 5.5), the others 5 and 6
    assert [b - a for a, b in bounds] in ([5, 6, 1], [6, 5, 1])


def test_split_fits_max_memory():
    """With a budget (--max_memory), the most balanced cut whose every stage's planned peak fits: GPT-2 large's shape on
    3 stages in bf16 at 6 GiB moves blocks off the end stages (which hold the vocabulary's matrices) onto the middle
    one; the planner (layouts.plan) plans that cut; a budget nothing fits keeps the cut for compute."""
    from parallel import layouts
    config = GPTConfig(block_size=1024, vocab_size=50304, n_layer=36, n_head=20, n_embd=1280)
    balanced = stage_split.stage_bounds(config, 3, 64, None, True)
    fitted = stage_split.stage_bounds(config, 3, 64, 6 * 2**30, True)
    assert [b - a for a, b in balanced] == [13, 13, 10] and [b - a for a, b in fitted] == [11, 14, 11]
    for s, (a, b) in enumerate(fitted):
        params = sizes.stage_parameters(config, a, b, s == 0, s == 2)
        assert sizes.training_memory(params, (s == 0) + (s == 2), config, True) <= 6 * 2**30
    assert stage_split.stage_bounds(config, 3, 64, 2**30, True) == balanced

    def planned(budget):
        return layouts.plan(layouts.Layout("pp", "none", 3), config, 3, 1, 64, 3, True, budget).memory

    assert planned(6 * 2**30) < 6 * 2**30 < planned(None)


def test_bad_layouts_are_one_line(data, tmp_path):
    assert "--pp 5: more stages than the model's 4 blocks" in refused(data, 5, "--pp", "5", "--n_layer", "4")
    assert "--pp 2: the world size 3 is not a multiple" in refused(data, 3, "--pp", "2")
    assert "--pp 2 --lora runs with --shard none" in refused(data, 4, "--pp", "2", "--lora", "4", "--shard", "full")
    message = refused(data, 2, "--pp", "2", "--batch_size", "2", "--seq_len", "32", "--total_batch_size", "64")
    assert "--pp_schedule 1f1b needs at least 2 micro-batches a step" in message and "gpipe" in message
    proc = run_train(tiny_run_args(data, tmp_path / "log", "--pp", "2"), check=False)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error: --pp 2: the world size 1")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("ranks,flags", [(2, []), pytest.param(4, ["--shard", "full"], marks=pytest.mark.long)],
                         ids=["pp2", "dp2xpp2-full"])
def test_pipeline_on_task_data_equals_one_process(tmp_path, ranks, flags):
    """Packed task rows with answers of uneven length: each micro-batch's loss weighs by its share of the step's
    targets (4 micro-batches of one row a step), and the packing reaches every stage; also with each stage sharded
    over 2 replicas (2 micro-batches each, weighed by the step's targets over both)."""
    from test_finetune_train import task_run_args, uneven_task
    task = uneven_task(tmp_path)
    equal = ["--batch_size", "1", "--total_batch_size", "256", "--n_layer", "4"]
    single = run_train(task_run_args(task, tmp_path / "single", *equal), env=clean_env(), timeout=LIMIT)
    proc = run_launched(task_run_args(task, tmp_path / "pp", *equal, "--pp", "2", *flags), torchrun(ranks), clean_env())
    assert "pipeline: 2 stages" in proc.stdout
    ref, got = read_log(tmp_path / "single", "train"), read_log(tmp_path / "pp", "train")
    assert sorted(got) == sorted(ref) == [0, 1, 2, 3]
    assert max(abs(ref[s] - got[s]) for s in ref) <= TOL, (ref, got)
    vals = read_log(tmp_path / "single", "val"), read_log(tmp_path / "pp", "val")
    assert vals[0] and sorted(vals[0]) == sorted(vals[1]) and all(abs(vals[0][s] - vals[1][s]) <= 1e-4 for s in vals[0])
    # a uniform scale error on the gradient would keep the losses close (AdamW and clipping hide it): the norms show it
    norms, reference = printed_norms(proc.stdout), printed_norms(single.stdout)
    assert len(norms) == 4 and max(abs(a - b) for a, b in zip(norms, reference)) <= 2e-4, (norms, reference)
    assert final_weights_diff(tmp_path / "single", tmp_path / "pp") <= TOL


def test_pipeline_in_bf16_equals_one_process_in_bf16(data, tmp_path):
    """The stages run under the run's autocast (each forward the schedule makes, and the last stage's loss)."""
    bf16 = [*EQUAL, "--dtype", "bf16", "--no-compile", "--max_steps", "3", "--eval_interval", "0",
            "--checkpoint_interval", "0"]
    run_train(tiny_run_args(data, tmp_path / "one", *bf16), env=clean_env(), timeout=LIMIT)
    pp = run_launched(tiny_run_args(data, tmp_path / "pp", *bf16, "--pp", "2"), torchrun(2), clean_env())
    assert "--dtype bf16" in pp.stdout and "pipeline: 2 stages" in pp.stdout  # (its line, or its warning where slow)
    ref, got = read_log(tmp_path / "one", "train"), read_log(tmp_path / "pp", "train")
    assert sorted(got) == sorted(ref) == [0, 1, 2] and max(abs(ref[s] - got[s]) for s in ref) <= TOL, (ref, got)


TRAFFIC = RECORDING_RANK + r'''
from model import GPT, GPTConfig
from parallel import pipeline, stage_split
config = GPTConfig(block_size=16, vocab_size=128, n_layer=2, n_head=2, n_embd=8)
out = {}
for shard in ("full", "grads"):
    torch.manual_seed(0)
    pipe = pipeline.Pipeline(GPT(config),
                             SimpleNamespace(pp=2, shard=shard, batch_size=2, seq_len=16, pp_schedule="1f1b"),
                             SimpleNamespace(world_size=4, rank=dist.get_rank(), device="cpu"), 3, lambda *a: None)
    x = torch.randint(0, 128, (2, 16))
    seen.clear()
    with Record():
        pipe.step([(x, x, None)] * 3, None, 1.0)
    plan = stage_split.stage_plan(config, pipe.bounds, 2, 16, 3, 2, shard)[pipe.index][2]
    out[shard] = {"seen": list(seen), "plan": plan}
everything = [None] * 4
dist.all_gather_object(everything, out)
if dist.get_rank() == 0:
    print(json.dumps(everything))
del pipe  # the model goes before the group (world.leave_process_group says why)
from parallel import world
world.leave_process_group()
'''


def test_sharded_stage_traffic_is_the_plan_lines(tmp_path):
    """What 2 replicas x 2 stages send in a step of 3 micro-batches (1F1B), recorded on each rank: with each stage
    sharded (full), every unit (a block; the stage's own embeddings or ln_f + lm_head) all-gathered M + 1 = 4 times, not
    2 M (the schedule keeps a unit gathered after a backward), with --shard grads once; the gradients reduce-scattered
    once; and the bytes of it all (a ring all-gather sends half the whole tensor on 2 ranks; gloo's reduce-scatter
    twice its piece; the tied gradient's piece once; the activations and their gradients) are the plan line's."""
    import json
    script = tmp_path / "traffic.py"
    script.write_text(TRAFFIC)
    proc = run_rank_script(script, 4)
    for rank, out in enumerate(json.loads(proc.stdout.strip().splitlines()[-1])):
        for shard, got in out.items():
            gathers = sorted(b for f, b in got["seen"] if "allgather" in f)
            units = sorted(set(gathers))
            assert len(units) == 2 and gathers == sorted(units * {"full": 4, "grads": 1}[shard]), (rank, shard, gathers)
            scatters = [b for f, b in got["seen"] if "reduce_scatter" in f]
            assert sorted(2 * b for b in scatters) == units, (rank, shard, got["seen"])  # each rank's half, once
            sent = sum(b / 2 for b in gathers) + sum(2 * b for b in scatters)
            sent += sum(b for f, b in got["seen"] if ("send" in f or "allreduce" in f) and b > 4)  # (not the scalars)
            assert sent == got["plan"], (rank, shard, sent, got["plan"], got["seen"])


def test_lora_on_a_pipeline_equals_one_process(tmp_path):
    """--lora on 2 stages (the adapters in each stage's blocks, the base and its tied weight frozen) trains what one
    process's LoRA run trains: the losses of 6 steps and the final adapters within 1e-5; its checkpoint holds the
    adapters alone, numbered as one process's, and resumes on one process, continuing the uninterrupted run."""
    from conftest import save_random_hf_gpt2
    from test_lora import adapters_of, lora_args
    base = tmp_path / "base"
    save_random_hf_gpt2(base, n_layer=4, n_head=2, n_embd=32, n_positions=64)
    data = make_shards(tmp_path / "data", vocab=50257)
    run_train(lora_args(data, tmp_path / "one", str(base)), env=clean_env(), timeout=LIMIT)
    proc = run_launched(lora_args(data, tmp_path / "pp", str(base), "--pp", "2"), torchrun(2), clean_env())
    assert "pipeline: 2 stages" in proc.stdout and "lora: r 4" in proc.stdout
    ref, got = read_log(tmp_path / "one", "train"), read_log(tmp_path / "pp", "train")
    assert (sorted(got) == sorted(ref) == [0, 1, 2, 3, 4, 5]
            and max(abs(ref[s] - got[s]) for s in ref) <= TOL), (ref, got)
    (one, _), (pp, _) = adapters_of(tmp_path / "one"), adapters_of(tmp_path / "pp")
    assert sorted(pp) == sorted(one) and all(".lora_" in k for k in pp)
    assert max(float((one[k] - pp[k]).abs().max()) for k in one) <= TOL
    to_one = stopped_after_step_3(tmp_path / "pp", tmp_path / "to_one")
    run_train(["--resume", "--log_dir", to_one, "--init_from", str(base), "--lora", "4", "--lora_alpha", "8"],
              env=clean_env(), timeout=LIMIT)
    resumed, _ = adapters_of(to_one)
    assert max(float((one[k] - resumed[k]).abs().max()) for k in one) <= TOL
