"""bench/bench_parallel.py over real, rate-limited links: 2 ranks in network namespaces, a tiny model, two layouts
(FSDP's --shard full and a 2-stage pipeline). What each rank's link counted a step must be what the trainer's plan
line computed, within 10% (the packets' headers and the small collectives, the stop check's and the loss's, are the
difference; the acceptance of issue 34 asks 10% at GPT-2's size too). Nothing timed. Needs root and iproute2."""
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, can_create_namespaces, clean_env, need

pytestmark = pytest.mark.xdist_group("multiprocess-2")

FACTOR = 1.10  # measured / computed, either way


def test_measured_bytes_are_the_computed_ones():
    need(can_create_namespaces(tc=True), "making network namespaces for bench_parallel.py (root and iproute2: ip, tc)")
    bench = subprocess.Popen([sys.executable, "bench/bench_parallel.py", "--ranks", "2", "--layouts", "full,pp2",
                              "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", "32", "--tokens", "256",
                              "--steps", "1", "--rates", "1gbit"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=clean_env())
    out, err = bench.communicate(timeout=600)
    proc = subprocess.CompletedProcess(bench.args, bench.returncode, out, err)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {m.group(1): m.group(2)
            for m in re.finditer(r"^\s+(full|pp2) \|[^|]+\|[^|]+\| ([^|]+)\|", proc.stdout, re.M)}
    assert sorted(rows) == ["full", "pp2"], proc.stdout
    for name, cells in rows.items():
        pairs = [(float(a), float(b)) for a, b in re.findall(r"([\d.]+) \(([\d.]+)\)", cells)]
        assert len(pairs) == 2, (name, cells)
        for measured, computed in pairs:
            assert measured > 0 and computed > 0, (name, cells)
            assert 1 / FACTOR <= measured / computed <= FACTOR, (
                f"{name}: measured {measured} MB, computed {computed} MB")
    # FSDP gathers every weight twice a micro-step (4 of them): far more than the pipeline's activations
    assert float(rows["full"].split()[0]) > 4 * float(rows["pp2"].split()[0])
    # cleaned up: no namespace of its own left (its names start with gpt2pb and its pid; another run's may come and go)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not re.search(rf"^gpt2pb{bench.pid % 100000}(hub|r\d+)\b", left, re.M), left


@pytest.mark.long  # (the main lane: nodes_of and the crowding from hostnames and boot ids, test_layouts.py)
def test_ranks_sharing_a_hostname_are_a_node_to_parallel_auto():
    """4 ranks, 2 hostnames (--ranks_per_node 2: each rank its own namespace and UTS namespace): --parallel auto finds
    2 nodes of 2, times the link across them (a rank of each node with a rank of the other, both pairs at once), and
    offers tensor parallel over 2 ranks (a node's) but not over 4 (across the network)."""
    need(can_create_namespaces(tc=True), "making network namespaces for bench_parallel.py (root and iproute2: ip, tc)")
    proc = subprocess.run([sys.executable, "bench/bench_parallel.py", "--ranks", "4", "--ranks_per_node", "2",
                           "--layouts", "grads", "--n_layer", "2", "--n_head", "4", "--n_embd", "32", "--seq_len", "32",
                           "--tokens", "256", "--steps", "1", "--rates", "1gbit", "--auto", "0.38"], cwd=REPO,
                          capture_output=True, text=True, env=clean_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = re.search(r"parallel: .*\(predicted; link \d+ MB/s, \d+ us across nodes; a block .*; 2 nodes x 2 ranks"
                     # (the 4 ranks share this machine's cores, whatever their hostnames)
                     r"(, [\d.]+ threads a core)?\)",
                     proc.stdout)
    every = re.search(r"parallel: every layout's predicted step: (.*)", proc.stdout)
    assert line and every, proc.stdout
    print(line.group(0), every.group(0), sep="\n")
    # (--auto 0.38 GiB: 90% of it holds every layout but DDP, each with the process's 0.3 GiB: sizes.beyond_state)
    assert "tp 2 " in every.group(1) and "tp 4" not in every.group(1), every.group(1)


def test_without_root_it_says_so_and_exits_0(tmp_path):
    """As a user without root: one line, exit 0, nothing created."""
    if os.geteuid() != 0:
        env = clean_env()
    else:  # root: pretend not to be, through the one call the script asks
        shim = tmp_path / "sitecustomize.py"
        shim.write_text("import os\nos.geteuid = lambda: 1000\n")
        env = clean_env(PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "bench/bench_parallel.py"], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and "needs root" in proc.stdout, proc.stdout + proc.stderr
