"""
The plumbing under train_gpt2.py, hellaswag.py and sample.py: what a student needs to know exists,
but not to read first. One topic per module:

  world.py        how the processes of a job find each other and agree: launchers, the process group
                  and its backend, the device, stop signals, same-start and same-weights checks
  cpu.py          this CPU: what it computes fast (native bf16 or not, its matmul rates, measured at
                  every start and kept as the best seen), threads and affinity, malloc, the vector-math warm-up
  speedups.py     the precision (the one place a run's dtype is decided, from cpu.py's measurements) and
                  the optional ways to make a step faster: torch.compile and Intel's IPEX
  checkpoints.py  run folders: checkpoint names, atomic writes, checksums, .pt and .dcp files, the lock
  sharding.py     FSDP2: a GPT split across the ranks, built without any rank holding all of it
  stage_split.py  where --pp cuts the blocks into stages, and what each stage then holds and sends
  stage.py        one pipeline stage as a module: the GPT with the other stages' parts removed
  pipeline.py     pipeline parallel (--pp): its flags' checks, the stages on a (dp, pp, tp) mesh, its schedule,
                  its checkpoints
  tensor_parallel.py  tensor parallel (--tp): each block split over ranks
  parts.py        a rank's part of the model under --pp and --tp: built alone, read by name, digested; the
                  .dcp checkpoints every sharded layout writes and reads
  node_disks.py   a disk per node: which ranks share --log_dir, what each disk keeps of a checkpoint, the
                  checkpoint the ranks agree to resume, files sent to the disks that lack them
  layouts.py      --parallel auto: the layout predicted fastest from measured links and memory
  cluster.py      what --parallel auto measures: free memory, crowded cores, links, a block's time
  fused_loss.py   lm_head and the loss, a chunk of positions at a time
  attention.py    causal attention: our AMX kernel (attention.cpp) where it measures faster than PyTorch's
  inputs.py       what a run reads besides its arguments: the token shards' id check, OpenAI's weights
  progress.py     how long: the step line's elapsed time and ETA, progress lines of long passes
  clock.py        --hours: the family of shapes measured here, the one chosen for the time, the schedule
                  that re-fits its last step to the clock
  report.py       every run's picture: log_dir/report.png and report.md from its log.txt (and plot.py's)

This file holds what they all share: one-line errors, the cache folder with its small JSON files, and
the --help format of every script.
"""
import argparse
import json
import os
import threading

def one_line(e):
    """An exception as one line: errors we report must fit on one."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"

class ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every script's --help format: each flag's help ends with its default, "(default: 16)", unless the help
    already says it in words ("default: the longest example"), where a bare "None" would tell nothing."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)

def cache_dir(*parts):
    """~/.cache/gpt2-cpu/... (or under $XDG_CACHE_HOME): the demo's shards, compiled kernels, token-id
    scans and measured matmul rates, kept across runs."""
    return os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "gpt2-cpu", *parts)

def read_json(path):
    """A small cache file's dict, or {} if it is missing, unreadable, or holds something else: a cache is
    input like any other, and a broken one only makes the run work its contents out again."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}

def write_json(path, obj):
    """A small cache file, replaced whole (checkpoints.atomic_write): ranks on one host (or two runs) may write at
    once, each to a temporary file of its own, and the last rename wins; a reader sees the old file or a new one,
    never half of one. A read-only cache only makes the next run work it out again."""
    from plumbing.checkpoints import atomic_write  # (here: checkpoints imports this file)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, lambda f: f.write(json.dumps(obj).encode()), f"{path}.{os.getpid()}.{threading.get_ident()}.tmp")
    except OSError:
        pass
