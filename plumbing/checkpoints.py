"""
Run folders and checkpoint files: nothing written is left half-written, a damaged checkpoint is
refused, one run per folder.

  - names: model_00500.pt (one file), model_00500.dcp (a sharded run's folder, one file per rank)
  - listing and pruning them; the log folder (log.txt and its lines, args.json) and its lock
  - atomic writes (a temporary file, then a rename) and a check of the free space beforehand
  - CRC-32 checksums of every tensor, verified when a checkpoint is loaded
  - a sharded run's .dcp folder: named and listed here; its pieces are written and read by parallel/parts.py
  - a big checkpoint (LOUD_BYTES) says what it writes, and then how big it was and how long it took
"""
import fcntl
import glob
import json
import os
import re
import shutil
import socket
import time
import zlib

import torch

from plumbing.common import atomic_write, one_line
from plumbing.progress import QUIET_S, duration

# A checkpoint this big (GPT-2 (124M)'s weights and AdamW moments are 1.5 GB, XL's 19 GB) may take a while to write:
# it says so before, and how long it took after (as does any write that took QUIET_S seconds). Smaller: silent.
LOUD_BYTES = 2**30

def tensor_bytes(obj, bytes_of=None):
    """The bytes of every tensor in a nested dict/list (a checkpoint's state). bytes_of(tensor): a tensor's bytes here
    (parallel.sizes.local_bytes: a sharded one's pieces on this rank); default all of it."""
    if isinstance(obj, torch.Tensor):
        return bytes_of(obj) if bytes_of else obj.numel() * obj.element_size()
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(tensor_bytes(v, bytes_of) for v in items)

def folder_bytes(path):
    """A file's size, or all the files' in a folder (a .dcp)."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)

def say_writing(path, estimate):
    """'checkpoint: writing PATH (about 1.49 GB)' for a big one; returns what to call once it is written."""
    started, loud = time.time(), estimate >= LOUD_BYTES
    if loud:
        print(f"checkpoint: writing {path} (about {estimate / 1e9:.2f} GB)", flush=True)
    def written():
        spent = time.time() - started
        if loud or spent >= QUIET_S:
            size, took = folder_bytes(path), duration(spent) if spent >= 60 else f"{spent:.1f}s"
            print(f"checkpoint: {path} written, {size / 1e9:.2f} GB in {took} ({size / 1e9 / max(spent, 1e-3):.2f} "
                  f"GB/s)", flush=True)
    return written

def atomic_save(obj, path, quiet=False):
    """torch.save, atomically (atomic_write); a big one says so (say_writing), unless quiet. A failed write (a full
    disk, say) ends with one error line."""
    written = say_writing(path, 0 if quiet else tensor_bytes(obj))
    try:
        atomic_write(path, lambda f: torch.save(obj, f))
    except (OSError, RuntimeError) as e:
        # torch reports a failed write as "[enforce fail at inline_container.cc...]"; the OS's reason is more use
        cause = e if isinstance(e, OSError) else e.__cause__ or e.__context__ or e
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        raise SystemExit(f"error: cannot write {path} ({one_line(cause)}; {free / 2**20:.0f} MiB free there)") from None
    if not quiet:
        written()

def check_free_space(folder, needed, what):
    """One error line before training when a file we will write cannot fit."""
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise SystemExit(f"error: {folder} has {free / 2**20:.0f} MiB free, but {what} needs about "
                         f"{needed / 2**20:.0f} MiB: free some space or choose another --log_dir")

def checkpoint_path(log_dir, step, sharded=False):
    return os.path.join(log_dir, f"model_{step:05d}.{'dcp' if sharded else 'pt'}")

def checkpoint_step(path):
    """model_00500.pt (one file) or model_00500.dcp (a folder, one file per rank: sharded runs) -> 500; else None."""
    m = re.fullmatch(r"model_(\d+)\.(pt|dcp)", os.path.basename(path))
    return int(m.group(1)) if m else None

def list_checkpoints(log_dir):
    """Our checkpoints, oldest first, by step number (as text, model_100000.pt would sort before model_99999.pt).
    A folder being written is named *.tmp until it is whole, so it is never listed."""
    found = [f for f in glob.glob(os.path.join(log_dir, "model_*")) if checkpoint_step(f) is not None]
    return sorted(found, key=checkpoint_step)

def prune_checkpoints(log_dir, keep, newer_than=None):
    """Keep the newest `keep` (0: all); or, given newer_than=S, delete those after step S."""
    found = list_checkpoints(log_dir)
    if newer_than is not None:
        old = [f for f in found if checkpoint_step(f) > newer_than]
    else:
        old = found[:-keep] if keep > 0 else []
    for f in old:
        shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)

def append_log(log_dir, ranks, *lines):
    """log.txt: one line per measurement ('STEP KIND VALUE'), written by rank 0 alone; play.ipynb plots it."""
    if ranks.master:
        with open(os.path.join(log_dir, "log.txt"), "a") as f:
            f.write("".join(line + "\n" for line in lines))

def prepare_log_dir(log_dir, run_args, overwrite, fresh, log=True):
    """log.txt is appended to (--overwrite: emptied, and the old checkpoints deleted). A fresh run records
    its arguments in args.json, so that a --resume before its first checkpoint starts the same run. log False: the
    folder of another node's disk, without log.txt (rank 0 writes it)."""
    for f in list_checkpoints(log_dir) if overwrite else []:
        shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)
    if log:
        open(os.path.join(log_dir, "log.txt"), "w" if overwrite else "a").close()
    if fresh:
        atomic_write(os.path.join(log_dir, "args.json"), lambda f: f.write(json.dumps(run_args, indent=1).encode()))

