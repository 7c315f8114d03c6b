"""A disk per node (parallel/node_disks.py): three cloud VMs, each with its own disk, as Intel's module runs them. Here
a node's disk is a folder mounted over --log_dir for its ranks alone (a private mount: on_own_disk), and a node of its
own a network namespace.

  - which ranks share a folder, and files sent to the disks that lack them, byte for byte (no training)
  - DDP (.pt): each node writes the checkpoint on its own disk; a node that lost it is sent it on --resume
  - a node lost: torchrun's elastic rendezvous restarts the survivors on the world that remains, which resume from the
    newest checkpoint their disks hold between them (the lost node's disk gone with it) and finish

The .dcp layouts (FSDP, pipeline, tensor parallel) on a disk per node, resumed under each layout: tests/test_parts.py.
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from plumbing import checkpoints
from conftest import (LIMIT, REPO, assert_same_run, can_create_namespaces, can_mount_privately, clean_env,
                      namespace_hosts, need, on_own_disk, outputs_of, run_ranks, tiny_run_args)

pytestmark = pytest.mark.xdist_group("multiprocess")

TOL = 1e-5
EQUAL = ["--batch_size", "2", "--total_batch_size", "384"]  # 6, 3 or 2 micro-steps on 1, 2 or 3 ranks
REFERENCE = EQUAL  # (conftest's single: one process's run)


# -----------------------------------------------------------------------------
# Who shares a folder, and files sent where they are missing

SEND = r'''
import hashlib, json, os, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from parallel import node_disks, world
dist.init_process_group("gloo")
ranks = world.Ranks(*world.detect_launch())
log = sys.argv[2]
ranks.disks, line = node_disks.find(log, ranks)
node_disks.CHUNK = 1000  # several messages a file, and several files a message
contents = {"a": b"", "b": bytes(range(256)) * 10, "c": b"0123456789", "d": b""}
mine = "ab" if ranks.rank == 0 else "cd" if ranks.rank == 2 else ""  # rank 1 shares rank 0's disk
for name in mine:
    os.makedirs(os.path.join(log, "sub"), exist_ok=True)
    with open(os.path.join(log, "sub", name), "wb") as f:
        f.write(contents[name])
dist.barrier()
sent = node_disks.send_missing([os.path.join(log, "sub", n) for n in "abcd"], ranks, "testing")
same = all(open(os.path.join(log, "sub", n), "rb").read() == contents[n] for n in "abcd")
leftover = [f for f in os.listdir(log) if f.startswith(".rank")] + [f for f in os.listdir(os.path.join(log, "sub"))
                                                                    if f.endswith(".tmp")]
result = {"rank": ranks.rank, "disks": ranks.disks, "keeper": ranks.keeper, "line": line, "sent": sent, "same": same,
          "leftover": leftover}
sys.stdout.flush()
os.write(1, (json.dumps(result) + "\n").encode())  # (one write: the ranks may share a pipe)
dist.destroy_process_group()
'''


def test_ranks_find_who_shares_a_folder_and_send_each_disk_what_it_lacks(tmp_path):
    """3 ranks: 0 and 1 on one node's disk, 2 on another's. Each disk is sent the files the other holds (an empty one,
    one of several messages), written whole; nothing of the check or the sending is left behind."""
    need(can_mount_privately(), "a private mount for each rank (root, unshare)")
    script = tmp_path / "send.py"
    script.write_text(SEND)
    log, port = tmp_path / "log", str(20000 + os.getpid() % 20000)
    procs = []
    for rank, disk in enumerate(["a", "a", "b"]):
        env = clean_env(RANK=rank, WORLD_SIZE=3, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=3, MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port)
        cmd = on_own_disk([sys.executable, script, REPO, log], tmp_path / disk, log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = outputs_of(procs)
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    results = [json.loads(out.splitlines()[-1]) for out, _ in outputs]
    assert [r["disks"] for r in results] == [[[0, 1], [2]]] * 3
    assert [r["keeper"] for r in results] == [True, False, True]
    assert results[0]["line"] == f"log_dir: {log} is 2 separate folders, a disk per node (ranks 0,1 | 2): each keeps " \
                                 "its own checkpoints, with a copy of the next node's .dcp pieces"
    assert all(r["same"] and r["sent"] == 2560 + 10 and r["leftover"] == [] for r in results), results
    assert "checkpoint: testing: sending 4 file(s), 0.0 MB, to the disks that lack them" in outputs[0][0]


def test_one_shared_folder_is_one_disk(tmp_path):
    """The same 3 ranks on one folder: one disk, kept by rank 0; nothing to send."""
    script = tmp_path / "send.py"
    script.write_text(SEND.replace('mine = "ab" if ranks.rank == 0 else "cd" if ranks.rank == 2 else ""',
                                   'mine = "abcd" if ranks.rank == 0 else ""'))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", script,
                           REPO, tmp_path / "log"], capture_output=True, text=True, env=clean_env(), timeout=LIMIT)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    assert all(r["disks"] == [[0, 1, 2]] and r["sent"] == 0 and r["same"] for r in results), results
    assert {r["keeper"] for r in results if r["rank"] > 0} == {False}
    assert [r["line"] for r in results if r["rank"] == 0] == [f"log_dir: {tmp_path / 'log'} is one folder shared by "
                                                              "all 3 ranks"]


# -----------------------------------------------------------------------------
# DDP: the whole state on every rank, so each node's first rank writes the checkpoint on its disk


def test_ddp_keeps_the_checkpoint_on_every_node_and_resumes_where_one_lost_it(data, single, tmp_path):
    """2 nodes, a disk each: both disks get model_00003.pt and model_00006.pt, the same checkpoint (rank 0's data
    position and RNG, the same weights and AdamW state); log.txt and the report on rank 0's alone. A restart where node
    1's disk lost its checkpoints (a new VM) sends it the newest, and both continue the run as one process would."""
    need(can_mount_privately(), "a private mount for each rank (root, unshare)")
    disks, log = [tmp_path / "node0", tmp_path / "node1"], tmp_path / "log"
    proc = run_ranks(tiny_run_args(data, log, *EQUAL), 2, disks=disks)
    assert f"log_dir: {log} is 2 separate folders, a disk per node (ranks 0 | 1)" in proc.stdout
    for step in (3, 6):
        a, b = (checkpoints.load_checkpoint(str(d / f"model_0000{step}.pt")) for d in disks)
        assert a["loader"] == b["loader"] and a["step"] == b["step"] == step
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert all(torch.equal(x, y) for k in a["optimizer"]["state"] for x, y in
                   zip(a["optimizer"]["state"][k].values(), b["optimizer"]["state"][k].values()))
    rank_0s = {"log.txt", "report.png"}
    assert rank_0s <= set(os.listdir(disks[0])) and not rank_0s & set(os.listdir(disks[1]))
    assert_same_run(single[0], disks[0])
    for f in [*glob.glob(str(tmp_path / "node*" / "model_00006.pt")), disks[1] / "model_00003.pt"]:
        os.remove(f)
    proc = run_ranks(["--resume", "--log_dir", log, "--dist_timeout", 60], 2, disks=disks)
    assert "checkpoint: resuming from model_00003.pt: sending 1 file(s)" in proc.stdout
    assert f"resumed from {log}/model_00003.pt at step 3" in proc.stdout
    assert_same_run(single[0], disks[0])
    assert all(os.path.exists(d / "model_00006.pt") for d in disks)
    assert not glob.glob(str(tmp_path / "node*" / "*.tmp"))


