"""compute/attention.py: our causal attention kernel (attention.cpp, CPUs with AMX or with AVX512-BF16: oneDNN's bf16
brgemm runs on either) computes what F.scaled_dot_product_attention does, as closely as it does (both against an fp64
reference), forward and backward, at GPT-2's head size, through torch.compile too; and the run picks the faster of the
two by measuring both.

Without either the kernel cannot run: those tests skip, saying so, and the choice is PyTorch's
(tested here everywhere)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from compute import attention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KERNEL = bool(attention.kernel())
needs_kernel = pytest.mark.skipif(not KERNEL, reason="attention.cpp needs a CPU with AMX or AVX512-BF16 and a C++ "
                                  f"compiler ({attention.why_not})")


def qkv_views(B, H, T, D, seed=0):
    """q, k, v as the model makes them: (B, H, T, D) views of one (B, T, 3 H D) tensor, bf16, requiring grad."""
    qkv = torch.randn(B, T, 3 * H * D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return [t.view(B, T, H, D).transpose(1, 2).detach().requires_grad_() for t in qkv.split(H * D, dim=2)]


def forward_backward(attend, q, k, v, grad):
    for t in (q, k, v):
        t.grad = None
    out = attend(q, k, v)
    out.backward(grad)
    return [out.detach().double(), q.grad.double(), k.grad.double(), v.grad.double()]


@needs_kernel
def test_the_kernel_runs_on_every_thread():
    """at::parallel_for in the kernel spreads (batch, head) pairs over torch's threads: it runs on one thread only,
    silently, when the extension is compiled without OpenMP (it was: the kernel used one core of two)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.ops.gpt2cpu.attention_threads_used() == 2
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_the_kernel_declines_where_onednn_has_no_bf16_brgemm():
    """Held to AVX-512 without BF16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE: a Skylake Xeon's), oneDNN cannot make a bf16
    brgemm kernel: attention_available() tries one and says no (it raised oneDNN's error, once), and the run keeps
    PyTorch's attention."""
    code = "from compute import attention; print(attention.kernel(), attention.choose('bf16', 1, 2, 64, 64))"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ("False attention: PyTorch's (scaled_dot_product_attention; oneDNN's bf16 brgemm "
                                  "does not run here)")


@needs_kernel
@pytest.mark.parametrize("B,H,T,D", [(2, 3, 200, 64), (1, 2, 1024, 64), (2, 3, 77, 64), (1, 2, 1023, 64),
                                     (2, 2, 99, 32), (1, 1, 5, 96), (1, 2, 130, 128)])
def test_the_kernel_is_as_close_to_fp64_as_sdpa(B, H, T, D):
    """Output and the three gradients, against fp64 attention: within 1.5x of SDPA's own bf16 error (max and relative
    norm). T 200 leaves a partial last block of 64 queries; T 1024 is GPT-2's context; odd T (77, 1023) leave an odd
    last key and a last block of an odd number of rows, where the kernel pairs values and rows (VNNI) with zeros.
    Each of the four checks was seen failing on a copy of attention.cpp broken for it alone (out, dQ, dK, dV each
    off by 1%), and the odd T on one that dropped an odd T's last key (docs/performance.md). Other heads of a multiple
    of 32 values, the kernel's condition, too (96 with T 5: the zero rows past T are read D values at a time)."""
    q, k, v = qkv_views(B, H, T, D)
    grad = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    ours = forward_backward(attention.causal_attention, q, k, v, grad)
    theirs = forward_backward(sdpa, q, k, v, grad)
    exact = forward_backward(sdpa, *[t.detach().double().requires_grad_() for t in (q, k, v)], grad.double())
    for name, a, b, ref in zip(("out", "dq", "dk", "dv"), ours, theirs, exact):
        ours_err, sdpa_err = (a - ref).abs().max().item(), (b - ref).abs().max().item()
        assert ours_err <= 1.5 * sdpa_err + 1e-3, f"{name}: max error {ours_err:.2e} vs SDPA's {sdpa_err:.2e}"
        ours_rel, sdpa_rel = ((a - ref).norm() / ref.norm()).item(), ((b - ref).norm() / ref.norm()).item()
        assert ours_rel <= 1.5 * sdpa_rel, f"{name}: relative error {ours_rel:.2e} vs SDPA's {sdpa_rel:.2e}"


