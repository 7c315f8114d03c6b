"""LoRA at its edges (load_model, plumbing/checkpoints.load_sharded, train_args): a LoRA checkpoint as the
base of another run (full fine-tuning, new adapters, in bf16, sharded), --lora on a sharded (.dcp) base, a resume that
would change the adapters' targets or scale, --lora_alpha 0, and the default --seq_len capped by the base's context."""
import contextlib
import json

import pytest
import torch

import lora
import train_args
from model import load_model
from conftest import free_port, make_shards, read_log, run_train, save_random_hf_gpt2
from parallel import build, parts, world
from model import GPT, GPTConfig

# one worker builds the LoRA run that most of these tests read (a module fixture is per xdist worker)
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("lora_edges")]

SMALL = GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)


def lora_flags(data_dir, log_dir, base, *extra):
    return ["--data_dir", data_dir, "--log_dir", log_dir, "--init_from", base, "--lora", "4", "--lora_alpha", "8",
            "--seq_len", "32", "--batch_size", "2", "--total_batch_size", "128", "--max_steps", "3", "--warmup_steps",
            "1", "--max_lr", "1e-2", "--eval_interval", "3", "--checkpoint_interval", "3", "--val_tokens", "256",
            "--hellaswag_interval", "0", "--sample_interval", "0", "--dtype", "fp32", "--threads", "1", *extra]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 3-step LoRA run (r 4, alpha 8) on a random tiny GPT-2 in the Hugging Face layout: (its checkpoint, the base,
    the shards, its log folder)."""
    root = tmp_path_factory.mktemp("lora_run")
    base = str(root / "base")
    save_random_hf_gpt2(base, n_head=2, n_embd=32, n_positions=64)
    shards = make_shards(root / "data")
    run_train(lora_flags(shards, str(root / "log"), base))
    return str(root / "log" / "model_00003.pt"), base, shards, str(root / "log")


@contextlib.contextmanager
def one_rank_group():
    """A process group of one rank (gloo), for what needs one: FSDP2, sharded checkpoints."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield world.Ranks(rank=0, world_size=1, local_rank=0, local_world=1, launcher="test")
    finally:
        torch.distributed.destroy_process_group()


def with_adapters(config, rank=2, targets=("attn",)):
    """What train_gpt2.build_model's make() builds under --lora: a GPT with fresh adapters, its base frozen."""
    return lora.add_adapters(GPT(config), rank, 2.0 * rank, list(targets), init=False)


def test_a_lora_checkpoint_is_the_start_of_full_fine_tuning(lora_run, tmp_path):
    ckpt, _, shards, lora_log = lora_run
    merged = load_model(ckpt)[0]
    assert all(p.requires_grad for p in merged.parameters())   # a base like any other: nothing left frozen
    run_train(lora_flags(shards, str(tmp_path / "full"), ckpt, "--lora", "0", "--max_steps", "2",
                         "--checkpoint_interval", "2", "--eval_interval", "2"))
    # its step 0 is the LoRA run's last step: the same model, merged
    assert abs(read_log(tmp_path / "full", "val")[0] - read_log(lora_log, "val")[3]) < 1e-4
    trained = load_model(str(tmp_path / "full" / "model_00002.pt"))[0].state_dict()
    changed = [k for k, p in merged.state_dict().items() if not torch.equal(p, trained[k])]
    assert any(".ln_" in k for k in changed) and any("wte" in k for k in changed)   # every weight trains now


def test_a_lora_checkpoint_is_built_as_any_base_in_bf16_and_sharded_with_new_adapters(lora_run):
    ckpt, _, _, _ = lora_run
    merged = dict(load_model(ckpt)[0].named_parameters())
    unmerged = load_model(ckpt, merge=False)[0]   # the base in fp32, the adapters beside it
    expected = {name: p.detach().to(torch.bfloat16) for name, p in unmerged.named_parameters() if ".lora_" not in name}
    for name, linear in lora.adapted(unmerged):   # the base held in bf16, then W + s B A in fp32, rounded once
        delta = linear.lora_scale * linear.lora_B.detach() @ linear.lora_A.detach()
        expected[name + ".weight"] = (expected[name + ".weight"].float() + delta).to(torch.bfloat16)
    def bf16(config, init_weights=False):   # build_model's build for --lora in bf16
        return build.build_in(torch.bfloat16, lambda: with_adapters(config), init_weights)
    model = load_model(ckpt, bf16)[0]
    assert [name for name, _ in lora.adapted(model)] == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    for name, p in model.named_parameters():
        assert (p.requires_grad == (".lora_" in name)
                and p.dtype == (torch.float32 if ".lora_" in name else torch.bfloat16))
        assert ".lora_" in name or torch.equal(p, expected[name]), name
    with one_rank_group() as ranks:   # FSDP2: every weight a DTensor, holding the merged values
        model = load_model(ckpt, lambda config, init_weights=False: build.build_sharded(
            lambda: GPT(config), ranks, False, init_weights))[0]
        for name, p in model.named_parameters():
            assert p.requires_grad and torch.equal(p.full_tensor(), merged[name]), name


