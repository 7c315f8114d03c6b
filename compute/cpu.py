"""
This CPU: how many threads a rank runs, what the C library does with freed memory, the vector-math
warm-up that keeps results independent of thread timing, and what it computes fast: native bf16 or
not, and its matmul rates, measured and kept as the best ever seen (matmul_rates), from which
speedups.resolve_dtype picks a run's dtype (decision_rates: on a busy machine, from a longer measurement
or the rates kept) and each step line takes its share (MatmulRate).
"""
import collections
import ctypes
import math
import os
import platform
import socket
import time

import torch

from plumbing.common import cache_dir, read_json, write_json

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
# at a time, zero-filled: ~550,000 faults, a sixth of a 124M step on a 2-core VM. Malloc told never to mmap
# nor give its heap's top back, the next step reuses it: no faults after warm-up (bench/bench_train.py: faults, A/B).

def keep_freed_memory(keep=True):
    """mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, -1) where the C library is glibc; True if set. keep=False:
    glibc's usual policy back, at the thresholds its adaptive ones settle at in a step (blocks over 32 MB mapped, up to
    64 MB of the heap's free top kept). Another allocator (LD_PRELOAD of tcmalloc, jemalloc; macOS) keeps its own."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it (musl's mallopt does nothing)
    except (OSError, AttributeError, TypeError):  # (TypeError: Windows has no CDLL(None))
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # from glibc's malloc.h
    settings = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: -1} if keep else {M_MMAP_MAX: 65536, M_MMAP_THRESHOLD: 32 << 20,
                                                                    M_TRIM_THRESHOLD: 64 << 20}
    return all([bool(libc.mallopt(option, value)) for option, value in settings.items()])

# -----------------------------------------------------------------------------
# What this CPU computes fast. With AVX512-BF16 or AMX (x86), or Arm's BF16 extension, oneDNN runs bf16
# matmuls at over twice the fp32 rate (AMD EPYC Zen 4, 2 cores: 418 vs 184 GFLOP/s at GPT-2's MLP shape).
# Without them PyTorch falls back to a slow bf16 GEMM: 0.9 GFLOP/s against 184 for fp32 on an AVX2 EPYC,
# 200x slower (pytorch/pytorch#118499). The flags say which; a short measurement at the model's matmul
# shape confirms (speedups.resolve_dtype decides), and gives each step line its share of the CPU's rate.

def cpu_name():
    """The CPU's model name, as /proc/cpuinfo gives it (else the platform's word for it)."""
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

# Intel's AMX tile units for bf16 (Xeons since their 4th generation): matmuls at several times AVX-512's rate
def has_amx():
    return any(line.split(":")[0].strip() == "flags" and " amx_bf16" in line for line in cpuinfo_lines())

def describe_cpu(threads):
    """The startup line: what this CPU offers (AMX named where it has it), and how much of it the run uses."""
    return (f"cpu: {cpu_name()}, {torch.backends.cpu.get_cpu_capability()}{' + AMX' * has_amx()}, native bf16: "
            f"{'yes' if native_bf16() else 'no'}, {threads} torch thread(s)")

# The matmul rate: GFLOP/s of this CPU, on torch's threads now, at the model's matmul shape, (M, width) @
# (width, 4 width), the MLP's first layer. A shared machine's noise (another job, a package install) only
# ever slows a measurement, so a rate is a best, not a sample: every start measures afresh (well under a
# second, up to a second more on a busy machine), and ~/.cache/gpt2-cpu/matmul_rates.json keeps the best
# ever measured for each key (CPU, ISA, torch, threads, dtype, width), which a later, quieter start can
# only raise. Once, a first run made during a package install cached 34 GFLOP/s where the CPU does 410, and
# every later run printed "195% of this CPU's bf16 matmul rate": now the next start corrects it. Delete the
# file (or one key) to start over.

MEASURE_ROUNDS = 5  # at least this many timed products per dtype, in turns across the dtypes: the best counts
# A busy machine. Another job on these cores takes them from torch's threads for whole scheduler time
# slices, longer than a product takes, and a product that loses its cores runs at a fraction of this CPU's
# rate: beside two training jobs, a start measured "bf16 0 GFLOP/s vs fp32 0" on a CPU that does 422 and
# 204. The process's CPU time says which products that happened to: undisturbed, each thread of a product
# is on a CPU all along (computing, or spin-waiting for the others), so CPU time = wall time x threads. The
# whole process's, as OpenMP's waiting thread spins on its CPU while a descheduled partner holds the product
# up. (Not the spread between trials: jobs that hold the cores steadily slow every trial alike.) A library
# may run a product on fewer threads than torch has (PyTorch's bf16 fallback uses one), with a low share on
# a quiet machine too: each dtype's products are judged against their highest share, or one thread's worth.
UNDISTURBED = 0.75  # a product whose share reaches this fraction of its dtype's (just above) ran undisturbed
LONGER = 1.0  # seconds of products a disturbed measurement may go on for
# A product quicker than a time slice (Linux: 0.75 ms at least) kept its cores: a low share says it
TIME_SLICE = 0.5e-3  # ran on fewer threads (quiet AMX Xeon, demo's width: 0.1 ms products on one thread or two)

def rate_key(dtype, width):
    """The cache's key for a rate: it holds only for this CPU, vector ISA, torch, thread count, dtype and width."""
    return (f"{cpu_name()}|{torch.backends.cpu.get_cpu_capability()}|{torch.__version__}|"
            f"{torch.get_num_threads()}|{dtype}|{width}")

