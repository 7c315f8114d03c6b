"""
--parallel auto: how the ranks split the training (the layout), decided from the cluster itself, the way the dtype is
decided from the CPU: measured, predicted, and said in one line.

  - If every rank can hold the whole training state and a micro-batch's activations in 90% of its free memory (or of
    --max_memory), data parallel (DDP), as always: nothing is measured but each rank's free memory.
  - Otherwise, for every layout that fits (FSDP, ZeRO-2, a pipeline (its stages whole, sharded over its replicas,
    or split by tensor parallel inside a node), tensor parallel, each with data parallel across the rest), its step
    is predicted from what decides it: the compute (one block's forward and backward, timed on every rank at once at
    the run's shape, compiled where the run compiles), the bytes each rank sends (computed, as the plan lines print
    them) over the link (timed at the start: an all-reduce of 4 bytes for its latency, one of 32 MB for its
    bandwidth), and the pipeline's bubble. The fastest prediction wins; the line gives it, the runner-up, and the
    flag that forces another.
  - Layouts that talk inside every block (FSDP gathers each block's weights twice a micro-step, TP all-reduces its
    activations four times) have that block timed as they run it, collectives and all (docs/parallel.md); sharded
    layouts their embeddings and loss too, whose vocabulary-sized temporaries page-fault anew each micro-step.
  - Nodes: ranks with one hostname share a node (shared memory between them, the network between nodes). Tensor
    parallel is offered only where its groups lie inside a node (its block is timed there, on that link); with
    several nodes of several ranks, the link across nodes is timed between one rank of each node.

The predictions assume nothing overlaps: compute, then sending (DDP and FSDP overlap some: docs/parallel.md).
"""
import dataclasses
import socket
from dataclasses import dataclass

import torch

from plumbing import cpu, sharding, speedups, stage_split, tensor_parallel
from plumbing.cluster import crowding, free_memory, measure_network, time_block, time_head
from plumbing.world import describe_nodes, inside_nodes, nodes_of

FORCED = {"dp": ("none", 1), "fsdp": ("full", 1), "fsdp_grads": ("grads", 1)}  # --parallel NAME: (--shard, --pp)
HEADROOM = 0.9  # a layout must fit in this share of the free memory: the rest is for what the estimate leaves out
STATE_BYTES = 16  # per trained parameter: fp32 weight, gradient, AdamW's two moments

def beyond_state(params, vocab_matrices, config, bf16):
    """A rank's peak beyond its training state, as measured (peak RSS, AMD EPYC Zen 4, GPT-2 large on 3 stages, fp32
    and bf16): the process 0.3 GiB; 2 bytes a parameter (a backward's temporaries); 4 V C bytes for each vocabulary
    matrix held (the tied weight's gradients, from the embedding and the loss); in bf16, autocast's weight copies."""
    return 0.3 * 2**30 + (2 + 2 * bf16) * params + vocab_matrices * 4 * config.vocab_size * config.n_embd

@dataclass
class Layout:
    name: str  # dp, fsdp, fsdp_grads, pp, tp
    shard: str  # --shard
    pp: int  # --pp (pipeline stages)
    tp: int = 1  # --tp (tensor-parallel ranks); data-parallel replicas: world // (pp x tp)
    memory: float = 0.0  # bytes a rank needs at most (training state, gathered weights, activations)
    sent: float = 0.0  # bytes the busiest rank sends a step
    sent_in_blocks: float = 0.0  # of them, the bytes inside `block`'s time (FSDP's gathers of the blocks, TP's all-reduces)
    block: float = 0.0  # seconds of a block's forward and backward as this layout runs it (FSDP, TP: timed); 0: plain
    head: float = 0.0  # seconds of the embeddings' and the loss's, sharded (timed: cluster.time_head); 0: by FLOPs
    sent_in_head: float = 0.0  # the bytes inside `head`'s time (FSDP's gathers of the embeddings)
    seconds: float = 0.0  # the predicted step
    bounds: tuple = ()  # a pipeline's stages, (first block, end) each (stages())

    def flags(self):
        if self.pp > 1:
            return f"--pp {self.pp}" + f" --tp {self.tp}" * (self.tp > 1) + f" --shard {self.shard}" * (self.shard != "none")
        return f"--tp {self.tp}" if self.tp > 1 else f"--parallel {self.name}"

    def short(self):
        if self.pp > 1:
            return f"pp {self.pp}" + f" tp {self.tp}" * (self.tp > 1) + f" {self.shard}" * (self.shard != "none")
        return f"tp {self.tp}" if self.tp > 1 else self.name

    def describe(self, world):
        what = {"dp": "data parallel (DDP)", "fsdp": "FSDP (--shard full)", "fsdp_grads": "ZeRO-2 (--shard grads)"}
        replicas = f" x {world // (self.pp * self.tp)} data-parallel replica(s)"
        stages = f"pipeline of {self.pp} stages" + f" of {self.tp} tensor-parallel ranks" * (self.tp > 1) + replicas
        return what.get(self.name) or (stages + f", each stage sharded (--shard {self.shard})" * (self.shard != "none")
                                       if self.pp > 1 else f"tensor parallel over {self.tp} ranks" + replicas)

