"""
Causal self-attention, forward and backward, as fast as this CPU does it: PyTorch's own (F.scaled_dot_product_attention)
or, on a CPU with AMX or AVX512-BF16, our kernel in attention.cpp, whichever is measured faster at the model's shape.
"""
import fcntl
import hashlib
import math
import os
import time

import torch
import torch.nn.functional as F

from compute import cpu
from plumbing.common import cache_dir, one_line

# Why a kernel of our own. On an Intel Xeon with AMX (2 cores), a GPT-2 (124M) step in bf16 spent 27% of its time in
# PyTorch's CPU flash attention for a tenth of its FLOPs: forward and backward of one layer (B 4, 12 heads, T 1024,
# head 64) took 107-113 ms, under 0.2 TFLOP/s where the weight matmuls reach 1.5-3. Its blocks are small products
# through a general GEMM call each, and its backward walks keys by queries. attention.cpp takes 64 queries at a
# time against all the keys they see, and does every product as AMX tile products (oneDNN's brgemm, which PyTorch
# ships): the block's scores are at most 64 x T fp32 (256 KB at T 1024) and stay in the core's L2 cache, so the
# softmax is exact over the row, in fp32, as SDPA's. The numbers differ from SDPA's by rounding only
# (tests/test_attention.py checks both against an fp64 reference). Without AMX, on AVX512-BF16 (AMD EPYC Zen 4 and 5,
# Cooper Lake Xeons), the same brgemm calls run oneDNN's AVX-512 kernels (vdpbf16ps, the bf16 matmuls' own instruction
# there): on a 2-core Zen 4, one layer's forward ran at ~260 GFLOP/s and backward ~270-290, 2.2-2.9x SDPA's, two thirds
# of the weight matmuls' rate (bench/bench_attention.py, docs/performance.md).

chosen = False  # causal() runs attention.cpp's kernel (set by choose(), once per run)

def causal(q, k, v):
    """F.scaled_dot_product_attention(q, k, v, is_causal=True), by the kernel choose() picked for this run."""
    if chosen and q.dtype == torch.bfloat16 and q.size(-1) % 32 == 0:
        return causal_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

def choose(dtype, batch_size, n_head, seq_len, head_size, ranks=None):
    """Decide, for this run, which causal attention trains faster at its shape; returns the line that says why.
    Only bf16 has a choice (the kernel is bf16), only where it loads (AMX or AVX512-BF16), and only for heads of a
    multiple of 32 values (its 16 x 16 transposes of value pairs). Measured as the dtype is: both, forward and backward
    of one layer's shape, in turns, each keeping its best, in CPU time (the process's: another job that takes a core
    away for a while slows the wall clock, not the work); every rank must agree, so all take PyTorch's unless all chose
    ours."""
    global chosen
    chosen = False
    if dtype != "bf16" or head_size % 32:
        return None
    best = measure(batch_size, n_head, seq_len, head_size) if kernel() else None
    ours_faster = float(best is not None and best["ours"] < best["sdpa"])
    if ranks is not None and ranks.world_size > 1:  # (a collective: every rank with bf16 gets here, kernel or not)
        ours_faster = ranks.all_reduce_sum(torch.tensor(ours_faster, device=ranks.device)).item() == ranks.world_size
    chosen = bool(ours_faster)
    if best is None:
        return f"attention: PyTorch's (scaled_dot_product_attention; {why_not})"
    times = f"{1000 * best['ours']:.0f} ms vs PyTorch's {1000 * best['sdpa']:.0f} ms of CPU time"
    choice = f"ours (attention.cpp, {bf16_units()})" if chosen else "PyTorch's"
    return (f"attention: {choice}: forward and backward of "
            f"one layer ({batch_size} x {n_head} heads x {seq_len} x {head_size}) took ours {times}")