@needs_kernel
def test_the_kernel_trains_a_model_like_sdpa_eager_and_compiled(monkeypatch):
    """One bf16 step of a GPT (2 layers, 128 wide, heads of 64) with the kernel chosen and with SDPA: the same loss and
    gradients up to bf16 rounding; compiled, the kernel gives what it gives eagerly (its fake shapes and gradient
    formula are what torch.compile traces)."""
    from model import GPTConfig, GPT
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=256, vocab_size=512, n_layer=2, n_head=2, n_embd=128))
    x, y = torch.randint(0, 512, (2, 256)), torch.randint(0, 512, (2, 256))

    def step(m, use_kernel):
        attention.chosen = use_kernel
        try:
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = m(x, y)
            loss.backward()
            return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])
        finally:
            attention.chosen = False
    (loss_sdpa, grad_sdpa), (loss_ours, grad_ours) = step(model, False), step(model, True)
    assert abs(loss_ours - loss_sdpa) < 1e-3
    assert ((grad_ours - grad_sdpa).norm() / grad_sdpa.norm()).item() < 2e-2
    monkeypatch.setattr(torch._dynamo.config, "disable", False)  # (conftest.py turns torch.compile off)
    torch._dynamo.reset()
    loss_compiled, grad_compiled = step(torch.compile(model), True)
    assert abs(loss_compiled - loss_ours) < 1e-3
    assert ((grad_compiled - grad_ours).norm() / grad_ours.norm()).item() < 2e-2


def test_the_choice_is_measured_and_said(monkeypatch):
    """fp32, or heads the kernel does not take: PyTorch's, without measuring. bf16 with the kernel (AMX or AVX512-BF16):
    the faster, measured, and the line gives both times (and, chosen, what runs it); a kernel made slow loses. Without
    the kernel the line says why PyTorch's."""
    assert attention.choose("fp32", 2, 2, 64, 64) is None and not attention.chosen
    assert attention.choose("bf16", 2, 2, 64, 16) is None and not attention.chosen
    line = attention.choose("bf16", 2, 2, 128, 64)
    if not KERNEL:
        assert line == f"attention: PyTorch's (scaled_dot_product_attention; {attention.why_not})"
        assert not attention.chosen
        return
    assert line.startswith("attention: ") and " ms vs PyTorch's " in line and "(2 x 2 heads x 128 x 64)" in line
    assert not attention.chosen or line.startswith(f"attention: ours (attention.cpp, {attention.bf16_units()}): ")
    fast = attention.causal_attention

    def slow(q, k, v):  # 0.2 s more, busy rather than asleep: the choice counts CPU time
        import time
        start = time.process_time()
        while time.process_time() - start < 0.2:
            pass
        return fast(q, k, v)
    monkeypatch.setattr(attention, "causal_attention", slow)
    line = attention.choose("bf16", 2, 2, 128, 64)
    assert line.startswith("attention: PyTorch's: ") and not attention.chosen
    attention.chosen = False


@needs_kernel
def test_bench_attention_times_both_ways():
    """bench/bench_attention.py, tiny: both ways in turns, then forward and backward GFLOP/s of each and their ratio."""
    run = subprocess.run([sys.executable, "bench/bench_attention.py", "--batch_size", "1", "--n_head", "2", "--seq_len",
                          "128", "--turns", "2", "--threads", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("cpu: ") and f"bf16 units for brgemm: {attention.bf16_units()}" in lines[0]
    assert sum(line.startswith("turn ") for line in lines) == 2
    for name in ("forward ", "backward"):
        assert any(line.startswith(f"{name}: sdpa ") and "x sdpa (median of 2 per-turn ratios" in line
                   for line in lines)
    assert lines[-1].startswith("forward + backward: ours is ")


def test_a_killed_build_leaves_no_lock_that_stops_the_next_run(tmp_path):
    """torch's cpp_extension builds under a lock file that a killed build leaves behind, and every later load waits
    on it forever (seen: a run hung at its start). kernel() builds under a lock the OS frees, and clears the stale
    file. A copy of this machine's build (no rebuild), with a stale lock file in it, loads within a minute."""
    import shutil
    if not attention.kernel():
        pytest.skip(f"no kernel here: {attention.why_not}")
    build = attention.build_dir()
    cache = tmp_path / "cache"
    # (cache_dir: $XDG_CACHE_HOME/gpt2-cpu)
    copy = cache / os.path.relpath(build, os.path.dirname(attention.cache_dir()))
    shutil.copytree(build, copy)  # (copy2: the times ninja compares kept)
    (copy / "lock").touch()
    code = "from compute import attention; print(attention.kernel(), attention.build_dir())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, XDG_CACHE_HOME=str(cache)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", str(copy)] and not (copy / "lock").exists()
