"""
A rank's part of a checkpoint: FSDP's pieces, a pipeline's stage, tensor parallel's share, each written and read by its
rank in the whole model's names, and digested for the end-of-run check, without any rank holding more than its part.

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
import os
import shutil

import torch
import torch.distributed as dist

from parallel import node_disks, sizes
from plumbing import checkpoints

# -----------------------------------------------------------------------------
# A sharded checkpoint's folder: every rank writes its pieces, and reads the pieces it holds now

def state_of(model, optimizer):
    """{"model": ..., "optimizer": ...}: the state dicts DCP writes and reads, named by parameter (a sharded tensor is
    this rank's pieces, with their places in the whole). A LoRA run's frozen base is no part of its checkpoints: only
    what trains, and its AdamW state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    # (get_state_dict keeps a frozen tied weight under its second name, lm_head.weight: left out too)
    return {"model": {k: v for k, v in model_state.items() if k not in frozen}, "optimizer": optimizer_state}

def save_sharded(path, state, meta, ranks):
    """A sharded checkpoint: a folder where each rank writes its own pieces of state (state_of, or a layout's own:
    whole-model names, so that any layout reads it) with torch.distributed.checkpoint, rank 0 adds meta.pt (step,
    config, data position, RNG...). It is written as path.tmp and renamed once every rank has finished, so a folder
    named model_XXXXX.dcp is always whole. Where each node has its own --log_dir folder, the disks then share what
    each must keep (node_disks.spread) before each renames its own."""
    import torch.distributed.checkpoint as dcp
    tmp = path + ".tmp"
    # (rank 0 says it, from its own part: the ranks' parts are about equal)
    estimate = checkpoints.tensor_bytes(state, sizes.local_bytes) * dist.get_world_size() if ranks.master else 0
    written = checkpoints.say_writing(path, estimate)
    if ranks.keeper and os.path.exists(tmp):  # left by a run killed while saving
        shutil.rmtree(tmp)
    dist.barrier()
    # a file per tensor (a piece, a replicated one: written by one of the ranks that hold it), not one a rank: a node
    # that lacks a few of another rank's tensors is sent just those (node_disks.spread, read_dcp)
    metadata = dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=False))  # (all wrote)
    if ranks.master:
        checkpoints.atomic_save(meta, os.path.join(tmp, "meta.pt"), quiet=True)
    if len(ranks.disks or [0]) > 1:
        node_disks.spread(tmp, state, metadata, ranks)
    dist.barrier()
    if ranks.keeper:
        if os.path.exists(path):  # the same step saved again (a resumed run re-saving it): same contents
            shutil.rmtree(path)
        os.replace(tmp, path)
    if ranks.master:
        written()
    dist.barrier()

def load_sharded(path, model, optimizer=None, ranks=None):
    """The weights (and AdamW state) of a sharded checkpoint, into a model sharded over any number of ranks,
    or not sharded at all: each rank reads just the pieces it owns now (DCP reshards on load), sent to its disk first
    where it lacks them (node_disks.read_dcp; ranks None: one process). Without an optimizer, the weights of model that
    the checkpoint holds (a full run's: all; a LoRA run's: its adapters): returns their names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    if optimizer is None:  # what the checkpoint holds decides, not what trains in model (a base under --lora is frozen)
        held = node_disks.read_metadata(path).state_dict_metadata
        state = {"model": {k: v for k, v in model.state_dict().items() if f"model.{k}" in held}}
        node_disks.read_dcp(state, path, ranks)
        model.load_state_dict(state["model"], strict=False)
        return set(state["model"])
    state = state_of(model, optimizer)  # (a LoRA run's: the adapters, not the base)
    node_disks.read_dcp(state, path, ranks)
    # (not strict: a LoRA run's frozen base is not asked for; DCP has already refused a checkpoint missing what trains)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))

def read_sharded(path, shapes):
    """{name: the whole tensor} of a sharded checkpoint's weights (shapes: {name: shape}), read whole on every rank:
    a LoRA run's adapters, small."""
    import torch.distributed.checkpoint as dcp
    state = {"model": {name: torch.empty(shape) for name, shape in shapes.items()}}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]

def model_line(config, held, args):
    """'model: 774.03M parameters (rank 0 holds 321.51M: its stage), GPTConfig(...)': held is what rank 0 holds."""
    if args.pp * args.tp == 1:
        return f"model: {held / 1e6:.2f}M parameters, {config}"
    part = {(True, False): "stage", (False, True): "share"}.get((args.pp > 1, args.tp > 1), "share of its stage")
    whole = sizes.parameters(config)[0]
    return f"model: {whole / 1e6:.2f}M parameters (rank 0 holds {held / 1e6:.2f}M: its {part}), {config}"

def one_process_groups(names, groups):
    """AdamW's param_groups as a one-process run's checkpoint names them (get_state_dict): the whole model's trained
    parameters, decayed matrices first (GPT.configure_optimizer), with this rank's hyperparameters for each kind.
    names: [(name, is a matrix)] of the whole model; groups: this rank's optimizer.param_groups."""
    out = []
    for matrices in (True, False):
        mine = ([g for g in groups if g["params"] and (g["params"][0].dim() >= 2) == matrices]
                or [groups[0] if matrices else groups[-1]])
        out.append({**{k: v for k, v in mine[0].items() if k != "params"},
                    "params": [n for n, m in names if m == matrices]})
    return out

