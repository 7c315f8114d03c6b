"""
What every part of the project shares, importing nothing of it: one-line errors, the --help format of every script,
the cache folder and its small JSON files, and atomic writes (a temporary file, then a rename).
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
    """A small cache file, replaced whole (atomic_write, below): ranks on one host (or two runs) may write at
    once, each to a temporary file of its own, and the last rename wins; a reader sees the old file or a new one,
    never half of one. A read-only cache only makes the next run work it out again."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, lambda f: f.write(json.dumps(obj).encode()),
                     f"{path}.{os.getpid()}.{threading.get_ident()}.tmp")
    except OSError:
        pass

def atomic_write(path, write, tmp=None):
    """write(f) to a temporary file (path.tmp, or tmp: ranks on one host writing the same file each need their own),
    flushed to the disk, then renamed to path. The rename is atomic, so path is either the old file or the complete new
    one, never a half-written one, even after kill -9 or a power cut. A failed write removes the temporary file."""
    tmp = tmp or path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
