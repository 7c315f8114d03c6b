"""
Where each rank sits: its place on the (dp, pp, tp) device mesh (its data-parallel replica, pipeline stage and
tensor-parallel rank), the ranks the data loader sees as one, and which ranks share a node (their hostnames).
Plain arithmetic on rank numbers, but for the mesh itself, which torch makes once a process.
"""
import dataclasses
import functools
from collections import namedtuple

# -----------------------------------------------------------------------------
# The device mesh: where each rank sits among the data-parallel replicas, pipeline stages and tensor-parallel ranks

Place = namedtuple("Place", "replica stage tp_rank")

def place(rank, pp, tp):
    """Where a rank sits on the (dp, pp, tp) mesh: rank r is tensor-parallel rank r % tp of stage (r // tp) % pp of
    replica r // (pp tp). Tensor parallel's ranks are neighbours (one node's cores, with the fastest links between
    them), a replica's stages next."""
    return Place(rank // (pp * tp), (rank // tp) % pp, rank % tp)

def rank_at(replica, stage, tp_rank, pp, tp):
    """The global rank at that place (place's inverse)."""
    return (replica * pp + stage) * tp + tp_rank

@functools.cache
def mesh_of(world_size, pp, tp, device_type):
    """The (dp, pp, tp) device mesh, its ranks placed as place() says. Made once a process (every rank makes it
    together), for the build and then for the step."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_type, (world_size // (pp * tp), pp, tp), mesh_dim_names=("dp", "pp", "tp"))

def replica_ranks(ranks, group):
    """This rank as the data loader sees it: its data-parallel replica among the replicas (the `group` ranks of a
    replica, a pipeline's stages and tensor parallel's shares, read the same micro-batches). Only global rank 0
    prints."""
    replica = dataclasses.replace(ranks, rank=ranks.rank // group, world_size=ranks.world_size // group)
    replica.print0 = ranks.print0
    return replica


# -----------------------------------------------------------------------------
# Which ranks share a node: their hostnames

def nodes_of(hostnames):
    """[[the ranks of a node], ...] from each rank's hostname, nodes in the order of their first rank."""
    nodes = {}
    for rank, host in enumerate(hostnames):
        nodes.setdefault(host, []).append(rank)
    return list(nodes.values())

def inside_nodes(tp, hostnames):
    """Whether every tensor-parallel group lies inside one node: its tp consecutive ranks (tensor_parallel.py's mesh,
    rank r in group r // tp) share a hostname. Launchers (torchrun, mpirun, srun by block) put consecutive ranks on one
    node, so this holds where tp divides the ranks per node; TP's all-reduces, every block's, never cross a network."""
    return all(len(set(hostnames[i:i + tp])) == 1 for i in range(0, len(hostnames), tp))

def describe_nodes(nodes):
    sizes = sorted({len(n) for n in nodes})
    each = f"{sizes[0]} rank" + "s" * (sizes[0] > 1) if len(sizes) == 1 else "/".join(map(str, sizes)) + " ranks"
    return f"{len(nodes)} node" + "s" * (len(nodes) > 1) + f" x {each}"
