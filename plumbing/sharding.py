"""
Sharding (FSDP2): the weights, gradients and AdamW state of a GPT split across the ranks.
Openly model-aware: it shards GPT's blocks one by one and replays GPT's own initialization.
"""
import torch

def shard_model(model, ranks, bf16):
    """FSDP2 (fully sharded data parallel): every parameter is split in world_size pieces along its first
    dimension, one per rank, and so are its gradient and AdamW's moments. Each block is its own unit:
    its weights are all-gathered just before its forward (and again for its backward), then freed; its
    gradients are reduce-scattered, each rank keeping the piece it owns. What stays unsharded in memory
    is one block's weights at a time, and the activations. The root unit holds the embeddings, whose
    weight lm_head shares (tied): it stays one parameter, sharded once.
    bf16: the weights are all-gathered in bf16 (half the traffic), and used as such, so autocast keeps no
    bf16 copy of every weight for backward; gradients are reduced in fp32 and AdamW updates fp32 pieces."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    ranks.print0(f"shard: FSDP2, each rank holds 1/{ranks.world_size} of the weights, gradients and AdamW state")

def build_sharded(build, ranks, bf16, init_weights=True):
    """build() -> a model, sharded without any rank ever holding all of it: it is built on the meta device
    (shapes, no storage), sharded, and only then given memory: each rank allocates just its pieces.
    init_weights: fill them with exactly the weights that build() followed by shard_model() would give
    (so a sharded run starts where a DDP run does), one module at a time; else leave them for a checkpoint.
    The replay: every module's constructor draws its own random init (which GPT._init_weights then
    overwrites, but the draws move the random generator), so first each module's constructor init is drawn
    and dropped, in construction order; then, in _init_weights' order, each module is made in full on its
    own, initialized, and each rank keeps its piece of every parameter."""
    import copy
    with torch.device("meta"):
        model = build()
    empty_copy = {n: copy.deepcopy(m) for n, m in model.named_modules()  # still on meta: no memory yet
                  if next(m.parameters(recurse=False), None) is not None}  # (the modules that own parameters)
    shard_model(model, ranks, bf16)
    model.to_empty(device="cpu")
    if not init_weights:
        return model
    for empty in empty_copy.values():  # registration order is construction order for GPT
        copy.deepcopy(empty).to_empty(device="cpu").reset_parameters()
    order = []
    model.apply(order.append)  # the order GPT.__init__'s self.apply(self._init_weights) visits modules
    name_of = {id(m): n for n, m in model.named_modules()}
    with torch.no_grad():
        for module in order:
            name = name_of[id(module)]
            if name not in empty_copy:
                continue
            full = copy.deepcopy(empty_copy[name]).to_empty(device="cpu")
            with torch.random.fork_rng(devices=[]):  # the constructor's values, for what _init_weights leaves (LayerNorm)
                full.reset_parameters()
            model._init_weights(full)
            for key, value in full.named_parameters(recurse=False):
                copy_weight(getattr(module, key), value)
    return model

def copy_weight(param, full):
    """param = full; for a sharded parameter (a DTensor), just the piece of full that this rank holds."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    with torch.no_grad():
        if isinstance(param, DTensor):
            param, full = param.to_local(), distribute_tensor(full, param.device_mesh, param.placements,
                                                              src_data_rank=None).to_local()
        param.copy_(full)

def load_full_optimizer_state(model, optimizer, state):
    """A plain checkpoint's AdamW state (as optimizer.state_dict() numbers the parameters) into the
    optimizer of a sharded model: each rank keeps its pieces. The numbering is configure_optimizer's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    names = [n for decay in (True, False) for n, p in model.named_parameters() if (p.dim() >= 2) == decay]
    by_name = {"state": {names[i]: s for i, s in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
