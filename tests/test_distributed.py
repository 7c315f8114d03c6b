"""Data parallel training, proven equal to one process: torchrun, mpirun, three hosts in network
namespaces, resume, a killed or hung rank, and the launch detection each of them relies on.

The equality tests compare against one process that accumulates the same total batch in more
micro-steps: 384 tokens per step = 2 sequences x 32 tokens x (6 micro-steps on 1 rank,
3 on each of 2 ranks, 2 on each of 3 ranks). Same data, same mean gradient; only the order of
floating point sums differs, so losses agree to about 1e-6.

Tools a test needs (mpirun, ip) are skipped where missing, except under CI=true, where
.ci/install-system has installed them and a skip would hide a failure.
"""
import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import (LIMIT, REPO, TORCHRUN, assert_same_run, can_create_namespaces, checkpoint_val, clean_env,
                      final_weights_diff, free_port, namespace_hosts, need, outputs_of, read_log, run_launched,
                      run_rank_script, run_train, start_ranks, stopped_after_step_3, tiny_run_args)

from parallel.world import choose_backend, detect_launch
from compute.cpu import cpu_list, physical_cores, ranks_sharing_cpus
from dataloader import DataLoader

FAKE_CCL = os.path.join(REPO, "tests", "fake_ccl")
EQUAL = ["--batch_size", "2", "--total_batch_size", "384"]  # 6, 3 or 2 micro-steps on 1, 2 or 3 ranks
REFERENCE = EQUAL  # (conftest's single: one process's run)
TOL = 1e-5

# launchers and ranks: the whole file runs on one xdist worker, one test at a time (docs/tests.md), which also
# builds the runs the tests share (single, two_ranks, two_ranks_sharded) once
pytestmark = pytest.mark.xdist_group("multiprocess")


def weights_digest(state):
    """The trainer's end-of-run checksum, recomputed from a checkpoint's model state."""
    return hashlib.sha256(b"".join(state[k].float().numpy().tobytes() for k in sorted(state))).hexdigest()


def printed_digest(stdout, world_size, parts=False):
    """The digest of the final weights that rank 0 printed for all ranks: of the whole weights (DDP), or of each rank's
    parts (FSDP, a pipeline, tensor parallel: no rank gathers a tensor whole to check it)."""
    lines = [l for l in stdout.splitlines() if l.startswith("parameter sha256")]
    assert len(lines) == 1, stdout  # printed once: rank 0 speaks for all ranks
    of = ", of the parts" if parts else ""
    assert lines[0].startswith(f"parameter sha256 (all {world_size} rank(s){of}): "), lines[0]
    return lines[0].split()[-1]


# -----------------------------------------------------------------------------
# Runs shared by several tests (built once per test module and worker)


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("torchrun") / "log"
    proc = run_launched(tiny_run_args(data, log_dir, *EQUAL), TORCHRUN, clean_env())
    return log_dir, proc


# -----------------------------------------------------------------------------
# Launch detection: every launcher's variables, in the order the trainer trusts them