def measure(batch_size, n_head, seq_len, head_size):
    """{'ours': seconds, 'sdpa': seconds}: each one's best forward and backward at this shape, in turns."""
    qkv = torch.randn(batch_size, seq_len, 3, n_head, head_size, generator=torch.Generator().manual_seed(0))
    q, k, v = (t.transpose(1, 2).to(torch.bfloat16).requires_grad_() for t in qkv.unbind(2))
    grad = torch.ones(batch_size, n_head, seq_len, head_size, dtype=torch.bfloat16)
    best = {"ours": math.inf, "sdpa": math.inf}
    ways = {"ours": causal_attention, "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    for turn in range(MEASURE_TURNS):
        for name, attend in ways.items():
            start = time.process_time()
            attend(q, k, v).backward(grad)
            best[name] = min(best[name], time.process_time() - start)
    return best

MEASURE_TURNS = 3

_kernel = None  # whether attention.cpp is loaded (None: not tried yet)
why_not = "attention.cpp's kernel needs AMX or AVX512-BF16"  # what kernel() found, when it could not load the kernel

def bf16_units():
    """What computes bf16 products here for oneDNN's brgemm: 'AMX' (Xeons since Sapphire Rapids), 'AVX512-BF16' (AMD
    Zen 4 and 5, Cooper Lake: vdpbf16ps, at the rate of bf16 matmuls there), or None."""
    flags = set()
    for line in cpu.cpuinfo_lines():
        if line.split(":")[0].strip() == "flags":
            flags.update(line.split(":", 1)[1].split())
    return "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else None

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention.cpp")

def build_dir():
    """Where attention.cpp is built: one folder for each torch and each version of the source (two venvs or two
    checkouts never rebuild each other's)."""
    with open(SOURCE, "rb") as f:
        return cache_dir("extensions", torch.__version__, hashlib.sha256(f.read()).hexdigest()[:12])

def kernel():
    """True once attention.cpp is compiled for this CPU and loaded (torch.utils.cpp_extension, cached on disk like
    torch.compile's kernels); False where it cannot run (neither AMX nor AVX512-BF16: oneDNN's bf16 brgemm needs one)
    or be built (no C++ compiler), and then why_not says why."""
    global _kernel, why_not
    if _kernel is None:
        _kernel = False
        if bf16_units() and torch.backends.mkldnn.is_available():
            from torch.utils import cpp_extension
            source, build = SOURCE, build_dir()
            os.makedirs(build, exist_ok=True)
            try:
                # one build at a time (the ranks of a run all load it), under a lock the OS frees when its holder dies:
                # torch's own lock file stays behind when a build is killed, and every later load waits on it forever
                with open(os.path.join(build, "build.flock"), "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    if os.path.exists(os.path.join(build, "lock")):  # (left by a killed build: no one else builds now)
                        os.remove(os.path.join(build, "lock"))
                    cpp_extension.load("gpt2cpu_attention", [source], build_directory=build, is_python_module=False,
                                       extra_cflags=["-O3", "-march=native", "-fno-strict-aliasing",
                                                     "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-fopenmp"],
                                       extra_ldflags=["-fopenmp"])  # (OpenMP: at::parallel_for's threads, see .cpp)
            except (OSError, RuntimeError, ImportError) as e:  # no compiler, no ninja, ...: PyTorch's attention runs
                why_not = f"attention.cpp's kernel could not be built: {one_line(e)}"
                return False
            _kernel = torch.ops.gpt2cpu.attention_available()
            why_not = "oneDNN's bf16 brgemm does not run here"
            # what torch.compile needs to trace through the ops (their outputs' shapes), and their gradient
            torch.library.register_fake("gpt2cpu::attention_forward", _forward_shapes)
            torch.library.register_fake("gpt2cpu::attention_backward", _backward_shapes)
            torch.library.register_autograd("gpt2cpu::attention_forward", _backward, setup_context=_setup_context)
    return _kernel

def _rows_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()

def _forward_shapes(q, k, v):
    B, H, n, D = q.shape
    return q.new_empty(B, n, H, D), q.new_empty(B, H, n, dtype=torch.float32)

def _backward_shapes(d_out, q, k, v, out, lse):
    return tuple(q.new_empty(q.size(0), q.size(2), q.size(1), q.size(3)) for _ in range(3))

def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)

def _backward(ctx, d_out, d_lse):
    q, k, v, out, lse = ctx.saved_tensors  # (out, d_out: (B, T, H, D))
    dq, dk, dv = torch.ops.gpt2cpu.attention_backward(_rows_contiguous(d_out).transpose(1, 2), q, k, v,
                                                       out.transpose(1, 2), lse)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

def causal_attention(q, k, v):
    """F.scaled_dot_product_attention(q, k, v, is_causal=True) for bf16 q, k, v (B, H, T, D) whose rows of D values
    are contiguous; its output (B, H, T, D) is laid out as (B, T, H, D), so the heads join side by side for free."""
    out, _ = torch.ops.gpt2cpu.attention_forward(q, k, v)
    return out.transpose(1, 2)