def test_lora_on_a_sharded_base_reads_the_base(tmp_path):
    torch.manual_seed(0)
    full = GPT(SMALL)
    path = str(tmp_path / "model_00005.dcp")
    with one_rank_group() as ranks:   # a sharded run's checkpoint, as save_checkpoint writes it (the base: all of it)
        optimizer, _ = full.configure_optimizer(0.1, 1e-3, "cpu")
        parts.save_sharded(path, parts.state_of(full, optimizer),
                           {"config": vars(SMALL), "step": 5, "task": None, "lora": None}, ranks)
    model = load_model(path, lambda config, init_weights=False: with_adapters(config))[0]
    assert len(lora.adapted(model)) == 2
    ours = dict(model.named_parameters())
    for name, p in full.named_parameters():
        assert torch.equal(ours[name], p), name


def test_a_resume_keeps_the_adapters_targets_and_scale(lora_run, tmp_path):
    ckpt, base, shards, lora_log = lora_run
    ranks = world.Ranks(rank=0, world_size=1, local_rank=0, local_world=1, launcher="single")
    resume = lora_flags(shards, lora_log, base, "--resume", ckpt)
    args = train_args.resolve_args(resume, ranks)[0]   # as it ran: the four targets, alpha 8
    assert (args.lora_targets, args.lora_alpha) == (list(lora.TARGETS), 8.0)
    for extra, message in ((["--lora_targets", "attn,fc"], "--lora_targets attn,fc, but the run's adapters are on "
                                                            "attn,proj,fc,mlp_proj"),
                           (["--lora_alpha", "16"], "--lora_alpha 16, but the run's adapters were trained at alpha 8")):
        with pytest.raises(SystemExit) as e:
            train_args.resolve_args(resume + extra, ranks)
        assert str(e.value).startswith(f"error: --resume {ckpt}: ") and message in str(e.value)
        assert "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:   # 0 is no alpha (a scale of 0: the adapters would do nothing)
        args = train_args.resolve_args(lora_flags(shards, str(tmp_path / "new"), base, "--lora_alpha", "0"), ranks)[0]
        train_args.check_args(args, 1)
    assert str(e.value) == "error: --lora 4 --lora_alpha 0: the rank must be >= 0 (0: no LoRA), alpha positive"


def test_the_default_seq_len_is_capped_by_the_base_context(lora_run, tmp_path):
    import finetune
    ckpt, base, _, _ = lora_run   # the base's context: 64 positions
    rows = [{"prompt": f"Q{i}:", "completion": " a b"} for i in range(20)]
    long = [{"prompt": "x " * 90, "completion": " y"}]   # a val example of ~93 positions: past the context
    for name, examples in (("train", rows), ("val", rows[:3] + long)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in examples)
    finetune.main(["--input", str(tmp_path / "train.jsonl"), "--val_input", str(tmp_path / "val.jsonl"),
                   "--output_dir", str(tmp_path / "task")])
    ranks = world.Ranks(rank=0, world_size=1, local_rank=0, local_world=1, launcher="single")
    for init_from in (base, ckpt):   # a Hugging Face-layout folder, one of our checkpoints
        args = train_args.resolve_args(["--data_dir", str(tmp_path / "task"), "--init_from", init_from, "--lora", "4",
                                        "--log_dir", str(tmp_path / "log")], ranks)[0]
        assert args.seq_len == 64, init_from   # not 128 (the longest val example, rounded up): it is left out
    args = train_args.resolve_args(["--data_dir", str(tmp_path / "task"), "--block_size", "32"], ranks)[0]
    assert args.seq_len == 32   # from scratch: --block_size is the context