LAUNCHES = [
    ({}, (0, 1, 0, 1, "single")),
    (dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2"), (3, 4, 1, 2, "torchrun")),
    (dict(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="6", OMPI_COMM_WORLD_LOCAL_RANK="1",
          OMPI_COMM_WORLD_LOCAL_SIZE="2"), (5, 6, 1, 2, "openmpi")),
    # MPICH's hydra: mpirun -n 3 -ppn 1 over three hosts
    (dict(PMI_RANK="2", PMI_SIZE="3", MPI_LOCALRANKID="0", MPI_LOCALNRANKS="1"), (2, 3, 0, 1, "mpich")),
    # Intel MPI uses the same hydra variables, next to its own I_MPI_ ones
    (dict(PMI_RANK="1", PMI_SIZE="4", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2", I_MPI_ROOT="/opt/intel/mpi"),
     (1, 4, 1, 2, "mpich")),
    # srun: 2 tasks on each of 2 nodes; this is the second task of the second node
    (dict(SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1", SLURM_NODEID="1", SLURM_STEP_ID="0",
          SLURM_STEP_TASKS_PER_NODE="2(x2)"), (3, 4, 1, 2, "slurm")),
    # srun with uneven nodes: 3 tasks on the first, 1 on the second
    (dict(SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="0", SLURM_NODEID="1", SLURM_STEP_ID="7",
          SLURM_STEP_TASKS_PER_NODE="3,1"), (3, 4, 0, 1, "slurm")),
    # the salloc trap: inside an allocation but outside srun every process inherits SLURM_PROCID=0
    (dict(SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_ID="42",
          SLURM_TASKS_PER_NODE="2(x2)"), (0, 1, 0, 1, "single")),
    # mpirun inside a Slurm allocation sees both: the MPI launcher is the one that started us
    (dict(PMI_RANK="1", PMI_SIZE="2", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2",
          SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_STEP_ID="0"), (1, 2, 1, 2, "mpich")),
    # torchrun started by srun (one agent per node): torchrun's variables describe the workers
    (dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
          SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_STEP_ID="0"), (5, 8, 1, 4, "torchrun")),
]


@pytest.mark.parametrize("env,expected", LAUNCHES, ids=[
    "none", "torchrun", "openmpi", "mpich", "intel-mpi", "srun", "srun-uneven", "salloc-trap",
    "mpirun-in-slurm", "torchrun-in-srun"])
def test_detect_launch(env, expected):
    assert detect_launch(env) == expected


@pytest.mark.parametrize("env,message", [
    (dict(RANK="one", WORLD_SIZE="2"), "RANK='one' is not an integer"),
    (dict(PMI_RANK="3", PMI_SIZE="3"), "inconsistent mpich variables"),
    (dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_STEP_ID="0", SLURM_STEP_TASKS_PER_NODE="2(y2)"),
     "cannot parse SLURM_STEP_TASKS_PER_NODE"),
])
def test_detect_launch_rejects_bad_variables(env, message):
    with pytest.raises(SystemExit, match="^error: .*" + message.replace("(", r"\(").replace(")", r"\)")):
        detect_launch(env)


def test_choose_backend_without_oneccl(monkeypatch):
    monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", None)  # as if not installed
    assert choose_backend("auto", "cpu") == "gloo"
    assert choose_backend("auto", "cuda") == "nccl"
    assert choose_backend("auto", "xpu") == "xccl"
    assert choose_backend("gloo", "cpu") == "gloo"
    with pytest.raises(SystemExit, match="^error: --backend ccl needs Intel's oneccl_bindings_for_pytorch"):
        choose_backend("ccl", "cpu")
    with pytest.raises(SystemExit, match="^error: --backend nccl does not work with --device cpu"):
        choose_backend("nccl", "cpu")


def test_choose_backend_with_oneccl(monkeypatch):
    monkeypatch.syspath_prepend(FAKE_CCL)
    monkeypatch.delitem(sys.modules, "oneccl_bindings_for_pytorch", raising=False)
    assert choose_backend("auto", "cpu") == "ccl"
    assert choose_backend("ccl", "cpu") == "ccl"
    assert choose_backend("auto", "cuda") == "nccl"  # oneCCL is for CPUs and Intel GPUs
    assert "ccl" in torch.distributed.Backend.backend_list


def test_thread_helpers():
    mine = os.sched_getaffinity(0)
    assert 1 <= physical_cores() <= len(mine)
    assert physical_cores({min(mine)}) == 1
    assert cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


def test_ranks_sharing_cpus():
    """Threads per rank = physical cores / ranks sharing them: a launcher that pinned each rank to
    its own cores has already divided them."""
    both = [0, 1, 2, 3]
    # torchrun, no pinning: 2 ranks of node a on the same 4 CPUs, and 2 more on node b
    everyone = [("a", both), ("a", both), ("b", both), ("b", both)]
    assert ranks_sharing_cpus(set(both), "a", everyone, 2) == 2
    # Intel MPI's default pinning: each rank of node a on its own half
    everyone = [("a", [0, 1]), ("a", [2, 3]), ("b", [0, 1]), ("b", [2, 3])]
    assert ranks_sharing_cpus({0, 1}, "a", everyone, 2) == 1
    # hosts that share a hostname (namespaces, containers): the launcher's count of local ranks wins
    assert ranks_sharing_cpus(set(both), "a", [("a", both)] * 3, 1) == 1


