"""The dtype follows the CPU: bf16 only where it is native and measured faster, fp32 everywhere else,
whichever kind of CPU runs these tests; the matmul rate behind that choice is cheap and cached; the
FLOPs count behind "N% of this CPU's matmul rate" is GPT-2's; every run says which CPU it ran on."""
import json
import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import make_shards, run_train, tiny_run_args
from plumbing import cpu, speedups
from train_gpt2 import GPT, GPTConfig

# matmul rates in GFLOP/s at GPT-2's width (768) on 2 threads, measured on the two kinds of host this
# project runs on: an AMD EPYC with AVX512-BF16, and an AMD EPYC with AVX2 only (no native bf16, where
# PyTorch's fallback runs bf16 matmuls ~170x slower than fp32)
BF16_HOST = {"bf16": 420.0, "fp32": 185.0}
AVX2_HOST = {"bf16": 1.0, "fp32": 170.0}


def test_auto_picks_bf16_only_where_native_and_faster():
    dtype, line = cpu.choose_dtype("auto", True, BF16_HOST)
    assert dtype == "bf16" and line.startswith("dtype: bf16 (") and "bf16 matmul 420 GFLOP/s vs fp32 185 here" in line
    dtype, line = cpu.choose_dtype("auto", False, AVX2_HOST)
    assert dtype == "fp32" and line.startswith("dtype: fp32 (") and "no native bf16" in line
    assert "bf16 matmul 1 GFLOP/s vs fp32 170 here" in line and "--dtype bf16 forces it" in line
    # a CPU that advertises bf16 but does not run it faster than fp32 (the check measures, not trusts)
    dtype, line = cpu.choose_dtype("auto", True, {"bf16": 200.0, "fp32": 185.0})
    assert dtype == "fp32" and "native bf16, but not faster" in line
    # the measured rates alone do not make bf16 native: the flags must say so too
    assert cpu.choose_dtype("auto", False, BF16_HOST)[0] == "fp32"


def test_explicit_dtype_is_obeyed_with_a_warning_where_bf16_is_slow():
    dtype, line = cpu.choose_dtype("bf16", False, AVX2_HOST)
    assert dtype == "bf16" and line.startswith("warning: --dtype bf16 on a CPU without fast bf16")
    assert "170.0x slower than fp32" in line
    dtype, line = cpu.choose_dtype("bf16", True, BF16_HOST)
    assert dtype == "bf16" and not line.startswith("warning")
    assert cpu.choose_dtype("fp32", True, BF16_HOST)[0] == "fp32"


def test_autocast_follows_the_dtype():
    x = torch.ones(2, 2)
    with speedups.autocast("bf16", "cpu"):
        assert (x @ x).dtype == torch.bfloat16
    with speedups.autocast("fp32", "cpu"):
        assert (x @ x).dtype == torch.float32
    with pytest.raises(ValueError, match="'bf16' or 'fp32'"):
        speedups.autocast("auto", "cpu")


def test_matmul_rate_is_measured_once_and_draws_no_random_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rng = torch.get_rng_state()
    rate = cpu.matmul_rate(torch.float32, 64)
    assert rate > 0 and torch.equal(torch.get_rng_state(), rng)  # a run's random stream is untouched
    with open(tmp_path / "gpt2-cpu" / "matmul_rates.json") as f:
        cached = json.load(f)
    assert list(cached.values()) == [rate] and "float32|64" in list(cached)[0]
    monkeypatch.setattr(cpu, "measure_matmul_rate", lambda *a: pytest.fail("measured twice"))
    assert cpu.matmul_rate(torch.float32, 64) == rate


def test_flops_per_token_counts_what_the_matmuls_do():
    # an independent count: PyTorch's FLOP counter over one training step's forward and backward, with
    # attention computed by plain matmuls (the counter does not see inside the fused CPU kernel)
    config = GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=64)
    model, T = GPT(config), 64
    x = torch.randint(0, config.vocab_size, (2, T))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        _, loss = model(x, x)
        loss.backward()
    counted = counter.get_total_flops() / x.numel()
    n_params = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()  # a lookup, no matmul
    ours = cpu.flops_per_token(n_params, config.n_layer, config.n_embd, T)
    assert abs(ours - counted) / counted < 0.02, (ours, counted)  # (ours counts biases and LayerNorms too)


def test_a_run_names_its_cpu_dtype_and_share_of_the_matmul_rate(tmp_path):
    data = make_shards(tmp_path / "data")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = run_train(tiny_run_args(data, tmp_path / "log", "--max_steps", "2"), env=env).stdout
    assert f"cpu: {cpu.cpu_name()}, {torch.backends.cpu.get_cpu_capability()}, native bf16: " in out
    assert "1 torch thread(s)" in out and "dtype: fp32 (--dtype fp32; bf16 matmul " in out
    assert out.count("% of this CPU's fp32 matmul rate") == 2  # on every step line
    assert os.path.exists(tmp_path / "cache" / "gpt2-cpu" / "matmul_rates.json")


def test_one_bf16_training_step_runs_on_any_cpu(tmp_path):
    # where bf16 is not native this step is slow (the tiny model's 50,304-row lm_head), but it must work,
    # after a warning; --dtype auto would have chosen fp32 there
    data = make_shards(tmp_path / "data")
    args = tiny_run_args(data, tmp_path / "log", "--dtype", "bf16", "--max_steps", "1", "--eval_interval", "0",
                         "--checkpoint_interval", "1", "--total_batch_size", "128")
    out = run_train(args, env={"XDG_CACHE_HOME": str(tmp_path / "cache")}).stdout
    native = cpu.native_bf16()
    assert ("dtype: bf16 (--dtype bf16;" in out) == native and ("warning: --dtype bf16 on a CPU without" in out) != native
    assert "of this CPU's bf16 matmul rate" in out
    ckpt = torch.load(tmp_path / "log" / "model_00001.pt", weights_only=True)
    assert ckpt["args"]["dtype"] == "bf16" and all(torch.isfinite(w).all() for w in ckpt["model"].values())


def test_auto_resolves_the_same_way_in_a_run_as_here(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    expected, _ = speedups.resolve_dtype("auto", "cpu", 32)  # on one thread, as the run below (--threads 1)
    data = make_shards(tmp_path / "data")
    out = run_train(tiny_run_args(data, tmp_path / "log", "--dtype", "auto", "--max_steps", "1",
                                  "--eval_interval", "0"), env={"XDG_CACHE_HOME": str(tmp_path / "cache")}).stdout
    assert f"dtype: {expected} (" in out and f"of this CPU's {expected} matmul rate" in out
    assert expected == "fp32" or cpu.native_bf16()  # never bf16 without native support


def test_ipex_is_dropped_or_refused_where_it_cannot_run_bf16():
    # ipex.optimize's bf16 weights need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2 CPU it asserts
    ipex = object()  # stands for the module find_ipex returned: only whether it is kept matters here
    assert speedups.ipex_for_dtype(ipex, "auto", "bf16", bf16_weights=True) is ipex
    assert speedups.ipex_for_dtype(ipex, "auto", "fp32", bf16_weights=False) is ipex
    assert speedups.ipex_for_dtype(None, "auto", "bf16", bf16_weights=False) is None
    assert speedups.ipex_for_dtype(ipex, "auto", "bf16", bf16_weights=False) is None  # auto: train without it
    with pytest.raises(SystemExit, match="--ipex on with bf16: IPEX's bf16 weights need AVX-512"):
        speedups.ipex_for_dtype(ipex, "on", "bf16", bf16_weights=False)
