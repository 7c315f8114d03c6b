"""
A model built as this rank holds it, never whole: on the meta device (shapes, no storage), then sharded by FSDP, cut
to a pipeline's stage or split over tensor parallel's ranks, and only then given memory, each rank allocating just its
part; then filled with exactly the weights one process gets for the same seed, or left for a checkpoint's or
pretrained weights. And a LoRA base held in bf16, built a tensor at a time.
"""
import copy

import torch
import torch.nn as nn

from parallel import mesh, sharding, stage, stage_split, tensor_parallel
from parallel.sizes import copy_weight, max_memory_bytes

def build_sharded(build, ranks, bf16, init_weights=True, keep_gathered=False):
    """build() -> a model, sharded without any rank ever holding all of it: built on the meta device (shapes, no
    storage), sharded, and only then given memory: each rank allocates just its pieces (see build_in_pieces)."""
    def shard_then_allocate(model):
        sharding.shard_model(model, ranks, bf16, keep_gathered)
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
                    storage = torch.empty(p.shape, dtype=p.dtype if p.requires_grad else dtype)
                    held.setdefault(id(p), nn.Parameter(storage, p.requires_grad))
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
            # the constructor's values, for what _init_weights leaves (LayerNorm)
            with torch.random.fork_rng(devices=[]):
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

def build_part(make, args, ranks, init_weights, bf16):
    """make()'s model, as this rank holds it under --pp (its stage) and --tp (its share of every block), built alone:
    on the meta device, cut or split, then given memory for its part only, and filled with exactly the weights one
    process gets for the same seed (build_in_pieces), or left for a checkpoint's or pretrained weights."""
    def allocate(model):
        if args.pp > 1:  # (cut as pipeline.Pipeline cuts it)
            index = mesh.place(ranks.rank, args.pp, args.tp).stage
            bounds = stage_split.stage_bounds(model.config, args.pp, args.seq_len, max_memory_bytes(args.max_memory),
                                              bf16, args.tp)
            stage.cut_to_stage(model, index, args.pp, bounds[index])
        if args.tp > 1:  # (what is left of it split, as tensor_parallel.TensorParallel splits it)
            device_mesh = mesh.mesh_of(ranks.world_size, args.pp, args.tp, ranks.device.split(":")[0])
            tensor_parallel.split_blocks(model, device_mesh["tp"], args.tp)
        else:
            model.to_empty(device="cpu")
    return build_in_pieces(make, allocate, init_weights)