def test_ranks_read_disjoint_data_covering_one_process(data):
    """Each step, rank r of 2 gets the r-th half of the blocks one process would get: disjoint, complete."""
    one = DataLoader(data, "train", 4, 32, rank=0, world_size=1)
    ranks = [DataLoader(data, "train", 2, 32, rank=r, world_size=2) for r in range(2)]
    for _ in range(200):  # 200 x 4 blocks of 32: past the end of an epoch of ~340 blocks
        x1, y1 = one.next_batch()
        (x0, y0), (x1r, y1r) = ranks[0].next_batch(), ranks[1].next_batch()
        assert torch.equal(torch.cat([x0, x1r]), x1) and torch.equal(torch.cat([y0, y1r]), y1)


# -----------------------------------------------------------------------------
# Equal to one process


def test_torchrun_two_ranks_equal_one_process(single, two_ranks):
    (ref_dir, ref), (dist_dir, proc) = single, two_ranks
    assert "distributed: torchrun, world size 2, backend gloo" in proc.stdout
    assert f"log_dir: {dist_dir} is one folder shared by all 2 ranks" in proc.stdout  # (each rank looked)
    worst = assert_same_run(ref_dir, dist_dir)
    print(f"torchrun x2 vs 1 process: largest train loss difference {worst:.1e}")
    # the checksum is of the real final weights, and the ranks agreed on it
    final = torch.load(os.path.join(dist_dir, "model_00006.pt"), weights_only=True)["model"]
    assert printed_digest(proc.stdout, 2) == weights_digest(final)
    printed_digest(ref.stdout, 1)
    # ranks other than 0 are quiet: each line once
    assert proc.stdout.count("validation loss") == 3 and len(re.findall(r"^step ", proc.stdout, re.M)) == 6


# (FSDP on 3 ranks in the main lane: three namespace hosts, below)
@pytest.mark.parametrize("shard", ["none", pytest.param("full", marks=pytest.mark.long)])
def test_mpirun_three_ranks_equal_one_process(data, single, tmp_path, shard):
    mpirun = shutil.which("mpirun.mpich") or shutil.which("mpirun")
    need(mpirun, "MPICH's mpirun")
    log_dir = tmp_path / "log"
    # --threads 0: the automatic choice, one physical core (of 2 here) per rank at most
    proc = run_launched(tiny_run_args(data, log_dir, *EQUAL, "--threads", "0", "--shard", shard),
                        (mpirun, "-n", "3", "-ppn", "1", sys.executable), clean_env(MASTER_PORT=free_port()))
    assert "distributed: mpich, world size 3, backend gloo, master 127.0.0.1:" in proc.stdout
    assert f"threads: 1 torch threads per rank ({physical_cores()} physical cores / 3 rank(s))" in proc.stdout
    assert "3 rank(s) x 2 accumulation steps" in proc.stdout
    worst = assert_same_run(single[0], log_dir)
    print(f"mpirun x3 (--shard {shard}) vs 1 process: largest train loss difference {worst:.1e}")
    printed_digest(proc.stdout, 3, parts=shard == "full")
    assert final_weights_diff(single[0], log_dir) <= TOL


def test_ranks_agree_on_bf16_only_if_every_cpu_computes_it_fast(data, tmp_path, monkeypatch, one_thread):
    """--dtype auto on two ranks whose CPUs differ: MPICH's mpirun starts rank 1 with PyTorch, oneMKL and
    oneDNN limited to AVX2 (a CPU without native bf16). Whatever rank 0's CPU, the run trains in fp32."""
    mpirun = shutil.which("mpirun.mpich") or shutil.which("mpirun")
    need(mpirun, "MPICH's mpirun")
    from compute import speedups
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # rank 0's choice, made here first on one thread as rank 0 runs: rank 0 measures again, but the cache keeps
    # the best rates, so its rates are at least these, and a busy moment cannot make it choose otherwise
    alone, _ = speedups.resolve_dtype("auto", "cpu", 32)
    args = [str(a) for a in tiny_run_args(data, tmp_path / "log", "--dtype", "auto", "--max_steps", "2",
                                          "--eval_interval", "0", "--checkpoint_interval", "2")]
    avx2 = ["-env", "ATEN_CPU_CAPABILITY", "avx2", "-env", "ONEDNN_MAX_CPU_ISA", "AVX2",
            "-env", "MKL_ENABLE_INSTRUCTIONS", "AVX2"]
    # MPMD: rank 0 as this CPU is, then (after ':') rank 1 limited to AVX2; run_launched appends rank 1's script
    launcher = (mpirun, "-n", "1", sys.executable, os.path.join(REPO, "train_gpt2.py"), *args, ":", "-n", "1", *avx2,
                sys.executable)
    env = clean_env(MASTER_PORT=free_port(), XDG_CACHE_HOME=tmp_path / "cache")
    proc = run_launched(args, launcher, env)
    assert "distributed: mpich, world size 2" in proc.stdout and "dtype: fp32 (" in proc.stdout
    if alone == "bf16":  # rank 0 alone would have chosen bf16 here
        assert "dtype: fp32 (some ranks' CPUs have no fast bf16)" in proc.stdout
    assert "of this CPU's fp32 matmul rate" in proc.stdout
    printed_digest(proc.stdout, 2)  # (and the ranks ended with the same weights, which the run checks)


