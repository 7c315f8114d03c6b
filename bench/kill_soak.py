"""
The kill soak: a 2-rank run under a layout whose checkpoints are written in parts (--shard full, --pp 2, --tp 2), on one
shared folder or on a disk per node, killed with SIGKILL again and again (rank 0, rank 1, or both; some in the middle of
a .dcp save) and resumed each time with --resume, until it finishes. Its final weights' digest must equal the
uninterrupted run's, and no folder named model_*.dcp may ever lack a piece it should hold: on a shared folder every
piece; on a node's disk, its own rank's and the next node's (parallel/node_disks.py).

    python bench/kill_soak.py                                   # 10 kills for each layout and kind of folder
    python bench/kill_soak.py --kills 2 --cases full/disks,pp2/shared,tp2/disks

A case is LAYOUT/FOLDER: LAYOUT full, pp2 or tp2; FOLDER shared, or disks (each rank's --log_dir a folder only it sees:
a private mount, which needs root). A kill comes after the launch's first step line: once a .dcp save has begun (its
model_*.dcp.tmp folder appears), 0-20 ms later, and every other one at a random moment. A run that finishes before
its kill is checked too, and the case goes on from a fresh folder until it has had its kills. A line a kill; a table at
the end; exit code 1 if any digest differs or any folder lacked a piece.
"""
import argparse
import glob
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from parallel import node_disks  # noqa: E402

LAYOUTS = {"full": ["--shard", "full"], "pp2": ["--pp", "2"], "tp2": ["--tp", "2"]}
RANKS = 2
DIGEST = re.compile(r"parameter sha256 \(all 2 rank\(s\), of the parts\): (\w+)")


def run_flags(data, log_dir, steps):
    """A tiny fp32 model (4 blocks of 32, 2 heads), 384 tokens a step, a checkpoint every 2 steps (the last 2 kept)."""
    return ["--data_dir", data, "--log_dir", log_dir, "--n_layer", "4", "--n_head", "2", "--n_embd", "32",
            "--block_size", "64", "--seq_len", "32", "--batch_size", "2", "--total_batch_size", "384",
            "--max_steps", str(steps), "--warmup_steps", "2", "--eval_interval", "4", "--val_tokens", "512",
            "--checkpoint_interval", "2", "--keep_checkpoints", "2", "--sample_interval", "0",
            "--hellaswag_interval", "0", "--dtype", "fp32", "--threads", "1", "--dist_timeout", "20", "--resume"]


def start(flags, folder, disks, port):
    """The ranks, by hand with torchrun's variables (as srun starts them), rank r's output in folder/rankR.out; with
    disks, rank r's --log_dir is folder/diskR, mounted for it alone."""
    procs = []
    for rank in range(RANKS):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(RANKS),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   TORCH_COMPILE_DISABLE="1")
        cmd = [sys.executable, os.path.join(REPO, "train_gpt2.py"), *flags]
        if disks:
            log_dir = flags[flags.index("--log_dir") + 1]
            os.makedirs(f"{folder}/disk{rank}", exist_ok=True)
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", f"{folder}/disk{rank}", log_dir, *cmd]
        with open(f"{folder}/rank{rank}.out", "w") as out:
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO))
    return procs


def folders(folder, disks):
    """Where the ranks' files are: each rank's disk, or the one shared --log_dir."""
    return [f"{folder}/disk{r}" for r in range(RANKS)] if disks else [f"{folder}/log"]


def lacking(folder, disks):
    """Every file a renamed model_*.dcp folder should hold and does not: its metadata and meta.pt, and the pieces
    its metadata names (on a node's disk: those its own rank wrote, __R_*, and the next node's)."""
    missing = []
    for i, where in enumerate(folders(folder, disks)):
        mine = {f"__{i}_", f"__{(i + 1) % RANKS}_"} if disks else None
        for path in glob.glob(f"{where}/model_*.dcp"):
            if not os.path.exists(f"{path}/.metadata") or not os.path.exists(f"{path}/meta.pt"):
                missing.append(f"{path}/.metadata or meta.pt")
                continue
            pieces = {info.relative_path for info in node_disks.read_metadata(path).storage_data.values()}
            missing += [f"{path}/{p}" for p in sorted(pieces) if (mine is None or p.startswith(tuple(mine)))
                        and not os.path.exists(f"{path}/{p}")]
    return missing


def output(folder):
    with open(f"{folder}/rank0.out") as f:
        return f.read()


