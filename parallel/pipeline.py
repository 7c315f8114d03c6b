"""
Pipeline parallel (--pp N): the GPT's blocks cut into N stages, one per rank, and each step's accumulation
micro-batches flowing through them (torch.distributed.pipelining: PipelineStage and its 1F1B or GPipe schedule).
Between two stages travels one activation tensor per micro-batch forward, and its gradient backward: for a model
too big for one node, over slow links, far fewer bytes than FSDP's gathering of every weight (docs/parallel.md).

One device mesh, (dp, pp, tp): each rank's place on it is mesh.place's. The stages of one replica read
the same micro-batches; a stage's replicas average their gradients with DDP (--shard none), or hold 1/dp of the
stage each and gather it as FSDP does (--shard full: ZeRO-3, --shard grads: ZeRO-2; see shard_stage).

The model is openly GPT: the first stage holds the embeddings, the last ln_f and lm_head, whose weight is wte's
(tied). Each of the two keeps its copy; after every step the two copies' gradients are summed (one all-reduce
between the first and the last stage), so they stay equal, and gradient clipping counts the weight once.
"""

import functools

import torch
import torch.distributed as dist

from parallel import mesh, parts, sizes, tensor_parallel
from parallel.sharding import precision
from parallel.stage import Side, Stage, Target
from parallel.stage_split import stage_bounds, stage_plan

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
    steps = sizes.micro_steps(args.total_batch_size, args.batch_size, args.seq_len, dp)
    if pp > 1 and args.pp_schedule == "1f1b" and steps < pp:
        raise SystemExit(f"error: --pp {pp} --pp_schedule 1f1b needs at least {pp} micro-batches a step, and "
                         f"--total_batch_size {args.total_batch_size} gives {steps} (--batch_size {args.batch_size} x "
                         f"--seq_len {args.seq_len} x {dp} replica(s)): raise it, or use --pp_schedule gpipe")
    return dp

def shard_stage(stage, dp_mesh, shard, bf16):
    """FSDP2 within a stage, over its dp replicas (dp_mesh): each of the stage's blocks is a unit, the stage itself (its
    embeddings, or ln_f and lm_head) the root, as sharding.shard_model does for a whole GPT. --shard grads keeps a
    unit's weights gathered after its forward; the schedule keeps them after every backward but the step's last
    (PipelineStage does, for FSDP), then reduce-scatters the gradients once."""
    from torch.distributed.fsdp import fully_shard  # (here, as every heavy torch.distributed module: 0.8 s to import)
    policy = precision(bf16)
    for i in stage.blocks:
        fully_shard(stage.gpt.transformer.h[i], mesh=dp_mesh, mp_policy=policy, reshard_after_forward=shard == "full")
    fully_shard(stage, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=shard == "full")

# -----------------------------------------------------------------------------
# The pipeline: this rank's stage, its groups, its schedule