def trained_names(gpt_meta):
    """[(name, is a matrix)] of a whole GPT's trained parameters (the tied weight once: transformer.wte.weight)."""
    return [(n, p.dim() >= 2) for n, p in gpt_meta.named_parameters() if p.requires_grad]

def as_pieces(t, n_embd, tp, group):
    """c_attn's weight or bias (or an AdamW moment of it), split by tensor parallel in the ranks' order, as DCP should
    see it: this rank's rows are q's, k's and v's rows of its heads, at rows p C + r C/tp of the whole (p = 0, 1, 2)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    local, rank, share = sizes.local(t), dist.get_rank(group), n_embd // tp
    pieces = [Shard(block, ShardMetadata([p * n_embd + rank * share, *[0] * (t.dim() - 1)], list(block.shape),
                                         f"rank:{dist.get_rank()}/{local.device.type}"))  # (where: the global rank)
              for p, block in enumerate(local.split(share))]
    return init_from_local_shards(pieces, list(t.shape), process_group=group)

def load(source, state, into, ranks=None):
    """Read a checkpoint's tensors for this rank's part: state (what is filled, in place, in the whole model's names),
    then into(state) puts them where they go. source: a .dcp folder (DCP reads just this rank's pieces, sent to its disk
    first where it lacks them), or a one-process checkpoint's state by name (by_name: each tensor's piece cut from the
    whole, as DCP would). The optimizer's param_groups stay this rank's (only the moments are read)."""
    state = {"model": state["model"], "optimizer": {"state": state["optimizer"]["state"]}}
    if isinstance(source, str):
        node_disks.read_dcp(state, source, ranks)
    else:
        fill(state, *source)
    into(state)

def source(ckpt, whole_model):
    """What load() reads a checkpoint's part from: its .dcp folder, or its one-process state by name (whole_model: the
    whole model on the meta device, for its names) with the checksum of each tensor, checked as it is read."""
    if ckpt["sharded_path"]:
        return ckpt["sharded_path"]
    names = trained_names(whole_model)
    sums = {k: v for k, v in ckpt.get("checksums", {}).items() if k.split("/")[0] in ckpt["unchecked"]}
    return by_name(ckpt["model"], ckpt["optimizer"], names), (by_name(*nested(sums), names), ckpt["path"])

def nested(sums):
    """A checkpoint's {"model/NAME": crc, "optimizer/state/I/KEY": crc} as the model and optimizer dicts they belong to
    (by_name then names them as it names the tensors)."""
    model, optimizer = {}, {"state": {}, "param_groups": []}
    for key, crc in sums.items():
        kind, rest = key.split("/", 1)
        if kind == "model":
            model[rest] = crc
        elif rest.startswith("state/"):
            _, i, moment = rest.split("/")
            optimizer["state"].setdefault(int(i), {})[moment] = crc
    return model, optimizer

def by_name(model, optimizer, names):
    """A one-process checkpoint's model and AdamW state_dicts as DCP names them: AdamW numbers its parameters as
    GPT.configure_optimizer lists them (names: [(name, is a matrix)], parts.trained_names), matrices first."""
    numbered = [n for matrices in (True, False) for n, m in names if m == matrices]
    return {"model": model, "optimizer": {
        "state": {numbered[i]: s for i, s in optimizer["state"].items()},
        "param_groups": [{**g, "params": [numbered[i] for i in g["params"]]} for g in optimizer["param_groups"]]}}

@torch.no_grad()
def fill(state, whole, checked=None):
    """Each tensor of state (nested dicts, in the whole model's names) given its piece of the same name in whole: a
    plain tensor all of it; a DTensor (FSDP's, tensor parallel's) its local shard; a ShardedTensor (as_pieces) each of
    its pieces, by their places. checked: (the checksums of whole's tensors, nested alike; the file): each tensor whole
    is read against its checksum before a piece of it is taken (only the tensors this rank holds are read)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    def cut(t, offsets, shape):
        return t[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]
    sums, path = checked or (None, None)
    for key, value in state.items():
        if isinstance(value, dict):
            fill(value, whole[key], sums and (sums.get(key, {}), path))
            continue
        if sums and key in sums and torch.is_tensor(whole[key]):
            checkpoints.verify_checksums({key: whole[key]}, {key: sums[key]}, path)
        if isinstance(value, DTensor):
            shape, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            sizes.local(value).copy_(cut(whole[key], offsets, shape))
        elif hasattr(value, "local_shards"):
            for piece in value.local_shards():
                piece.tensor.copy_(cut(whole[key], piece.metadata.shard_offsets, piece.metadata.shard_sizes))
        elif torch.is_tensor(value):
            value.copy_(whole[key])

def digest(tensors):
    """sha256 of this rank's tensors (its pieces of split ones), in sorted name order."""
    checksum = hashlib.sha256()
    for name in sorted(tensors):
        t = sizes.local(tensors[name])
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