def load_checkpoint(path, weights=True):
    """A checkpoint file; or a sharded run's folder, whose meta.pt has all but the weights and AdamW state
    (parts.load_sharded reads those, each rank its own pieces). The file is mapped, not read: a tensor is read when it
    is used (a pipeline's stage reads its blocks of a one-process checkpoint, not the whole of it). weights False: the
    checksums of the weights and AdamW state are checked as they are read (checked, verify_weights, parts.source)."""
    try:
        sharded = os.path.isdir(path)
        ckpt = torch.load(os.path.join(path, "meta.pt") if sharded else path, map_location="cpu", weights_only=True,
                          mmap=not sharded)
    except Exception as e:
        raise SystemExit(f"error: cannot load checkpoint {path}: {one_line(e)}")
    ckpt.update(sharded_path=path if sharded else None, path=path,
                unchecked=set() if weights else {"model", "optimizer"})
    verify_checksums({k: v for k, v in ckpt.items() if k not in ("checksums", *ckpt["unchecked"])},
                     ckpt.get("checksums", {}), path)
    return ckpt

def verify_weights(ckpt, part):
    """ckpt[part] ("model" or "optimizer") checked against its checksums, if load_checkpoint left them unchecked."""
    if part in ckpt["unchecked"] and part in ckpt:
        verify_checksums({part: ckpt[part]}, ckpt.get("checksums", {}), ckpt["path"])
        ckpt["unchecked"].discard(part)
    return ckpt.get(part)

def checked(ckpt, part, name):
    """One tensor, ckpt[part][name], checked against its checksum if load_checkpoint left it unchecked."""
    tensor = ckpt[part][name]
    if part in ckpt["unchecked"]:
        verify_checksums({f"{part}/{name}": tensor}, ckpt.get("checksums", {}), ckpt["path"])
    return tensor

def remove_unfinished(folder):
    """What a run killed while writing left here: model_*.tmp (a .pt, or a .dcp folder, being written) and *.tmp
    inside a .dcp folder (a piece being received). Called by the folder's keeper, holding its lock."""
    for path in (glob.glob(os.path.join(folder, "model_*.tmp"))
                 + glob.glob(os.path.join(folder, "model_*.dcp", "*.tmp"))):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)

def tensor_checksums(obj, prefix=""):
    """{path: CRC-32 of the tensor's bytes} for every tensor in a nested dict/list (a checkpoint).
    CRC-32 catches every single flipped bit and every burst of up to 32, at ~1 GB/s."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return {prefix: zlib.crc32(t.view(-1).view(torch.uint8).numpy()) if t.numel() else 0}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    sums = {}
    for k, v in items:
        sums.update(tensor_checksums(v, f"{prefix}/{k}" if prefix else str(k)))
    return sums

def verify_checksums(obj, expected, path):
    """A damaged tensor (a bit flipped on disk or in transit) is refused, naming the file and the tensor."""
    for name, crc in tensor_checksums(obj).items():
        if expected.get(name, crc) != crc:
            raise SystemExit(f"error: checkpoint {path} is damaged: tensor {name} does not match its checksum")

def lock_folder(folder):
    """One writer per log folder: an advisory lock, held until this process ends (kill -9 included).
    Returns the open lock file, which must stay referenced for as long as the lock is wanted."""
    lock_path = os.path.join(folder, "lock")
    try:
        os.makedirs(folder, exist_ok=True)
        f = open(lock_path, "a+")
    except OSError as e:
        raise SystemExit(f"error: --log_dir {folder} is not writable ({one_line(e)})") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        raise SystemExit(f"error: --log_dir {folder} is in use by {holder}: one run per folder (if that "
                         "process is a leftover rank of a killed launcher, kill it first)") from None
    f.truncate(0)
    f.write(f"PID {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f