def test_resume_two_ranks_equals_uninterrupted_with_ccl_backend(two_ranks, tmp_path):
    """Resume a 2-rank run from its step-3 checkpoint: bit-identical losses and final weights.

    It runs with oneccl_bindings_for_pytorch importable (the test stand-in, gloo underneath),
    so it also covers --backend auto choosing ccl and initialising through it."""
    full_dir, full = two_ranks
    log_dir = tmp_path / "resumed"
    log_dir.mkdir()
    shutil.copy(os.path.join(full_dir, "model_00003.pt"), log_dir)
    proc = run_launched(["--resume", "--log_dir", log_dir], TORCHRUN, clean_env(PYTHONPATH=FAKE_CCL))
    assert "backend ccl" in proc.stdout and "resumed from" in proc.stdout
    full_train, got = read_log(full_dir, "train"), read_log(log_dir, "train")
    assert got == {s: full_train[s] for s in (3, 4, 5)}
    assert read_log(log_dir, "val") == {6: read_log(full_dir, "val")[6]}
    assert checkpoint_val(log_dir, 6) == checkpoint_val(full_dir, 6)
    assert printed_digest(proc.stdout, 2) == printed_digest(full.stdout, 2)


# -----------------------------------------------------------------------------
# Failures: a dead or hung rank must not hold the others; a multi-host job needs MASTER_ADDR


def ranks_by_hand(data, log_dir, world_size, *extra):
    """world_size ranks started by hand with torchrun's variables, training until stopped, outputs in files."""
    outputs = [open(os.path.join(os.path.dirname(log_dir), f"rank{rank}.out"), "w+") for rank in range(world_size)]
    args = tiny_run_args(data, log_dir, *EQUAL, "--max_steps", "100000", "--eval_interval", "0",
                         "--checkpoint_interval", "100000", *extra)
    return list(zip(start_ranks(args, world_size, outputs), outputs))


def wait_for(path_or_file, text, procs, limit=180):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        path_or_file.seek(0)
        if text in path_or_file.read():
            return
        if any(p.poll() is not None for p, _ in procs):
            break
        time.sleep(0.2)
    path_or_file.seek(0)
    raise AssertionError(f"never printed {text!r}:\n{path_or_file.read()}")


@pytest.mark.parametrize("victim,sig", [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP)],
                         ids=["kill-rank1", "kill-rank0", "hang-rank1"])
def test_dead_or_hung_rank_stops_the_other(data, tmp_path, victim, sig):
    """SIGKILL: the survivor's next collective fails at once. SIGSTOP (a hang): the survivor's collective
    times out after --dist_timeout. Either way it exits non-zero, well within 60 s, saying why."""
    procs = ranks_by_hand(data, tmp_path / "log", 2, "--dist_timeout", "10")
    try:
        wait_for(procs[0][1], "step     1 |", procs)
        os.kill(procs[victim][0].pid, sig)
        killed_at = time.monotonic()
        survivor, out = procs[1 - victim]
        rc = survivor.wait(timeout=60)
        elapsed = time.monotonic() - killed_at
        out.seek(0)
        text = out.read()
        assert rc != 0, text
        assert f"error: rank {1 - victim}: a collective with the other ranks failed" in text, text
        print(f"{signal.Signals(sig).name} of rank {victim}: rank {1 - victim} exited {rc} after {elapsed:.1f}s")
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            out.close()