def matmul_timer(width):
    """time_product(dtype, rows) -> (seconds, share): one (rows, width) @ (width, 4 width) product on torch's threads,
    and the share of those seconds its threads were on a CPU (the process's CPU time / (seconds x threads)).
    The first product of each shape is a warm-up (oneDNN picks and caches its kernel there), untimed.
    Constant inputs: no draw from the random generator, which would change the run."""
    operands = {}  # dtype: (rows, a, b), the latest shape only
    def time_product(dtype, rows):
        if operands.get(dtype, (None,))[0] != rows:
            operands[dtype] = (rows, torch.full((rows, width), 0.5, dtype=dtype),
                               torch.full((width, 4 * width), 0.5, dtype=dtype))
            operands[dtype][1] @ operands[dtype][2]
        _, a, b = operands[dtype]
        t0, cpu0 = time.perf_counter(), time.process_time()
        a @ b
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
        return seconds, cpu_seconds / (seconds * torch.get_num_threads()) if seconds > 0 else 1.0
    return time_product

# What measure_in_turns found: rates ({dtype: GFLOP/s}, each dtype's fastest product), busy (some dtype's fastest
# product lost its cores: the rates are low by an unknown factor), rounds (the turns each dtype got at its size),
# running ({dtype: GFLOP/s} over the time its threads were on a CPU, at best: exact on one thread, where no
# thread spins waiting for another)
Measurement = collections.namedtuple("Measurement", "rates busy rounds running")

