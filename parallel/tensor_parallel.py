"""
Tensor parallel (--tp N): every block's matmuls split across N ranks, which compute one layer together
(torch.distributed.tensor.parallel: parallelize_module, ColwiseParallel, RowwiseParallel; the split weights are
DTensors).

    attention: c_attn by columns (each rank computes the q, k and v of its n_head/N heads), attention itself on those
               heads alone, c_proj by rows (its rows are the heads' outputs): the partial sums all-reduced
    MLP:       c_fc by columns (4C/N hidden units per rank), GELU on them, c_proj by rows: all-reduced
    the rest:  embeddings, LayerNorms, ln_f and the tied lm_head (with the chunked loss) replicated: every rank of a
               tensor-parallel group computes them alike, on the same micro-batches, so their gradients agree

Per block and micro-batch, two all-reduces of the (B, T, C) activations forward (after each c_proj) and two backward
(the gradients of c_attn's and c_fc's inputs): Megatron-LM's layout. That traffic is every layer's, every micro-batch's:
it pays inside a node, over shared memory or fast links, to fit a model whose blocks one rank cannot hold
(docs/parallel.md).

One device mesh, (dp, tp): rank r is tensor-parallel rank r % tp of data-parallel replica r // tp. A replica's ranks
read the same micro-batches; the replicas average their gradients, as DDP does, once a step. Checkpoints stay in the
one-process (Hugging Face) layout: any layout, sample.py and export_hf.py read them.
"""
import functools

import torch
import torch.distributed as dist

from compute import speedups
from parallel import mesh, parts, sizes

# -----------------------------------------------------------------------------
# Layouts refused with one line, before anything expensive

def check_layout(args, world_size):
    """One error line for a --tp that cannot run. Returns the world size left for the other degrees (world / tp): a
    pipeline's stages (--pp) and the data-parallel replicas."""
    tp = args.tp
    if tp < 1 or world_size % tp:
        raise SystemExit(f"error: --tp {tp}: the world size {world_size} is not a multiple of it "
                         f"(world = data-parallel replicas x pipeline stages x tensor-parallel ranks)")
    if tp > 1 and (args.shard != "none" or args.lora):
        flag = "--shard" if args.shard != "none" else "--lora"
        raise SystemExit(f"error: --tp {tp} with {flag}: not yet combined (--tp runs with --shard none, no --lora)")
    if tp > 1 and args.init_from == "scratch" and not args.resume:
        check_divides(tp, args.n_head, args.n_embd)
    return world_size // tp

def check_divides(tp, n_head, n_embd):
    """Each rank computes whole heads. The MLP's width, 4 n_embd = 4 n_head x head size, is then divisible too."""
    if n_head % tp:
        raise SystemExit(f"error: --tp {tp} does not divide the model's {n_head} heads (--n_head): each rank computes "
                         f"whole heads, and 4 x n_embd / {tp} of the MLP's columns")

# -----------------------------------------------------------------------------
# c_attn's rows: q, k, v one after the other, regrouped so that a plain split by rows hands each rank its heads

def rank_order(n_embd, tp):
    """The permutation of c_attn's 3C output rows that puts [q, k, v of rank 0's heads], [q, k, v of rank 1's], ... one
    after the other. A plain column split of [q; k; v] would give rank 0 of 2 all of q's first half and none of v."""
    share = n_embd // tp
    return torch.cat([part * n_embd + rank * share + torch.arange(share) for rank in range(tp) for part in range(3)])

def to_rank_order(t, n_embd, tp, inverse=False):
    """c_attn's weight (3C, C), bias (3C,) or their AdamW moments, from the one-process order to the ranks' (or
    back)."""
    order = rank_order(n_embd, tp)
    return t[torch.argsort(order)] if inverse else t[order]

def is_c_attn(name):
    return name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias")