# -----------------------------------------------------------------------------
# What a layout holds and sends, computed (a rank's share; the busiest rank's where they differ)

def activation_bytes(config, rows, seq_len, layers, bf16):
    """A micro-batch's activations kept for the backward through `layers` blocks. Per token and block about 48 C
    bytes in bf16 (the inputs of the four matmuls and of attention, the LayerNorms' and GELU's inputs, in bf16 or
    fp32 as autocast leaves them) and 80 C in fp32: measured on GPT-2 (124M) as peak memory minus the state. Plus
    the loss's chunk of logits (fp32, 4096 positions x V at most)."""
    per_token = (48 if bf16 else 80) * config.n_embd
    return rows * seq_len * layers * per_token + 4 * min(rows * seq_len, 4096) * config.vocab_size

def parameters(config):
    """(all of them, one block's, the embeddings' (wte, wpe)): GPT-2's, lm_head tied to wte."""
    C, V = config.n_embd, config.vocab_size
    block = 12 * C * C + 13 * C
    embeddings = (V + config.block_size) * C
    return config.n_layer * block + embeddings + 2 * C, block, embeddings

def ring(world, size):
    """Bytes a rank sends in a ring all-gather or reduce-scatter of `size` bytes (an all-reduce is both)."""
    return (world - 1) / world * size

def stages(config, pp, seq_len, budget=None, bf16=False, tp=1):
    """A pipeline's [(first block, end)] per stage, and its slowest stage's compute in blocks (lm_head and the loss
    count on the last stage), as stage_split.py cuts it (to fit budget, --max_memory in bytes, where it can)."""
    block_cost, head_cost = stage_split.stage_costs(config, seq_len)
    bounds = stage_split.stage_bounds(config, pp, seq_len, budget, bf16, tp)
    return bounds, max(
        (b - a) + (s == pp - 1) * head_cost / block_cost for s, (a, b) in enumerate(bounds))

