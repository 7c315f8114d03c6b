"""
Sharding (FSDP2): the weights, gradients and AdamW state of a GPT split across the ranks.
Openly model-aware: it shards GPT's blocks one by one and replays GPT's own initialization.
"""
import torch
import torch.nn as nn

def shard_model(model, ranks, bf16, keep_gathered=False):
    """FSDP2 (fully sharded data parallel): every parameter is split in world_size pieces along its first
    dimension, one per rank, and so are its gradient and AdamW's moments. Each block is its own unit:
    its weights are all-gathered just before its forward (and again for its backward), then freed; its
    gradients are reduce-scattered, each rank keeping the piece it owns. What stays unsharded in memory
    is one block's weights at a time, and the activations. The root unit holds the embeddings, whose
    weight lm_head shares (tied): it stays one parameter, sharded once.
    bf16: the weights are all-gathered in bf16 (half the traffic), and used as such, so autocast keeps no
    bf16 copy of every weight for backward; gradients are reduced in fp32 and AdamW updates fp32 pieces.
    keep_gathered (--shard grads, ZeRO-2): a unit's weights, once gathered, stay whole after its forward, and
    train_step keeps them through the backward of every micro-step but the last (set_reshard_after_backward):
    one all-gather per optimizer step instead of two per micro-step, for the whole model's weights in memory."""
    from torch.distributed.fsdp import fully_shard
    policy = precision(bf16)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy, reshard_after_forward=not keep_gathered)
    fully_shard(model, mp_policy=policy, reshard_after_forward=not keep_gathered)
    ranks.print0(f"shard: FSDP2, each rank holds 1/{ranks.world_size} of the " + (
        "AdamW state; the weights are gathered once a step, the gradients accumulate whole until its last micro-step "
        "and are then reduce-scattered (ZeRO-2)" if keep_gathered else
        "weights, gradients and AdamW state"))

def precision(bf16):
    """FSDP2's policy: under bf16, weights gathered in bf16 and gradients reduced in fp32; else fp32 throughout."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()

def build_sharded(build, ranks, bf16, init_weights=True, keep_gathered=False):
    """build() -> a model, sharded without any rank ever holding all of it: built on the meta device (shapes, no
    storage), sharded, and only then given memory: each rank allocates just its pieces (see build_in_pieces)."""
    def shard_then_allocate(model):
        shard_model(model, ranks, bf16, keep_gathered)
        model.to_empty(device="cpu")
    return build_in_pieces(build, shard_then_allocate, init_weights)

def build_in(dtype, build, init_weights=True):
    """build() -> a model whose frozen weights are held in dtype (a LoRA base in bf16; what trains stays fp32), with
    never a whole fp32 copy of it in memory: built on the meta device, given storage, then filled a tensor at a time."""
    def allocate(model):
        held = {}  # meta parameter -> its tensor: a weight two modules share (wte, lm_head) stays one
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    held.setdefault(id(p), nn.Parameter(torch.empty(p.shape, dtype=p.dtype if p.requires_grad else dtype),
                                                        p.requires_grad))
                    module._parameters[name] = held[id(p)]
    return build_in_pieces(build, allocate, init_weights)

def build_in_pieces(build, allocate, init_weights=True):
    """build() on the meta device, allocate(model) gives it memory (each rank's pieces, another dtype, or a part: a
    pipeline's stage, tensor parallel's share), then init_weights: fill it with exactly the weights that build() would
    give (so a run in parts starts where one process does), one module at a time; else leave them for a checkpoint or
    pretrained weights.
    The replay: every module's constructor draws its own random init (which GPT._init_weights then overwrites, but
    the draws move the random generator), so first each module's constructor init is drawn and dropped, in
    construction order; then, in _init_weights' order, each module of the whole model is made in full on its own,
    initialized, and copied into what this rank holds of it (nothing, if allocate dropped it: a stage's other blocks).
    A weight two modules share (wte and lm_head) is found under either name: a stage may hold it under one only."""
    import copy
    with torch.device("meta"):
        model = build()
    owners = [(n, m) for n, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]
    empty_copy = {n: copy.deepcopy(m) for n, m in owners}  # still on meta: no memory yet
    order = []
    model.apply(order.append)  # the order GPT.__init__'s self.apply(self._init_weights) visits modules
    name_of = {id(m): n for n, m in model.named_modules()}
    order = [name_of[id(m)] for m in order if name_of[id(m)] in empty_copy]
    names = {}  # every name of each parameter (the tied weight has two)
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    also = {name: names[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    allocate(model)
    retie(model, also)
    if not init_weights:
        return model
    for empty in empty_copy.values():  # registration order is construction order for GPT
        copy.deepcopy(empty).to_empty(device="cpu").reset_parameters()
    held = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name in order:
            full = copy.deepcopy(empty_copy[name]).to_empty(device="cpu")
            with torch.random.fork_rng(devices=[]):  # the constructor's values, for what _init_weights leaves (LayerNorm)
                full.reset_parameters()
            model._init_weights(full)
            for key, value in full.named_parameters(recurse=False):
                mine = {id(held[n]): held[n] for n in also[f"{name}.{key}" if name else key] if n in held}
                for param in mine.values():
                    copy_weight(param, value)
    return model

def retie(model, also):
    """A weight that two modules shared on the meta device shares one tensor again where this rank holds both names
    (to_empty gave each module's its own storage: wte and lm_head would train apart). also: {name: all its names}."""
    held = dict(model.named_parameters(remove_duplicate=False))
    for name, same in also.items():
        if name in held and same[0] in held and held[name] is not held[same[0]]:
            owner, _, key = name.rpartition(".")
            setattr(model.get_submodule(owner), key, held[same[0]])

def copy_weight(param, full):
    """param = full; for a sharded parameter (a DTensor), just the piece of full that this rank holds (in the order
    param.from_whole gives, where a layout holds its rows in another order: tensor parallel's c_attn)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    with torch.no_grad():
        if isinstance(param, DTensor):
            full = param.from_whole(full) if hasattr(param, "from_whole") else full
            param, full = param.to_local(), distribute_tensor(full, param.device_mesh, param.placements,
                                                              src_data_rank=None).to_local()
        param.copy_(full)

def load_full_optimizer_state(model, optimizer, state):
    """A plain checkpoint's AdamW state (as optimizer.state_dict() numbers the parameters) into the
    optimizer of a sharded model: each rank keeps its pieces. The numbering is configure_optimizer's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from plumbing import parts
    by_name = parts.by_name({}, state, parts.trained_names(model))["optimizer"]
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))

