"""
A disk per node: where --log_dir is not one folder for all ranks (three cloud VMs, each with its own disk), every
node keeps, on its own disk, what it needs of each checkpoint, and no single lost node loses one.

  - which ranks share a folder: every rank writes a token file there, and says which of the others' it sees
  - a .pt checkpoint (DDP: every rank holds the whole state) is written on each disk, by the disk's first rank
  - a .dcp checkpoint (FSDP, --pp, --tp: every rank writes its pieces on its own disk): each disk also gets its
    metadata and meta.pt, the pieces its own ranks read back under the same layout (a replicated tensor is written
    by one rank only), and a copy of the next disk's pieces; then each disk renames and prunes its own folder
  - a resume: the ranks agree on the newest checkpoint the disks hold whole between them, and before a rank reads
    a file its disk lacks, a rank that holds it sends it over the process group (another layout, fewer nodes)

One shared folder is the case of one disk: nothing is sent. Every function here is called by every rank.
"""
import os
import time

import torch
import torch.distributed as dist

from plumbing import checkpoints
from plumbing.common import one_line

def find(log_dir, ranks):
    """Which ranks see one --log_dir folder, [[ranks], ...] in the order of their first rank (ranks.disks), and the
    line that says so. Each rank writes an empty file named by a token
    of rank 0's and its rank; once all have, each lists which ranks' files it sees; those that see each other share
    a disk. A folder that one rank cannot write is one error line on every rank."""
    if ranks.world_size == 1:
        return [[0]], None
    token = ranks.broadcast(os.urandom(6).hex())
    def mark(rank):
        return os.path.join(log_dir, f".rank{rank}-{token}")
    try:
        os.makedirs(log_dir, exist_ok=True)
        open(mark(ranks.rank), "w").close()
        problem = None
    except OSError as e:
        problem = f"rank {ranks.rank}: {one_line(e)}"
    problems = [p for p in ranks.gather(problem) if p]
    if problems:
        raise SystemExit(f"error: --log_dir {log_dir} cannot be written ({problems[0]})" if ranks.master else 1)
    seen = ranks.gather([r for r in range(ranks.world_size) if os.path.exists(mark(r))])
    os.remove(mark(ranks.rank))  # (every rank has looked: the gather above waited for all)
    groups = [group for r, group in enumerate(seen) if group[0] == r]
    if any(seen[r] != group for group in groups for r in group) or sum(map(len, groups)) != ranks.world_size:
        raise SystemExit(f"error: --log_dir {log_dir}: the ranks see each other's files inconsistently "
                         f"({seen}, rank r: the ranks whose files it sees): a network file system's cache?"
                         if ranks.master else 1)
    if len(groups) == 1:
        return groups, f"log_dir: {log_dir} is one folder shared by all {ranks.world_size} ranks"
    each = " | ".join(",".join(map(str, g)) for g in groups)
    return groups, (f"log_dir: {log_dir} is {len(groups)} separate folders, a disk per node (ranks {each}): each keeps "
                   "its own checkpoints, with a copy of the next node's .dcp pieces")

# -----------------------------------------------------------------------------
# Which files each disk holds, and which a checkpoint needs

def inventory(folder):
    """{checkpoint name: (its files here, the files a whole copy needs or None if this disk cannot tell)}, files
    relative to folder: a .pt is one file; a .dcp its .metadata, meta.pt and every piece its metadata names."""
    found = {}
    for path in checkpoints.list_checkpoints(folder):
        name = os.path.basename(path)
        if not os.path.isdir(path):
            found[name] = ([name], [name])
            continue
        held = [os.path.join(name, f) for f in sorted(os.listdir(path)) if not f.endswith(".tmp")]
        needs = None
        if os.path.join(name, ".metadata") in held:
            pieces = {info.relative_path for info in read_metadata(path).storage_data.values()}
            needs = sorted(os.path.join(name, f) for f in pieces | {".metadata", "meta.pt"})
        found[name] = (held, needs)
    return found

def read_metadata(path):
    from torch.distributed.checkpoint import FileSystemReader
    return FileSystemReader(path).read_metadata()