def plan(layout, config, world, rows, seq_len, micro_steps, bf16, budget=None):
    """Fill in the layout's memory and bytes sent a step (micro_steps: each data-parallel replica's accumulation
    steps), the bytes as the trainer's plan lines compute them (sharding, pipeline, tensor_parallel; on gloo)."""
    P, block, embeddings = parameters(config)
    weight = 2 if bf16 else 4  # bytes of a weight as FSDP gathers it (bf16: gathered in bf16)
    acts = lambda layers: activation_bytes(config, rows, seq_len, layers, bf16)  # noqa: E731
    L = config.n_layer
    if layout.name == "dp":  # the whole state; DDP's buckets are a second copy of the gradients
        layout.memory = (STATE_BYTES + 4) * P + acts(L) + beyond_state(P, 1, config, bf16)
        layout.sent = sharding.bytes_sent(P, P, world, "none", micro_steps, bf16)
    elif layout.name == "fsdp":  # a share of the state; one block and the embeddings gathered at a time; the gradients
        whole = 4 * P * (micro_steps > 1)  # whole until the last micro-step (sync off: as ZeRO-2's), fp32 (reduce_dtype)
        layout.memory = STATE_BYTES * P / world + 2 * (4 * block + 4 * embeddings) + whole + acts(L) + \
            beyond_state(P, 1, config, False)  # (every gradient is computed whole: its temporaries, 2 bytes each)
        layout.sent = sharding.bytes_sent(P, P, world, "full", micro_steps, bf16)
        layout.sent_in_blocks = 2 * micro_steps * ring(world, L * block * weight)
        layout.sent_in_head = 2 * micro_steps * ring(world, embeddings * weight)
    elif layout.name == "fsdp_grads":  # weights and moments sharded; every weight gathered and kept, gradients whole
        layout.memory = (STATE_BYTES - 4) * P / world + (weight + 4) * P + acts(L) + beyond_state(P, 1, config, False)
        layout.sent = sharding.bytes_sent(P, P, world, "grads", micro_steps, bf16)
    elif layout.name == "tp":  # a 1/tp share of every block's matrices; embeddings, LayerNorms and lm_head whole
        t, dp = layout.tp, world // layout.tp
        held, tp_bytes, dp_bytes = tensor_parallel.rank_plan(config, t, dp, rows, seq_len, micro_steps,
                                                             "bf16" if bf16 else "fp32")
        layout.memory = (STATE_BYTES + 4 * (dp > 1)) * held + acts(L) * (1 + 1 / t) / 2 + \
            beyond_state(held, 1, config, bf16)  # (about half of the activations split)
        layout.sent, layout.sent_in_blocks = tp_bytes + dp_bytes, tp_bytes
    else:  # pipeline: the busiest stage; 1F1B keeps pp - s micro-batches' activations on stage s, and the last
        dp, N, t = world // (layout.pp * layout.tp), layout.pp, layout.tp  # stage alone computes the loss (acts(0))
        layout.bounds = stages(config, N, seq_len, budget, bf16, t)[0]
        held = stage_split.stage_plan(config, layout.bounds, rows, seq_len, micro_steps, dp, layout.shard, bf16, tp=t)
        sharded = layout.shard != "none"  # as FSDP and ZeRO-2 above, over the stage's replicas
        state = lambda p: {"none": (STATE_BYTES + 4 * (dp > 1)) * p, "grads": 12 * p / dp + (weight + 4) * p,  # noqa: E731
                           "full": 16 * p / dp + (weight + 4 * (micro_steps > 1)) * p}[layout.shard]
        layout.memory = max(state(params) + beyond_state(params, (s == 0) + (s == N - 1), config, bf16 and not sharded)
                            + min(N - s, micro_steps) * (acts(b - a) - acts(0)) * (1 + 1 / t) / 2 + (s == N - 1) * acts(0)
                            for s, ((a, b), (_, params, _)) in enumerate(zip(layout.bounds, held)))
        busiest = max(range(N), key=lambda s: held[s][2])
        a, b = layout.bounds[busiest]  # tensor parallel's all-reduces: inside its timed block (stage_plan's formula)
        layout.sent = held[busiest][2]
        layout.sent_in_blocks = micro_steps * (b - a) * 4 * (t - 1) / t * rows * seq_len * config.n_embd * (weight + 4)
    return layout

def candidates(config, world, pp_stages_ok, tp=True, hostnames=None):
    """Every layout this world size can run: DDP, FSDP, ZeRO-2, pipelines of every stage count that divides it, and
    tensor parallel over every rank count that divides it and the heads, and whose groups lie inside a node
    (hostnames: each rank's; None: all on one node)."""
    layouts = [Layout(name, *FORCED[name]) for name in ("dp", "fsdp", "fsdp_grads")]
    tps = [t for t in range(2, world + 1) if tp and world % t == 0 and config.n_head % t == 0 and
           inside_nodes(t, hostnames or [""] * world)]
    for pp in (pp for pp in range(2, world + 1) if world % pp == 0 and pp_stages_ok(pp)):
        layouts += [Layout("pp", "none", pp)] + [Layout("pp", shard, pp) for shard in ("grads", "full") if world > pp]
        layouts += [Layout("pp", "none", pp, t) for t in tps if world % (pp * t) == 0]  # tp inside nodes, pp across
    return layouts + [Layout("tp", "none", 1, t) for t in tps]

# -----------------------------------------------------------------------------
# The prediction, and the choice