def measure_in_turns(dtypes, width, seconds=0.05, time_product=None, longer=0.0):
    """A Measurement of each dtype at the model's shape. For each dtype, M grows from 16 rows, 4x at a time up to
    1024, while a product of the next size would still take under `seconds` (4 times this one), so one that runs at
    1 GFLOP/s costs a fraction of a second to find out about. Then the dtypes take turns (bf16, fp32, bf16, fp32, ...),
    and each keeps its fastest product: a busy moment slows both alike, where timing one dtype and then the other
    could slow only one and flip the choice between them. Every dtype gets the same number of turns: MEASURE_ROUNDS,
    or more while they span under 2 x `seconds` in all (a small model's products take a millisecond, less than a
    busy moment lasts), or, while some dtype's fastest product lost its cores, until they span `longer`: more
    turns, more chances to find the cores free. time_product: matmul_timer(width)'s kind."""
    time_product, threads = time_product or matmul_timer(width), torch.get_num_threads()
    rows, fastest, top, ran = {}, {}, {}, {}  # at each dtype's size: (seconds, share) of its fastest product,
    def timed(dtype):                          # its highest share, its least seconds x share
        took, share = time_product(dtype, rows[dtype])
        fastest[dtype] = min(fastest.get(dtype, (math.inf, 0.0)), (took, share))
        top[dtype] = max(top.get(dtype, 0.0), share)
        ran[dtype] = min(ran.get(dtype, math.inf), took * min(1.0, share))
        return took
    def grows(dtype):  # the next size, if the fastest product so far says it would still take under `seconds`
        if 4 * fastest[dtype][0] > seconds or rows[dtype] >= 1024:
            return False
        rows[dtype] *= 4
        del fastest[dtype], top[dtype], ran[dtype]  # a new size: its own products only
        return True
    for dtype in dtypes:
        rows[dtype] = 16
        timed(dtype)
        while grows(dtype):
            timed(dtype)
    # a dtype so slow that 16 rows take over `seconds` of CPU time (the bf16 fallback) is not timed again (seconds
    # at XL's width); CPU time, as a product that lost its cores may take 50 ms for 20 us of work (it is retimed)
    turns = [d for d in dtypes if rows[d] > 16 or fastest[d][0] * fastest[d][1] * threads <= seconds]
    def undisturbed():  # each dtype's share when undisturbed: its highest, but at least one thread's worth, once
        full = max((top[d] for d in turns), default=1.0) >= UNDISTURBED  # some product had all its threads on a CPU
        return {d: max(1 / threads, min(1.0, top[d])) if full else 1.0 for d in dtypes}  # (else none did: all)
    def busy():  # some dtype's fastest product lost its cores for a while (which takes at least a TIME_SLICE)
        return any(fastest[d][1] < UNDISTURBED * undisturbed()[d] and fastest[d][0] > TIME_SLICE for d in turns)
    rounds, spent = 0, 0.0
    while turns and rounds < 1000 and (rounds < MEASURE_ROUNDS or spent < 2 * seconds or (spent < longer and busy())):
        for dtype in turns:
            spent += timed(dtype)
        # a size cut short by a product that lost its cores (tiny products' rates are mostly call overhead) grows
        # once a faster product of it shows the next size fits after all, and the turns at the new size start over
        rounds = 0 if sum(grows(dtype) for dtype in turns) else rounds + 1
    flops = {d: 2 * rows[d] * width * 4 * width / 1e9 for d in dtypes}
    return Measurement({d: flops[d] / fastest[d][0] for d in dtypes}, busy(), rounds,
                       {d: flops[d] / max(ran[d], 1e-9) for d in dtypes})

def measure_matmul_rates(dtypes, width, seconds=0.05, time_product=None):
    """{dtype: GFLOP/s} measured now, at the model's shape, in turns (measure_in_turns)."""
    return measure_in_turns(dtypes, width, seconds, time_product).rates

def measure_matmul_rate(dtype, width, seconds=0.05):
    """One dtype's rate now, from a fresh measurement alone (bench/bench_train.py probes with it after each step)."""
    return measure_matmul_rates([dtype], width, seconds)[dtype]

