"""Never losing a run: signals, divergence, step 100,000, damaged checkpoints, bad token ids, one run
per folder, a full or read-only disk, --resume before the first checkpoint, and resumes that compute
exactly the same numbers in every process (docs/reliability.md)."""
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import torch

from plumbing import checkpoints
import train_gpt2
from conftest import REPO, make_shards, need, read_log, run_train, start_ranks, tiny_run_args

# 8 micro-steps of the tiny model per optimizer step: ~0.4 s a step on one core (AMX Xeon), so a signal sent
# once step 2 is printed lands in the middle of the run's 10 steps without any test hook in the trainer
SLOW = ["--total_batch_size", "1024", "--max_steps", "10", "--eval_interval", "4", "--checkpoint_interval", "4"]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted run every interrupted one is compared with."""
    log = tmp_path_factory.mktemp("ref") / "log"
    return log, run_train(tiny_run_args(data, log, *SLOW)).stdout


@pytest.fixture(scope="module")
def three_steps(data, tmp_path_factory):
    """A 3-step run with its checkpoint at step 3, which tests copy and then damage or edit."""
    log = tmp_path_factory.mktemp("three_steps") / "log"
    run_train(tiny_run_args(data, log, "--max_steps", "3", "--eval_interval", "0"))
    return log


def copy_of(run, tmp_path):
    log = tmp_path / "log"
    shutil.copytree(run, log)
    return log


def digest(stdout):
    """The final weights' checksum that the (last) run printed."""
    return re.findall(r"parameter sha256 \(all \d+ rank\(s\)\): (\w+)", stdout)[-1]


def start(args, env=None, **kw):
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.Popen([sys.executable, os.path.join(REPO, "train_gpt2.py"), *map(str, args)], cwd=REPO,
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def read_until(proc, text, limit=180):
    """Lines of proc's stdout up to the first containing text."""
    seen, deadline = [], time.monotonic() + limit
    for line in proc.stdout:
        seen.append(line)
        if text in line or time.monotonic() > deadline:
            return seen
    raise AssertionError(f"never printed {text!r}:\n{''.join(seen)}{proc.stderr.read()}")


def assert_same_as_reference(reference, log, stdout):
    ref_log, ref_out = reference
    assert read_log(log, "train") == read_log(ref_log, "train")  # every step's loss, as logged (6 decimals)
    assert read_log(log, "val") == read_log(ref_log, "val")
    assert digest(stdout) == digest(ref_out)  # bitwise-equal final weights


# ----------------------------------------------------------------------------- signals

# SIGINT here, SIGTERM on two ranks below (one process and SIGTERM: the long lane; the same path, another number)
@pytest.mark.xdist_group("reliability-reference")  # both on one worker, which builds `reference` (20 s) once
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.long), signal.SIGINT],
                         ids=["SIGTERM", "SIGINT"])
def test_signal_saves_and_resume_equals_uninterrupted(data, reference, tmp_path, sig):
    log = tmp_path / "log"
    proc = start(tiny_run_args(data, log, *SLOW))
    read_until(proc, "step     2 |")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    line = err.strip().splitlines()[-1]
    m = re.fullmatch(rf"rank 0: stopped by {sig.name} before step (\d+): saved (\S+); continue with --resume; "
                     rf"exit code {128 + sig}", line)
    assert m, err
    assert "Traceback" not in err
    step = int(m.group(1))
    assert 3 <= step < 10 and os.path.basename(m.group(2)) == f"model_{step:05d}.pt"
    assert torch.load(m.group(2), weights_only=True)["evaluated"] is False  # its evals run on resume
    resumed = run_train(tiny_run_args(data, log, *SLOW, "--resume")).stdout
    assert f"resumed from {m.group(2)} at step {step}" in resumed
    assert_same_as_reference(reference, log, out + resumed)


def by_hand(data, log, world_size, *extra):
    """world_size ranks started by hand with torchrun's variables, as srun starts Slurm's tasks."""
    return start_ranks(tiny_run_args(data, log, *SLOW, *extra), world_size)