def test_multi_host_job_without_master_addr_fails_at_once(data, tmp_path):
    """Ranks of an mpirun job over 2 hosts (1 rank each) and no MASTER_ADDR: rank 0 says what to export,
    rank 1 exits quietly, neither waits for the other."""
    procs = []
    for rank in range(2):
        env = clean_env(PMI_RANK=rank, PMI_SIZE=2, MPI_LOCALRANKID=0, MPI_LOCALNRANKS=1)
        procs.append(subprocess.Popen([sys.executable, os.path.join(REPO, "train_gpt2.py"),
                                       *map(str, tiny_run_args(data, tmp_path / "log"))],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO))
    (out0, err0), (out1, err1) = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1]
    assert "error: this mpich job spans several hosts but MASTER_ADDR is not set" in err0
    assert "mpirun -genv MASTER_ADDR" in err0
    assert err1.strip() == "" and out1.strip() == ""


# -----------------------------------------------------------------------------
# Three hosts: network namespaces joined by a bridge, one rank in each


# (DDP on 3 ranks: mpirun's test above; over namespace hosts, the long lane)
@pytest.mark.parametrize("shard", [pytest.param("none", marks=pytest.mark.long), "full"])
def test_three_hosts_over_network_namespaces_equal_one_process(data, single, tmp_path, shard):
    """mpirun -n 3 -ppn 1 over three hosts, as MPICH's hydra would start it: each rank in its own
    network namespace, with its own address, seeing one local rank; MASTER_ADDR is rank 0's address
    and gloo talks over the namespaces' bridge (GLOO_SOCKET_IFNAME)."""
    need(can_create_namespaces(), "creating network namespaces (root and iproute2)")
    log_dir = tmp_path / "log"
    with namespace_hosts(3) as (hosts, addresses):
        procs = []
        for rank, ns in enumerate(hosts):
            env = clean_env(PMI_RANK=rank, PMI_SIZE=3, MPI_LOCALRANKID=0, MPI_LOCALNRANKS=1,
                            MASTER_ADDR=addresses[0], MASTER_PORT=29500, GLOO_SOCKET_IFNAME="eth0")
            cmd = ["ip", "netns", "exec", ns, sys.executable, os.path.join(REPO, "train_gpt2.py"),
                   *map(str, tiny_run_args(data, log_dir, *EQUAL, "--dist_timeout", "120", "--shard", shard))]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=env, cwd=REPO))
        outputs = outputs_of(procs)
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, f"{out}\n{err}"
    out0 = outputs[0][0]
    assert f"distributed: mpich, world size 3, backend gloo, master {addresses[0]}:29500" in out0
    assert "1 rank(s) on this node" in out0
    assert all(out.strip() == "" for out, _ in outputs[1:])  # ranks other than 0 are quiet
    worst = assert_same_run(single[0], log_dir)
    print(f"3 namespace hosts (--shard {shard}) vs 1 process: largest train loss difference {worst:.1e}")
    assert final_weights_diff(single[0], log_dir) <= TOL
    printed_digest(out0, 3, parts=shard == "full")


# -----------------------------------------------------------------------------
# Sharded data parallel (--shard full, FSDP2): the same training, each rank holding a part of the state


def two_ranks_with(shard, data, tmp_path_factory):
    """torchrun, 2 ranks, --shard `shard`: (its folder, its CompletedProcess)."""
    log_dir = tmp_path_factory.mktemp(shard) / "log"
    return log_dir, run_launched(tiny_run_args(data, log_dir, *EQUAL, "--shard", shard), TORCHRUN, clean_env())


@pytest.fixture(scope="module")
def two_ranks_sharded(data, tmp_path_factory):
    return two_ranks_with("full", data, tmp_path_factory)


def test_torchrun_two_ranks_sharded_equals_ddp_and_one_process(single, two_ranks, two_ranks_sharded):
    log_dir, proc = two_ranks_sharded
    assert "shard: FSDP2, each rank holds 1/2 of the weights, gradients and AdamW state" in proc.stdout
    assert sorted(os.listdir(log_dir)) == ["args.json", "lock", "log.txt", "model_00003.dcp", "model_00006.dcp",
                                           "report.md", "report.png"]  # (rank 0's report, no other rank's)
    worst = assert_same_run(single[0], log_dir)
    print(f"torchrun x2 sharded vs 1 process: largest train loss difference {worst:.1e}")
    assert final_weights_diff(single[0], log_dir) <= TOL and final_weights_diff(two_ranks[0], log_dir) <= TOL
    printed_digest(proc.stdout, 2, parts=True)  # (each rank's pieces digested: none gathered whole to check them)
    assert re.search(r"peak memory per rank: [\d.]+, [\d.]+ GiB", proc.stdout)


