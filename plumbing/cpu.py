"""
This CPU: how many threads a rank runs, what the C library does with freed memory, and the
vector-math warm-up that keeps results independent of thread timing.
"""
import ctypes
import os
import socket
import sys

import torch

# -----------------------------------------------------------------------------
# CPU threads: one per physical core, divided among the ranks that share those cores


def physical_cores(cpus=None):
    """Physical cores among the given logical CPUs (default: those this process may run on).
    Hyper-threads of one core share its vector units, so a matmul thread per hyper-thread
    only adds contention."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cpus = set(cpus)
    try:
        cores = set()
        with open("/proc/cpuinfo") as f:
            info = {}
            for line in f.read().splitlines() + [""]:
                if ":" in line:
                    key, value = (s.strip() for s in line.split(":", 1))
                    info[key] = value
                elif info:
                    cpu = int(info.get("processor", -1))
                    if cpu in cpus:
                        cores.add((info.get("physical id"), info.get("core id", cpu)))
                    info = {}
        return max(1, len(cores)) if cores else len(cpus)
    except (OSError, ValueError):
        return max(1, len(cpus))


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
