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

import torch.distributed as dist

def build_part(make, args, ranks, init_weights, bf16):
    """make()'s model, as this rank holds it under --pp (its stage) or --tp (its share of every block), built alone:
    on the meta device, cut or split, then given memory for its part only, and filled with exactly the weights one
    process gets for the same seed (sharding.build_in_pieces), or left for a checkpoint's or pretrained weights."""
    from plumbing import pipeline, sharding, stage_split, tensor_parallel
    def allocate(model):
        if args.pp > 1:  # (cut as pipeline.Pipeline cuts it)
            index = ranks.rank % args.pp
            bounds = stage_split.stage_bounds(model.config, args.pp, args.seq_len, pipeline.memory_budget(args), bf16)
            stage_split.cut_to_stage(model, index, args.pp, bounds[index]).to_empty(device="cpu")
        else:
            mesh = tensor_parallel.mesh_of(ranks.world_size, args.tp, ranks.device.split(":")[0])
            tensor_parallel.split_model(model, mesh["tp"], args.tp)
    return sharding.build_in_pieces(make, allocate, init_weights)

def model_line(config, held, args):
    """'model: 774.03M parameters (rank 0 holds 321.51M: its stage), GPTConfig(...)': held is what rank 0 holds."""
    from plumbing import layouts
    if args.pp * args.tp == 1:
        return f"model: {held / 1e6:.2f}M parameters, {config}"
    part = "stage" if args.pp > 1 else "share"
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

def load(path, state, into):
    """Read a checkpoint's tensors for this rank's part: state (what DCP fills, in place, in the whole model's names),
    then into(state) puts them where they go. The optimizer's param_groups stay this rank's (only the moments are read)."""
    import torch.distributed.checkpoint as dcp
    state = {"model": state["model"], "optimizer": {"state": state["optimizer"]["state"]}}
    dcp.load(state, checkpoint_id=path)
    into(state)

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
