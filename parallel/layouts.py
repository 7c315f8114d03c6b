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

from compute import cpu, speedups
from parallel import sharding, sizes, stage_split, tensor_parallel
from parallel.cluster import crowding, free_memory, measure_network, time_block, time_head
from parallel.sizes import STATE_BYTES, activation_bytes, beyond_state, gib
from parallel.mesh import describe_nodes, inside_nodes, nodes_of

FORCED = {"dp": ("none", 1), "fsdp": ("full", 1), "fsdp_grads": ("grads", 1)}  # --parallel NAME: (--shard, --pp)
HEADROOM = 0.9  # a layout must fit in this share of the free memory: the rest is for what the estimate leaves out
@dataclass
class Layout:
    name: str  # dp, fsdp, fsdp_grads, pp, tp
    shard: str  # --shard
    pp: int  # --pp (pipeline stages)
    tp: int = 1  # --tp (tensor-parallel ranks); data-parallel replicas: world // (pp x tp)
    memory: float = 0.0  # bytes a rank needs at most (training state, gathered weights, activations)
    sent: float = 0.0  # bytes the busiest rank sends a step
    sent_in_blocks: float = 0.0  # of them, the bytes inside block_seconds (FSDP's gathers of blocks, TP's all-reduces)
    block_seconds: float = 0.0  # a block's forward and backward as this layout runs it (FSDP, TP: timed); 0: plain
    head_seconds: float = 0.0  # the embeddings' and the loss's, sharded (timed: cluster.time_head); 0: by FLOPs
    sent_in_head: float = 0.0  # the bytes inside head_seconds (FSDP's gathers of the embeddings)
    seconds: float = 0.0  # the predicted step
    bounds: tuple = ()  # a pipeline's stages, (first block, end) each (stages())

    def flags(self):
        if self.pp > 1:
            return (f"--pp {self.pp}" + f" --tp {self.tp}" * (self.tp > 1)
                    + f" --shard {self.shard}" * (self.shard != "none"))
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
    P, block, embeddings = sizes.parameters(config)
    weight = 2 if bf16 else 4  # bytes of a weight as FSDP gathers it (bf16: gathered in bf16)
    L = config.n_layer
    def acts(layers):
        return activation_bytes(config, rows, seq_len, layers, bf16)
    if layout.name == "dp":  # the whole state; DDP's buckets are a second copy of the gradients
        layout.memory = (STATE_BYTES + 4) * P + acts(L) + beyond_state(P, 1, config, bf16)
        layout.sent = sharding.bytes_sent(P, P, world, "none", micro_steps, bf16)
    elif layout.name == "fsdp":  # a share of the state; one block and the embeddings gathered at a time; the gradients
        # whole until the last micro-step (sync off: as ZeRO-2's), fp32 (reduce_dtype)
        whole = 4 * P * (micro_steps > 1)
        gathered = 2 * (4 * block + 4 * embeddings)  # (every gradient is computed whole: its temporaries, 2 bytes each)
        layout.memory = STATE_BYTES * P / world + gathered + whole + acts(L) + beyond_state(P, 1, config, False)
        layout.sent = sharding.bytes_sent(P, P, world, "full", micro_steps, bf16)
        layout.sent_in_blocks = 2 * micro_steps * sharding.ring(world, L * block * weight)
        layout.sent_in_head = 2 * micro_steps * sharding.ring(world, embeddings * weight)
    elif layout.name == "fsdp_grads":  # weights and moments sharded; every weight gathered and kept, gradients whole
        layout.memory = (STATE_BYTES - 4) * P / world + (weight + 4) * P + acts(L) + beyond_state(P, 1, config, False)
        layout.sent = sharding.bytes_sent(P, P, world, "grads", micro_steps, bf16)
    elif layout.name == "tp":  # a 1/tp share of every block's matrices; embeddings, LayerNorms and lm_head whole
        t, dp = layout.tp, world // layout.tp
        held, tp_bytes, dp_bytes = tensor_parallel.rank_plan(config, t, dp, rows, seq_len, micro_steps,
                                                             "bf16" if bf16 else "fp32")
        split_acts = acts(L) * (1 + 1 / t) / 2  # (about half of the activations split)
        layout.memory = (STATE_BYTES + 4 * (dp > 1)) * held + split_acts + beyond_state(held, 1, config, bf16)
        layout.sent, layout.sent_in_blocks = tp_bytes + dp_bytes, tp_bytes
    else:
        plan_pipeline(layout, config, world, rows, seq_len, micro_steps, bf16, budget, acts)
    return layout