def is_rate(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0

def keep_best(fresh, width):
    """{dtype: GFLOP/s}: the best rates kept for this machine before `fresh` ({dtype: GFLOP/s} measured now; only
    the dtypes it has a rate for), and the cache raised to `fresh` wherever that beats it. The cache file is read
    as input: entries that are not positive numbers are dropped; unreadable JSON is replaced."""
    cache_file = cache_dir("matmul_rates.json")
    # read again just before writing, and write at once: another rank's or run's rates written meanwhile are kept
    cache = {k: v for k, v in read_json(cache_file).items() if is_rate(v)}
    kept = {dtype: cache[rate_key(dtype, width)] for dtype in fresh if rate_key(dtype, width) in cache}
    cache.update({rate_key(dtype, width): max(rate, kept.get(dtype, 0)) for dtype, rate in fresh.items()})
    write_json(cache_file, cache)
    return kept

def matmul_rates(dtypes, width, time_product=None):
    """{dtype: GFLOP/s}: for each dtype the best of a fresh measurement (interleaved, see measure_in_turns) and the
    best ever kept for this machine, which the fresh one raises if it beats it (the step lines' rate)."""
    fresh = measure_matmul_rates(dtypes, width, time_product=time_product)
    kept = keep_best(fresh, width)
    return {dtype: max(fresh[dtype], kept.get(dtype, 0)) for dtype in dtypes}

# The dtype decision's rates. A quiet start decides from its own measurement in turns, both dtypes from the
# same moment (like with like). A busy one measures longer first; if its fastest products still lost their
# cores, and its rates are under half the best ones kept for this machine for every dtype, the kept ones
# decide: they were measured in quieter moments. But noise cannot raise a rate, so a kept rate can only be
# too high if the file was edited or copied, or the CPU got slower for good, and then it must not sway the
# choice (issue #23): so the kept rates are checked against a measurement on one thread, counted over the
# time the thread was on a CPU. One thread waits for no partner, so its CPU time is its work: at a load
# average of 13 on an AMD EPYC's 2 cores (AVX2), fp32 at the demo's width measured 66 GFLOP/s on one thread
# by the wall clock, 0.04-1.7 on two, and PyTorch's bf16 fallback 0.2-1.1 on one by the wall clock, 2.3
# quietly. On T threads a product runs at most T times as fast as on one.
BUSY_BELOW = 0.5  # fresh rates under this fraction of the kept ones, for every dtype: the machine is busy now
KEPT_PER_THREAD = 2.0  # a kept rate counts up to 2 x threads x the one-thread rate now (2: it may be busy too)

def one_thread_rates(dtypes, width, time_product=None):
    """{dtype: GFLOP/s} on one of torch's threads now, over the time it was on a CPU (torch's threads are put back)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_in_turns(dtypes, width, time_product=time_product).running
    finally:
        torch.set_num_threads(threads)

def decision_rates(dtypes, width, time_product=None):
    """(rates, source, measurement) for speedups.resolve_dtype: {dtype: GFLOP/s}, 'now' or 'earlier' (the best rates
    kept for this machine, on a busy start, see above), and this start's Measurement. The cache keeps the best."""
    now = measure_in_turns(dtypes, width, time_product=time_product, longer=LONGER)
    kept = keep_best(now.rates, width)
    if now.busy and len(kept) == len(dtypes) and all(now.rates[d] < BUSY_BELOW * kept[d] for d in dtypes):
        threads, one = torch.get_num_threads(), one_thread_rates(dtypes, width, time_product)
        if all(kept[d] <= KEPT_PER_THREAD * threads * one[d] for d in dtypes):
            return kept, "earlier", now
    return now.rates, "now", now

def rate_text(rate):
    """A rate as the lines print it: whole GFLOP/s from 10 up, two significant digits below, so that a slow rate
    (0.4, PyTorch's bf16 fallback on a busy machine) never reads as 0."""
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"

def matmul_rate(dtype, width, time_product=None):
    return matmul_rates([dtype], width, time_product)[dtype]

class MatmulRate:
    """This CPU's matmul rate in the run's dtype ('bf16' or 'fp32') at the model's width, and a step's share of it (the
    step lines' ' | 62% of this CPU's fp32 matmul rate'). A step above 100% is evidence that the rate is wrong: a busy
    moment slowed its measurement. Then it is measured again, once per run: a step that still beats it runs shapes the
    probe does not (the bf16 fallback, docs/performance.md), and measuring again every step would not change that."""

    def __init__(self, name, width, time_product=None):
        self.name, self.width, self.time_product = name, width, time_product
        self.dtype = torch.bfloat16 if name == "bf16" else torch.float32
        self.gflops, self.measured_again = matmul_rate(self.dtype, width, time_product), False

    def share(self, gflops):
        """' | N% of this CPU's bf16 matmul rate' for a step that ran at `gflops` GFLOP/s (per rank)."""
        note = ""
        if gflops > self.gflops and not self.measured_again:
            old, self.measured_again = self.gflops, True
            self.gflops = matmul_rate(self.dtype, self.width, self.time_product)
            note = (f" (measured again: the step beat the {rate_text(old)} GFLOP/s on record; "
                    f"now {rate_text(self.gflops)})")
        return f" | {100 * gflops / self.gflops:.0f}% of this CPU's {self.name} matmul rate{note}"