def finish(procs):
    results = [p.communicate(timeout=300) for p in procs]
    return [p.returncode for p in procs], results


@pytest.mark.xdist_group("multiprocess-2")
def test_sigterm_to_every_rank_then_resume_equals_uninterrupted_two_ranks(data, tmp_path):
    ref = tmp_path / "ref"
    codes, ref_results = finish(by_hand(data, ref, 2))
    assert codes == [0, 0], ref_results
    log = tmp_path / "log"
    procs = by_hand(data, log, 2)
    read_until(procs[0], "step     2 |")
    for p in procs:  # Slurm's --signal=TERM@120 signals every task
        p.send_signal(signal.SIGTERM)
    codes, results = finish(procs)
    assert codes == [143, 143], results
    assert "saved" in results[0][1] and "continue with --resume" in results[0][1]
    assert re.search(r"rank 1: stopped by SIGTERM before step \d+: exit code 143", results[1][1]), results[1][1]
    codes, resumed = finish(by_hand(data, log, 2, "--resume"))
    assert codes == [0, 0], resumed
    assert read_log(log, "train") == read_log(ref, "train") and read_log(log, "val") == read_log(ref, "val")
    assert digest(resumed[0][0]) == digest(ref_results[0][0])


def test_second_signal_stops_at_once(tmp_path):
    code = ("import os, signal, time\nfrom parallel import world\n"
            "stop = world.GracefulStop()\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "os.kill(os.getpid(), signal.SIGINT)  # within a second: the same request\n"
            "assert stop.signum == signal.SIGINT\n"
            "print('still running', flush=True)\n"
            "time.sleep(1.2)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(30)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130 and time.monotonic() - t0 < 20
    assert proc.stdout == "still running\n"
    assert proc.stderr.strip() == "SIGINT again: stopping now, without a checkpoint"


# ----------------------------------------------------------------------------- divergence

def test_divergence_stops_and_keeps_only_checkpoints_that_trained_on(data, tmp_path):
    log = tmp_path / "log"
    run_train(tiny_run_args(data, log, "--max_steps", "4", "--checkpoint_interval", "4"))
    proc = run_train(tiny_run_args(data, log, "--resume", "--max_lr", "1e6", "--max_steps", "40",
                                   "--checkpoint_interval", "1", "--keep_checkpoints", "3", "--eval_interval", "0"),
                     check=False)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training diverged: 5 steps in a row with a diverged loss or gradient"), proc.stderr
    assert "update skipped" in proc.stdout
    train = read_log(log, "train")
    kept = checkpoints.list_checkpoints(str(log))
    assert kept and os.path.basename(kept[-1]) in last
    for f in kept:  # finite weights, and a step from them gave a sane loss
        ckpt = torch.load(f, weights_only=True)
        assert all(torch.isfinite(t).all() for t in ckpt["model"].values())
        assert train[ckpt["step"]] < train_gpt2.DIVERGED_LOSS, (f, train)
    # and the run goes on from there with a sane learning rate
    out = run_train(tiny_run_args(data, log, "--resume", "--max_lr", "1e-3", "--max_steps", str(len(train) + 2),
                                  "--eval_interval", "0")).stdout
    assert f"resumed from {kept[-1]}" in out and "update skipped" not in out


def test_blown_up_but_finite_weights_never_push_out_the_last_good_checkpoint(data, tmp_path):
    """--max_lr 1e6 blows the weights up in one step to a finite loss of ~1e12, then NaN: with a checkpoint
    every step and only one kept, the last checkpoint of normal training must be the one left."""
    log = tmp_path / "log"
    run_train(tiny_run_args(data, log, "--max_steps", "3", "--eval_interval", "1"))
    blow_up = ["--resume", "--max_lr", "1e6", "--max_steps", "40", "--eval_interval", "1",
               "--checkpoint_interval", "1", "--keep_checkpoints", "1"]
    proc = run_train(tiny_run_args(data, log, *blow_up), check=False)
    assert proc.returncode == 1 and "error: training diverged" in proc.stderr
    assert [os.path.basename(f) for f in checkpoints.list_checkpoints(str(log))] == ["model_00003.pt"]


# ----------------------------------------------------------------------------- checkpoints

def test_checkpoints_are_ordered_by_step_number(tmp_path):
    for step in (99_998, 99_999, 100_000, 100_001, 7):
        (tmp_path / f"model_{step:05d}.pt").write_bytes(b"")
    (tmp_path / "model_final.pt").write_bytes(b"")  # not ours: ignored
    names = [os.path.basename(f) for f in checkpoints.list_checkpoints(str(tmp_path))]
    assert names == ["model_00007.pt", "model_99998.pt", "model_99999.pt", "model_100000.pt", "model_100001.pt"]


def rewrite(path, new_path, **changes):
    """A checkpoint with some entries changed, its checksums recomputed (as the trainer writes them)."""
    ckpt = torch.load(path, weights_only=True)
    ckpt.update(changes)
    ckpt["checksums"] = checkpoints.tensor_checksums({k: v for k, v in ckpt.items() if k != "checksums"})
    torch.save(ckpt, new_path)


def test_resume_past_step_100000_prunes_and_picks_the_newest(data, three_steps, tmp_path):
    log = copy_of(three_steps, tmp_path)
    rewrite(log / "model_00003.pt", log / "model_99998.pt", step=99_998)
    os.remove(log / "model_00003.pt")
    def resume(max_steps):
        return run_train(tiny_run_args(data, log, "--resume", "--max_steps", max_steps, "--checkpoint_interval", "1",
                                       "--keep_checkpoints", "2", "--eval_interval", "0")).stdout
    resume(100_003)
    kept = [os.path.basename(f) for f in checkpoints.list_checkpoints(str(log))]
    assert kept == ["model_100002.pt", "model_100003.pt"]
    assert sorted(read_log(log, "train"))[-3:] == [100_000, 100_001, 100_002]
    assert f"resumed from {log / 'model_100003.pt'} at step 100003" in resume(100_004)


def flip_tensor_byte(path):
    """Flip one bit in the middle of the largest tensor's stored bytes, inside the checkpoint's zip."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset)
        header = f.read(30)
        name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
        offset = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def test_a_flipped_bit_in_tensor_data_is_refused(data, three_steps, tmp_path):
    log = copy_of(three_steps, tmp_path)
    path = log / "model_00003.pt"
    torch.load(path, weights_only=True)  # torch itself reads the damaged file without complaint: see below
    flip_tensor_byte(path)
    assert torch.load(path, weights_only=True)  # still loads: only our checksums can tell
    for proc in (run_train(tiny_run_args(data, log, "--resume", "--max_steps", "4"), check=False),
                 subprocess.run([sys.executable, "sample.py", "--ckpt_path", str(path)], cwd=REPO,
                                capture_output=True, text=True)):
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        damaged = rf"error: checkpoint {re.escape(str(path))} is damaged: tensor \S+ does not match its checksum"
        assert re.fullmatch(damaged, last), last


def test_checkpoints_without_checksums_still_load(three_steps, tmp_path):
    log = copy_of(three_steps, tmp_path)
    ckpt = torch.load(log / "model_00003.pt", weights_only=True)
    del ckpt["checksums"]  # as written before checksums existed
    torch.save(ckpt, log / "model_00003.pt")
    assert checkpoints.load_checkpoint(str(log / "model_00003.pt"))["step"] == 3


# ----------------------------------------------------------------------------- data

def shards_with_token(tmp_path, shard, position, token):
    """Tiny shards with one token replaced; returns (data folder, that shard's path)."""
    data = make_shards(tmp_path / "data")
    path = os.path.join(data, shard)
    tokens = np.load(path)
    tokens[position] = token
    np.save(path, tokens)
    return data, path


def test_token_id_beyond_the_vocabulary_is_refused_before_the_model(tmp_path):
    data, bad = shards_with_token(tmp_path, "tiny_train_000002.npy", 1234, 60_000)
    proc = run_train(tiny_run_args(data, tmp_path / "log"), check=False, env={"XDG_CACHE_HOME": str(tmp_path / "c")})
    assert proc.returncode == 1 and "model:" not in proc.stdout  # refused before the model was built
    assert proc.stderr.strip().splitlines()[-1] == \
        f"error: shard {bad} holds token id 60000, beyond the model's vocabulary of 50304"


def test_padding_ids_train_with_a_warning(tmp_path):
    data, shard = shards_with_token(tmp_path, "tiny_train_000001.npy", 10, 50_300)
    proc = run_train(tiny_run_args(data, tmp_path / "log", "--max_steps", "2"),
                     env={"XDG_CACHE_HOME": str(tmp_path / "c")})
    assert f"warning: shard {shard} holds token id 50300" in proc.stdout


# ----------------------------------------------------------------------------- the log folder

@pytest.mark.xdist_group("multiprocess-2")
def test_second_run_in_a_folder_is_refused(data, tmp_path):
    log = tmp_path / "log"
    first = start(tiny_run_args(data, log, "--max_steps", "100000", "--eval_interval", "0"))
    try:
        read_until(first, "step     1 |")
        proc = run_train(tiny_run_args(data, log, "--resume", "--max_steps", "100000"), check=False)
        assert proc.returncode == 1
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: --log_dir {log} is in use by PID {first.pid} on "), last
    finally:
        first.kill()
        first.communicate()
    # the lock died with its process (kill -9): the folder can be used again
    run_train(tiny_run_args(data, log, "--resume", "--max_steps", "2"))


@contextlib.contextmanager
def tmpfs(path, options):
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    # (skipped where it cannot mount, but under CI, which runs as root, a failure)
    need(mounted.returncode == 0, f"mounting a tmpfs ({mounted.stderr.decode().strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)])


def test_full_disk_is_one_line_and_leaves_no_partial_file(data, tmp_path):
    with tmpfs(tmp_path / "small", "size=4m") as small:
        # before training: the tiny model's checkpoint (1.6M parameters x 12 bytes) cannot fit
        proc = run_train(tiny_run_args(data, small / "log"), check=False)
        assert proc.returncode == 1 and "step" not in proc.stdout
        assert re.fullmatch(rf"error: {small / 'log'} has \d+ MiB free, but a checkpoint needs about 19 MiB: .*",
                            proc.stderr.strip().splitlines()[-1]), proc.stderr
        # while writing: a disk that fills up under a save
        target = str(small / "model_00001.pt")
        with pytest.raises(SystemExit) as e:
            checkpoints.atomic_save({"w": torch.zeros(2_000_000)}, target)
        no_space = (rf"error: cannot write {re.escape(target)} \(OSError: \[Errno 28\] No space left on device; "
                    r"\d+ MiB free there\)")
        assert re.fullmatch(no_space, str(e.value)), e.value
        assert os.listdir(small) == ["log"]  # no model_00001.pt.tmp left behind


def test_read_only_log_dir_is_one_line(data, tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        proc = run_train(tiny_run_args(data, ro / "log"), check=False)
        assert proc.returncode == 1 and "model:" not in proc.stdout
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: --log_dir {ro / 'log'} is not writable ("), proc.stderr


def test_resume_with_no_checkpoint_yet_starts_the_run(data, tmp_path):
    plain, requeued = tmp_path / "plain", tmp_path / "requeued"
    run_train(tiny_run_args(data, plain))
    out = run_train(tiny_run_args(data, requeued, "--resume")).stdout
    assert f"--resume: no checkpoint in --log_dir {requeued} yet: starting the run from step 0" in out
    assert read_log(requeued, "train") == read_log(plain, "train")
    # killed before its first checkpoint, then requeued with --resume alone: args.json gives the run back
    os.remove(requeued / "model_00003.pt")
    os.remove(requeued / "model_00006.pt")
    out = run_train(["--resume", "--log_dir", requeued]).stdout
    assert "starting the run from step 0" in out and read_log(requeued, "train") == read_log(plain, "train")


# ----------------------------------------------------------------------------- the same numbers in every process

@pytest.mark.long
@pytest.mark.xdist_group("multiprocess-2")
def test_resume_gives_the_same_loss_in_every_process_beside_a_cpu_load(data, tmp_path):
    """oneMKL picks each vector-math kernel at its first call, and when several threads make that call
    at once one of them can compute its chunk with a low-accuracy kernel (pytorch/pytorch#188792): the
    same resume then gives different losses in different processes, a few times in 40. The warm-up in
    cpu.warm_up_vector_math prevents it. Without the warm-up this test fails only now and then, so it runs in the
    long lane, with 12 resumes beside a core kept busy."""
    log = tmp_path / "log"
    run_train(tiny_run_args(data, log, "--max_steps", "3", "--eval_interval", "0", "--batch_size", "8",
                            "--total_batch_size", "512"))
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        losses = set()
        for i in range(12):
            out = run_train(tiny_run_args(data, log, "--resume", "--max_steps", "4", "--threads", "2",
                                          "--checkpoint_interval", "0", "--log_dir", tmp_path / f"copy{i}",
                                          "--resume", str(log / "model_00003.pt")),
                            env={"OMP_NUM_THREADS": "2"}).stdout
            losses.add(re.search(r"step     3 \| loss (\S+) ", out).group(1))
    finally:
        burner.kill()
        burner.wait()
    assert len(losses) == 1, losses


# ----------------------------------------------------------------------------- kill -9 under every layout

# the main lane: one case, FSDP on a disk per node (the save protocol, .dcp.tmp then a rename on each disk, is one for
# every layout: parallel/parts.py); the long lane: a pipeline on one shared folder and tensor parallel on a disk per
# node too (about a minute of both cores each)
SOAK_CASES = [pytest.param(["full/disks"], id="full-disks"),
              pytest.param(["full/disks", "pp2/shared", "tp2/disks"], id="every-layout", marks=pytest.mark.long)]


@pytest.mark.xdist_group("multiprocess-2")
@pytest.mark.parametrize("cases", SOAK_CASES)
def test_kills_during_training_and_saves_under_each_layout_resume_to_the_same_weights(cases):
    """bench/kill_soak.py, short: 2 ranks under --shard full (a disk per node), and in the long lane also --pp 2 (one
    shared folder) and --tp 2 (a disk per node), each killed with SIGKILL (one rank or both, at random) once a .dcp
    save has begun, and resumed; each ends with the uninterrupted run's digest, and no model_*.dcp folder ever lacked a
    piece or kept a *.tmp. Kills at a random moment of training: the long soak, and test_distributed.py's kill -9 of a
    sharded run. The long soak, 10 kills for each layout on each kind of folder: docs/reliability.md."""
    from conftest import can_mount_privately, need
    need(can_mount_privately(), "a private mount for each rank (root, unshare)")
    proc = subprocess.run([sys.executable, "bench/kill_soak.py", "--kills", "1", "--steps", "6",
                           "--cases", ",".join(cases)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = r"^\| (full|pp2|tp2) \| (disks|shared) \| 1 \(1 in a save\) \| \d+ \| (\d+) \| (\d+)/(\d+) \| 0 \|"
    rows = re.findall(row, proc.stdout, re.M)
    assert ["/".join(r[:2]) for r in rows] == cases, proc.stdout
    assert all(int(r[2]) >= 1 and r[3] == r[4] == r[2] for r in rows), proc.stdout
    saves = re.findall(r"kill \d: rank\(s\) [01,]+ during a save; exit codes", proc.stdout)
    assert len(saves) == len(cases), proc.stdout
