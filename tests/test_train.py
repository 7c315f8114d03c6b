import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from plumbing import checkpoints, inputs
from model import GPTConfig, GPT
from conftest import REPO, make_shards, read_log, run_train, tiny_run_args
from dataloader import DataLoader, ValLoader


# ----------------------------------------------------------------------------- data loader

def blocks_of(x):
    """Each row of a batch identifies its block by its tokens."""
    return [tuple(row) for row in x.tolist()]


def epoch_blocks(data_dir, T):
    out = []
    for f in inputs.find_shards(data_dir, "train"):
        a = np.load(f)
        out += [tuple(a[i * T:i * T + T].tolist()) for i in range((len(a) - 1) // T)]
    return out


def test_loader_is_deterministic_and_seeded(shards):
    a = [DataLoader(shards, "train", 4, 32, seed=1).next_batch()[0] for _ in range(2)]
    assert torch.equal(a[0], a[1])
    b = DataLoader(shards, "train", 4, 32, seed=2).next_batch()[0]
    assert not torch.equal(a[0], b)
    x, y = DataLoader(shards, "train", 4, 32, seed=1).next_batch()
    assert x.dtype == torch.long and x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_block_once_per_epoch_and_disjoint_ranks(shards, world_size):
    B, T = 3, 32
    everything = epoch_blocks(shards, T)
    loaders = [DataLoader(shards, "train", B, T, rank=r, world_size=world_size, seed=5) for r in range(world_size)]
    seen = []
    n_steps = -(-len(everything) // (B * world_size))  # enough steps to cover one epoch
    owner = {}
    for _ in range(n_steps):
        for rank, loader in enumerate(loaders):
            rows = blocks_of(loader.next_batch()[0])
            seen += rows
            owner.update({len(seen) - len(rows) + i: rank for i in range(len(rows))})
    # in stream order, the first epoch holds each block exactly once, so no two ranks share one
    first_epoch = seen[:len(everything)]
    assert len(set(first_epoch)) == len(first_epoch)
    assert sorted(first_epoch) == sorted(everything)
    if world_size > 1:
        assert len({owner[i] for i in range(len(first_epoch))}) == world_size  # all ranks got work
    # the next epoch is a different order of the same blocks
    assert loaders[0].epoch == 1


def test_loader_state_round_trip(shards):
    a = DataLoader(shards, "train", 4, 32, seed=3)
    for _ in range(70):  # past the end of the first shard and into the next epoch
        a.next_batch()
    b = DataLoader(shards, "train", 4, 32, seed=3)
    b.load_state_dict(a.state_dict())
    for _ in range(50):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    with pytest.raises(SystemExit, match="seed"):
        DataLoader(shards, "train", 4, 32, seed=4).load_state_dict(a.state_dict())


def test_val_tokens_do_not_depend_on_batch_or_world(shards):
    def scored(B, world):
        rows = []
        for rank in range(world):
            for x, y in ValLoader(shards, 32, 1024, B, rank, world):
                rows += blocks_of(torch.cat((x, y[:, -1:]), dim=1))
        return sorted(rows)
    ref = scored(4, 1)
    assert len(ref) == 1024 // 32
    assert scored(3, 2) == ref and scored(32, 3) == ref


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory):
    """One plain run of tiny_run_args (6 steps, checkpoints at 3 and 6): several tests read it, none writes to it."""
    log = tmp_path_factory.mktemp("finished") / "log"
    run_train(tiny_run_args(data, log))
    return log


def test_checkpoint_loads_with_weights_only(finished):
    assert sorted(os.listdir(finished)) == ["args.json", "lock", "log.txt", "model_00003.pt", "model_00006.pt",
                                            "report.md", "report.png"]
    ckpt = torch.load(finished / "model_00006.pt", weights_only=True)
    assert ckpt["step"] == 6 and ckpt["config"]["n_layer"] == 2
    assert ckpt["args"]["total_batch_size"] == 256 and ckpt["loader"]["seed"] == 1337
    assert isinstance(ckpt["val_loss"], float) and "torch" in ckpt["rng"]
    model = GPT(GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    assert len(ckpt["optimizer"]["state"]) == len(list(model.parameters()))
    log = read_log(finished, "val")
    assert abs(log[6] - ckpt["val_loss"]) < 1e-4


def test_checkpoint_pruning(tmp_path, shards):
    run_train(tiny_run_args(shards, tmp_path / "log", "--checkpoint_interval", "1", "--keep_checkpoints", "2"))
    assert sorted(f for f in os.listdir(tmp_path / "log") if f.endswith(".pt")) == ["model_00005.pt", "model_00006.pt"]


def test_checkpoint_interval_zero_saves_none(tmp_path, shards):
    run_train(tiny_run_args(shards, tmp_path / "log", "--checkpoint_interval", "0"))
    assert len(read_log(tmp_path / "log", "train")) == 6
    assert not [f for f in os.listdir(tmp_path / "log") if f.endswith(".pt")]


def test_crash_while_saving_leaves_no_truncated_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "model_00010.pt")
    checkpoints.atomic_save({"step": 10, "w": torch.ones(3)}, path)

    def dying_save(obj, f):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt  # the process is stopped in the middle of writing

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.atomic_save({"step": 10, "w": torch.zeros(3)}, path)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.atomic_save({"step": 20}, str(tmp_path / "model_00020.pt"))
    assert checkpoints.list_checkpoints(str(tmp_path)) == [path]  # no model_00020.pt at all
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))  # old one intact