LEAVE_GROUP = """
import os, sys, torch
sys.path.insert(0, sys.argv[1])
from parallel import mesh, world
world.init_process_group("gloo", int(os.environ["RANK"]), 2, 2, "torchrun", 60)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(768, 768))
model(torch.randn(4, 768)).sum().backward()
pipeline_mesh = mesh.mesh_of(2, 2, 1, "cpu")  # a pipeline's mesh, made once a process (a cache keeps it)
torch.distributed.all_reduce(torch.ones(3), group=pipeline_mesh["pp"].get_group())
del model, pipeline_mesh
world.leave_process_group()
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
os.write(1, f"gloo threads left: {sorted(t for t in threads if 'gloo' in t)}\\n".encode())  # one write: a shared pipe
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task")
def test_leaving_the_group_ends_its_threads(tmp_path):
    """After leave_process_group no gloo thread may run: one still running as the process exits can abort it,
    after a run that did everything right ("terminate called without an active exception"). DDP's constructor
    first imports a torch module whose default arguments keep the group, unless it was imported before; the
    cached device mesh keeps its groups. (FSDP's and tensor parallel's DTensors still leave torch's own caches
    holding theirs.)"""
    script = tmp_path / "leave_group.py"
    script.write_text(LEAVE_GROUP)
    proc = run_rank_script(script, 2)
    assert proc.stdout.count("gloo threads left: []") == 2, proc.stdout


class Ended(Exception):
    pass


@pytest.mark.parametrize("threads_left", [True, False])
def test_a_run_that_leaves_gloo_threads_running_ends_without_the_teardown(monkeypatch, threads_left):
    """FSDP's and tensor parallel's groups outlive destroy_process_group in torch's DTensor caches, and their gloo
    threads with them; a --tp 2 run of the tests then aborted as the interpreter exited, after it had saved and
    printed everything. So a run that left its group with gloo threads running ends with os._exit, keeping its exit
    code (0, or a signal's 143); with none left, it ends as usual."""
    from parallel import world
    ended = []

    def exit_now(code):
        ended.append(code)
        raise Ended
    monkeypatch.setattr(world.os, "_exit", exit_now)
    monkeypatch.setattr(world, "left_group", True)
    monkeypatch.setattr(world, "gloo_threads", lambda: ["gloo_tcp_loop"] if threads_left else [])

    def stopped_by_a_signal():
        raise SystemExit(143)
    for main, code in ((lambda: None, 0), (stopped_by_a_signal, 143)):
        with pytest.raises(Ended) if threads_left else contextlib.nullcontext():
            try:
                world.run_main(main)
            except SystemExit as e:
                assert not threads_left and e.code == code
                continue
        assert ended == ([code] if threads_left else []), ended
        ended.clear()


BUILD_SHARDED = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import train_gpt2
from model import GPTConfig, GPT
from parallel import build, sharding, world
torch.distributed.init_process_group("gloo")
ranks = world.Ranks(*world.detect_launch())
config = GPTConfig(block_size=32, vocab_size=300, n_layer=2, n_head=2, n_embd=16)
torch.manual_seed(7)
whole = GPT(config)  # built whole, then sharded: what a DDP run starts from
after_whole = torch.get_rng_state()
sharding.shard_model(whole, ranks, bf16=False)
torch.manual_seed(7)
built = build.build_sharded(lambda: GPT(config), ranks, bf16=False)
assert torch.equal(torch.get_rng_state(), after_whole), "the random generator moved on differently"
assert built.lm_head.weight is built.transformer.wte.weight, "lm_head is no longer tied"
a, b = whole.state_dict(), built.state_dict()
assert list(a) == list(b)
for k in a:
    assert b[k].to_local().numel() < b[k].numel(), k  # each rank holds a piece, not the whole
    assert torch.equal(a[k].full_tensor(), b[k].full_tensor()), k
print(f"same weights {len(a)}")  # one write: the two ranks share this pipe
del whole, built, a, b
world.leave_process_group()
"""


def test_sharded_build_starts_from_a_whole_builds_weights(tmp_path):
    """--shard full builds the model on the meta device and gives each rank only its pieces; they must hold
    bit for bit the weights of the whole model built and then sharded (and leave the random generator where
    that leaves it), or a sharded run would not start where a DDP run does."""
    script = tmp_path / "build_sharded.py"
    script.write_text(BUILD_SHARDED)
    proc = run_rank_script(script, 2)
    assert proc.stdout.count("same weights 29") == 2, proc.stdout


def test_sharded_finetune_from_pretrained_equals_one_process(data, tmp_path):
    """--init_from a Hugging Face folder with --shard full: the model is built sharded and each rank copies
    in just its pieces, one tensor at a time; the fine-tune must equal the same fine-tune on one process (and so
    DDP's: test_torchrun_two_ranks_equal_one_process)."""
    from conftest import save_random_hf_gpt2
    save_random_hf_gpt2(tmp_path / "hf")
    one = run_train(tiny_run_args(data, tmp_path / "one", *EQUAL, "--init_from", tmp_path / "hf"), env=clean_env(),
                    timeout=LIMIT)
    sharded = run_launched(tiny_run_args(data, tmp_path / "sharded", *EQUAL, "--init_from", tmp_path / "hf",
                                         "--shard", "full"), TORCHRUN, clean_env())
    assert "n_embd=64" in one.stdout and "n_embd=64" in sharded.stdout and "shard: FSDP2" in sharded.stdout
    assert_same_run(tmp_path / "one", tmp_path / "sharded")
    assert final_weights_diff(tmp_path / "one", tmp_path / "sharded") <= TOL


def add_a_half_written_save(log_dir):
    """The folder a sharded save leaves when killed half-way (model_00005.dcp.tmp), which must never be used."""
    os.makedirs(log_dir / "model_00005.dcp.tmp")
    (log_dir / "model_00005.dcp.tmp" / "__0_0.distcp").write_bytes(b"half")


def killed_after_step_3(run_dir, tmp_path):
    """A copy of a finished run's folder as a run killed after its step-3 checkpoint leaves it, with a half-written
    sharded save in it too."""
    copy = stopped_after_step_3(run_dir, tmp_path / "log")
    add_a_half_written_save(copy)
    return copy


def parent_pid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state
    except (OSError, ValueError, IndexError):
        return None


def test_sharded_run_killed_with_sigkill_resumes_on_two_ranks_and_on_one(data, single, two_ranks_sharded, tmp_path):
    """A real kill -9 of both ranks of a sharded run once it has trained past its step-3 checkpoint (wherever the kill
    lands: a save may be half-written; one, model_00005.dcp.tmp, is added for certain), resumed on 2 ranks (bitwise)
    and, from a copy, on 1 (the same run as one process's)."""
    log_dir = tmp_path / "two" / "log"
    cmd = [*TORCHRUN, os.path.join(REPO, "train_gpt2.py"),
           *map(str, tiny_run_args(data, log_dir, *EQUAL, "--shard", "full"))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(),
                            cwd=REPO, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step     4"):
                break
    finally:  # torchrun starts each rank in a session of its own: kill the ranks, then the launcher
        ranks = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if parent_pid(pid) == proc.pid]
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(ranks) == 2
    assert os.path.isdir(log_dir / "model_00003.dcp") and not os.path.isdir(log_dir / "model_00006.dcp")
    add_a_half_written_save(log_dir)
    shutil.copytree(log_dir, tmp_path / "one" / "log")
    proc = run_launched(["--resume", "--log_dir", log_dir], TORCHRUN, clean_env())
    assert "resumed from" in proc.stdout and "model_00003.dcp at step 3" in proc.stdout, proc.stdout.splitlines()[:12]
    assert read_log(log_dir, "train") == read_log(two_ranks_sharded[0], "train")  # same ranks: bitwise
    assert printed_digest(proc.stdout, 2, parts=True) == printed_digest(two_ranks_sharded[1].stdout, 2, parts=True)
    proc = run_train(["--resume", "--log_dir", tmp_path / "one" / "log"], env=clean_env(), timeout=LIMIT)
    assert "model_00003.dcp at step 3" in proc.stdout
    assert "--shard full: with one rank there is nothing to split" in proc.stdout
    assert_same_run(single[0], tmp_path / "one" / "log")
    assert final_weights_diff(single[0], tmp_path / "one" / "log") <= TOL


def test_ddp_checkpoint_resumed_sharded(single, two_ranks, tmp_path):
    log_dir = killed_after_step_3(two_ranks[0], tmp_path)
    proc = run_launched(["--resume", "--log_dir", log_dir, "--shard", "full"], TORCHRUN, clean_env())
    assert "model_00003.pt at step 3" in proc.stdout and "shard: FSDP2" in proc.stdout
    assert_same_run(single[0], log_dir)
    assert os.path.isdir(log_dir / "model_00006.dcp")  # from here on, sharded checkpoints
    assert final_weights_diff(two_ranks[0], log_dir) <= TOL


def test_shard_errors_are_one_line(data, two_ranks_sharded, tmp_path):
    proc = run_train(tiny_run_args(data, tmp_path / "log", "--shard", "half"), check=False)
    assert proc.returncode == 2 and "error: argument --shard: invalid choice: 'half'" in proc.stderr.splitlines()[-1]
    half = tmp_path / "model_00009.dcp"  # a sharded folder without its meta.pt: not a checkpoint
    shutil.copytree(two_ranks_sharded[0] / "model_00003.dcp", half)
    os.remove(half / "meta.pt")
    proc = subprocess.run([sys.executable, "sample.py", "--ckpt_path", str(half)], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error:"), proc.stderr
    assert "Traceback" not in proc.stderr


# -----------------------------------------------------------------------------
# --shard grads (ZeRO-2): gradients and AdamW state sharded, the weights gathered once an optimizer step


@pytest.fixture(scope="module")
def two_ranks_grads(data, tmp_path_factory):
    return two_ranks_with("grads", data, tmp_path_factory)


def test_shard_grads_equals_one_process_and_resumes(single, two_ranks_grads, tmp_path):
    log_dir, proc = two_ranks_grads
    assert ("the gradients accumulate whole until its last micro-step and are then reduce-scattered (ZeRO-2)"
            in proc.stdout)
    worst = assert_same_run(single[0], log_dir)
    print(f"torchrun x2 --shard grads vs 1 process: largest train loss difference {worst:.1e}")
    assert final_weights_diff(single[0], log_dir) <= TOL
    resumed = killed_after_step_3(log_dir, tmp_path)
    proc = run_launched(["--resume", "--log_dir", resumed], TORCHRUN, clean_env())
    assert "model_00003.dcp at step 3" in proc.stdout
    assert read_log(resumed, "train") == read_log(log_dir, "train")  # same ranks, same layout: bitwise


COUNT_GATHERS = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import train_gpt2
from parallel import world
calls = [0]
gather = torch.distributed.all_gather_single
def counted(*a, **k):
    calls[0] += 1
    return gather(*a, **k)
torch.distributed.all_gather_single = counted  # FSDP2's all-gather of a unit's weights
step = train_gpt2.train_step
def counted_step(run, n):
    before = calls[0]
    out = step(run, n)
    run.ranks.print0(f"all-gathers in step {n}: {calls[0] - before}")
    return out
train_gpt2.train_step = counted_step
sys.argv[1:] = sys.argv[2:]  # (main reads its flags there)
world.run_main(train_gpt2.main)  # as train_gpt2.py ends: FSDP's gloo threads outlive the group (parallel/world.py)
"""


def test_shard_grads_gathers_the_weights_once_a_step(data, tmp_path):
    """--shard grads all-gathers each FSDP unit (2 blocks and the root) at most once per optimizer step, however many
    micro-steps (3 here); --shard full gathers them again for every micro-step's forward and backward."""
    script = tmp_path / "count.py"
    script.write_text(COUNT_GATHERS)
    counts = {}
    for shard in ("grads", "full"):
        args = tiny_run_args(data, tmp_path / shard, *EQUAL, "--shard", shard, "--max_steps", "2")
        proc = subprocess.run([*TORCHRUN, str(script), REPO, *map(str, args)], capture_output=True, text=True,
                              env=clean_env(), timeout=LIMIT)
        assert proc.returncode == 0, proc.stderr
        counts[shard] = [int(n) for n in re.findall(r"all-gathers in step \d+: (\d+)", proc.stdout)]
    assert len(counts["grads"]) == 2 and max(counts["grads"]) <= 3, counts
    assert min(counts["full"]) >= 3 * 3, counts