def predict(layout, config, world, seq_len, micro_steps, block_seconds, link, crowd=1.0):
    """Seconds of a step: the busiest rank's compute (each micro-step runs its blocks forward and backward, and the
    last stage lm_head and the loss, counted in blocks by their FLOPs), then its sending over the link (bytes a
    second, latency), but for the bytes inside layout.block's time (FSDP's and TP's blocks, timed as they run); a
    pipeline of N stages runs M + N - 1 micro-steps' worth of its slowest stage (the bubble: (N-1)/(M+N-1) idle).
    crowd: how many times more threads than cores a node's ranks have (crowding(), at least 1); block_seconds is a block
    timed with every rank busy, so a rank alone runs it crowd times faster."""
    bandwidth, latency = link
    L = config.n_layer
    block_cost, head_cost = stage_split.stage_costs(config, seq_len)
    head = layout.head or head_cost / block_cost * block_seconds  # lm_head and the loss, whole on each rank computing them
    if layout.pp == 1:  # FSDP's and TP's blocks as they run them (TP: its share of each, its all-reduces inside)
        compute = micro_steps * (L * (layout.block or block_seconds) + head)
        messages = {"fsdp": 2 * micro_steps + L + 1, "fsdp_grads": 2 * (L + 1), "dp": L + 1, "tp": 1}[layout.name]
    else:  # (a stage's blocks as its tensor-parallel ranks run them: layout.block, timed; lm_head whole on each)
        stage = max((b - a) * (layout.block or block_seconds) + (s == layout.pp - 1) * head
                    for s, (a, b) in enumerate(layout.bounds))
        chain = (micro_steps + layout.pp - 1) * stage / crowd
        # On crowded cores the lighter stages' and the bubble's idle time is lent to the busy stage (3 ranks on 2
        # cores: ZeRO-2 predicted ahead, the pipeline measured 1.19x faster), so the node's cores, all busy with the
        # whole step's work, bound it instead; with a core for every thread (crowd 1) the chain is always longer.
        compute = max(chain, micro_steps * (L * (layout.block or block_seconds) + head) / layout.pp)
        messages = 2 * micro_steps + 2
    timed = layout.sent_in_blocks * bool(layout.block) + layout.sent_in_head * bool(layout.head)
    sending = (layout.sent - timed) / bandwidth  # (the untimed bytes: all over the link)
    layout.seconds = compute + sending + messages * 2 * (world - 1) * latency
    return layout

def choose(layouts, free, fits_alone):
    """(chosen, runner-up or None): the fastest predicted layout that fits, DDP outright when it fits (fits_alone)."""
    fitting = [l for l in layouts if l.memory <= HEADROOM * free]
    if not fitting:
        return None, None
    if fits_alone:
        return next(l for l in fitting if l.name == "dp"), None
    ranked = sorted(fitting, key=lambda l: l.seconds)
    return ranked[0], (ranked[1] if len(ranked) > 1 else None)

def gib(b):
    return f"{b / 2**30:.2f} GiB"

def check_fits(args, config, ranks, bf16):
    """A layout forced (--parallel NAME, --shard, --pp, --tp) that cannot fit: one error line with the memory it needs
    and has, before the model is built. (Held to all the free memory, not 90%: the estimate is not exact.)"""
    W, tp = ranks.world_size, getattr(args, "tp", 1)
    name = "pp" if args.pp > 1 else "tp" if tp > 1 else {"none": "dp", "full": "fsdp", "grads": "fsdp_grads"}[args.shard]
    micro = args.total_batch_size // (args.batch_size * args.seq_len * (W // (args.pp * tp)))
    layout = plan(Layout(name, args.shard, args.pp, tp), config, W, args.batch_size, args.seq_len, micro, bf16,
                  args.max_memory and args.max_memory * 2**30)
    free = free_memory(ranks, args.max_memory)
    if layout.memory > free:
        raise SystemExit(f"error: {layout.describe(W)} needs ~{gib(layout.memory)} a rank (training state and "
                         f"activations), and a rank has {gib(free)}" + (" (--max_memory)" if args.max_memory else " free")
                         + ": more ranks, a smaller --batch_size, or another layout (--parallel auto chooses one)")