def plan_pipeline(layout, config, world, rows, seq_len, micro_steps, bf16, budget, acts):
    """plan() for a pipeline: its busiest stage. 1F1B keeps pp - s micro-batches' activations on stage s, and the last
    stage alone computes the loss (acts(0)); a sharded stage holds as FSDP and ZeRO-2 do over the stage's replicas."""
    dp, N, t = world // (layout.pp * layout.tp), layout.pp, layout.tp
    weight = 2 if bf16 else 4
    layout.bounds = stages(config, N, seq_len, budget, bf16, t)[0]
    held = stage_split.stage_plan(config, layout.bounds, rows, seq_len, micro_steps, dp, layout.shard, bf16, tp=t)
    def state(p):
        return {"none": (STATE_BYTES + 4 * (dp > 1)) * p, "grads": 12 * p / dp + (weight + 4) * p,
                "full": STATE_BYTES * p / dp + (weight + 4 * (micro_steps > 1)) * p}[layout.shard]
    def peak(s, a, b, params):
        held_acts = min(N - s, micro_steps) * (acts(b - a) - acts(0)) * (1 + 1 / t) / 2 + (s == N - 1) * acts(0)
        beyond = beyond_state(params, (s == 0) + (s == N - 1), config, bf16 and layout.shard == "none")
        return state(params) + beyond + held_acts
    layout.memory = max(peak(s, a, b, params) for s, ((a, b), (_, params, _)) in enumerate(zip(layout.bounds, held)))
    busiest = max(range(N), key=lambda s: held[s][2])
    a, b = layout.bounds[busiest]  # tensor parallel's all-reduces: inside its timed block (stage_plan's formula)
    layout.sent = held[busiest][2]
    layout.sent_in_blocks = tensor_parallel.all_reduce_bytes(b - a, micro_steps, t, rows, seq_len, config.n_embd, bf16)

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
    second, latency), but for the bytes inside layout.block_seconds (FSDP's and TP's blocks, timed as they run); a
    pipeline of N stages runs M + N - 1 micro-steps' worth of its slowest stage (the bubble: (N-1)/(M+N-1) idle).
    crowd: how many times more threads than cores a node's ranks have (crowding(), at least 1); block_seconds is a block
    timed with every rank busy, so a rank alone runs it crowd times faster."""
    bandwidth, latency = link
    L = config.n_layer
    block_cost, head_cost = stage_split.stage_costs(config, seq_len)
    block = layout.block_seconds or block_seconds  # (TP: its share of each block, its all-reduces inside)
    head = layout.head_seconds or head_cost / block_cost * block_seconds  # lm_head and the loss, whole where computed
    if layout.pp == 1:
        compute = micro_steps * (L * block + head)
        messages = {"fsdp": 2 * micro_steps + L + 1, "fsdp_grads": 2 * (L + 1), "dp": L + 1, "tp": 1}[layout.name]
    else:
        stage = max((b - a) * block + (s == layout.pp - 1) * head for s, (a, b) in enumerate(layout.bounds))
        chain = (micro_steps + layout.pp - 1) * stage / crowd
        # On crowded cores the lighter stages' and the bubble's idle time is lent to the busy stage (3 ranks on 2
        # cores: ZeRO-2 predicted ahead, the pipeline measured 1.19x faster), so the node's cores, all busy with the
        # whole step's work, bound it instead; with a core for every thread (crowd 1) the chain is always longer.
        compute = max(chain, micro_steps * (L * block + head) / layout.pp)
        messages = 2 * micro_steps + 2
    timed = layout.sent_in_blocks * bool(layout.block_seconds) + layout.sent_in_head * bool(layout.head_seconds)
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

def forced(args):
    """The Layout the flags force (--shard, --pp, --tp)."""
    tp = getattr(args, "tp", 1)  # (a test's arguments may name only --pp)
    name = ("pp" if args.pp > 1 else "tp" if tp > 1 else
            {"none": "dp", "full": "fsdp", "grads": "fsdp_grads"}[args.shard])
    return Layout(name, args.shard, args.pp, tp)

def planned(layout, args, config, world, bf16):
    """plan() at the run's shapes: its batch, its context, its micro-steps for this layout's replicas."""
    micro = sizes.micro_steps(args.total_batch_size, args.batch_size, args.seq_len, world // (layout.pp * layout.tp))
    return plan(layout, config, world, args.batch_size, args.seq_len, micro, bf16,
                sizes.max_memory_bytes(args.max_memory))

def check_fits(args, config, ranks, bf16):
    """A layout forced (--parallel NAME, --shard, --pp, --tp) that cannot fit: one error line with the memory it needs
    and has, before the model is built."""
    layout = planned(forced(args), args, config, ranks.world_size, bf16)
    sizes.refuse_if_over(layout.memory, free_memory(ranks, args.max_memory), args.max_memory,
                         layout.describe(ranks.world_size), "more ranks, a smaller --batch_size, or another layout "
                         "(--parallel auto chooses one)")

def decide(args, config, ranks, bf16, autocast, models):
    """--parallel auto on `ranks`: the Layout to train with, and the line that says why (see the top of this file).
    args: the run's (batch_size, seq_len, total_batch_size, max_memory); models: (Block, GPT), the classes to time."""
    W = ranks.world_size
    free = free_memory(ranks, args.max_memory)
    dp = planned(Layout("dp", *FORCED["dp"]), args, config, W, bf16)
    if dp.memory <= HEADROOM * free:
        return dp, (f"parallel: {dp.describe(W)}: the training state and activations, ~{gib(dp.memory)} a rank, fit "
                    f"in {HEADROOM:.0%} of the {gib(free)} free on each "
                    "(--parallel fsdp, fsdp_grads or pp forces another)")
    # which ranks share a node: TP only inside one (its block timed there)
    hostnames = ranks.gather(socket.gethostname())
    nodes, crowd = nodes_of(hostnames), crowding(ranks)
    def stages_ok(pp):
        return pp <= config.n_layer and sizes.micro_steps(args.total_batch_size, args.batch_size, args.seq_len,
                                                          W // pp) >= pp
    layouts = [planned(l, args, config, W, bf16)
               for l in candidates(config, W, stages_ok, tp=hasattr(args, "tp"), hostnames=hostnames)]
    link = measure_network(ranks, nodes)
    block_seconds, own, heads = time_layouts(layouts, args, config, ranks, bf16, autocast, models, free)
    for layout in layouts:
        micro = sizes.micro_steps(args.total_batch_size, args.batch_size, args.seq_len, W // (layout.pp * layout.tp))
        predict(layout, config, W, args.seq_len, micro, block_seconds, link, crowd)
    chosen, runner_up = choose(layouts, free, fits_alone=False)
    if chosen is None:
        least = min(layouts, key=lambda l: l.memory)
        raise SystemExit(f"error: --parallel auto: no layout fits in {HEADROOM:.0%} of the {gib(free)} free on each "
                         f"rank (the least, {least.describe(W)}, needs ~{gib(least.memory)}): more ranks, a smaller "
                         f"--batch_size, or --max_memory")
    timed = ", ".join(f"{k if isinstance(k, str) else f'tp {k}'}'s {seconds * 1000:.0f}" for k, seconds in own.items())
    measured = (f"link {link[0] / 1e6:.0f} MB/s, {link[1] * 1e6:.0f} us" + " across nodes" * (len(nodes) > 1)
                + f"; a block {block_seconds * 1000:.0f} ms" + (f" ({timed})" if timed else "")
                + "".join(f"; embeddings and loss {t * 1000:.0f} ms (--shard {shard})" for shard, t in heads.items())
                + f"; {gib(free)} free a rank; {describe_nodes(nodes)}"
                + (f", {crowd:.2g} threads a core" * (crowd > 1)))
    return chosen, decision_lines(layouts, chosen, runner_up, dp, measured, free, W)

def time_layouts(layouts, args, config, ranks, bf16, autocast, models, free):
    """Times what decides the layouts that fit: a plain block, and each layout's own where it talks inside every block
    (FSDP, ZeRO-2, each tp degree: timed once) or shards its embeddings and loss. Each piece is timed under the memory
    policy its run has: train_gpt2.py keeps freed memory (cpu.keep_freed_memory) but for sharded runs, whose memory is
    short (a plain block measured 0.90x its time without: GPT-2 medium, Zen 4). Sets each layout's block_seconds and
    head_seconds; returns (a plain block's seconds, {FSDP's, ZeRO-2's, tp degree's block: seconds},
    {shard: seconds})."""
    compiled = speedups.will_compile(getattr(args, "compile", False), "cpu")
    def block(layout=None):
        return time_block(lambda: models[0](config), args.batch_size, args.seq_len, config.n_embd, autocast, ranks,
                          layout=layout, bf16=bf16, compiled=compiled)
    def head(shard):
        return time_head(lambda: models[1](dataclasses.replace(config, n_layer=0)), args.batch_size, args.seq_len,
                         config.vocab_size, autocast, ranks, shard, bf16, compiled)
    fitting = [l for l in layouts if l.memory <= HEADROOM * free]
    own, heads = {}, {}
    cpu.keep_freed_memory()
    plain = block()
    for layout in (l for l in fitting if l.tp > 1):
        layout.block_seconds = own[layout.tp] = own.get(layout.tp) or block(Layout("tp", "none", 1, layout.tp))
    cpu.keep_freed_memory(False)
    for layout in fitting:
        if layout.name in ("fsdp", "fsdp_grads"):
            layout.block_seconds = own[layout.name] = own.get(layout.name) or block(Layout(layout.name, "none", 1))
        # a sharded layout's embeddings and loss, timed as it runs them (a sharded stage's: ZeRO-2's way, no traffic)
        shard = "grads" if layout.pp > 1 and layout.shard != "none" else layout.shard
        if shard != "none":
            layout.head_seconds = heads[shard] = heads.get(shard) or head(shard)
    return plain, own, heads

def decision_lines(layouts, chosen, runner_up, dp, measured, free, world):
    """The two lines that say why: the chosen layout, what was measured, the runner-up; every layout's prediction."""
    def line(l):
        return f"{l.describe(world)}: {l.seconds:.2f} s a step, {l.sent / 1e6:.0f} MB sent, {gib(l.memory)} a rank"
    every = ", ".join(f"{l.short()} {l.seconds:.2f} s" + (" (does not fit)" if l.memory > HEADROOM * free else
                                                          " (chosen)" if l is chosen else "") for l in layouts)
    return (f"parallel: {line(chosen)} (predicted; {measured}); runner-up {line(runner_up) if runner_up else 'none'}"
            f" ({(runner_up or chosen).flags()} forces it); DDP would need ~{gib(dp.memory)} a rank\n"
            f"parallel: every layout's predicted step: {every}")
