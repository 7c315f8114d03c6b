"""Helpers shared by the tests: tiny token shards, and running train_gpt2.py as a user would."""
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# torch.compile is on by default in train_gpt2.py, but compiling a tiny model costs a test far more
# time than it saves: make it a no-op here and in every subprocess (they inherit the environment).
# tests/test_perf.py turns it back on where compilation is what it tests.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

# a model small enough that a CPU trains it in a fraction of a second per step
TINY_MODEL = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64"]


def make_shards(data_dir, train_tokens=(6000, 5000), val_tokens=3000, seed=0, vocab=50257, prefix="tiny"):
    """Random-token shards in build-nanogpt's format: np.save'd 1-D uint16 arrays."""
    rng = np.random.default_rng(seed)
    os.makedirs(data_dir, exist_ok=True)
    np.save(os.path.join(data_dir, f"{prefix}_val_000000.npy"), rng.integers(0, vocab, val_tokens, dtype=np.uint16))
    for i, n in enumerate(train_tokens, start=1):
        np.save(os.path.join(data_dir, f"{prefix}_train_{i:06d}.npy"), rng.integers(0, vocab, n, dtype=np.uint16))
    return str(data_dir)


def tiny_run_args(data_dir, log_dir, *extra):
    """Flags for a short fp32 run of the tiny model; later flags override earlier ones."""
    return ["--data_dir", str(data_dir), "--log_dir", str(log_dir), *TINY_MODEL,
            "--seq_len", "32", "--batch_size", "4", "--total_batch_size", "256", "--max_steps", "6",
            "--warmup_steps", "2", "--max_lr", "1e-3", "--min_lr", "1e-4", "--eval_interval", "3",
            "--val_tokens", "512", "--sample_interval", "0", "--hellaswag_interval", "0",
            "--checkpoint_interval", "3", "--keep_checkpoints", "0", "--dtype", "fp32", "--threads", "1",
            *extra]


def run_train(args, launcher=(), check=True, env=None, timeout=600, cwd=None):
    """Run train_gpt2.py in a subprocess, as a user would; returns the CompletedProcess."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    cmd = [*launcher, *([] if launcher else [sys.executable]), os.path.join(REPO, "train_gpt2.py"), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd or REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_log(log_dir, kind):
    """{step: value} of one kind of line ('train', 'val', 'hella') in log_dir/log.txt."""
    out = {}
    with open(os.path.join(log_dir, "log.txt")) as f:
        for line in f:
            step, k, value = line.split()
            if k == kind:
                out[int(step)] = float(value)
    return out


@pytest.fixture
def shards(tmp_path):
    return make_shards(tmp_path / "data")
