"""
Pipeline parallel (--pp N): the GPT's blocks cut into N stages, one per rank, and each step's accumulation
micro-batches flowing through them (torch.distributed.pipelining: PipelineStage and its 1F1B or GPipe schedule).
Between two stages travels one activation tensor per micro-batch forward, and its gradient backward: for a model
too big for one node, over slow links, far fewer bytes than FSDP's gathering of every weight (docs/parallel.md).

One device mesh, (dp, pp): rank r is stage r % pp of data-parallel replica r // pp. The stages of one replica read
the same micro-batches; a stage's replicas average their gradients with DDP (--shard none).

The model is openly GPT: the first stage holds the embeddings, the last ln_f and lm_head, whose weight is wte's
(tied). Each of the two keeps its copy; after every step the two copies' gradients are summed (one all-reduce
between the first and the last stage), so they stay equal, and gradient clipping counts the weight once.
"""

import torch
import torch.distributed as dist
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
    if pp > 1 and args.shard != "none" or pp > 1 and args.lora:
        raise SystemExit(f"error: --pp {pp} runs with --shard none and without --lora (not yet combined)")
    dp = world_size // pp
    steps = args.total_batch_size // max(args.batch_size * args.seq_len * dp, 1)
    if pp > 1 and args.pp_schedule == "1f1b" and steps < pp:
        raise SystemExit(f"error: --pp {pp} --pp_schedule 1f1b needs at least {pp} micro-batches a step, and "
                         f"--total_batch_size {args.total_batch_size} gives {steps} (--batch_size {args.batch_size} x "
                         f"--seq_len {args.seq_len} x {dp} replica(s)): raise it, or use --pp_schedule gpipe")
    return dp