def test_killed_while_saving_leaves_no_truncated_checkpoint(tmp_path):
    # a real SIGKILL in the middle of writing a large checkpoint
    code = ("import sys, torch\nfrom plumbing import checkpoints\n"
            "print('writing', flush=True)\n"
            "checkpoints.atomic_save({'w': torch.zeros(400_000_000 // 4)}, sys.argv[1])\n")
    path = tmp_path / "model_00001.pt"
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    tmp = str(path) + ".tmp"
    for _ in range(2000):  # kill once the temporary file has started to grow
        if os.path.exists(tmp) and os.path.getsize(tmp) > 0:
            break
        proc.poll()
        assert proc.returncode is None
        import time
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not path.exists()
    assert checkpoints.list_checkpoints(str(tmp_path)) == []


# ----------------------------------------------------------------------------- exact resume

def test_resume_is_exact(tmp_path, data, finished):
    full = finished
    reference = read_log(full, "train")
    assert sorted(reference) == [0, 1, 2, 3, 4, 5]

    # kill -9 a second run after it has trained past its step-3 checkpoint, then resume it
    part = tmp_path / "part"
    cmd = [sys.executable, os.path.join(REPO, "train_gpt2.py"), *tiny_run_args(data, part)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    for line in proc.stdout:
        if line.startswith("step     4"):
            proc.kill()
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert os.path.exists(part / "model_00003.pt") and not os.path.exists(part / "model_00006.pt")
    with open(part / "log.txt") as f:
        before = f.read()

    out = run_train(["--resume", "--log_dir", part]).stdout  # everything else comes from the checkpoint
    assert "resumed from" in out and "model_00003.pt" in out
    with open(part / "log.txt") as f:
        after = f.read()
    assert after.startswith(before)  # appended, never truncated
    resumed = [line.split() for line in after[len(before):].splitlines()]
    resumed_train = {int(s): float(v) for s, k, v in resumed if k == "train"}
    assert sorted(resumed_train) == [3, 4, 5]
    for step, loss in resumed_train.items():
        assert loss == reference[step], (step, loss, reference[step])  # bit-for-bit, as logged
    assert read_log(part, "val")[6] == read_log(full, "val")[6]
    a = torch.load(full / "model_00006.pt", weights_only=True)["model"]
    b = torch.load(part / "model_00006.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_from_a_given_file(tmp_path, data, finished):
    out = run_train(tiny_run_args(data, tmp_path / "b", "--max_steps", "8", "--resume",
                                  finished / "model_00006.pt")).stdout
    assert "at step 6" in out
    assert sorted(read_log(tmp_path / "b", "train")) == [6, 7]


# ----------------------------------------------------------------------------- refusing to destroy a run

def test_existing_run_is_never_overwritten_silently(tmp_path, data, finished):
    log = tmp_path / "log"
    shutil.copytree(finished, log)  # a finished run in this folder
    with open(log / "log.txt") as f:
        original = f.read()
    proc = run_train(tiny_run_args(data, log), check=False)
    assert proc.returncode != 0
    assert "--resume" in proc.stderr and "--log_dir" in proc.stderr and "--overwrite" in proc.stderr
    with open(log / "log.txt") as f:
        assert f.read() == original
    run_train(tiny_run_args(data, log, "--overwrite", "--max_steps", "2", "--checkpoint_interval", "5"))
    assert sorted(read_log(log, "train")) == [0, 1]
    assert sorted(f for f in os.listdir(log) if f.endswith(".pt")) == ["model_00002.pt"]


# ----------------------------------------------------------------------------- clear errors on bad input

def expect_error(args, *needles, env=None):
    proc = run_train(args, check=False, env=env)
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:"), proc.stderr
    for needle in needles:
        assert str(needle) in last, (needle, last)
    return last


def test_bad_inputs_get_one_clear_error(tmp_path, shards):
    log = tmp_path / "log"
    expect_error(tiny_run_args(tmp_path / "missing", log), "--data_dir", "missing")
    expect_error(tiny_run_args(shards, log, "--seq_len", "128"), "--seq_len", "--block_size")
    expect_error(tiny_run_args(shards, log, "--total_batch_size", "300"), "--total_batch_size", "300")
    expect_error(tiny_run_args(shards, log, "--n_embd", "33"), "--n_embd", "--n_head")
    expect_error(tiny_run_args(shards, log, "--resume", tmp_path / "nope.pt"), "nope.pt")
    bad_ckpt = tmp_path / "bad.pt"
    bad_ckpt.write_bytes(b"not a checkpoint")
    expect_error(tiny_run_args(shards, log, "--resume", bad_ckpt), "bad.pt")
    expect_error(tiny_run_args(tmp_path, log), "no shards", "train")  # a dir with no shards in it
    assert not log.exists()  # nothing was started


@pytest.mark.parametrize("content", ["garbage", "empty", "float", "truncated"])
def test_bad_shards_are_named(tmp_path, content):
    data = make_shards(tmp_path / "data")
    bad = os.path.join(data, "tiny_train_000002.npy")
    if content == "garbage":
        with open(bad, "wb") as f:
            f.write(b"this is no numpy file")
    elif content == "empty":
        np.save(bad, np.zeros(0, dtype=np.uint16))
    elif content == "float":
        np.save(bad, np.zeros(1000, dtype=np.float32))
    else:
        with open(bad, "rb") as f:
            head = f.read(300)
        with open(bad, "wb") as f:
            f.write(head)
    expect_error(tiny_run_args(data, tmp_path / "log"), "tiny_train_000002.npy")


# ----------------------------------------------------------------------------- the demo

def test_demo_runs_end_to_end(tmp_path):
    # the same path as `python train_gpt2.py` with no shards, shortened by flags
    out = run_train(["--log_dir", tmp_path / "log", "--max_steps", "3", "--eval_interval", "3",
                     "--sample_interval", "3", "--val_tokens", "4096", "--threads", "1"],
                    env={"XDG_CACHE_HOME": str(tmp_path / "cache")}, cwd=tmp_path).stdout
    assert "running the demo" in out
    assert "sample 0: Hello, I'm a language model," in out
    shards = os.listdir(tmp_path / "cache" / "gpt2-cpu" / "demo")
    assert sorted(shards) == ["demo_train_000001.npy", "demo_val_000000.npy"]
    val = read_log(tmp_path / "log", "val")
    assert sorted(val) == [0, 3] and val[3] < val[0]
    assert os.path.exists(tmp_path / "log" / "model_00003.pt")


# ----------------------------------------------------------------------------- fine-tuning

def test_finetune_from_pretrained_dir_and_from_checkpoint(tmp_path, shards):
    from conftest import save_random_hf_gpt2
    save_random_hf_gpt2(tmp_path / "hf")  # a GPT-2 in the hub's layout, context 128, vocab 50257
    out = run_train(tiny_run_args(shards, tmp_path / "ft", "--init_from", tmp_path / "hf", "--max_steps", "2")).stdout
    assert "vocab_size=50257" in out and "n_embd=64" in out  # sizes come from config.json, vocab not padded
    ckpt = torch.load(tmp_path / "ft" / "model_00002.pt", weights_only=True)
    assert ckpt["config"]["block_size"] == 128
    # and on from our own checkpoint, with a fresh optimizer and schedule
    out = run_train(tiny_run_args(shards, tmp_path / "ft2", "--init_from", tmp_path / "ft" / "model_00002.pt",
                                  "--max_steps", "1")).stdout
    assert "n_embd=64" in out
    assert sorted(read_log(tmp_path / "ft2", "train")) == [0]


def test_device_flag_errors(tmp_path, shards):
    expect_error(tiny_run_args(shards, tmp_path / "log", "--device", "tpu"), "--device")
    if not torch.cuda.is_available():
        expect_error(tiny_run_args(shards, tmp_path / "log", "--device", "cuda"), "--device", "cuda")


def test_short_last_shard_is_used_not_refused(tmp_path):
    # fineweb.py's last train shard can be shorter than one sequence: it just holds no block
    data = make_shards(tmp_path / "data", train_tokens=(3000, 20))
    run_train(tiny_run_args(data, tmp_path / "log", "--max_steps", "2"))
    loader = DataLoader(data, "train", 4, 32)
    everything = epoch_blocks(data, 32)
    seen = [b for _ in range(len(everything) // 4 + 1) for b in blocks_of(loader.next_batch()[0])]
    assert sorted(seen[:len(everything)]) == sorted(everything)
    tiny = make_shards(tmp_path / "tiny", train_tokens=(20, 30))
    expect_error(tiny_run_args(tiny, tmp_path / "log2"), "fewer than the 33 tokens", "tiny_train_000001.npy")
