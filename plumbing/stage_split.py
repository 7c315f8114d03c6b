"""
The stage split of pipeline parallel (--pp N, run by plumbing/pipeline.py): which layouts can run, where the GPT's
blocks are cut so that the stages take equal time, one stage as a module (the GPT with the other stages' parts
removed), and what each stage holds and sends a step, computed for the plan line.

The model is openly GPT: the first stage holds the embeddings, the last ln_f and lm_head, whose weight is wte's
(tied): each of the two keeps its copy (pipeline.py sums their gradients every step).
"""

import torch
import torch.nn as nn

SCHEDULES = ("1f1b", "gpipe")

def check_layout(args, world_size):
    """One error line for a layout that cannot run, before anything expensive. Returns the data-parallel size."""
    pp = args.pp
    if pp < 1 or world_size % pp:
        raise SystemExit(f"error: --pp {pp}: the world size {world_size} is not a multiple of the stage count "
                         f"(world = data-parallel replicas x pipeline stages)")
    if pp > args.n_layer and args.init_from == "scratch" and not args.resume:
        raise SystemExit(f"error: --pp {pp}: more stages than the model's {args.n_layer} blocks (--n_layer)")
    if pp > 1 and args.lora and args.shard != "none" and world_size > pp:
        raise SystemExit(f"error: --pp {pp} --lora runs with --shard none (sharded stages with adapters: not yet)")
    dp = world_size // pp
    steps = args.total_batch_size // max(args.batch_size * args.seq_len * dp, 1)
    if pp > 1 and args.pp_schedule == "1f1b" and steps < pp:
        raise SystemExit(f"error: --pp {pp} --pp_schedule 1f1b needs at least {pp} micro-batches a step, and "
                         f"--total_batch_size {args.total_batch_size} gives {steps} (--batch_size {args.batch_size} x "
                         f"--seq_len {args.seq_len} x {dp} replica(s)): raise it, or use --pp_schedule gpipe")
    return dp

# -----------------------------------------------------------------------------
# Cutting the model: contiguous runs of blocks, balanced by their compute

def stage_costs(config, seq_len):
    """Forward FLOPs per token: (a block's, lm_head's with its loss). A block: its four matmuls (24 C^2) and attention
    (4 T C, as if not causal: the kernel's work). The embeddings are lookups: no FLOPs, but they are the first stage's."""
    C = config.n_embd
    return 24 * C * C + 4 * seq_len * C, 2 * config.vocab_size * C