class Pipeline:
    """This rank's stage of a GPT (model: cut down to it, in place), its place on the (dp, pp) mesh, and its
    schedule. step() runs one optimizer step's forward and backward; calling it evaluates a batch."""

    def __init__(self, model, args, ranks, n_microbatches, print0, dtype="fp32", whole=None):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        self.pp, self.tp = args.pp, getattr(args, "tp", 1)  # (a test's arguments may name only --pp)
        self.ranks = ranks  # (a checkpoint's pieces are read on its disk)
        self.dp = ranks.world_size // (self.pp * self.tp)
        self.replica, self.index, self.tp_rank = mesh.place(ranks.rank, self.pp, self.tp)
        self.config, device_type = model.config, ranks.device.split(":")[0]
        # whole(): the whole model, built on the meta device: the names one process gives its tensors (adapters too)
        self.whole = whole or functools.partial(type(model), model.config)
        device_mesh = mesh.mesh_of(ranks.world_size, self.pp, self.tp, device_type)
        self.pp_group, self.dp_group, self.tp_group = (device_mesh.get_group(d) for d in ("pp", "dp", "tp"))
        self.first_rank, self.last_rank = self.rank_of_stage(0), self.rank_of_stage(self.pp - 1)
        # the tied weight's two copies: a group for each replica and tensor-parallel rank, its first and last stage
        # (every rank makes every group)
        tied = {(d, t): dist.new_group([mesh.rank_at(d, 0, t, self.pp, self.tp), mesh.rank_at(d, self.pp - 1, t,
                                                                                                 self.pp, self.tp)])
                for d in range(self.dp) for t in range(self.tp)}
        self.tied_group = tied[self.replica, self.tp_rank]
        self.bounds = stage_bounds(model.config, self.pp, args.seq_len,
                                   sizes.max_memory_bytes(getattr(args, "max_memory", None)), dtype == "bf16", self.tp)
        self.stage = Stage(model, self.index, self.pp, self.bounds[self.index], dtype, device_type)
        if self.tp > 1:  # --tp: the stage's blocks split across the tensor-parallel ranks (built split in a run)
            tensor_parallel.split_built(self.stage.gpt, device_mesh["tp"], self.tp)
        self.first, self.last = self.stage.first, self.stage.last
        self.shard = args.shard if self.dp > 1 else "none"  # (one replica: nothing to split)
        self.bf16, self.backend = dtype == "bf16", dist.get_backend()
        trained = self.stage
        if self.shard != "none":  # (sharded in place: the optimizer made after this holds the pieces)
            shard_stage(self.stage, device_mesh["dp"], self.shard, self.bf16)
        elif self.dp > 1 and self.tp == 1:  # each stage's replicas average its gradients (the schedule asks for it at
            from torch.nn.parallel import DistributedDataParallel as DDP  # the last micro-batch; --tp: step() does)
            trained = DDP(self.stage, process_group=self.dp_group)
        # the shapes that travel, given (static mode): else the schedule would infer them by running a first
        # micro-batch through a copy of the loss with its target as a tensor, which ours (Target) is not
        B, T, C = args.batch_size, args.seq_len, model.config.n_embd
        # the residual stream: fp32 also under autocast
        stream = torch.empty(B, T, C, device="meta", requires_grad=True)
        loss = torch.empty((), device="meta", requires_grad=True)  # the last stage's output
        self.pipe_stage = PipelineStage(trained, self.index, self.pp, torch.device(ranks.device), group=self.pp_group,
                                        input_args=torch.empty(B, T, dtype=torch.long, device="meta") if self.first
                                        else stream, output_args=loss if self.last else stream)
        schedule = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[args.pp_schedule]
        # scale_grads=False: each micro-batch's loss already carries its weight in the step's mean (Stage.loss);
        # the last stage's output is that loss (computed in its forward, where FSDP has lm_head gathered)
        self.schedule = schedule(self.pipe_stage, n_microbatches, loss_fn=lambda loss, _: loss, scale_grads=False)
        self.n_microbatches, self.batch, self.seq_len = n_microbatches, args.batch_size, args.seq_len
        print0(plan_line(self, args.pp_schedule))

    def rank_of_stage(self, stage):
        """The global rank of that stage of this rank's replica, at this rank's tensor-parallel place."""
        return mesh.rank_at(self.replica, stage, self.tp_rank, self.pp, self.tp)

    def step(self, batches, n_targets, max_norm):
        """One optimizer step's gradients, summed over its micro-batches (batches: [(x, y, packed)], the same on every
        stage of a replica; n_targets: the step's targets over all replicas, or None when every micro-batch holds as
        many), then clipped to max_norm. Returns (the step's mean loss, the global gradient norm before clipping)."""
        weights = [sizes.loss_weight(y, n_targets, self.dp, len(batches)) for _, y, _ in batches]
        args = [(x,) for x, _, _ in batches] if self.first else None
        kwargs = [{"side": Side(packed, Target(y, packed, w) if self.last else None)}
                  for (_, y, packed), w in zip(batches, weights)]
        targets = [None] * len(batches) if self.last else None  # (the targets travel in the side, to the forward)
        losses = [] if self.last else None
        # what schedule.step() does before its _step_microbatches, which takes the micro-batches as we already have
        # them: step() would cut one batch into equal chunks, and a packed micro-batch's lengths do not cut that way
        self.pipe_stage.has_backward = True
        self.pipe_stage.clear_runtime_states()
        # one autocast around the whole schedule: its cache keeps one bf16 copy of each weight for the step, where each
        # micro-batch's own (the stage's forward enters autocast again) would keep one per micro-batch in flight
        # until its backward: 1F1B's first stage holds N of them (measured, GPT-2 large's shape on 3 stages: +0.8 GiB)
        with self.stage.autocast():
            self.schedule._step_microbatches(args, kwargs, targets, losses)
        self.sum_tied_gradients()
        if self.tp > 1:  # (DDP does it for a stage not split)
            tensor_parallel.average_replicas(self.stage.parameters(), self.dp_group, self.dp)
        loss = torch.stack(losses).sum().detach() if self.last else torch.zeros(())
        dist.all_reduce(loss)  # the last stage of each replica (its tp ranks alike) holds its mean: the replicas' mean
        return loss / (self.dp * self.tp), self.clip(max_norm)

    def compile(self, compile):
        """The stage's forward (its blocks, and the last stage's loss) compiled for training, as one process compiles
        the GPT's: compile(function) -> (compiled function, whether it compiled). Evaluation runs it eagerly (its
        no-grad forward would compile again)."""
        self.stage.compiled, compiled = compile(self.stage.run)
        return compiled

    def sum_tied_gradients(self):
        """wte (first stage) and lm_head (last stage) are one weight in the model: its gradient is the sum of the two
        copies' gradients, and both copies get it, so both take the same AdamW step and stay equal."""
        if self.pp > 1 and (self.first or self.last):
            gpt = self.stage.gpt
            tied = (gpt.transformer.wte if self.first else gpt.lm_head).weight
            if tied.requires_grad:  # (frozen under --lora: no gradient; sharded: the same piece at both ends)
                dist.all_reduce(sizes.local(tied.grad), group=self.tied_group)

    def clip(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ over the whole model: the global norm sums every stage's squares, counting the
        tied weight once (the first stage's copy), and a split block's once (tensor_parallel.squares); every stage
        scales its gradients by the same factor. Sharded, each rank squares its pieces and the sum runs over every rank
        (replicas hold different pieces, not copies)."""
        grads = [sizes.local(p.grad) for p in self.stage.parameters() if p.grad is not None]
        counted = [p for n, p in self.stage.named_parameters() if self.first or n != "gpt.lm_head.weight"]
        squares = tensor_parallel.squares(counted, self.tp_group)
        dist.all_reduce(squares, group=self.pp_group if self.shard == "none" else None)
        return tensor_parallel.clip(grads, squares, max_norm)

    @torch.no_grad()
    def __call__(self, x, y, packed=None):
        """(None, the loss of one batch) on every stage of the replica, as GPT.forward returns it: the activations go
        from stage to stage (no schedule: evaluation has no backward to overlap), the last stage's loss comes back."""
        side = Side(packed, Target(y, packed, 1.0) if self.last else None)
        if self.first:
            h = self.stage(x, side)
        else:
            h = torch.empty(x.size(0), x.size(1), self.config.n_embd, device=x.device)
            dist.recv(h, src=self.rank_of_stage(self.index - 1))
            h = self.stage(h, side)
        if not self.last:
            dist.send(h.float().contiguous(), dst=self.rank_of_stage(self.index + 1))
            loss = torch.zeros((), device=x.device)
        else:
            loss = h.detach()
        dist.broadcast(loss, src=self.last_rank, group=self.pp_group)
        return None, loss

    # -------------------------------------------------------------------------
    # Checkpoints: each rank writes and reads its stage's part, in the whole model's names (parallel/parts.py)

    def whole_model(self):
        """The whole model on the meta device (shapes, no storage): its names, as one process has them."""
        with torch.device("meta"):
            return self.whole()

    def state(self, optimizer, pieces=True):
        """This stage's weights and AdamW state as DCP writes and reads them: the whole model's names, the tied weight
        under both of its names on both its stages (written once: they hold it alike), its moments under wte's; split
        (--tp), c_attn's rows as their blocks of the whole (tensor_parallel.as_pieces), unless not pieces."""
        state = parts.state_of(self.stage.gpt, optimizer)
        model, moments = state["model"], state["optimizer"]["state"]
        for mine, other in (("transformer.wte.weight", "lm_head.weight"), ("lm_head.weight", "transformer.wte.weight")):
            if mine in model:
                model[other] = model[mine]
        if "lm_head.weight" in moments:
            moments["transformer.wte.weight"] = moments.pop("lm_head.weight")
        state["optimizer"]["param_groups"] = parts.one_process_groups(parts.trained_names(self.whole_model()),
                                                                      optimizer.param_groups)
        return self.as_pieces(state) if pieces else state

    def as_pieces(self, state):
        """state as DCP should see it: split (--tp), c_attn's rows as their blocks of the whole; else as it is."""
        return tensor_parallel.as_pieces(state, self.config.n_embd, self.tp, self.tp_group) if self.tp > 1 else state

    def load_sharded(self, source, optimizer):
        """A checkpoint of any layout into this stage and its AdamW: a .dcp folder (DCP reads just this stage's
        tensors), or a one-process checkpoint by name (parts.by_name: each tensor's part cut from the whole)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_state_dict
        plain = self.state(optimizer, pieces=False)
        def into(_):  # (what was read went into plain's tensors, in place: the pieces are views of them)
            moments = dict(plain["optimizer"]["state"])
            if self.last and "transformer.wte.weight" in moments:
                moments["lm_head.weight"] = moments.pop("transformer.wte.weight")
            model = {k: v for k, v in plain["model"].items() if k in self.stage.gpt.state_dict()}
            groups = get_optimizer_state_dict(self.stage.gpt, optimizer)["param_groups"]
            set_state_dict(self.stage.gpt, optimizer, model_state_dict=model,
                           optim_state_dict={"state": moments, "param_groups": groups})
        parts.load(source, self.as_pieces(plain), into, self.ranks)

    def check_same_weights(self, ranks):
        """The end-of-run check (world.check_same_weights), for a model in stages, by digests (parallel/parts.py): the
        replicas of each stage hold the same weights, and the tied weight's two copies are equal."""
        gpt, tied = self.stage.gpt, {}
        if self.pp > 1 and (self.first or self.last):
            tied["the tied weight (wte, lm_head)"] = parts.digest({"w": sizes.whole(
                (gpt.transformer.wte if self.first else gpt.lm_head).weight)})  # (sharded: gathered, this one tensor)
        # sharded stages: each of a stage's ranks holds its own pieces (nothing to compare); else whole copies
        tp_rank = dist.get_rank(self.tp_group)
        replica, position = ((0, (self.index, self.replica)) if self.shard != "none" else
                             (self.replica, (self.index, tp_rank)))
        parts.check_same_parts(ranks, self.stage.state_dict(), replica, position, tied)

# -----------------------------------------------------------------------------
# The plan line: what each stage holds and sends (stage_split.stage_plan), as this run has them

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
    plan = stage_plan(pipe.config, pipe.bounds, pipe.batch, pipe.seq_len, M, pipe.dp, pipe.shard, pipe.bf16,
                      pipe.backend, pipe.tp)
    share = pipe.dp if pipe.shard != "none" else 1
    for s, (what, params, sent) in enumerate(plan):
        gathered = {"none": "",
                    "full": f" (+ {4 * params / sizes.GiB:.3f} GiB: its weights, gathered whole by a backward)",
                    "grads": f" (+ {4 * params / sizes.GiB:.3f} GiB: its weights, gathered for the step)"}[pipe.shard]
        peak = sizes.training_memory(params / share, (s == 0) + (s == N - 1), pipe.config, pipe.bf16)
        state = sizes.STATE_BYTES * params / share / sizes.GiB
        lines.append(f"  stage {s}: {what}: {params / 1e6:.2f}M parameters, {state:.3f} GiB of "
                     f"weights, gradients and AdamW state a rank{gathered}, ~{peak / sizes.GiB:.2f} GiB at its peak "
                     f"(with the process, temporaries{', bf16 copies' if pipe.bf16 else ''}); each of its ranks sends "
                     f"{sent / 1e6:.1f} MB a step")
    return "\n".join(lines)