def replica_ranks(ranks, pp):
    """This rank as the data loader sees it: its data-parallel replica among the replicas (every stage of a replica
    reads the same micro-batches). Only global rank 0 prints."""
    import dataclasses
    replica = dataclasses.replace(ranks, rank=ranks.rank // pp, world_size=ranks.world_size // pp)
    if not ranks.master:
        replica.print0 = lambda *a, **k: None
    return replica

# -----------------------------------------------------------------------------
# Cutting the model: contiguous runs of blocks, balanced by their compute

def stage_costs(config, seq_len):
    """Forward FLOPs per token: (a block's, lm_head's with its loss). A block: its four matmuls (24 C^2) and attention
    (4 T C, as if not causal: the kernel's work). The embeddings are lookups: no FLOPs, but they are the first stage's."""
    C = config.n_embd
    return 24 * C * C + 4 * seq_len * C, 2 * config.vocab_size * C

def split_blocks(n_layer, n_stages, block_cost, head_cost):
    """[(first block, end)] for each stage: contiguous, at least one block each, the largest stage cost (its blocks,
    plus lm_head's for the last) as small as it can be. Exact, by dynamic programming over the cut points."""
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
                cost = max(best[s - 1][a], (b - a) * block_cost + extra)
                if cost < best[s][b]:
                    best[s][b], cut[s][b] = cost, a
    bounds, b = [], n_layer
    for s in range(n_stages, 0, -1):
        bounds.append((cut[s][b], b))
        b = cut[s][b]
    return bounds[::-1]

class Stage(nn.Module):
    """One stage of a GPT: the GPT itself with what other stages hold removed (their blocks become Identity, so the
    parameters keep the whole model's names, as checkpoints have them). Inputs: token ids (first stage) or the
    residual stream (B, T, C); output: the residual stream, after ln_f on the last stage."""

    def __init__(self, gpt, index, n_stages, blocks, dtype="fp32", device_type="cpu"):
        super().__init__()
        from plumbing import speedups  # the run's autocast, made afresh for each forward (the schedule runs them)
        self.autocast = lambda: speedups.autocast(dtype, device_type)
        self.first, self.last, self.blocks = index == 0, index == n_stages - 1, range(*blocks)
        for i in range(len(gpt.transformer.h)):
            if i not in self.blocks:
                gpt.transformer.h[i] = nn.Identity()
        if not self.first:
            del gpt.transformer["wte"], gpt.transformer["wpe"]
        if not self.last:
            del gpt.transformer["ln_f"]
            gpt.lm_head = None
        self.gpt = gpt

    def forward(self, x, side=None):
        with self.autocast():
            return self.layers(x, side.packed if side is not None else None)

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
    """A micro-batch's packing (dataloader.Packed, or None), handed to every stage beside its input. Wrapped so that
    the pipeline's schedules pass it through untouched, not as tensors to send or to differentiate."""

    def __init__(self, packed):
        self.packed = packed

class Target:
    """What the last stage's loss needs of a micro-batch: its targets, its packing, and its weight in the step's mean."""

    def __init__(self, y, packed, weight):
        self.y, self.packed, self.weight = y, packed, weight

# -----------------------------------------------------------------------------
# The pipeline: this rank's stage, its groups, its schedule

class Pipeline:
    """This rank's stage of a GPT (model: cut down to it, in place), its place on the (dp, pp) mesh, and its
    schedule. step() runs one optimizer step's forward and backward; calling it evaluates a batch."""

    def __init__(self, model, args, ranks, n_microbatches, print0, dtype="fp32"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        self.pp, self.dp = args.pp, ranks.world_size // args.pp
        self.index, self.replica, self.config = ranks.rank % self.pp, ranks.rank // self.pp, model.config
        device_type = ranks.device.split(":")[0]
        mesh = init_device_mesh(device_type, (self.dp, self.pp), mesh_dim_names=("dp", "pp"))
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.first_rank, self.last_rank = self.replica * self.pp, self.replica * self.pp + self.pp - 1
        # the tied weight's two copies: one group per replica, its first and last stage (every rank makes every group)
        tied = [dist.new_group([d * self.pp, d * self.pp + self.pp - 1]) for d in range(self.dp)]
        self.tied_group = tied[self.replica]
        block_cost, head_cost = stage_costs(model.config, args.seq_len)
        self.bounds = split_blocks(model.config.n_layer, self.pp, block_cost, head_cost)
        self.stage = Stage(model, self.index, self.pp, self.bounds[self.index], dtype, device_type)
        self.first, self.last = self.stage.first, self.stage.last
        trained = self.stage
        if self.dp > 1:  # each stage's replicas average its gradients (the schedule asks for it at the last micro-batch)
            from torch.nn.parallel import DistributedDataParallel as DDP
            trained = DDP(self.stage, process_group=self.dp_group)
        # the shapes that travel, given (static mode): else the schedule would infer them by running a first
        # micro-batch through a copy of the loss with its target as a tensor, which ours (Target) is not
        B, T, C = args.batch_size, args.seq_len, model.config.n_embd
        stream = torch.empty(B, T, C, device="meta", requires_grad=True)  # the residual stream: fp32 also under autocast
        self.pipe_stage = PipelineStage(trained, self.index, self.pp, torch.device(ranks.device), group=self.pp_group,
                                        input_args=torch.empty(B, T, dtype=torch.long, device="meta") if self.first
                                        else stream, output_args=stream)
        schedule = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[args.pp_schedule]
        # scale_grads=False: each micro-batch's loss already carries its weight in the step's mean (loss below)
        self.schedule = schedule(self.pipe_stage, n_microbatches, loss_fn=self.loss, scale_grads=False)
        self.n_microbatches, self.batch, self.seq_len = n_microbatches, args.batch_size, args.seq_len
        print0(plan_line(self, args.pp_schedule))

    def loss(self, h, target):
        """The last stage's loss of one micro-batch, as GPT.forward computes it, times its weight in the step."""
        from plumbing.fused_loss import lm_head_loss
        y, packed = target.y, target.packed
        if packed is not None:  # only the targets' positions through lm_head
            h, y = h.flatten(0, 1)[packed.picked], y.flatten()[packed.picked]
        with self.stage.autocast():  # (lm_head's matmuls in the run's dtype, as GPT.forward under autocast)
            return lm_head_loss(h, self.stage.gpt.lm_head.weight, y) * target.weight

    def step(self, batches, n_targets, max_norm):
        """One optimizer step's gradients, summed over its micro-batches (batches: [(x, y, packed)], the same on every
        stage of a replica; n_targets: the step's targets over all replicas, or None when every micro-batch holds as
        many), then clipped to max_norm. Returns (the step's mean loss, the global gradient norm before clipping)."""
        from plumbing.fused_loss import IGNORE
        weights = [1 / len(batches) if n_targets is None else int((y != IGNORE).sum()) * self.dp / max(n_targets, 1)
                   for _, y, _ in batches]
        args = [(x,) for x, _, _ in batches] if self.first else None
        kwargs = [{"side": Side(packed)} for _, _, packed in batches]
        targets = [Target(y, packed, w) for (_, y, packed), w in zip(batches, weights)] if self.last else None
        losses = [] if self.last else None
        # what schedule.step() does before its _step_microbatches, which takes the micro-batches as we already have
        # them: step() would cut one batch into equal chunks, and a packed micro-batch's lengths do not cut that way
        self.pipe_stage.has_backward = True
        self.pipe_stage.clear_runtime_states()
        self.schedule._step_microbatches(args, kwargs, targets, losses)
        self.sum_tied_gradients()
        loss = torch.stack(losses).sum().detach() if self.last else torch.zeros(())
        dist.all_reduce(loss)  # the last stage of each replica holds its mean: the mean of the replicas' means
        return loss / self.dp, self.clip(max_norm)

    def sum_tied_gradients(self):
        """wte (first stage) and lm_head (last stage) are one weight in the model: its gradient is the sum of the two
        copies' gradients, and both copies get it, so both take the same AdamW step and stay equal."""
        if self.pp > 1 and (self.first or self.last):
            gpt = self.stage.gpt
            dist.all_reduce((gpt.transformer.wte if self.first else gpt.lm_head).weight.grad, group=self.tied_group)

    def clip(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ over the whole model: the global norm sums every stage's squares, counting the
        tied weight once (the first stage's copy); every stage scales its gradients by the same factor."""
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        counted = [p.grad for n, p in self.stage.named_parameters()
                   if p.grad is not None and not (n == "gpt.lm_head.weight" and not self.first)]
        squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in counted]).sum()
        dist.all_reduce(squares, group=self.pp_group)
        norm = squares.sqrt()
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    @torch.no_grad()
    def __call__(self, x, y, packed=None):
        """(None, the loss of one batch) on every stage of the replica, as GPT.forward returns it: the activations
        go from stage to stage (no schedule: evaluation has no backward to overlap), the last stage's loss comes back."""
        side = Side(packed)
        if self.first:
            h = self.stage(x, side)
        else:
            h = torch.empty(x.size(0), x.size(1), self.config.n_embd, device=x.device)
            dist.recv(h, src=self.first_rank + self.index - 1)
            h = self.stage(h, side)
        if not self.last:
            dist.send(h.float().contiguous(), dst=self.first_rank + self.index + 1)
            loss = torch.zeros((), device=x.device)
        else:
            loss = self.loss(h, Target(y, packed, 1.0)).float()
        dist.broadcast(loss, src=self.last_rank, group=self.pp_group)
        return None, loss

    # -------------------------------------------------------------------------
    # Checkpoints: the one-process format, so that any layout, sample.py and export_hf.py read them

    def optimizer_names(self, gpt):
        """gpt's trained parameters' names in configure_optimizer's order (decayed matrices first), lm_head's copy
        named as the one parameter of the whole model: transformer.wte.weight."""
        return [n.replace("lm_head.weight", "transformer.wte.weight") for decay in (True, False)
                for n, p in gpt.named_parameters() if p.requires_grad and (p.dim() >= 2) == decay]

    def whole_names(self):
        with torch.device("meta"):
            return self.optimizer_names(type(self.stage.gpt)(self.config))

    def full_state(self, optimizer=None):
        """(the whole model's state_dict, AdamW's state_dict numbered as one process numbers it, or None) on rank 0,
        (None, None) elsewhere. Every rank calls it: replica 0's stages send their parts to rank 0."""
        part = None
        if self.replica == 0:
            weights = {k.removeprefix("gpt."): v for k, v in self.stage.state_dict().items()}
            names = self.optimizer_names(self.stage.gpt)
            moments = {names[i]: s for i, s in optimizer.state_dict()["state"].items()} if optimizer else None
            part = (weights, moments)
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(part, parts, dst=0)
        if parts is None:
            return None, None
        weights, moments = {}, {}
        for part in filter(None, parts):  # in stage order: the whole model's key order
            weights.update(part[0])
            for name, state in (part[1] or {}).items():
                moments.setdefault(name, state)  # the tied weight's two copies hold the same moments: one is kept
        if optimizer is None:
            return weights, None
        names = self.whole_names()
        split = sum(1 for n in names if weights[n].dim() >= 2)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(ids)}
                  for g, ids in zip(optimizer.state_dict()["param_groups"], (range(split), range(split, len(names))))]
        return weights, {"state": {i: moments[n] for i, n in enumerate(names) if n in moments}, "param_groups": groups}

    def load_optimizer_state(self, optimizer, full):
        """A one-process checkpoint's AdamW state (full) into this stage's optimizer: its own parameters' part."""
        whole = {n: i for i, n in enumerate(self.whole_names())}
        mine = self.optimizer_names(self.stage.gpt)
        ours = optimizer.state_dict()["param_groups"]
        groups = []
        for group, full_group in zip(ours, full["param_groups"]):
            groups.append({**{k: v for k, v in full_group.items() if k != "params"}, "params": group["params"]})
        state = {i: full["state"][whole[n]] for i, n in enumerate(mine) if whole[n] in full["state"]}
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def load_sharded(self, path, optimizer):
        """A sharded run's .dcp checkpoint into this stage and its AdamW: DCP reads just this stage's tensors. The tied
        weight is saved once, as transformer.wte.weight: the last stage's lm_head and its moments are read from it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        names = [("lm_head.weight", "transformer.wte.weight")] if self.last else []
        def renamed(d, back=False):
            return {dict(names if not back else [(b, a) for a, b in names]).get(k, k): v for k, v in d.items()}
        model_state, optimizer_state = get_state_dict(self.stage.gpt, optimizer)
        state = {"model": renamed(model_state), "optimizer": {"state": renamed(optimizer_state["state"])}}
        dcp.load(state, checkpoint_id=path)  # (the moments only: the param groups stay this stage's)
        set_state_dict(self.stage.gpt, optimizer, model_state_dict=renamed(state["model"], back=True),
                       optim_state_dict={**optimizer_state, "state": renamed(state["optimizer"]["state"], back=True)})

    def check_same_weights(self, ranks):
        """The end-of-run check (world.check_same_weights), for a model in stages: the replicas of each stage hold the
        same weights, the tied weight's two copies are equal, and rank 0 prints the whole model's digest (the one a
        single process with the same weights prints)."""
        from plumbing import world
        digest = world.state_digest({k: v for k, v in self.stage.state_dict().items()})
        digests = [None] * self.dp
        dist.all_gather_object(digests, digest, group=self.dp_group)
        weights, _ = self.full_state()
        if len(set(digests)) != 1:
            raise SystemExit(f"error: stage {self.index}'s replicas hold different parameters: {digests}")
        if ranks.master:
            if not torch.equal(weights["transformer.wte.weight"], weights["lm_head.weight"]):
                raise SystemExit("error: the tied weight's copies (wte on the first stage, lm_head on the last) differ")
            print(f"parameter sha256 (all {ranks.world_size} rank(s)): {world.state_digest(weights)}", flush=True)

# -----------------------------------------------------------------------------
# What each stage holds and sends, computed

def stage_plan(config, bounds, batch, seq_len, n_microbatches, dp):
    """[(what it holds, its parameters, bytes each of its ranks sends a step)] per stage. Parameters: a block's
    12 C^2 + 13 C, the embeddings' (V + block_size) C on the first stage, ln_f's 2 C and lm_head's copy of wte, V C, on
    the last. Sent: an fp32 activation (B, T, C) a micro-batch to the next stage, its gradient to the one before; the
    tied gradient to the other end (a 2-rank all-reduce sends it once); DDP's ring all-reduce of the stage's gradients
    (2 (dp-1)/dp of them)."""
    C, V, pp = config.n_embd, config.vocab_size, len(bounds)
    activation = batch * seq_len * C * 4 * n_microbatches
    plan = []
    for s, (a, b) in enumerate(bounds):
        first, last = s == 0, s == pp - 1
        params = (b - a) * (12 * C * C + 13 * C) + first * (V + config.block_size) * C + last * (2 * C + V * C)
        sent = (not last) * activation + (not first) * activation + (pp > 1 and (first or last)) * V * C * 4
        sent += 2 * (dp - 1) / dp * params * 4
        what = ("embeddings + " if first else "") + f"blocks {a}-{b - 1}" + (" + ln_f, lm_head" if last else "")
        plan.append((what, params, sent))
    return plan

def plan_line(pipe, schedule):
    """The pipeline's plan: the layout, its bubble, and per stage its blocks, memory and bytes sent a step."""
    M, N = pipe.n_microbatches, pipe.pp
    lines = [f"pipeline: {N} stages x {pipe.dp} data-parallel replica(s), schedule {schedule}, {M} micro-batches a "
             f"step: bubble (N-1)/(M+N-1) = {(N - 1) / (M + N - 1):.1%}"]
    plan = stage_plan(pipe.config, pipe.bounds, pipe.batch, pipe.seq_len, M, pipe.dp)
    for s, (what, params, sent) in enumerate(plan):
        lines.append(f"  stage {s}: {what}: {params / 1e6:.2f}M parameters, {16 * params / 2**30:.3f} GiB of "
                     f"weights, gradients and AdamW state; each of its ranks sends {sent / 1e6:.1f} MB a step")
    return "\n".join(lines)