def bytes_sent(weights, grads, world_size, shard, micro_steps, bf16, backend="gloo", gathers=None):
    """Bytes each rank sends an optimizer step under DDP (--shard none) or FSDP (full, grads): see plan_line.
    gathers: how many times a step each weight is all-gathered, where not this trainer's (a pipeline's stage)."""
    ring = (world_size - 1) / world_size
    if shard == "none":
        return 2 * ring * grads * 4
    gathers = (gathers or {"full": 2 * micro_steps, "grads": 1}[shard]) * weights
    scatter = 2 if backend == "gloo" else 1
    return ring * (gathers * (2 if bf16 else 4) + scatter * grads * 4)

def plan_line(model, world_size, shard, micro_steps, bf16, backend):
    """DDP's and FSDP's bytes each rank sends an optimizer step, computed (bench/bench_parallel.py measures them).
    The collectives are rings: an all-gather sends (n-1)/n of the whole tensor from each rank, a reduce-scatter as
    much, an all-reduce twice that; but gloo reduce-scatters by all-reducing (each rank then keeps its piece): twice.
    DDP all-reduces the gradients once a step. --shard full all-gathers every weight for each micro-step's forward
    and again for its backward (the root unit too, the embeddings: we reshard it after forward, where FSDP2's default
    would keep it), and reduce-scatters the gradients once; --shard grads gathers every weight once a step.
    Weights travel in bf16 under --dtype bf16 when sharded; gradients always in fp32."""
    weights = sum(p.numel() for p in model.parameters())  # (the tied lm_head counted once)
    grads = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sent = bytes_sent(weights, grads, world_size, shard, micro_steps, bf16, backend)
    if shard == "none":
        how = "a ring all-reduce of the gradients"
    else:
        how = ("every weight all-gathered twice a micro-step" if shard == "full" else
               "the weights all-gathered once") + f", the gradients reduce-scattered once ({backend})"
    return (f"data parallel: {world_size} ranks, --shard {shard}, {micro_steps} micro-steps a step: {how}; "
            f"each rank sends {sent / 1e6:.1f} MB a step (computed)")