def pieces_read(path, state, metadata=None):
    """The files of the .dcp at path that dcp.load(state) reads on this rank: DCP's own load plan, made ahead."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    metadata = metadata or read_metadata(path)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    files = {metadata.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items}
    return sorted(os.path.join(path, f) for f in files)

def resume_point(log_dir, resume, ranks):
    """The checkpoint every rank resumes from, or None (there is none yet): --resume latest (resume "latest") the
    newest one the disks hold whole between them; --resume PATH that one. A rank's disk is then sent what
    load_checkpoint reads that it lacks: a .pt whole, a .dcp's metadata and meta.pt (its pieces come as they are read:
    read_dcp). What is not whole anywhere is one error line that names the missing files and where the rest are."""
    log = os.path.join(log_dir, "log.txt")  # (rank 0 writes it: a restart may have made another node's rank rank 0)
    held = ranks.gather(os.path.exists(log))
    if any(held) and not held[0]:
        send_missing([log] if ranks.master else [], ranks)
    folder = log_dir if resume == "latest" else os.path.dirname(resume) or "."
    if resume != "latest" and not os.path.basename(resume):  # (a .dcp given with a trailing slash)
        folder, resume = os.path.dirname(folder) or ".", folder
    everyone = ranks.gather(inventory(folder) if ranks.keeper else {})
    names = sorted({n for mine in everyone for n in mine}, key=checkpoints.checkpoint_step)
    missing = {n: missing_files(n, everyone) for n in names}
    if resume == "latest":
        whole = [n for n in names if not missing[n]]
        if not whole and names:
            raise SystemExit(f"error: --resume: no checkpoint in --log_dir {folder} is whole on the nodes' disks; the "
                             f"newest, {names[-1]}: {missing[names[-1]]}" if ranks.master else 1)
        if not whole:
            return None
        name = whole[-1]
        for newer in names[names.index(name) + 1:]:
            ranks.print0(f"warning: {os.path.join(folder, newer)} is not whole on the nodes' disks ({missing[newer]}): "
                         f"resuming from {name}")
    else:
        name = os.path.basename(resume)
        if name not in missing:
            local = os.path.exists(resume)  # (not one of ours by its name: read as it is, where it is)
            if not all(ranks.gather(local)):
                raise SystemExit(f"error: --resume: checkpoint {resume} not found"
                                 + (f" on every node's disk (rank {ranks.rank} has it)" if local else "")
                                 if ranks.master or local else 1)
            return resume
        if missing[name]:
            raise SystemExit(f"error: --resume: {resume} is not whole on the nodes' disks ({missing[name]})"
                             if ranks.master else 1)
    path = os.path.join(folder, name)
    send_missing([path] if not os.path.isdir(path) and name.endswith(".pt") else
                 [os.path.join(path, ".metadata"), os.path.join(path, "meta.pt")], ranks, f"resuming from {name}")
    return path

def missing_files(name, everyone):
    """'' if the disks hold the checkpoint `name` whole between them, else which of its files no disk holds, and how
    many each disk does."""
    held, needs = set(), None
    for mine in everyone:
        files, whole = mine.get(name, ([], None))
        held.update(files)
        needs = needs or whole
    if needs is None:
        return "no disk holds its .metadata"
    lost = sorted(os.path.basename(f) for f in set(needs) - held)
    if not lost:
        return ""
    where = ", ".join(f"rank {r}'s disk {len(mine[name][0])}" for r, mine in enumerate(everyone) if name in mine)
    return (f"{', '.join(lost[:3])}{f' and {len(lost) - 3} more' if len(lost) > 3 else ''} on no disk; of its "
            f"{len(needs)} files, {where}")

# -----------------------------------------------------------------------------
# Sending files over the process group

CHUNK = 64 * 2**20  # bytes a message

def send_missing(paths, ranks, why=None):
    """Make each of these paths (this rank's; the ranks may ask for different ones) a file on this rank's disk: for
    every disk that lacks one its ranks ask for, a rank that holds it sends it to the first rank there that asked,
    which writes it atomically at the same path. Returns the bytes sent; with why, rank 0 says what and how long."""
    asked = ranks.gather(sorted(p for p in paths if not os.path.exists(p)))
    wanted = sorted(set().union(*map(set, asked)))
    if not wanted:
        return 0
    holders = ranks.gather({p: os.path.getsize(p) for p in wanted if os.path.exists(p)})
    moves, size = {}, {}  # {(sender, receiver): [paths]}: the files one rank sends another, as one stream
    for p in wanted:
        senders = [r for r, held in enumerate(holders) if p in held]
        if not senders:
            raise SystemExit(f"error: {p} is on no node's disk" if ranks.master else 1)
        size[p] = holders[senders[0]][p]
        for group in ranks.disks or [list(range(ranks.world_size))]:
            askers = [r for r in group if p in asked[r]]
            if askers:
                moves.setdefault((senders[0], askers[0]), []).append(p)
    total, started = sum(size[p] for files in moves.values() for p in files), time.time()
    if why:
        ranks.print0(f"checkpoint: {why}: sending {sum(map(len, moves.values()))} file(s), {total / 1e6:.1f} MB, "
                     "to the disks that lack them")
    for (sender, receiver), files in moves.items():  # (every rank walks the same list: each pair meets in order)
        if ranks.rank == sender:
            send_files(files, [size[p] for p in files], receiver)
        elif ranks.rank == receiver:
            receive_files(files, [size[p] for p in files], sender)
    dist.barrier()  # (every rank of a disk sees what was written there)
    spent = time.time() - started
    if why:
        ranks.print0(f"checkpoint: {why}: sent {total / 1e6:.1f} MB in {spent:.1f}s "
                     f"({total / 1e6 / max(spent, 1e-3):.0f} MB/s)")
    return total

def send_files(paths, sizes, receiver):
    """The files end to end, in messages of CHUNK bytes (many small files: few messages)."""
    files = iter(paths)
    f = None
    try:
        for start in range(0, sum(sizes), CHUNK):
            chunk = torch.empty(min(CHUNK, sum(sizes) - start), dtype=torch.uint8)
            view, filled = memoryview(chunk.numpy()), 0
            while filled < len(view):
                got = f.readinto(view[filled:]) if f else 0
                if not got:  # this file is done (or none is open yet): the next one
                    if f:
                        f.close()
                    f = open(next(files), "rb")
                filled += got
            dist.send(chunk, receiver)
    finally:
        if f:
            f.close()

def receive_files(paths, sizes, sender):
    """send_files' stream, each file written as PATH.tmp, flushed to the disk, then renamed: whole, or not there."""
    tmps = [p + ".tmp" for p in paths]
    try:
        outs, at = [], 0  # the files open so far; where the stream is in the last one
        for start in range(0, sum(sizes), CHUNK):
            chunk = torch.empty(min(CHUNK, sum(sizes) - start), dtype=torch.uint8)
            dist.recv(chunk, sender)
            data = memoryview(chunk.numpy())
            while data:
                if not outs or at == sizes[len(outs) - 1]:
                    os.makedirs(os.path.dirname(tmps[len(outs)]) or ".", exist_ok=True)
                    outs.append(open(tmps[len(outs)], "wb"))
                    at = 0
                n = min(len(data), sizes[len(outs) - 1] - at)
                outs[-1].write(data[:n])
                data, at = data[n:], at + n
        for p, tmp in zip(paths[len(outs):], tmps[len(outs):]):  # (empty files at the end: no bytes came for them)
            outs.append(open(tmp, "wb"))
        for out, tmp, p in zip(outs, tmps, paths):
            out.flush()
            os.fsync(out.fileno())
            out.close()
            os.replace(tmp, p)
    except BaseException:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)
        raise