# -----------------------------------------------------------------------------
# A node lost: torchrun's elastic rendezvous, three hosts in network namespaces

ELASTIC = ["--max_steps", "9", "--eval_interval", "3", "--checkpoint_interval", "3", "--dist_timeout", "60"]


def elastic_hosts(hosts, addresses, args, folder, disks):
    """torchrun on each host, one rank a host, a c10d rendezvous on host 0 that admits 2 or 3 hosts and restarts the
    workers up to 3 times; each host's --log_dir its own disk (disks) or one shared folder."""
    procs = []
    for i, ns in enumerate(hosts):
        conf = f"last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,is_host={int(i == 0)}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc_per_node", "1",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{addresses[0]}:29400", "--rdzv_id", "lost",
               "--rdzv_conf", conf, "--max-restarts", "3", "--local-addr", addresses[i],
               os.path.join(REPO, "train_gpt2.py"), *map(str, args)]
        if disks:
            cmd = on_own_disk(cmd, folder / f"node{i}", args[args.index("--log_dir") + 1])
        out = open(folder / f"host{i}.out", "w+")
        # each round its own store (torch 2.13 keeps one across rounds, and a restarted rank may read the last
        # round's addresses from it: docs/distributed.md)
        env = clean_env(GLOO_SOCKET_IFNAME="eth0", TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
        procs.append((subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=out, stderr=subprocess.STDOUT,
                                       env=env, cwd=REPO), out))
    return procs


