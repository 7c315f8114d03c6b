"""Helpers shared by the tests: tiny token shards, running train_gpt2.py as a user would, one torch
thread for tiny models, and a few HellaSwag examples."""
import json
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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and leave the other cores to other jobs).
    A test module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch  # here, not at the top: the tests that never touch torch need not import it
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def hellaswag_example(ind, activity, ctx_a, ctx_b, label, endings, split_type="indomain"):
    """One HellaSwag example with all the keys of the official jsonl, as in its val split."""
    return {"ind": ind, "activity_label": activity, "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}".strip(),
            "split": "val", "split_type": split_type, "label": label, "endings": endings, "source_id": f"handmade~{ind}"}


# Hand-made examples in the official format (our own text). Endings of very different lengths make
# acc (the lowest sum of loss) and acc_norm (the lowest mean) disagree: tests/test_hellaswag.py checks it.
HELLASWAG_EXAMPLES = [
    hellaswag_example(1, "Making tea", "A woman fills a kettle with water.", "she", 2, [
        "puts it on the stove and waits for the water to boil while reading the paper.",
        "throws the kettle out of the window.", "turns it on.",
        "paints the kettle blue and green and then sells it at a market in town."]),
    hellaswag_example(2, "Riding a bike", "A boy rides a bicycle down a hill.", "he", 0, [
        "brakes.", "flies into space on the bicycle, waving to the birds as they pass by.",
        "eats the front wheel.", "reads a long novel about the history of the bicycle while riding."], "zeroshot"),
    hellaswag_example(3, "Cooking", "How to cook rice. Rinse the rice in cold water.", "", 3, [
        "Put the rice in a washing machine and run a full cycle with detergent.",
        "Burn it.", "Plant the rice in the garden and wait a year.",
        "Add two cups of water per cup of rice and bring it to a boil."]),
    hellaswag_example(4, "Gardening", "A man kneels in a garden.", "he", 1, [
        "sings.", "pulls weeds.", "builds a rocket out of the flower pots and launches it to the moon.",
        "digs."], "zeroshot"),
    hellaswag_example(5, "Swimming", "People swim in a pool.", "a lifeguard", 1, [
        "watches them from a tall chair.", "blows.", "is eating a very large sandwich made of bricks.",
        "swims."]),
    hellaswag_example(6, "Snow", "Snow falls on the town. Children run outside.", "", 0, [
        "They build a snowman.", "They swim.", "They sunbathe on the roofs of their houses all afternoon.",
        "They sleep."], "zeroshot"),
]


def write_hellaswag(folder, examples):
    """folder/hellaswag_val.jsonl, one example per line, as hellaswag.py caches the download."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "hellaswag_val.jsonl"), "w") as f:
        f.writelines(json.dumps(ex) + "\n" for ex in examples)
    return str(folder)
