"""LoRA (lora.py, train_gpt2.py --lora): against peft on a transformers GPT-2 built from our weights (logits, loss,
adapter gradients, three AdamW steps), both exports (merged for transformers, peft's layout for peft), DDP and
--shard full against one process, a bit-exact resume that holds only the adapters and reloads the base once, a bf16
base built a tensor at a time, and one error line for each kind of bad input."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import export_hf
import lora
from plumbing import checkpoints
from conftest import (REPO, TORCHRUN, clean_env, make_shards, read_log, run_launched, run_train,
                      save_random_hf_gpt2)
from model import GPT, GPTConfig, load_model
from parallel import build

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)
ALL = list(lora.TARGETS)


def ours_and_peft(rank=4, alpha=8.0, targets=ALL, seed=0):
    """Our random small GPT with adapters, and peft's LoRA on a transformers GPT2LMHeadModel holding the same weights
    (all 50304 embedding rows, so the losses are over the same classes), its A and B copied from ours."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    model = GPT(SMALL)
    hf_cfg = {k: v for k, v in export_hf.hf_config(model.config).items() if k not in ("architectures", "torch_dtype")}
    hf = GPT2LMHeadModel(GPT2Config(**{**hf_cfg, "vocab_size": 50304}))
    weights = {**export_hf.hf_weights(model), "transformer.wte.weight": model.transformer.wte.weight.detach().clone()}
    hf.load_state_dict(weights, strict=False)
    lora.add_adapters(model, rank, alpha, targets)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=[lora.TARGETS[t] for t in targets],
                        fan_in_fan_out=True, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(hf, config)
    copy_adapters(model, peft_model)
    return model.train(), peft_model.train()


def peft_adapters(peft_model):
    return {n: p for n, p in peft_model.named_parameters() if p.requires_grad}


# transformer.h.0.attn.c_attn.lora_A -> base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight
def name_in_peft(name):
    return f"base_model.model.{name}.default.weight"


def copy_adapters(model, peft_model):
    theirs = peft_adapters(peft_model)
    assert len(theirs) == len(lora.adapters(model))
    with torch.no_grad():
        for name, p in lora.adapters(model).items():
            theirs[name_in_peft(name)].copy_(p)


