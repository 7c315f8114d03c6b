"""
The plumbing under train_gpt2.py, hellaswag.py and sample.py: what a student needs to know exists,
but not to read first. One topic per module:

  world.py        how the processes of a job find each other and agree: launchers, the process group
                  and its backend, the device, stop signals, same-start and same-weights checks
  cpu.py          this CPU: what it computes fast (native bf16 or not, measured matmul rates) and so
                  which dtype a run uses, threads and affinity, malloc, the vector-math warm-up
  speedups.py     the optional ways to make a step faster: torch.compile and Intel's IPEX
  checkpoints.py  run folders: checkpoint names, atomic writes, checksums, .pt and .dcp files, the lock
  sharding.py     FSDP2: a GPT split across the ranks, built without any rank holding all of it
  inputs.py       what a run reads besides its arguments: the token shards' id check, OpenAI's weights

This file holds the two things they all share: one-line errors and the cache folder.
"""
import json
import os

def one_line(e):
    """An exception as one line: errors we report must fit on one."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"

def cache_dir(*parts):
    """~/.cache/gpt2-cpu/... (or under $XDG_CACHE_HOME): the demo's shards, compiled kernels, token-id
    scans and measured matmul rates, kept across runs."""
    return os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "gpt2-cpu", *parts)

def read_json(path):
    """A small cache file's contents, or {} if it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}

def write_json(path, obj):
    """A small cache file, replaced whole: ranks on one host may write at once, each to its own temporary
    file, and the last rename wins. A read-only cache only makes the next run work it out again."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.{os.getpid()}.tmp", "w") as f:
            json.dump(obj, f)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    except OSError:
        pass
