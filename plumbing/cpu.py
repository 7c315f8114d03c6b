"""
This CPU: how many threads a rank runs, what the C library does with freed memory, the vector-math
warm-up that keeps results independent of thread timing, and what it computes fast: native bf16 or
not, its measured matmul rates, and so the dtype a run uses (choose_dtype) and its share of that rate.
"""
import ctypes
import os
import socket
import sys
import time

import torch

from plumbing import cache_dir, read_json, write_json

# -----------------------------------------------------------------------------
# CPU threads: one per physical core, divided among the ranks that share those cores

def cpuinfo_lines():
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []

def physical_cores(cpus=None):
    """Physical cores among the given logical CPUs (default: those this process may run on).
    Hyper-threads of one core share its vector units, so a matmul thread per hyper-thread
    only adds contention."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cpus, cores, info = set(cpus), set(), {}
    for line in cpuinfo_lines() + [""]:  # a block of 'key: value' lines per logical CPU, then a blank line
        if ":" in line:
            key, value = (s.strip() for s in line.split(":", 1))
            info[key] = value
        elif info:
            if info.get("processor", "").isdigit() and int(info["processor"]) in cpus:
                cores.add((info.get("physical id"), info.get("core id", info["processor"])))
            info = {}
    return max(1, len(cores) if cores else len(cpus))

def ranks_sharing_cpus(mine, host, everyone, local_world):
    """How many ranks of this node (mine among them) run on CPUs that overlap mine.

    everyone: (hostname, CPU list) of every rank. Capped by the launcher's count of ranks on this
    node, since hosts in containers or network namespaces can share a hostname."""
    return max(1, min(local_world, sum(h == host and not mine.isdisjoint(cpus) for h, cpus in everyone)))

def cpu_list(cpus):
    """{0,1,2,3,8} -> '0-3,8', the notation of taskset and /proc/self/status."""
    out, cpus = [], sorted(cpus)
    for i, c in enumerate(cpus):
        if i and c == cpus[i - 1] + 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)

def set_cpu_threads(threads, world_size, local_world):
    """torch's thread count for this rank; returns a line saying how it was chosen.

    A launcher that pins each rank to its own cores (Intel MPI does by default; mpirun -bind-to core)
    already did the dividing: ranks whose CPU sets don't overlap need not divide again."""
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    sharing = local_world
    if not threads and world_size > 1:  # a collective: every rank takes part, whatever its node
        everyone = [None] * world_size
        torch.distributed.all_gather_object(everyone, (socket.gethostname(), sorted(mine)))
        sharing = ranks_sharing_cpus(mine, socket.gethostname(), everyone, local_world)
    torch.set_num_threads(threads or max(1, physical_cores(mine) // sharing))
    return (f"threads: {torch.get_num_threads()} torch threads per rank "
            f"({'--threads' if threads else f'{physical_cores(mine)} physical cores / {sharing} rank(s)'}), "
            f"{local_world} rank(s) on this node, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
            f"affinity {cpu_list(mine)}")

# -----------------------------------------------------------------------------
# Same numbers in every process. oneMKL 2024.2 (inside torch 2.13's wheels) picks each vector-math
# function's kernel (exp, log, tanh, ...) at its first call; when that first call runs on several threads
# at once, one thread can compute its whole chunk with a low-accuracy kernel (pytorch/pytorch#188792).
# Results then depend on thread timing: the same resume gave 10.572952 in one process and 10.572960 in
# another. One call on one element, made by one thread before any parallel work, settles every kernel.

def warm_up_vector_math():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dtype in (torch.float32, torch.float64):
            x = torch.full((1,), 0.5, dtype=dtype)
            for f in (torch.exp, torch.expm1, torch.log, torch.log1p, torch.log2, torch.log10, torch.tanh,
                      torch.sigmoid, torch.erf, torch.erfc, torch.erfinv, torch.sqrt, torch.rsqrt, torch.reciprocal,
                      torch.sin, torch.cos, torch.tan, torch.asin, torch.acos, torch.atan, torch.sinh, torch.cosh,
                      torch.lgamma, torch.abs, torch.neg, torch.floor, torch.ceil, torch.trunc):
                f(x)
            x.pow(1.5)
    finally:
        torch.set_num_threads(threads)

# -----------------------------------------------------------------------------
# Memory: keep what was freed. A training step allocates and frees the same big tensors every time
# (activations, logits chunks, gradients). glibc's malloc serves every block over 32 MB with its own
# mmap and unmaps it when freed, so each step the kernel hands those pages back one 4 KB page fault
# at a time, zero-filled: ~550,000 faults, about a sixth of a 124M step on a 2-core VM. Telling malloc
# never to use mmap for big blocks, and never to give the top of its heap back, lets the second step
# reuse the first one's memory: no faults after warm-up (bench/bench_train.py shows faults/step and the A/B).

def keep_freed_memory():
    """mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, -1) where the C library is glibc; True if set.
    Another allocator (LD_PRELOAD of tcmalloc, jemalloc; macOS) keeps its own policy."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it (musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's malloc.h
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))

# -----------------------------------------------------------------------------
# The dtype: bf16 only where this CPU computes it natively. With AVX512-BF16 or AMX (x86), or Arm's BF16
# extension, oneDNN runs bf16 matmuls at over twice the fp32 rate (AMD EPYC Zen 4, 2 cores: 418 vs 184
# GFLOP/s at GPT-2's MLP shape). Without them PyTorch falls back to a slow bf16 GEMM: 0.9 GFLOP/s
# against 184 for fp32 on an AVX2 EPYC, 200x slower (pytorch/pytorch#118499). So the flags decide, and
# a short measurement at the model's matmul shape confirms: a CPU that advertises bf16 but runs it no
# faster than fp32 gets fp32, which is also the more precise of the two.

BF16_MIN_SPEEDUP = 1.25  # bf16's matmul must beat fp32's by this much to pay for autocast's casts

def cpu_name():
    """The CPU's model name, as /proc/cpuinfo gives it (else the platform's word for it)."""
    import platform
    for line in cpuinfo_lines():
        if line.split(":")[0].strip() in ("model name", "Model", "CPU part"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()

def native_bf16():
    """Does this CPU compute bf16 in hardware, and will PyTorch use it? x86: AVX512-BF16 or AMX flags;
    Arm: the bf16 feature; and oneDNN (PyTorch's bf16 matmul path) must accept the CPU."""
    flags = set()
    for line in cpuinfo_lines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}) and torch.ops.mkldnn._is_mkldnn_bf16_supported()