def split_blocks(n_layer, n_stages, block_cost, head_cost, fits=None):
    """[(first block, end)] for each stage: contiguous, at least one block each, the largest stage cost (its blocks,
    plus lm_head's for the last) as small as it can be. Exact, by dynamic programming over the cut points. fits(stage,
    first block, end): False rules that stage out (None: no such cut fits)."""
    if n_stages > n_layer:
        raise SystemExit(f"error: --pp {n_stages}: more stages than the model's {n_layer} blocks")
    INF = float("inf")
    best = [[INF] * (n_layer + 1) for _ in range(n_stages + 1)]  # best[s][b]: s stages over blocks 0..b-1
    cut = [[0] * (n_layer + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        extra = head_cost if s == n_stages else 0.0
        for b in range(s, n_layer + 1):
            for a in range(s - 1, b):
                if fits is not None and not fits(s - 1, a, b):
                    continue
                cost = max(best[s - 1][a], (b - a) * block_cost + extra)
                if cost < best[s][b]:
                    best[s][b], cut[s][b] = cost, a
    if best[n_stages][n_layer] == INF:
        return None
    bounds, b = [], n_layer
    for s in range(n_stages, 0, -1):
        bounds.append((cut[s][b], b))
        b = cut[s][b]
    return bounds[::-1]

def stage_params(config, a, b, first, last, tp=1):
    """A stage's parameters a rank holds: a block's 12 C^2 + 13 C each (split over --tp's ranks but for 6 C:
    tensor_parallel.rank_plan), the embeddings' (V + block_size) C on the first stage, ln_f's 2 C and lm_head's copy
    of wte, V C, on the last."""
    C, V = config.n_embd, config.vocab_size
    return (b - a) * ((12 * C * C + 7 * C) / tp + 6 * C) + first * (V + config.block_size) * C + last * (2 * C + V * C)

def stage_bounds(config, n_stages, seq_len, budget=None, bf16=False):
    """Each stage's (first block, end), balanced by compute (split_blocks); with a budget (--max_memory, bytes a rank),
    the most balanced cut whose every stage's peak (its state and layouts.beyond_state, activations aside) fits in it,
    where one does: the first and last stages, which hold the vocabulary's matrices, then take fewer blocks."""
    from plumbing.layouts import beyond_state
    def fits(s, a, b):
        first, last = s == 0, s == n_stages - 1
        params = stage_params(config, a, b, first, last)
        return 16 * params + beyond_state(params, first + last, config, bf16) <= budget
    cut = lambda fits: split_blocks(config.n_layer, n_stages, *stage_costs(config, seq_len), fits)  # noqa: E731
    return (budget and cut(fits)) or cut(None)

def cut_to_stage(gpt, index, n_stages, blocks):
    """gpt, in place, with what other stages hold removed: their blocks become Identity, so the parameters keep the
    whole model's names, as checkpoints have them; the embeddings stay on the first stage, ln_f and lm_head on the
    last. On the meta device (before any storage: a rank builds only its stage), or again on a cut one (no change)."""
    for i in range(len(gpt.transformer.h)):
        if i not in range(*blocks):
            gpt.transformer.h[i] = nn.Identity()
    if index > 0 and "wte" in gpt.transformer:
        del gpt.transformer["wte"], gpt.transformer["wpe"]
    if index < n_stages - 1 and "ln_f" in gpt.transformer:
        del gpt.transformer["ln_f"]
        gpt.lm_head = None
    return gpt

class Stage(nn.Module):
    """One stage of a GPT: the GPT itself with what other stages hold removed (their blocks become Identity, so the
    parameters keep the whole model's names, as checkpoints have them). Inputs: token ids (first stage) or the
    residual stream (B, T, C); output: the residual stream, or on the last stage the micro-batch's loss when its side
    carries a Target. The loss is inside forward so that lm_head's weight is used where FSDP has gathered it."""

    def __init__(self, gpt, index, n_stages, blocks, dtype="fp32", device_type="cpu"):
        super().__init__()
        from plumbing import speedups  # the run's autocast, made afresh for each forward (the schedule runs them)
        self.autocast = lambda: speedups.autocast(dtype, device_type)
        self.first, self.last, self.blocks = index == 0, index == n_stages - 1, range(*blocks)
        self.gpt = cut_to_stage(gpt, index, n_stages, blocks)
        self.compiled = None  # run(), compiled (pipeline.Pipeline.compile): for training; evaluation runs it eagerly

    def forward(self, x, side=None):
        if self.compiled is not None and torch.is_grad_enabled():
            return self.compiled(x, side)
        return self.run(x, side)

    def run(self, x, side=None):
        with self.autocast():
            h = self.layers(x, side.packed if side is not None else None)
            return self.loss(h, side.target) if self.last and side is not None and side.target else h

    def loss(self, h, target):
        """The last stage's loss of one micro-batch, as GPT.forward computes it, times its weight in the step."""
        from plumbing.fused_loss import lm_head_loss
        y, packed = target.y, target.packed
        if packed is not None:  # only the targets' positions through lm_head
            h, y = h.flatten(0, 1)[packed.picked], y.flatten()[packed.picked]
        return (lm_head_loss(h, self.gpt.lm_head.weight, y) * target.weight).float()

    def layers(self, x, packed):
        t = self.gpt.transformer
        if self.first:
            T = x.size(1)
            positions = packed.positions if packed is not None else torch.arange(T, device=x.device)
            x = t.wte(x) + t.wpe(positions)
        lengths = packed.lengths if packed is not None else None
        for layer in self.blocks:
            if self.gpt.recompute:  # as GPT.hidden does: keep only the block's input for backward
                x = torch.utils.checkpoint.checkpoint(t.h[layer], x, None, layer, None, lengths, use_reentrant=False)
            else:
                x = t.h[layer](x, None, layer, None, lengths)
        return t.ln_f(x) if self.last else x

class Side:
    """A micro-batch's packing (dataloader.Packed, or None) and, for the last stage, its Target, handed to every stage
    beside its input. Wrapped so that the pipeline's schedules pass it through untouched, not as tensors to send or
    to differentiate."""

    def __init__(self, packed, target=None):
        self.packed, self.target = packed, target

class Target:
    """What the last stage's loss needs of a micro-batch: its targets, its packing, and its weight in the step's mean."""

    def __init__(self, y, packed, weight):
        self.y, self.packed, self.weight = y, packed, weight

# -----------------------------------------------------------------------------
# What each stage holds and sends, computed

def stage_plan(config, bounds, batch, seq_len, n_microbatches, dp, shard="none", bf16=False, backend="gloo", tp=1):
    """[(what it holds, its parameters, bytes each of its ranks sends a step)] per stage. Parameters: a block's
    12 C^2 + 13 C, the embeddings' (V + block_size) C on the first stage, ln_f's 2 C and lm_head's copy of wte, V C, on
    the last. Sent: an fp32 activation (B, T, C) a micro-batch to the next stage, its gradient to the one before; the
    tied gradient to the other end (a 2-rank all-reduce sends it once; sharded, each rank's 1/dp piece of it); and
    among the stage's dp ranks what sharding.bytes_sent computes for the stage's parameters: DDP's ring all-reduce,
    or FSDP's gathers and reduce-scatter. Under the schedule, --shard full gathers a unit's weights M + 1 times a step,
    not 2 M: the pipeline keeps a unit gathered after each backward (torch's PipelineStage), so of the forwards only
    those after another forward gather, and of the backwards only those after a forward: for 1F1B and GPipe alike,
    every forward and then the first backward. Split (--tp), each rank also sends its blocks' tensor-parallel
    all-reduces (tensor_parallel.rank_plan)."""
    from plumbing.sharding import bytes_sent
    C, V, pp = config.n_embd, config.vocab_size, len(bounds)
    activation = batch * seq_len * C * 4 * n_microbatches
    gathers = {"none": None, "full": n_microbatches + 1, "grads": 1}[shard]
    plan = []
    for s, (a, b) in enumerate(bounds):
        first, last = s == 0, s == pp - 1
        params = stage_params(config, a, b, first, last, tp)
        tied = (pp > 1 and (first or last)) * V * C * 4 / (dp if shard != "none" else 1)
        sent = (not last) * activation + (not first) * activation + tied
        sent += n_microbatches * (b - a) * 2 * 2 * (tp - 1) / tp * batch * seq_len * C * ((2 if bf16 else 4) + 4)
        sent += bytes_sent(params, params, dp, shard, n_microbatches, bf16, backend, gathers) if dp > 1 else 0
        what = ("embeddings + " if first else "") + f"blocks {a}-{b - 1}" + (" + ln_f, lm_head" if last else "")
        plan.append((what, params, sent))
    return plan

def plan_line(pipe, schedule):
    """The pipeline's plan: the layout, its bubble, and per stage its blocks, memory and bytes sent a step. Sharded
    (--shard, dp > 1), a rank holds 1/dp of its stage's weights, gradients and AdamW state, and gathers the rest: for
    the whole step (grads), or a block at a time in a forward, but kept whole after a backward until the next forward
    (full: the schedule keeps them, see stage_plan), so that a backward brings all of the stage's weights back whole."""
    M, N = pipe.n_microbatches, pipe.pp
    how = f", each stage sharded over its replicas (--shard {pipe.shard})" if pipe.shard != "none" else ""
    how += f", each stage's blocks split over {pipe.tp} tensor-parallel ranks" if pipe.tp > 1 else ""
    lines = [f"pipeline: {N} stages x {pipe.dp} data-parallel replica(s){how}, schedule {schedule}, {M} micro-batches "
             f"a step: bubble (N-1)/(M+N-1) = {(N - 1) / (M + N - 1):.1%}"]
    plan = stage_plan(pipe.config, pipe.bounds, pipe.batch, pipe.seq_len, M, pipe.dp, pipe.shard, pipe.bf16, pipe.backend,
                      pipe.tp)
    share = pipe.dp if pipe.shard != "none" else 1
    from plumbing.layouts import beyond_state
    for s, (what, params, sent) in enumerate(plan):
        gathered = {"none": "", "full": f" (+ {4 * params / 2**30:.3f} GiB: its weights, gathered whole by a backward)",
                    "grads": f" (+ {4 * params / 2**30:.3f} GiB: its weights, gathered for the step)"}[pipe.shard]
        peak = 16 * params / share + beyond_state(params / share, (s == 0) + (s == N - 1), pipe.config, pipe.bf16)
        lines.append(f"  stage {s}: {what}: {params / 1e6:.2f}M parameters, {16 * params / share / 2**30:.3f} GiB of "
                     f"weights, gradients and AdamW state a rank{gathered}, ~{peak / 2**30:.2f} GiB at its peak (with "
                     f"the process, temporaries{', bf16 copies' if pipe.bf16 else ''}); each of its ranks sends "
                     f"{sent / 1e6:.1f} MB a step")
    return "\n".join(lines)
