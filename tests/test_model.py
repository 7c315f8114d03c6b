import json
import math
import os

import pytest
import torch

import train_args
import train_gpt2
from model import tanh_gelu, KVCache
from conftest import save_random_hf_gpt2
from model import GPT, GPTConfig

SMALL = GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)


def test_logits_equal_transformers(tmp_path):
    hf = save_random_hf_gpt2(tmp_path)
    ours = GPT.from_pretrained(str(tmp_path)).eval()
    assert ours.config == GPTConfig(block_size=128, vocab_size=50257, n_layer=2, n_head=4, n_embd=64)
    idx = torch.randint(0, 50257, (3, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(idx).logits
        logits, _ = ours(idx)
    diff = (logits - ref).abs().max().item()
    print(f"max abs logit difference vs transformers: {diff:.3e}")
    assert diff <= 1e-5


def test_openai_key_layout_loads(tmp_path):
    # OpenAI's upload on the hub has no 'transformer.' prefix and no lm_head: both layouts load the same
    from safetensors.torch import load_file, save_file
    save_random_hf_gpt2(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    os.makedirs(tmp_path / "openai")
    save_file({k.removeprefix("transformer."): v.contiguous() for k, v in tensors.items() if k != "lm_head.weight"},
              tmp_path / "openai" / "model.safetensors")
    (tmp_path / "openai" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    a = GPT.from_pretrained(str(tmp_path / "hf"))
    b = GPT.from_pretrained(str(tmp_path / "openai"))
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(SystemExit, match="config.json"):
        GPT.from_pretrained(str(tmp_path))
    with pytest.raises(SystemExit, match="neither"):
        GPT.from_pretrained(str(tmp_path / "nope"))
    save_random_hf_gpt2(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["n_embd"] = 32
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="shape"):
        GPT.from_pretrained(str(tmp_path / "hf"))


def test_architecture_and_init():
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_size=50304, n_layer=4, n_head=4, n_embd=256)
    model = GPT(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    x = torch.randn(1000)
    assert torch.equal(tanh_gelu(x), torch.nn.functional.gelu(x, approximate="tanh"))  # (compiled: test_perf)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
    residual = model.transformer.h[1].attn.c_proj.weight.std().item()
    ordinary = model.transformer.h[1].attn.c_attn.weight.std().item()
    assert abs(ordinary - 0.02) < 0.001
    assert abs(residual - 0.02 / math.sqrt(2 * 4)) < 0.001
    assert abs(model.transformer.wpe.weight.std().item() - 0.02) < 0.001
    x = torch.randint(0, 50304, (2, 16))
    logits, loss = model(x)
    assert logits.shape == (2, 16, 50304) and loss is None
    _, loss = model(x, torch.randint(0, 50304, (2, 16)))
    assert abs(loss.item() - math.log(50304)) < 0.1  # small init: close to uniform


def test_causality():
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    x = torch.randint(0, 50257, (1, 20))
    y = x.clone()
    y[0, 10:] = torch.randint(0, 50257, (10,))
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(y)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:], atol=1e-3)


def test_hidden_takes_positions_and_mask():
    """GPT.hidden: forward is lm_head on it; positions 0..T-1 and a causal mask are its defaults; two segments
    packed in one row (hellaswag.py's way), each with its own positions and blind to the other, equal the two
    run apart, even when the row is longer than block_size (64); and a KV cache takes several new tokens at once."""
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    idx = torch.randint(0, 50257, (2, 70))
    a, b = idx[:, :40], idx[:, 40:]
    causal = torch.ones(70, 70, dtype=torch.bool).tril()
    with torch.no_grad():
        h = model.hidden(a)
        assert torch.equal(model(a)[0], model.lm_head(h))
        torch.testing.assert_close(model.hidden(a, torch.arange(40).expand(2, 40), causal[:40, :40]), h)
        second = torch.arange(70) >= 40
        packed = model.hidden(idx, torch.cat((torch.arange(40), torch.arange(30))).expand(2, 70),
                              causal & (second[:, None] == second[None, :]))
        torch.testing.assert_close(packed[:, :40], h)
        torch.testing.assert_close(packed[:, 40:], model.hidden(b))
        cache = KVCache(SMALL.n_layer, SMALL.block_size)
        model.hidden(a[:, :25], cache=cache)
        torch.testing.assert_close(model.hidden(a[:, 25:], cache=cache), h[:, 25:])


def test_gradient_accumulation_equals_big_batch():
    torch.manual_seed(0)
    model = GPT(SMALL)
    k, B, T = 4, 2, 16
    x = torch.randint(0, 50257, (k * B, T))
    y = torch.randint(0, 50257, (k * B, T))
    _, loss = model(x, y)
    loss.backward()
    big = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for i in range(k):  # what the training loop does: loss / k on each micro-batch
        _, loss = model(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
        (loss / k).backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, big[n], rtol=1e-4, atol=1e-7), n
        rel = ((p.grad - big[n]).norm() / big[n].norm()).item()
        assert rel < 1e-5, (n, rel)


def reference_get_lr(it, max_lr, min_lr, warmup_steps, max_steps):
    """build-nanogpt's schedule, written out as one formula per phase (its constants made arguments)."""
    warming, decaying = it < warmup_steps, warmup_steps <= it <= max_steps
    progress = (it - warmup_steps) / (max_steps - warmup_steps) if decaying else None
    assert progress is None or 0 <= progress <= 1
    return (max_lr * (it + 1) / warmup_steps if warming else
            min_lr + (max_lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2 if decaying else min_lr)


def test_lr_schedule_is_build_nanogpts():
    args = train_args.build_parser().parse_args([])
    assert (args.max_lr, args.min_lr, args.warmup_steps, args.max_steps) == (6e-4, 6e-5, 715, 19073)
    for max_lr, min_lr, warmup, max_steps in [(6e-4, 6e-4 * 0.1, 715, 19073), (6e-4, 6e-5, 715, 19073),
                                              (3e-3, 0.0, 10, 60)]:
        for it in (list(range(0, 800)) + list(range(800, max_steps + 40, 37))
                   + [max_steps - 1, max_steps, max_steps + 1]):
            ours = train_gpt2.get_lr(it, warmup, max_steps, max_lr, min_lr)
            assert ours == reference_get_lr(it, max_lr, min_lr, warmup, max_steps), it


def test_optimizer_groups_and_fused():
    torch.manual_seed(0)
    model = GPT(SMALL)
    optimizer, fused = model.configure_optimizer(weight_decay=0.1, learning_rate=1e-3, device_type="cpu")
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))  # tied weight once
    assert any(p is model.lm_head.weight for p in decay["params"])
    assert fused is True and decay["fused"] is True  # PyTorch >= 2.4 has fused AdamW on CPU
    assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8


def test_kv_cache_generation_equals_recompute():
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    prompt = torch.randint(0, 50257, (2, 5))
    # runs past block_size (64) to cover the recompute fallback too
    cached = torch.stack(list(model.generate(prompt, 70, top_k=1)), dim=1)
    idx = prompt
    with torch.no_grad():
        for _ in range(70):
            logits, _ = model(idx[:, -SMALL.block_size:])
            idx = torch.cat((idx, logits[:, -1, :50257].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(cached, idx[:, 5:])
    sampled = [torch.stack(list(model.generate(prompt, 20, top_k=50, generator=torch.Generator().manual_seed(3))), 1)
               for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1])
    assert int(sampled[0].max()) < 50257