def describe_cpu(threads):
    """The startup line: what this CPU offers, and how much of it the run uses."""
    return (f"cpu: {cpu_name()}, {torch.backends.cpu.get_cpu_capability()}, native bf16: "
            f"{'yes' if native_bf16() else 'no'}, {threads} torch thread(s)")

def matmul_rate(dtype, width, seconds=0.05):
    """GFLOP/s of this CPU, on torch's threads now, at the model's matmul shape: (M, width) @ (width,
    4 width), the MLP's first layer. M grows from 16 to 1024 rows while one product takes under
    `seconds`, so a dtype that runs at 1 GFLOP/s costs a fraction of a second to find out about.
    Measured once per machine (CPU, ISA, torch, threads, shape) and remembered in the cache folder."""
    key = (f"{cpu_name()}|{torch.backends.cpu.get_cpu_capability()}|{torch.__version__}|"
           f"{torch.get_num_threads()}|{dtype}|{width}")
    cache_file = cache_dir("matmul_rates.json")
    cache = read_json(cache_file)
    if key not in cache:
        cache[key] = measure_matmul_rate(dtype, width, seconds)
        write_json(cache_file, cache)
    return cache[key]

def measure_matmul_rate(dtype, width, seconds):
    rows = 16
    while True:  # constant inputs: no draw from the random generator, which would change the run
        a, b = torch.full((rows, width), 0.5, dtype=dtype), torch.full((width, 4 * width), 0.5, dtype=dtype)
        a @ b  # warm-up: oneDNN picks and caches its kernel
        t0 = time.perf_counter()
        a @ b
        best = time.perf_counter() - t0
        if best > seconds or rows >= 1024:
            break
        rows *= 4
    for _ in range(min(3, int(seconds / best))):  # the best of a few: the machine's noise only slows
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * width * 4 * width / best / 1e9

def choose_dtype(requested, native, rates):
    """The run's dtype for --dtype auto|bf16|fp32 on a CPU: native (native_bf16()) and rates
    ({'bf16': GFLOP/s, 'fp32': GFLOP/s}, matmul_rate's) decide. Returns (dtype, line to print), the
    line starting 'warning:' when an explicit bf16 will run slowly here."""
    bf16, fp32 = rates["bf16"], rates["fp32"]
    fast = native and bf16 >= BF16_MIN_SPEEDUP * fp32
    measured = f"bf16 matmul {bf16:.0f} GFLOP/s vs fp32 {fp32:.0f} here"
    if requested == "bf16" and not fast:
        return "bf16", (f"warning: --dtype bf16 on a CPU without fast bf16: {measured}, "
                        f"{fp32 / max(bf16, 1e-9):.1f}x slower than fp32 would be (--dtype auto picks fp32)")
    if requested != "auto":
        return requested, f"dtype: {requested} (--dtype {requested}; {measured})"
    isa = torch.backends.cpu.get_cpu_capability()
    if fast:
        return "bf16", f"dtype: bf16 ({isa}, native bf16: {measured}; --dtype fp32 for full precision)"
    why = "native bf16, but not faster" if native else "no native bf16"
    return "fp32", f"dtype: fp32 ({isa}, {why}: {measured}; --dtype bf16 forces it)"

def flops_per_token(n_params, n_layer, n_embd, seq_len):
    """Training FLOPs per token (forward + backward): 6 per parameter (2 forward, 4 backward), plus
    attention's scores and weighted sum, 12 n_layer n_embd T (PaLM, appendix B)."""
    return 6 * n_params + 12 * n_layer * n_embd * seq_len