def wait_for(condition, procs, limit=120):
    """Poll condition() every millisecond while the ranks run; whether it came true."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if condition():
            return True
        time.sleep(0.001)
    return False


def finish(procs, limit=300):
    """Wait for the ranks; those still running after `limit` seconds are killed. Returns their exit codes."""
    deadline = time.monotonic() + limit
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


def reference(data, layout, steps, work):
    folder = f"{work}/{layout}-ref"
    os.makedirs(folder)
    codes = finish(start(run_flags(data, f"{folder}/log", steps) + LAYOUTS[layout], folder, False, free_port()))
    found = DIGEST.findall(output(folder))
    if codes != [0] * RANKS or not found:
        raise SystemExit(f"kill_soak: the uninterrupted {layout} run failed ({codes}):\n{output(folder)[-3000:]}")
    return found[-1]


def soak(data, layout, disks, kills, steps, want, work, rng):
    """Kill and resume until `kills` kills; returns a dict of what happened."""
    seen = {"kills": 0, "in a save": 0, "runs": 0, "finished": 0, "wrong digests": 0, "lacking": [], "stop s": []}
    folder, rounds = None, 0
    while seen["kills"] < kills or folder is not None:
        if folder is None:  # a fresh run
            rounds += 1
            folder = f"{work}/{layout}-{'disks' if disks else 'shared'}-{rounds}"
            os.makedirs(f"{folder}/log")
        procs = start(run_flags(data, f"{folder}/log", steps) + LAYOUTS[layout], folder, disks, free_port())
        seen["runs"] += 1
        if seen["kills"] < kills:
            in_save = seen["kills"] % 2 == 0  # (the first kill, and every other after it)
            wait_for(lambda: re.search(r"^step ", output(folder), re.M), procs)
            if in_save:
                landed = wait_for(lambda: any(glob.glob(f"{w}/model_*.dcp.tmp") for w in folders(folder, disks)), procs)
                time.sleep(rng.uniform(0, 0.02))
            else:  # a random moment
                landed = not wait_for(lambda: False, procs, rng.uniform(0, 1.5))
            if landed and all(p.poll() is None for p in procs):
                victims = rng.choice([[0], [1], [0, 1]])
                for r in victims:
                    procs[r].send_signal(signal.SIGKILL)
                killed = time.monotonic()
                codes = finish(procs, 60)
                seen["stop s"].append(time.monotonic() - killed)
                seen["kills"] += 1
                seen["in a save"] += in_save
                gone = lacking(folder, disks)
                seen["lacking"] += gone
                print(f"  {layout}/{'disks' if disks else 'shared'}: kill {seen['kills']}: rank(s) "
                      f"{','.join(map(str, victims))}{' during a save' if in_save else ''}; exit codes {codes}, all "
                      f"stopped in {seen['stop s'][-1]:.1f}s; {len(gone)} piece(s) lacking", flush=True)
                continue
        codes = finish(procs)
        found = DIGEST.findall(output(folder))
        if codes != [0] * RANKS or not found:
            raise SystemExit(f"kill_soak: a resumed {layout} run failed ({codes}):\n{output(folder)[-3000:]}")
        seen["finished"] += 1
        seen["wrong digests"] += found[-1] != want
        seen["lacking"] += lacking(folder, disks)
        leftover = [f for w in folders(folder, disks) for f in glob.glob(f"{w}/**/*.tmp", recursive=True)]
        seen["lacking"] += [f"left: {f}" for f in leftover]
        folder = None
    return seen


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--cases", default="full/shared,full/disks,pp2/shared,pp2/disks,tp2/shared,tp2/disks",
                        help="LAYOUT/FOLDER,...: full, pp2 or tp2 / shared or disks")
    parser.add_argument("--kills", type=int, default=10, help="kills a case")
    parser.add_argument("--steps", type=int, default=16, help="the run's steps (a checkpoint every 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cases = [c.split("/") for c in args.cases.split(",")]
    if any(len(c) != 2 or c[0] not in LAYOUTS or c[1] not in ("shared", "disks") for c in cases):
        raise SystemExit(f"error: --cases {args.cases}: give LAYOUT/FOLDER pairs, LAYOUT one of {', '.join(LAYOUTS)}, "
                         "FOLDER shared or disks")
    if any(f == "disks" for _, f in cases) and (os.geteuid() != 0 or not shutil.which("unshare")):
        raise SystemExit("error: a disk per rank needs root and unshare (a private mount for each rank)")
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from conftest import make_shards
    rng, started = random.Random(args.seed), time.time()
    with tempfile.TemporaryDirectory(prefix="kill_soak") as work:
        data = make_shards(f"{work}/data")
        wants, rows, bad = {}, [], False
        for layout, kind in cases:
            if layout not in wants:
                wants[layout] = reference(data, layout, args.steps, work)
            seen = soak(data, layout, kind == "disks", args.kills, args.steps, wants[layout], work, rng)
            bad |= bool(seen["wrong digests"] or seen["lacking"])
            stops = seen["stop s"]
            rows.append(f"| {layout} | {kind} | {seen['kills']} ({seen['in a save']} in a save) | {seen['runs']} | "
                        f"{seen['finished']} | {seen['finished'] - seen['wrong digests']}/{seen['finished']} | "
                        f"{len(seen['lacking'])} | {max(stops) if stops else 0:.1f} |")
            for problem in seen["lacking"]:
                print(f"  lacking: {problem}")
    print("\n| layout | folder | kills | launches | runs finished | digest = uninterrupted | pieces lacking | "
          "slowest stop (s) |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    print(f"kill_soak: {time.time() - started:.0f}s, seed {args.seed}, {args.steps} steps a run, {RANKS} ranks")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