def decide(args, config, ranks, bf16, autocast, models):
    """--parallel auto on `ranks`: the Layout to train with, and the line that says why (see the top of this file).
    args: the run's (batch_size, seq_len, total_batch_size, max_memory); models: (Block, GPT), the classes to time."""
    make_block, make_head = lambda: models[0](config), lambda: models[1](dataclasses.replace(config, n_layer=0))
    W = ranks.world_size
    free = free_memory(ranks, args.max_memory)
    micro = lambda dp: args.total_batch_size // (args.batch_size * args.seq_len * dp)  # noqa: E731
    planned = lambda l: plan(l, config, W, args.batch_size, args.seq_len, micro(W // (l.pp * l.tp)), bf16,  # noqa: E731
                             args.max_memory and args.max_memory * 2**30)
    dp = planned(Layout("dp", *FORCED["dp"]))
    if dp.memory <= HEADROOM * free:
        return dp, (f"parallel: {dp.describe(W)}: the training state and activations, ~{gib(dp.memory)} a rank, fit "
                    f"in {HEADROOM:.0%} of the {gib(free)} free on each (--parallel fsdp, fsdp_grads or pp forces another)")
    hostnames = [None] * W  # which ranks share a node: TP only inside one (its block timed there)
    torch.distributed.all_gather_object(hostnames, socket.gethostname())
    nodes, crowd = nodes_of(hostnames), crowding(ranks)
    layouts = [planned(l) for l in candidates(config, W, lambda pp: pp <= config.n_layer and micro(W // pp) >= pp,
                                              tp=hasattr(args, "tp"), hostnames=hostnames)]
    link = measure_network(ranks, nodes)
    compiled = speedups.will_compile(getattr(args, "compile", False), "cpu")
    timed = lambda layout=None: time_block(make_block, args.batch_size, args.seq_len, config.n_embd, autocast, ranks,  # noqa: E731
                                           layout=layout, bf16=bf16, compiled=compiled)
    # Each piece timed under the memory policy its run has: train_gpt2.py keeps freed memory (cpu.keep_freed_memory)
    # but for sharded runs, whose memory is short (a plain block measured 0.90x its time without: GPT-2 medium, Zen 4)
    own, heads = {}, {}  # (FSDP's, ZeRO-2's, each tp degree's block: timed once, for tp and pp x tp)
    cpu.keep_freed_memory()
    block_seconds = timed()
    for layout in layouts:
        if layout.tp > 1 and layout.memory <= HEADROOM * free:
            layout.block = own[layout.tp] = own.get(layout.tp) or timed(Layout("tp", "none", 1, layout.tp))
    cpu.keep_freed_memory(False)
    for layout in layouts:
        if layout.name in ("fsdp", "fsdp_grads") and layout.memory <= HEADROOM * free:
            layout.block = own[layout.name] = own.get(layout.name) or timed(Layout(layout.name, "none", 1))
        # a sharded layout's embeddings and loss, timed as it runs them (a sharded stage's: ZeRO-2's way, no traffic)
        shard = "grads" if layout.pp > 1 and layout.shard != "none" else layout.shard
        if shard != "none" and layout.memory <= HEADROOM * free:
            layout.head = heads[shard] = heads.get(shard) or time_head(
                make_head, args.batch_size, args.seq_len, config.vocab_size, autocast, ranks, shard, bf16, compiled)
        predict(layout, config, W, args.seq_len, micro(W // (layout.pp * layout.tp)), block_seconds, link, crowd)
    chosen, runner_up = choose(layouts, free, fits_alone=False)
    own = ", ".join(f"{k if isinstance(k, str) else f'tp {k}'}'s {seconds * 1000:.0f}" for k, seconds in own.items())
    measured = (f"link {link[0] / 1e6:.0f} MB/s, {link[1] * 1e6:.0f} us" + " across nodes" * (len(nodes) > 1) +
                f"; a block {block_seconds * 1000:.0f} ms" + (f" ({own})" if own else "") + "".join(
                    f"; embeddings and loss {seconds * 1000:.0f} ms (--shard {shard})" for shard, seconds in heads.items()) +
                f"; {gib(free)} free a rank; {describe_nodes(nodes)}" + (f", {crowd:.2g} threads a core" if crowd > 1 else ""))
    if chosen is None:
        least = min(layouts, key=lambda l: l.memory)
        raise SystemExit(f"error: --parallel auto: no layout fits in {HEADROOM:.0%} of the {gib(free)} free on each "
                         f"rank (the least, {least.describe(W)}, needs ~{gib(least.memory)}): more ranks, a smaller "
                         f"--batch_size, or --max_memory")
    line = lambda l: f"{l.describe(W)}: {l.seconds:.2f} s a step, {l.sent / 1e6:.0f} MB sent, {gib(l.memory)} a rank"  # noqa: E731
    every = ", ".join(f"{l.short()} {l.seconds:.2f} s" + (" (does not fit)" if l.memory > HEADROOM * free else
                                                          " (chosen)" if l is chosen else "") for l in layouts)
    return chosen, (f"parallel: {line(chosen)} (predicted; {measured}); runner-up {line(runner_up) if runner_up else 'none'}"
                    f" ({(runner_up or chosen).flags()} forces it); DDP would need ~{gib(dp.memory)} a rank\n"
                    f"parallel: every layout's predicted step: {every}")