# -----------------------------------------------------------------------------
# A sharded save on several disks, and a sharded read

def spread(tmp, state, metadata, ranks):
    """After dcp.save(state) into the folder tmp on every disk (and meta.pt on rank 0's): each disk gets the
    metadata and meta.pt, what its ranks read to resume under this layout, and a copy of the next disk's pieces.
    Rank 0 says what that cost."""
    written = ranks.gather(sorted(os.listdir(tmp)) if ranks.keeper else [])
    keepers = [g[0] for g in ranks.disks]
    paths = [os.path.join(tmp, ".metadata"), os.path.join(tmp, "meta.pt"), *pieces_read(tmp, state, metadata)]
    if ranks.keeper:
        next_disk = keepers[(keepers.index(ranks.rank) + 1) % len(keepers)]
        paths += [os.path.join(tmp, f) for f in written[next_disk] if f.endswith(".distcp")]
    started = time.time()
    sent = send_missing(paths, ranks)
    ranks.print0(f"checkpoint: {os.path.basename(tmp)[:-4]} kept on {len(keepers)} node disks, each with the next "
                 f"node's pieces: {sent / 1e6:.1f} MB sent between them in {time.time() - started:.1f}s")

def read_dcp(state, path, ranks=None):
    """dcp.load(state) from the .dcp at path, once this rank's disk holds every file it reads (read_dcp is called by
    every rank; ranks None: one process, or ranks that all see one folder)."""
    import torch.distributed.checkpoint as dcp
    if ranks is not None and ranks.world_size > 1:
        send_missing(pieces_read(path, state), ranks, f"reading {os.path.basename(path)}")
    dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