def split_block(block, mesh, tp):
    """A Block split in place over the mesh's tp ranks: c_attn and c_fc by columns, both c_proj by rows (c_attn's rows
    already in rank order for real weights). Its attention then sees n_head / tp heads of n_embd / tp."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    parallelize_module(block, mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                     "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    block.attn.n_head, block.attn.n_embd = block.attn.n_head // tp, block.attn.n_embd // tp  # its view of q, k, v

def blocks_of(model):
    """The blocks this rank holds (a pipeline's stage keeps the others' as Identity)."""
    return [b for b in model.transformer.h if hasattr(b, "attn")]

def split_blocks(model, mesh, tp):
    """Every block of model split over the mesh's tp ranks, in place, on the meta device (shapes, no storage: a rank
    builds only its share), then given memory. c_attn's weight and bias learn to take a whole tensor's rows in the
    ranks' order (from_whole: sizes.copy_weight asks it, for the initial weights as for a checkpoint's)."""
    for block in blocks_of(model):
        split_block(block, mesh, tp)
    model.to_empty(device="cpu")
    for block in blocks_of(model):
        for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
            p.from_whole = functools.partial(to_rank_order, n_embd=model.config.n_embd, tp=tp)

@torch.no_grad()
def split_built(model, mesh, tp):
    """A model built whole (as a test builds it; a run builds it split: split_blocks), split in place: c_attn's rows put
    in the ranks' order, then each block split. A model already split is left as it is."""
    blocks = blocks_of(model)
    if not blocks or hasattr(blocks[0].attn.c_attn.weight, "placements"):
        return
    for block in blocks:
        attn = block.attn
        attn.c_attn.weight.copy_(to_rank_order(attn.c_attn.weight, model.config.n_embd, tp))
        attn.c_attn.bias.copy_(to_rank_order(attn.c_attn.bias, model.config.n_embd, tp))
        split_block(block, mesh, tp)

# -----------------------------------------------------------------------------
# What a split model's step does beyond one process's (pipeline.Pipeline's stages do it too, split: --pp with --tp)

def average_replicas(params, dp_group, dp):
    """What DDP does, once a step: every replica's gradients averaged (each rank: its own share), in one all-reduce."""
    grads = [sizes.local(p.grad) for p in params if p.grad is not None]
    if dp == 1 or not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])  # one message for the whole share
    dist.all_reduce(flat, group=dp_group)
    flat /= dp
    for g, avg in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(avg)

def squares(params, tp_group):
    """The squared norm of this rank's part of the gradients (of params), split ones summed over the tensor-parallel
    ranks (each holds its share), replicated ones (every rank of the group holds all of each) counted once."""
    split, whole = [torch.zeros(())], [torch.zeros(())]
    for p in params:
        if p.grad is not None:
            sharded = hasattr(p.grad, "placements") and any(pl.is_shard() for pl in p.grad.placements)
            norm = torch.linalg.vector_norm(sizes.local(p.grad), dtype=torch.float32)
            (split if sharded else whole).append(norm ** 2)
    split = torch.stack(split).sum()
    dist.all_reduce(split, group=tp_group)
    return split + torch.stack(whole).sum()

def clip(grads, squares, max_norm):
    """torch.nn.utils.clip_grad_norm_ over the whole model, from its global squared norm: every rank scales its
    gradients by the same factor. Returns the norm before clipping."""
    norm = squares.sqrt()
    torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm

def as_pieces(state, n_embd, tp, group):
    """A state dict of a split model (state_of's {"model", "optimizer"}) as DCP should see it: c_attn's weight, bias
    and their moments, held in the ranks' order, as their three blocks of the whole (parts.as_pieces). New dicts: the
    optimizer's own keep its tensors."""
    def pieces(t):
        return parts.as_pieces(t, n_embd, tp, group) if hasattr(t, "to_local") and t.dim() else t
    model = {n: pieces(v) if is_c_attn(n) else v for n, v in state["model"].items()}
    moments = {n: {k: pieces(v) for k, v in m.items()} if is_c_attn(n) else m
               for n, m in state["optimizer"]["state"].items()}
    return {"model": model, "optimizer": {**state["optimizer"], "state": moments}}