def batch(seed=1, B=2, T=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50257, (B, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def peft_loss(peft_model, x, y):
    logits = peft_model(input_ids=x).logits
    return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def test_step_0_is_the_base_and_equals_peft_logits_loss_and_gradients():
    model, peft_model = ours_and_peft(seed=0)
    x, y = batch()
    torch.manual_seed(0)
    with torch.no_grad():   # the base alone, without adapters: the same weights (the same seed)
        base_logits = GPT(SMALL)(x)[0]
    assert all(p.abs().max() == 0 for n, p in lora.adapters(model).items() if "lora_B" in n)   # B starts at zero
    for randomize_b in (False, True):   # at step 0 (B = 0: A gets no gradient), then with B random on both sides
        if randomize_b:
            with torch.no_grad():
                for name, p in lora.adapters(model).items():
                    if "lora_B" in name:
                        p.normal_(0, 0.05)
            copy_adapters(model, peft_model)
        model.zero_grad(), peft_model.zero_grad()
        logits, _ = model(x)
        _, loss = model(x, y)
        loss.backward()
        their_logits, their_loss = peft_loss(peft_model, x, y)
        their_loss.backward()
        torch.testing.assert_close(logits, their_logits, rtol=0, atol=1e-6)
        torch.testing.assert_close(loss, their_loss, rtol=0, atol=1e-6)
        if not randomize_b:
            torch.testing.assert_close(logits, base_logits, rtol=0, atol=0)   # exactly the base
        theirs = peft_adapters(peft_model)
        for name, p in lora.adapters(model).items():
            ours_grad = dict(model.named_parameters())[name].grad
            torch.testing.assert_close(ours_grad, theirs[name_in_peft(name)].grad, rtol=0, atol=1e-5, msg=name)
            assert ours_grad.abs().max() > 0 or (not randomize_b and "lora_A" in name)
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)   # the base is frozen


def test_three_adamw_steps_equal_peft():
    model, peft_model = ours_and_peft(targets=["attn", "fc"])
    optimizer, _ = model.configure_optimizer(0.1, 1e-2, "cpu")   # the trainer's: fused AdamW, decay on matrices
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(lora.adapters(model))   # the adapters alone
    reference = torch.optim.AdamW(peft_adapters(peft_model).values(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1)
    for step in range(3):
        x, y = batch(seed=10 + step)
        for opt, loss in ((optimizer, lambda: model(x, y)[1]), (reference, lambda: peft_loss(peft_model, x, y)[1])):
            opt.zero_grad()
            loss().backward()
            opt.step()
    theirs = peft_adapters(peft_model)
    for name, p in lora.adapters(model).items():
        torch.testing.assert_close(p, theirs[name_in_peft(name)].detach(), rtol=0, atol=1e-5, msg=name)
    assert max((p - theirs[name_in_peft(n)]).abs().max() for n, p in lora.adapters(model).items()) < 1e-5


def test_merge_gives_a_plain_gpt_with_the_same_outputs():
    model, _ = ours_and_peft(targets=["proj", "mlp_proj"])
    with torch.no_grad():
        for name, p in lora.adapters(model).items():
            p.normal_(0, 0.05)
        x, _ = batch()
        before = model.eval()(x)[0]
        # a token a row, as generation feeds them: the adapters beside W (fewer tokens than the layers' width)
        one_token = model(x[:, :1])[0]
        lora.merge(model)
        after = model(x)[0]
    assert not lora.adapted(model) and all(type(m) is torch.nn.Linear for m in model.modules()
                                           if isinstance(m, torch.nn.Linear))
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    torch.testing.assert_close(one_token, after[:, :1], rtol=0, atol=1e-5)


def test_a_frozen_weight_gets_no_gradient_and_x_the_same_one():
    from compute.fused_loss import lm_head_loss
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 16, generator=g), torch.randn(100, 16, generator=g)
    y = torch.randint(0, 100, (40,), generator=g)
    grads = []
    for frozen in (False, True):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_(not frozen)
        lm_head_loss(xx, ww, y).backward()
        grads.append(xx.grad)
        assert (ww.grad is None) == frozen
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_a_bf16_base_is_built_a_tensor_at_a_time_with_fp32_adapters():
    def make():
        return lora.add_adapters(GPT(SMALL), 4, 8.0, ALL, init=False)
    torch.manual_seed(3)
    whole = GPT(SMALL)
    torch.manual_seed(3)
    built = build.build_in(torch.bfloat16, make)
    lora.init_adapters(built, seed=5)
    for name, p in built.named_parameters():
        assert (p.dtype == (torch.float32 if ".lora_" in name else torch.bfloat16)
                and p.requires_grad == (".lora_" in name))
    ours = dict(built.named_parameters())
    for name, p in whole.named_parameters():   # the same values as the fp32 build, rounded once
        assert torch.equal(ours[name], p.detach().to(torch.bfloat16)), name
    assert built.lm_head.weight is built.transformer.wte.weight   # still tied
    again = lora.add_adapters(GPT(SMALL), 4, 8.0, ALL, init=False)   # a whole fp32 base, another draw before
    lora.init_adapters(again, seed=5)   # the adapters' values do not depend on how the base was built
    assert all(torch.equal(p, lora.adapters(again)[k]) for k, p in lora.adapters(built).items())


def test_a_bf16_step_on_a_bf16_base_follows_the_fp32_one():
    """Under bf16 autocast, with the frozen base held in bf16 (as a bf16 run holds it): the adapters' gradients
    arrive in fp32, finite, and close to the fp32 step's (bf16 keeps about 3 significant digits)."""
    model, _ = ours_and_peft(targets=["attn", "mlp_proj"])
    with torch.no_grad():
        for name, p in lora.adapters(model).items():
            p.normal_(0, 0.05)
    x, y = batch()
    model(x, y)[1].backward()
    fp32 = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    for p in model.parameters():
        p.data = p.data if p.requires_grad else p.data.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad.dtype == torch.float32 and p.grad.isfinite().all()
            assert (p.grad - fp32[name]).norm() <= 0.05 * fp32[name].norm(), name


# -----------------------------------------------------------------------------
# Training runs: a random GPT-2 in the Hugging Face layout as the base, packed task rows and pretraining shards

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random small GPT-2 saved by transformers (what --init_from reads), and its path."""
    path = tmp_path_factory.mktemp("base") / "gpt2-tiny"
    save_random_hf_gpt2(path, n_head=2, n_embd=32, n_positions=64)
    return str(path)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    import finetune
    root = tmp_path_factory.mktemp("task")
    rng = np.random.default_rng(0)
    rows = [{"prompt": f"Q{i}: {' '.join(map(str, rng.integers(0, 9, 3)))} ->", "completion": " " + " ".join(
        map(str, sorted(rng.integers(0, 9, 3))))} for i in range(48)]
    with open(root / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    finetune.main(["--input", str(root / "train.jsonl"), "--val_examples", "6", "--output_dir", str(root / "t")])
    return str(root / "t")


def lora_args(data_dir, log_dir, base, *extra):
    return ["--data_dir", data_dir, "--log_dir", log_dir, "--init_from", base, "--lora", "4", "--lora_alpha", "8",
            "--seq_len", "32", "--batch_size", "2", "--total_batch_size", "128", "--max_steps", "6", "--warmup_steps",
            "1", "--max_lr", "1e-2", "--eval_interval", "3", "--checkpoint_interval", "3", "--keep_checkpoints", "0",
            "--val_tokens", "256", "--task_examples", "2", "--hellaswag_interval", "0", "--sample_interval", "0",
            "--dtype", "fp32", "--threads", "1", *extra]


def adapters_of(log_dir, step=6):
    """(the adapters a LoRA run's checkpoint of `step` holds, the checkpoint): a .pt, or a .dcp written in parts."""
    import lora
    from parallel import parts
    path = os.path.join(log_dir, f"model_{step:05d}.pt")
    path = path if os.path.exists(path) else path[:-3] + ".dcp"
    ckpt = checkpoints.load_checkpoint(path)
    if ckpt["sharded_path"]:
        spec = ckpt["lora"]
        shapes = lora.adapter_shapes(GPTConfig(**ckpt["config"]), spec["rank"], spec["targets"])
        return parts.read_sharded(path, shapes), ckpt
    return ckpt["model"], ckpt


def test_exports_merged_for_transformers_and_as_peft_adapters(base, task, tmp_path):
    from peft import PeftModel
    from transformers import GPT2LMHeadModel
    run_train(lora_args(task, tmp_path / "log", base))   # packed task rows
    ckpt_file = str(tmp_path / "log" / "model_00006.pt")
    ours, _ = load_model(ckpt_file, merge=False)   # base + adapters, unmerged
    assert lora.adapted(ours) and all(p.abs().max() > 0 for n, p in lora.adapters(ours).items() if "lora_B" in n)
    idx = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.eval()(idx)[0]
    for flags, load in ((["--adapter"], lambda d: PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), d)),
                        ([], lambda d: GPT2LMHeadModel.from_pretrained(d))):
        out = tmp_path / ("adapter" if flags else "merged")
        proc = subprocess.run([sys.executable, os.path.join(REPO, "export_hf.py"), ckpt_file, str(out), *flags],
                              capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        assert proc.returncode == 0, proc.stderr
        with torch.no_grad():
            theirs = load(str(out)).eval()(idx).logits
        torch.testing.assert_close(theirs, expected[..., :theirs.shape[-1]], rtol=0, atol=1e-5)
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert os.path.getsize(ckpt_file) < os.path.getsize(os.path.join(base, "model.safetensors")) / 4   # no base in it


# train_gpt2.py, counting what reads the base: its weights (inputs.copy_pretrained_weights), its file's sha256
COUNTING_READS = """import sys, lora, model, train_gpt2
reads = []
for module, name in ((model, "copy_pretrained_weights"), (lora, "base_identity")):
    setattr(module, name, lambda *a, real=getattr(module, name), name=name, **k: reads.append(name) or real(*a, **k))
try:
    train_gpt2.world.run_main(train_gpt2.main)
finally:
    print("base reads:", sorted(reads))
"""


def test_resume_is_bit_exact_holds_only_adapters_and_reads_the_base_once(base, tmp_path):
    shards = make_shards(tmp_path / "data")   # plain pretraining shards
    whole = run_train(lora_args(shards, tmp_path / "whole", base))
    assert whole.stdout.count("lora: r 4, alpha 8, 4 targets") == 1
    run_train(lora_args(shards, tmp_path / "cut", base))
    os.remove(tmp_path / "cut" / "model_00006.pt")   # as if stopped after step 3's checkpoint
    resumed = subprocess.run([sys.executable, "-c", COUNTING_READS,
                              *lora_args(shards, tmp_path / "cut", base, "--resume")],
                             capture_output=True, text=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr
    # its weights read once, its file hashed once (to check it is the base the adapters were trained on)
    assert "base reads: ['base_identity', 'copy_pretrained_weights']" in resumed.stdout
    a, ckpt = adapters_of(tmp_path / "whole")
    b, _ = adapters_of(tmp_path / "cut")
    assert sorted(a) == sorted(lora.adapters(load_model(str(tmp_path / "whole" / "model_00006.pt"),
                                                                    merge=False)[0]))   # the adapters, nothing more
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_log(tmp_path / "whole", "train")[5] == read_log(tmp_path / "cut", "train")[5]
    assert ckpt["lora"]["base"]["name"] == base and len(ckpt["lora"]["base"]["sha256"]) == 64


@pytest.mark.xdist_group("multiprocess-2")
def test_two_ranks_and_sharded_equal_one_process(base, task, tmp_path):
    run_train(lora_args(task, tmp_path / "one", base, "--total_batch_size", "256"))   # 2 accumulation steps
    for name, extra in (("ddp", []), ("fsdp", ["--shard", "full"])):
        run_launched(lora_args(task, tmp_path / name, base, "--total_batch_size", "256", *extra), TORCHRUN, clean_env())
        assert read_log(tmp_path / name, "train").keys() == read_log(tmp_path / "one", "train").keys()
        for step, loss in read_log(tmp_path / "one", "train").items():
            assert abs(read_log(tmp_path / name, "train")[step] - loss) <= 1e-5
        ours = load_model(checkpoints.list_checkpoints(str(tmp_path / name))[-1], merge=False)[0]
        ref = load_model(checkpoints.list_checkpoints(str(tmp_path / "one"))[-1], merge=False)[0]
        theirs = lora.adapters(ref)
        for k, p in lora.adapters(ours).items():
            torch.testing.assert_close(p, theirs[k], rtol=0, atol=1e-5, msg=f"{name} {k}")
        # merged (a .dcp's adapters read whole, added to the base a layer at a time): the same model
        merged = load_model(checkpoints.list_checkpoints(str(tmp_path / name))[-1])[0].state_dict()
        for k, p in lora.merge(ref).state_dict().items():
            torch.testing.assert_close(merged[k], p, rtol=0, atol=1e-5, msg=f"{name} merged {k}")


def test_bad_input_is_one_line_each(base, tmp_path):
    shards = make_shards(tmp_path / "data")
    run_train(lora_args(shards, tmp_path / "log", base, "--max_steps", "3"))
    other = tmp_path / "other-base"
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained(base)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] += 1.0
    model.save_pretrained(other)
    without_lora = [a for a in lora_args(shards, tmp_path / "log", base) if a not in ("--lora", "4")]
    assert "--lora" not in without_lora
    for args, message in (
            (lora_args(shards, tmp_path / "a", base, "--lora", "-1"), "error: --lora -1 --lora_alpha"),
            (lora_args(shards, tmp_path / "b", base, "--lora_targets", "attn,foo"),
             "error: --lora_targets 'attn,foo': unknown 'foo'"),
            (without_lora + ["--resume"], f"error: --resume {tmp_path / 'log' / 'model_00003.pt'}: a LoRA run "
                                          "(--lora 4): resume it with --lora 4"),
            (lora_args(shards, tmp_path / "log", base, "--resume", "--init_from", str(other)),
             "its adapters belong to the base"),
    ):
        proc = run_train(args, check=False)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and len(err) == 1 and message in err[0], proc.stderr
    assert str(other) in err[0] and base in err[0]   # the base mismatch names both