def lose_a_node(data, tmp_path, layout, disks, rate=None):
    """3 hosts train under torchrun elastic; once host 2 has written its second checkpoint (model_00006), it is lost:
    every process of it killed at once (and its disk with it, where it has one). Returns the output of the survivors'
    rank 0 (host 0 or 1: the restart may number them anew)."""
    need(can_create_namespaces(), "network namespaces (root, iproute2)")
    need(can_mount_privately() or not disks, "a private mount for each host (root, unshare)")
    args = tiny_run_args(data, tmp_path / "log", *EQUAL, *ELASTIC, "--resume", *layout)
    with namespace_hosts(3, rate) as (hosts, addresses):
        procs = elastic_hosts(hosts, addresses, args, tmp_path, disks)
        lost = tmp_path / ("node2" if disks else "log") / "model_00006"
        try:
            deadline = time.monotonic() + LIMIT
            while not (os.path.exists(f"{lost}.pt") or os.path.exists(f"{lost}.dcp")) and time.monotonic() < deadline:
                time.sleep(0.05)
            for pid in subprocess.run(["ip", "netns", "pids", hosts[2]], capture_output=True, text=True).stdout.split():
                os.kill(int(pid), signal.SIGKILL)
            if disks:
                shutil.rmtree(tmp_path / "node2")
            codes = [p.wait(timeout=LIMIT) for p, _ in procs[:2]]
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    outputs = []
    for _, out in procs:
        out.seek(0)
        outputs.append(out.read())
        out.close()
    assert codes == [0, 0], "\n".join(outputs)
    return next(o for o in outputs[:2] if "parameter sha256 (all 2 rank(s)" in o), "\n".join(outputs)


def losses_after_the_restart(output):
    """(the checkpoint the survivors resumed from, {step: loss} of the steps they trained from it), from rank 0's
    lines."""
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", output)
    assert resumed and int(resumed[-1][1]) >= 6, output
    after = output[output.rindex("resumed from"):]
    return resumed[-1][0], {int(s): float(l) for s, l in re.findall(r"^step +(\d+) \| loss ([\d.]+)", after, re.M)}


def resumed_on_two(tmp_path, checkpoint, layout, disks, ref):
    """The reference: 2 ranks (by hand) resumed from that checkpoint, on copies of the survivors' folders as they were
    then (what came later removed). Returns {step: loss}."""
    step = checkpoints.checkpoint_step(checkpoint)
    for source in ([tmp_path / "node0", tmp_path / "node1"] if disks else [tmp_path / "log"]):
        shutil.copytree(source, ref / source.name, ignore=shutil.ignore_patterns("*.tmp", "lock", "log.txt"))
        for f in checkpoints.list_checkpoints(str(ref / source.name)):
            if checkpoints.checkpoint_step(f) > step:
                shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)
    proc = run_ranks(["--resume", ref / "log" / os.path.basename(checkpoint), "--log_dir", ref / "log",
                      "--dist_timeout", 60, *layout], 2, disks=[ref / "node0", ref / "node1"] if disks else None)
    return losses_after_the_restart(proc.stdout)[1]


# --parallel auto on 3 hosts of 1 Gbit/s, a model whose DDP does not fit in --max_memory: the pipeline is predicted
# fastest (its one big message a step is the tied weight's gradient; FSDP and ZeRO-2 gather every weight)
AUTO = ["--n_layer", "6", "--n_embd", "256", "--n_head", "4", "--max_memory", "0.78"]


# The main lane loses a node under FSDP with a disk per node (the .dcp's pieces of the lost node read from the copy
# its neighbour kept); the long lane also under DDP on one shared folder, and under --parallel auto (~3 minutes of both
# cores: it measures its candidates on 3 hosts, then on the 2 left)
@pytest.mark.parametrize("layout,disks,rate",
                         [pytest.param([], False, None, marks=pytest.mark.long), (["--shard", "full"], True, None),
                          pytest.param(AUTO, True, "1gbit", marks=pytest.mark.long)],
                         ids=["ddp-shared-folder", "fsdp-disk-per-node", "auto-pp3-disk-per-node"])
def test_a_node_lost_the_survivors_resume_and_finish(data, tmp_path_factory, layout, disks, rate):
    """Host 2 lost after its second checkpoint: the survivors restart on 2 hosts, resume from the newest checkpoint
    whole on their disks (or in the shared folder), re-plan the layout where --parallel auto chose it, and end with
    rc 0; from there their losses are those of 2 ranks resumed from that checkpoint."""
    tmp_path = tmp_path_factory.mktemp("elastic")
    rank0, everything = lose_a_node(data, tmp_path, layout, disks, rate)
    assert ("a disk per node (ranks 0 | 1 | 2)" in everything) == disks and "world size 2" in rank0
    if layout == AUTO:  # chosen on 3 hosts, then again on the 2 left
        assert re.search(r"^parallel: pipeline of 3 stages", everything, re.M), everything
        assert len(re.findall(r"^parallel: every layout's predicted step", rank0, re.M)) >= 1
    checkpoint, got = losses_after_the_restart(rank0)
    want = resumed_on_two(tmp_path, checkpoint, layout, disks, tmp_path_factory.mktemp("ref"))
    assert sorted(got) == sorted(want) == list(range(checkpoints.checkpoint_step(checkpoint), 9))
    assert max(abs(got[s] - want[s]) for s in got) <= TOL, (got, want)
