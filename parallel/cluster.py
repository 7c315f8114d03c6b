"""
What --parallel auto (parallel/layouts.py) measures of the cluster before it predicts: each rank's free memory, how
crowded each machine's cores are, the links (latency and bandwidth, inside a node and across nodes), and one block's
forward and backward at the run's shape as each layout runs it. Every rank measures at once and takes the same
figure (the slowest rank's, or the least memory), so that all decide alike.
"""
import math
import os
import statistics
import time
from types import SimpleNamespace

import torch

from compute import cpu, speedups
from parallel import mesh, sharding, sizes, tensor_parallel

def crowding(ranks):
    """How many times more torch threads than physical cores the most crowded machine's ranks have, at least 1: 3 ranks
    of a thread each on 2 cores (an oversubscribed node) are 1.5. A machine is its kernel's boot id, not a hostname:
    containers or network namespaces with hostnames of their own (bench_parallel.py's nodes) still share its cores."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        machine = f.read().strip()
    everyone = ranks.gather((machine, sorted(os.sched_getaffinity(0)), torch.get_num_threads()))
    return slowest(threads_a_core(everyone, machine), ranks)  # (the largest: MAX)

def threads_a_core(everyone, machine):
    """Of every rank's (machine, CPUs it may run on, torch threads): the threads of this machine's ranks over the
    physical cores of their CPUs (as /proc/cpuinfo pairs them into cores), at least 1."""
    here = [(cpus, threads) for boot, cpus, threads in everyone if boot == machine]
    cores = cpu.physical_cores(set().union(*(cpus for cpus, _ in here)))
    return max(1.0, sum(threads for _, threads in here) / max(1, cores))

def available_memory(ranks, max_memory_gib):
    """Bytes this rank may use: --max_memory, or the memory the OS says is available on this node (MemAvailable)
    shared by the ranks on it."""
    if max_memory_gib:
        return sizes.max_memory_bytes(max_memory_gib)
    try:
        with open("/proc/meminfo") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:")) / ranks.local_world
    except (OSError, StopIteration):
        return float("inf")  # (not Linux: no limit known)

def free_memory(ranks, max_memory_gib):
    """available_memory, the least over the ranks (a CPU all-reduce: --parallel auto plans CPU runs, on gloo)."""
    least = torch.tensor([available_memory(ranks, max_memory_gib)], dtype=torch.float64)
    if ranks.world_size > 1:
        torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
    return least.item()

def slowest(seconds, ranks):
    """The largest of every rank's seconds (all ranks get the same number, so they decide the same way)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()

