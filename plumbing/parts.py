"""
A model held in parts (a pipeline's stages, tensor parallel's shares): how a rank builds its part alone, writes and
reads its checkpoints, and takes part in the end-of-run check, without ever holding more than its part.

Checkpoints are torch.distributed.checkpoint (DCP) folders in the whole model's names: every rank writes the tensors
it holds (a DTensor: its piece, with the piece's place in the whole tensor) and reads back the ones it holds now, so
a checkpoint written by one layout loads under any other, and on one process (DCP matches the pieces by name and
place). A tensor two ranks hold alike (a replica's, the tied weight's two copies) is written once.

Tensor parallel's c_attn is the one tensor whose piece is not one block of the whole: its rows are held in the ranks'
order (tensor_parallel.rank_order: q, k and v of rank 0's heads, then rank 1's, ...), so a rank's rows are three
blocks of the whole, one each in q, k and v. as_pieces() names those three blocks and their places for DCP (a
ShardedTensor, which may hold several pieces a rank), as views of the rank's own tensor: written from, and read into,
in place.
"""
import hashlib

import torch
import torch.distributed as dist

def build_part(make, args, ranks, init_weights, bf16):
    """make()'s model, as this rank holds it under --pp (its stage) and --tp (its share of every block), built alone:
    on the meta device, cut or split, then given memory for its part only, and filled with exactly the weights one
    process gets for the same seed (sharding.build_in_pieces), or left for a checkpoint's or pretrained weights."""
    from plumbing import pipeline, sharding, stage, stage_split, tensor_parallel, world
    def allocate(model):
        if args.pp > 1:  # (cut as pipeline.Pipeline cuts it)
            index = (ranks.rank // args.tp) % args.pp
            bounds = stage_split.stage_bounds(model.config, args.pp, args.seq_len, pipeline.memory_budget(args), bf16,
                                              args.tp)
            stage.cut_to_stage(model, index, args.pp, bounds[index])
        if args.tp > 1:  # (what is left of it split, as tensor_parallel.TensorParallel splits it)
            mesh = world.mesh_of(ranks.world_size, args.pp, args.tp, ranks.device.split(":")[0])
            tensor_parallel.split_model(model, mesh["tp"], args.tp)
        else:
            model.to_empty(device="cpu")
    return sharding.build_in_pieces(make, allocate, init_weights)

def model_line(config, held, args):
    """'model: 774.03M parameters (rank 0 holds 321.51M: its stage), GPTConfig(...)': held is what rank 0 holds."""
    from plumbing import layouts
    if args.pp * args.tp == 1:
        return f"model: {held / 1e6:.2f}M parameters, {config}"
    part = {(True, False): "stage", (False, True): "share"}.get((args.pp > 1, args.tp > 1), "share of its stage")
    return f"model: {layouts.parameters(config)[0] / 1e6:.2f}M parameters (rank 0 holds {held / 1e6:.2f}M: its {part}), {config}"

def one_process_groups(names, groups):
    """AdamW's param_groups as a one-process run's checkpoint names them (get_state_dict): the whole model's trained
    parameters, decayed matrices first (GPT.configure_optimizer), with this rank's hyperparameters for each kind.
    names: [(name, is a matrix)] of the whole model; groups: this rank's optimizer.param_groups."""
    out = []
    for matrices in (True, False):
        mine = [g for g in groups if g["params"] and (g["params"][0].dim() >= 2) == matrices] or [groups[0] if matrices else groups[-1]]
        out.append({**{k: v for k, v in mine[0].items() if k != "params"}, "params": [n for n, m in names if m == matrices]})
    return out

def trained_names(gpt_meta):
    """[(name, is a matrix)] of a whole GPT's trained parameters (the tied weight once: transformer.wte.weight)."""
    return [(n, p.dim() >= 2) for n, p in gpt_meta.named_parameters() if p.requires_grad]

def as_pieces(t, n_embd, tp, group):
    """c_attn's weight or bias (or an AdamW moment of it), split by tensor parallel in the ranks' order, as DCP should
    see it: this rank's rows are q's, k's and v's rows of its heads, at rows p C + r C/tp of the whole (p = 0, 1, 2)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    local, rank, share = t.to_local(), dist.get_rank(group), n_embd // tp
    pieces = [Shard(block, ShardMetadata([p * n_embd + rank * share, *[0] * (t.dim() - 1)], list(block.shape),
                                         f"rank:{dist.get_rank()}/{local.device.type}"))  # (where: the global rank)
              for p, block in enumerate(local.split(share))]
    return init_from_local_shards(pieces, list(t.shape), process_group=group)

def load(source, state, into):
    """Read a checkpoint's tensors for this rank's part: state (what is filled, in place, in the whole model's names),
    then into(state) puts them where they go. source: a .dcp folder (DCP reads just this rank's pieces), or a
    one-process checkpoint's state by name (by_name: each tensor's piece cut from the whole, as DCP would). The
    optimizer's param_groups stay this rank's (only the moments are read)."""
    import torch.distributed.checkpoint as dcp
    state = {"model": state["model"], "optimizer": {"state": state["optimizer"]["state"]}}
    if isinstance(source, str):
        dcp.load(state, checkpoint_id=source)
    else:
        fill(state, source)
    into(state)

def source(ckpt, whole_model):
    """What load() reads a checkpoint's part from: its .dcp folder, or its one-process state by name (whole_model: the
    whole model on the meta device, for its names)."""
    return ckpt["sharded_path"] or by_name(ckpt["model"], ckpt["optimizer"], trained_names(whole_model))

def by_name(model, optimizer, names):
    """A one-process checkpoint's model and AdamW state_dicts as DCP names them: AdamW numbers its parameters as
    GPT.configure_optimizer lists them (names: [(name, is a matrix)], parts.trained_names), matrices first."""
    numbered = [n for matrices in (True, False) for n, m in names if m == matrices]
    return {"model": model, "optimizer": {
        "state": {numbered[i]: s for i, s in optimizer["state"].items()},
        "param_groups": [{**g, "params": [numbered[i] for i in g["params"]]} for g in optimizer["param_groups"]]}}

@torch.no_grad()
def fill(state, whole):
    """Each tensor of state (nested dicts, in the whole model's names) given its piece of the same name in whole: a
    plain tensor all of it; a DTensor (FSDP's, tensor parallel's) its local shard; a ShardedTensor (as_pieces) each of
    its pieces, by their places."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    cut = lambda t, offsets, sizes: t[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]  # noqa: E731
    for key, value in state.items():
        if isinstance(value, dict):
            fill(value, whole[key])
        elif isinstance(value, DTensor):
            sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            value.to_local().copy_(cut(whole[key], offsets, sizes))
        elif hasattr(value, "local_shards"):
            for piece in value.local_shards():
                piece.tensor.copy_(cut(whole[key], piece.metadata.shard_offsets, piece.metadata.shard_sizes))
        elif torch.is_tensor(value):
            value.copy_(whole[key])

def digest(tensors):
    """sha256 of this rank's tensors (its pieces of split ones), in sorted name order."""
    checksum = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        t = t.to_local() if hasattr(t, "to_local") else t
        checksum.update(name.encode())
        checksum.update(t.detach().float().contiguous().numpy())
    return checksum.hexdigest()

def check_same_parts(ranks, part, replica, position, equal=None):
    """The end-of-run check for a model in parts: every data-parallel replica holds the same parts (each rank's digest
    against the same position's in replica 0), the pairs that must agree inside a replica do (equal: {key: digest},
    e.g. the tied weight's two copies), and rank 0 prints one digest of replica 0's parts. Only digests travel."""
    mine = (replica, position, digest(part), equal or {})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = {pos: d for rep, pos, d, _ in everyone if rep == 0}
    for rep, pos, d, _ in everyone:
        if d != first[pos]:
            raise SystemExit(f"error: replica {rep} holds different parameters than replica 0 at part {pos}")
    for rep in {r for r, *_ in everyone}:
        seen = {}
        for r, _, _, eq in everyone:
            for key, value in eq.items() if r == rep else ():
                if seen.setdefault(key, value) != value:
                    raise SystemExit(f"error: replica {rep}'s copies of {key} differ")
    if ranks.master:
        whole = hashlib.sha256("".join(first[pos] for pos in sorted(first)).encode()).hexdigest()
        print(f"parameter sha256 (all {ranks.world_size} rank(s), of the parts): {whole}", flush=True)