# -----------------------------------------------------------------------------
# The model split, and its step

class TensorParallel:
    """This rank's share of a GPT's blocks (model: split in place), its place on the (dp, tp) mesh. step() runs one
    optimizer step's forward and backward; calling it evaluates a batch. The same interface as pipeline.Pipeline."""

    def __init__(self, model, args, ranks, n_microbatches, print0, dtype="fp32"):
        config = model.config
        check_divides(args.tp, config.n_head, config.n_embd)  # (a pretrained model's or a checkpoint's own sizes)
        self.tp, self.dp, self.config, self.model = args.tp, ranks.world_size // args.tp, config, model
        self.ranks = ranks  # (a checkpoint's pieces are read on its disk)
        self.train_model = model  # (compiled by compile())
        self.replica, _, self.tp_rank = mesh.place(ranks.rank, 1, self.tp)
        self.device, self.device_type = ranks.device, ranks.device.split(":")[0]
        self.mesh = mesh.mesh_of(ranks.world_size, 1, self.tp, self.device_type)
        self.tp_group, self.dp_group = self.mesh.get_group("tp"), self.mesh.get_group("dp")
        split_built(model, self.mesh["tp"], self.tp)
        self.n_microbatches, self.batch, self.seq_len, self.dtype = n_microbatches, args.batch_size, args.seq_len, dtype
        print0(plan_line(self))

    def autocast(self):
        return speedups.autocast(self.dtype, self.device_type)

    def step(self, batches, n_targets, max_norm):
        """One optimizer step's gradients over its micro-batches (batches: [(x, y, packed)], the same on every rank of a
        replica; n_targets: the step's targets over all replicas, or None when every micro-batch holds as many),
        averaged over the replicas, then clipped. Returns (the step's mean loss, the global gradient norm before
        clipping)."""
        loss_accum = torch.zeros((), device=self.device)
        for x, y, packed in batches:
            x, y, packed = x.to(self.device), y.to(self.device), packed and packed.to(self.device)
            with self.autocast():
                _, loss = self.train_model(x, y, packed=packed)
            loss = loss * sizes.loss_weight(y, n_targets, self.dp, len(batches))
            loss_accum += loss.detach()
            loss.backward()
        average_replicas(self.model.parameters(), self.dp_group, self.dp)
        if self.dp > 1:
            dist.all_reduce(loss_accum, group=self.dp_group)
            loss_accum /= self.dp
        grads = [sizes.local(p.grad) for p in self.model.parameters() if p.grad is not None]
        return loss_accum, clip(grads, squares(self.model.parameters(), self.tp_group), max_norm)

    def compile(self, compile):
        """The split model's training forward compiled, as one process compiles the GPT's (evaluation runs it eagerly):
        compile(module) -> (compiled module, whether it compiled)."""
        self.train_model, compiled = compile(self.model)
        return compiled

    @torch.no_grad()
    def __call__(self, x, y, packed=None):
        """(None, the loss of one batch), as GPT.forward returns it: every rank of the replica computes it together."""
        return self.model(x, y, packed=packed)

    # -------------------------------------------------------------------------
    # Checkpoints: the one-process format, so that any layout, sample.py and export_hf.py read them

    def state(self, optimizer):
        """This rank's share of the weights and AdamW state as DCP writes and reads them (parallel/parts.py): the whole
        model's names and places; c_attn's rows, held in the ranks' order, as their three blocks of the whole."""
        state = as_pieces(parts.state_of(self.model, optimizer), self.config.n_embd, self.tp, self.tp_group)
        names = parts.trained_names(self.whole_model())
        state["optimizer"]["param_groups"] = parts.one_process_groups(names, optimizer.param_groups)
        return state

    def whole_model(self):
        with torch.device("meta"):
            return type(self.model)(self.config)

    def load_sharded(self, source, optimizer):
        """A checkpoint of any layout into this rank's share and its AdamW: a .dcp folder (DCP reads just this rank's
        pieces) or a one-process checkpoint by name (parts.by_name), into the tensors that get_state_dict hands out,
        which set_state_dict then puts in place."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        model_state, optimizer_state = get_state_dict(self.model, optimizer)
        def into(_):  # (the pieces DCP filled are views of model_state's and optimizer_state's tensors)
            set_state_dict(self.model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
        state = as_pieces({"model": model_state, "optimizer": optimizer_state}, self.config.n_embd, self.tp,
                          self.tp_group)
        parts.load(source, state, into, self.ranks)

    def check_same_weights(self, ranks):
        """The end-of-run check (world.check_same_weights), for a split model, by digests (parallel/parts.py): the
        replicas hold the same shares."""
        parts.check_same_parts(ranks, self.model.state_dict(), self.replica, self.tp_rank)

# -----------------------------------------------------------------------------
# What each rank holds and sends, computed

def rank_plan(config, tp, dp, batch, seq_len, n_microbatches, dtype):
    """(parameters a rank holds, bytes it sends a step under tp, bytes under dp). The parameters: sizes.block_parameters
    of every block (its matrices split in tp shares), the embeddings and ln_f whole (sizes.stage_parameters).
    Sent under tp: per micro-batch and block, 2 all-reduces of B T C activations forward, in the forward's dtype
    (c_proj's outputs: bf16 2 bytes, fp32 4), and 2 backward, in fp32 (the gradients of c_attn's and c_fc's inputs reach
    the all-reduce after autocast's cast back: seen in tests/test_tensor_parallel.py); a ring all-reduce sends
    2 (tp-1)/tp of its tensor from each rank:
        tp bytes = n_microbatches x n_layer x 2 x 2 (tp-1)/tp x B T C x (forward's bytes per element + 4)
    Under dp: the replicas' all-reduce of the rank's fp32 gradients, 2 (dp-1)/dp x parameters x 4."""
    params = sizes.stage_parameters(config, 0, config.n_layer, True, True, tp)
    tp_bytes = all_reduce_bytes(config.n_layer, n_microbatches, tp, batch, seq_len, config.n_embd, dtype == "bf16")
    return params, tp_bytes, 2 * (dp - 1) / dp * params * 4

def all_reduce_bytes(blocks, n_microbatches, tp, batch, seq_len, n_embd, bf16):
    """Bytes a rank sends a step in its blocks' tensor-parallel all-reduces (rank_plan's formula)."""
    return n_microbatches * blocks * 2 * 2 * (tp - 1) / tp * batch * seq_len * n_embd * ((2 if bf16 else 4) + 4)

def plan_line(split):
    """The layout, and per rank its parameters, the memory of its training state and the bytes it sends a step."""
    c, tp = split.config, split.tp
    params, tp_bytes, dp_bytes = rank_plan(c, tp, split.dp, split.batch, split.seq_len, split.n_microbatches,
                                           split.dtype)
    peak = sizes.training_memory(params, 1, c, split.dtype == "bf16")
    state = sizes.STATE_BYTES * params / sizes.GiB
    return (f"tensor parallel: {tp} ranks x {split.dp} data-parallel replica(s): each block's attention split by heads "
            f"({c.n_head // tp} of {c.n_head} a rank), its MLP by columns ({4 * c.n_embd // tp} of {4 * c.n_embd}); "
            f"embeddings, LayerNorms, lm_head replicated\n  each rank: {params / 1e6:.2f}M of "
            f"{sizes.parameters(c)[0] / 1e6:.2f}M parameters, {state:.3f} GiB of weights, gradients and AdamW state, "
            f"~{peak / sizes.GiB:.2f} GiB at its peak; sends {(tp_bytes + dp_bytes) / 1e6:.1f} MB a step "
            f"({tp_bytes / 1e6:.1f} MB in tp's 4 all-reduces a block and micro-batch, {dp_bytes / 1e6:.1f} MB in dp's)")