def measure_link(ranks, size=32 * 2**20, turns=3, group=None):
    """(bytes a second, seconds of latency) of the links, from all-reduces timed on every rank at once: 4 bytes (its
    time is 2 (W - 1) messages' latency) and `size` bytes (a ring: each rank sends 2 (W-1)/W x size), over all the
    ranks or, every rank in one, over groups of W ranks (one rank of each node)."""
    W = torch.distributed.get_world_size(group)
    def timed(t):
        best = math.inf
        for _ in range(turns):
            torch.distributed.barrier()
            start = time.perf_counter()
            torch.distributed.all_reduce(t, group=group)
            best = min(best, slowest(time.perf_counter() - start, ranks))
        return best
    latency = timed(torch.zeros(1)) / (2 * (W - 1))
    big = timed(torch.zeros(size // 4))
    return 2 * (W - 1) / W * size / max(big - 2 * (W - 1) * latency, 1e-9), latency

def measure_network(ranks, nodes):
    """(bytes a second, latency) of the links that data-parallel, FSDP and pipeline traffic crosses: with several nodes
    of several ranks each, timed between every node's i-th ranks at once (all ranks of a node sending together, as in
    training); otherwise over all the ranks."""
    if len(nodes) == 1 or {len(n) for n in nodes} != {len(nodes[0])} or len(nodes[0]) == 1:
        return measure_link(ranks)
    across, _ = torch.distributed.new_subgroups_by_enumeration([list(i) for i in zip(*nodes)])
    return measure_link(ranks, group=across)

def time_block(make_block, rows, seq_len, n_embd, autocast, ranks, turns=5, layout=None, bf16=False, compiled=False):
    """Seconds of one block's forward and backward at the run's micro-batch, compiled as the run will be (compiled:
    torch.compile, its first turn compiling), timed on every rank at once (ranks
    that share a node's cores slow each other down in training too): after a turn of warm-up, the median turn's
    slowest rank, a turn running the block enough times to last 0.5 s (3 turns where one pass lasts 2 s or more).
    Not each rank's best turn: with more ranks than cores, each rank's best is a turn in which it happened to run
    alone. Nor the best of single passes: with 3 ranks on 2 cores one pass caught bursts (a block of 176 ms in one
    run, 229 in another, for steps of one speed) and TP's, four waits on the slowest rank, swung 123-212 ms.
    layout: the block as that Layout runs it (as_layout_runs), else plain, under one autocast a turn (a pipeline's
    stage casts its weights once a step)."""
    block = as_layout_runs(make_block(), layout, ranks, bf16)
    block = speedups.compile_model(block) if compiled else block
    x = torch.randn(rows, seq_len, n_embd, requires_grad=True)
    return timed_passes(lambda: block(x).float().sum().backward(), autocast, ranks, turns)

def time_head(make_head, rows, seq_len, vocab_size, autocast, ranks, shard, bf16=False, compiled=False):
    """Seconds of a micro-step's embeddings, lm_head and loss (make_head(): a GPT of no blocks), forward and backward,
    sharded as `shard` ("full", "grads") shards it. Sharded runs let the C library give freed memory back to the OS
    (train_gpt2.py keeps it only for the others), so their vocabulary-sized temporaries (the tied weight's gradients
    from the loss and the embedding, their fp32 copies, the logits) are page-faulted in afresh every micro-step:
    GPT-2 medium's shape, 2 ranks, AMD EPYC Zen 4, 256 tokens: 1.41 s (ZeRO-2), 1.99 s (FSDP) against 0.65 s with the
    memory kept, the FLOPs' share. A block's temporaries are too small for that (malloc keeps them)."""
    model = as_layout_runs(make_head(), SimpleNamespace(name="fsdp" if shard == "full" else "fsdp_grads"), ranks, bf16)
    model = speedups.compile_model(model) if compiled else model
    idx = torch.randint(0, vocab_size, (rows, seq_len))
    return timed_passes(lambda: model(idx, idx)[1].backward(), autocast, ranks, turns=3)

def as_layout_runs(module, layout, ranks, bf16):
    """module as `layout` runs it: FSDP ("fsdp": sharded, gathered for its forward and again for its backward, its
    gradients kept whole as on a step's micro-steps before the last; "fsdp_grads", ZeRO-2: gathered once and kept, its
    gradients accumulated whole in fp32 by FSDP's hooks), split over tensor parallel's group (tp > 1), or plain."""
    if layout is not None and layout.name in ("fsdp", "fsdp_grads"):
        from torch.distributed.fsdp import fully_shard
        gathered = layout.name == "fsdp_grads"
        fully_shard(module, mp_policy=sharding.precision(bf16), reshard_after_forward=not gathered)
        module.set_requires_gradient_sync(False)
        module.set_reshard_after_backward(not gathered)
    elif layout is not None and layout.tp > 1:
        tensor_parallel.split_block(module, mesh.mesh_of(ranks.world_size, 1, layout.tp, "cpu")["tp"], layout.tp)
    return module

def timed_passes(one_pass, autocast, ranks, turns):
    """The median turn's slowest rank, over `turns` turns after one of warm-up (FSDP's and TP's first pass also sets
    them up), per pass; a turn runs enough passes to last 0.5 s (and only 3 turns where a pass lasts 2 s or more)."""
    def turn(passes):
        torch.distributed.barrier()
        start = time.perf_counter()
        with autocast:
            for _ in range(passes):
                one_pass()
        return slowest(time.perf_counter() - start, ranks) / passes
    turn(1)
    one = turn(1)
    passes = max(1, math.ceil(0.5 / one))
    return statistics.median([turn(passes) for _ in range(turns if one < 2 else 3)])
