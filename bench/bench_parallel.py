"""
What does each parallel layout send over the links, and what does it cost in step time?

    sudo python bench/bench_parallel.py                                   # 3 ranks, 1 Gbit/s, GPT-2 (124M)'s shape
    sudo python bench/bench_parallel.py --rates 1gbit,200mbit --layouts full,pp3
    sudo python bench/bench_parallel.py --ranks 4 --n_layer 4 --n_embd 64 --n_head 2   # a tiny model, dp2xpp2 too

Each rank is a host of its own: a network namespace with one veth link into a bridge (in a hub namespace of its
own), its address only inside the namespaces this script creates, the link rate-limited with tc's token bucket
(tbf), as a cluster of CPU nodes on ordinary Ethernet would be, with a hostname of its own (a UTS namespace;
--ranks_per_node K: K consecutive ranks share one, a node to --parallel auto). Every rank runs train_gpt2.py,
launched with torchrun's variables (MASTER_ADDR = rank 0's address), on random tokens, without evaluation or
checkpoints.

Bytes sent: each rank's link counter (the hub's port: what arrives there is what the rank sent), read when rank 0
prints its first measured step and again when it prints its last: rank 0 prints a step before the all-reduce that
ends it (the stop check), so at that moment every rank has finished the step's traffic and none has begun the
next one's; the difference over the steps between excludes the start (rendezvous, weights broadcast) and the end
(the weights' check). Beside each rank's bytes: the trainer's own computed figure, from the plan it prints.
Step time: the median of the measured steps' dt (the first step warms up). Peak memory: the trainer's last line.

Needs root (namespaces, links, tc): without it, it says so and exits 0. It removes what it created on exit
(also on Ctrl-C), and touches no other interface. All ranks share this machine's cores: with more ranks than
cores, the step times compare layouts on one machine, they are not a cluster's.
"""
import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = f"gpt2pb{os.getpid() % 100000}"  # every name this run creates starts with it: only those are removed

# -----------------------------------------------------------------------------
# The layouts: data, a name and the trainer's flags for n ranks. Another layout (--tp, a --parallel auto check) is
# one more entry, and its computed bytes one more plan line the trainer prints (see computed_bytes).

def layouts(n, n_head=12):
    """{name: trainer flags} for n ranks: DDP, FSDP (ZeRO-3, ZeRO-2), a pipeline of n stages, dp x pp for every other
    split of n (and its stages sharded, ZeRO-2 within each), tensor parallel over n ranks (where n divides the heads),
    and 2 stages of 2 tensor-parallel ranks."""
    out = {"ddp": ["--shard", "none"], "full": ["--shard", "full"], "grads": ["--shard", "grads"],
           f"pp{n}": ["--pp", n]}
    for pp in range(2, n):
        if n % pp == 0:
            out[f"dp{n // pp}xpp{pp}"] = ["--pp", pp]
            out[f"dp{n // pp}xpp{pp}grads"] = ["--pp", pp, "--shard", "grads"]
            out[f"dp{n // pp}xpp{pp}full"] = ["--pp", pp, "--shard", "full"]
    if n_head % n == 0:
        out[f"tp{n}"] = ["--tp", n]
    if n % 4 == 0 and n_head % 2 == 0:  # tensor parallel inside pairs of ranks, a pipeline across them
        out["pp2xtp2" if n == 4 else f"dp{n // 4}xpp2xtp2"] = ["--pp", 2, "--tp", 2]
    return out

def bench_name(short, n):
    """This benchmark's name for a layout as --parallel auto's line names it (dp, fsdp, fsdp_grads, 'pp N', 'tp N',
    'pp N tp T', 'pp N grads')."""
    words = short.split()
    if words[0] not in ("pp", "tp"):
        return {"dp": "ddp", "fsdp": "full", "fsdp_grads": "grads"}[words[0]]
    degrees = dict(zip(words[0:4:2], map(int, words[1:4:2])))
    ranks = math.prod(degrees.values())
    name = "x".join(f"{kind}{d}" for kind, d in degrees.items())
    return ("" if ranks == n else f"dp{n // ranks}x") + name + "".join(w for w in words if w in ("grads", "full"))

def auto_choice(stdout, n):
    """(the layout --parallel auto chose, {layout that fits: its predicted seconds a step}) from the trainer's
    'parallel: every layout's predicted step: ...' line."""
    every = re.search(r"^parallel: every layout's predicted step: (.*)$", stdout, re.M)
    found = re.findall(r"([a-z_]+(?: \d+)?(?: tp \d+)?(?: grads| full)?) ([\d.]+) s(?: \((chosen|does not fit)\))?",
                       every.group(1)) if every else []
    return (next((bench_name(name, n) for name, _, note in found if note == "chosen"), None),
            {bench_name(name, n): float(seconds) for name, seconds, note in found if note != "does not fit"})

def computed_bytes(stdout, n):
    """Each rank's bytes a step as the trainer computed them, from its plan lines: 'data parallel: ... each rank sends
    X MB a step' (every rank alike), or a pipeline's 'stage s: ... each of its ranks sends X MB a step' (rank r is
    stage (r // tp) % pp, as mesh.mesh_of lays them out). None for a rank the plan does not give."""
    if m := re.search(r"^data parallel: .*each rank sends ([\d.]+) MB a step", stdout, re.M):
        return [float(m.group(1)) * 1e6] * n
    if m := re.search(r"^  each rank: .*sends ([\d.]+) MB a step", stdout, re.M):  # tensor parallel's plan
        return [float(m.group(1)) * 1e6] * n
    stages = {int(s): float(x) * 1e6
              for s, x in re.findall(r"^  stage (\d+): .*each of its ranks sends ([\d.]+) MB", stdout, re.M)}
    if m := re.search(r"^pipeline: (\d+) stages", stdout, re.M):
        split = re.search(r"^pipeline: .*each stage's blocks split over (\d+) tensor-parallel ranks", stdout, re.M)
        return [stages.get(r // int(split.group(1) if split else 1) % int(m.group(1))) for r in range(n)]
    return [None] * n

# -----------------------------------------------------------------------------
# The network: a hub namespace with a bridge, one namespace per rank, a veth pair between them

def ip(*args):
    proc = subprocess.run(["ip", *map(str, args)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"error: ip {' '.join(map(str, args))}: {proc.stderr.strip()}")
    return proc.stdout

class Network:
    """n hosts on one switch, each link limited to `rate` (tc's syntax: 1gbit, 100mbit) in both directions."""

    def __init__(self, n):
        self.hub, self.hosts = f"{PREFIX}hub", [f"{PREFIX}r{i}" for i in range(n)]
        self.addresses, self.created = [f"10.213.0.{i + 1}" for i in range(n)], []

    def __enter__(self):
        for ns in (self.hub, *self.hosts):
            ip("netns", "add", ns)
            self.created.append(ns)
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            ip("-n", self.hub, "link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", self.hub, "link", "set", f"port{i}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc):
        for ns in reversed(self.created):  # a namespace's deletion deletes its ends of the veth pairs, and the bridge
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created = []

    def limit(self, rate):
        """Each link limited to rate, both ways: the rank's end (what it sends) and the hub's port (what it receives).
        tbf: a burst of 10 ms at the rate, and a queue of 200 ms, deep enough that TCP's bursts are not dropped
        (a drop would be sent again and counted twice)."""
        bits = parse_rate(rate)
        burst = max(bits // 8 // 100, 32 * 1024)
        for ns, dev in [(h, "eth0") for h in self.hosts] + [(self.hub, f"port{i}") for i in range(len(self.hosts))]:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                            "burst", str(burst), "latency", "200ms"], check=True, capture_output=True)

    def sent(self):
        """Bytes each rank has sent: its hub port's received bytes (one `ip` call reads all of them at once)."""
        links = json.loads(ip("-n", self.hub, "-s", "-j", "link", "show"))
        by_name = {link["ifname"]: link["stats64"]["rx"]["bytes"] for link in links}
        return [by_name[f"port{i}"] for i in range(len(self.hosts))]

def parse_rate(rate):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise SystemExit(f"error: --rates {rate!r}: expected tc's form, e.g. 1gbit, 100mbit")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])

# -----------------------------------------------------------------------------
# One layout's run

def run_layout(net, flags, args, data_dir, log_dir, port):
    """Train args.steps + 1 steps with flags on every rank; returns {'sent': bytes per step per rank, 'computed',
    'dt': the median step time, 'peaks': GiB per rank, 'link_s'} or {'error': ...}."""
    import common
    n = len(net.hosts)
    compiled = flags[-1:] == ["compiled"]  # (--compile ab's second run of a layout)
    flags = flags[:-1] if compiled else flags
    cmd = [sys.executable, os.path.join(REPO, "train_gpt2.py"), "--data_dir", data_dir, "--log_dir", log_dir,
           "--n_layer", args.n_layer, "--n_head", args.n_head, "--n_embd", args.n_embd,
           "--block_size", max(args.seq_len, 1024), "--batch_size", 1, "--seq_len", args.seq_len,
           "--total_batch_size", args.tokens, "--max_steps", args.steps + 1,
           "--warmup_steps", 1, "--eval_interval", 0, "--sample_interval", 0, "--hellaswag_interval", 0,
           "--checkpoint_interval", 0, "--dtype", args.dtype, "--threads", args.threads, "--dist_timeout", 1800,
           *([] if compiled or args.compile == "on" else ["--no-compile"]), *flags]
    procs, per_node = [], args.ranks_per_node
    try:
        for rank, ns in enumerate(net.hosts):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank % per_node),
                       LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR=net.addresses[0], MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(args.threads))
            # a node's hostname (a UTS namespace of the rank's own): consecutive ranks on one node, as launchers do
            named = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', f"{PREFIX}node{rank // per_node}"]
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *named, *map(str, cmd)], cwd=REPO, env=env,
                                          text=True,
                                          stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, preexec_fn=common.die_with_parent(signal.SIGTERM)))
        lines, marks = [], {}
        for line in procs[0].stdout:  # rank 0 prints each step before the all-reduce that ends it (see the docstring)
            if m := re.match(r"step\s+(\d+) \|", line):
                marks[int(m.group(1))] = net.sent()
                print(f"    {line.rstrip()}", flush=True)
            elif line.startswith("parallel:"):  # --parallel auto's lines: what it measured and predicted
                print(f"    {line.rstrip()}", flush=True)
            lines.append(line)
        codes = [p.wait() for p in procs]
        errors = [p.stderr.read() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()
    stdout = "".join(lines)
    if any(codes):
        rank = next(r for r, c in enumerate(codes) if c)
        return {"error": f"rank {rank} exited {codes[rank]}: " + " / ".join(errors[rank].strip().splitlines()[-3:])}
    first, last = 0, args.steps
    sent = [(b - a) / (last - first) for a, b in zip(marks[first], marks[last])]
    dts = [float(x) / 1000 for x in re.findall(r"\| dt (\d+)ms", stdout)][1:]
    peaks = [float(x) for x in re.search(r"peak memory per rank: (.*) GiB", stdout).group(1).split(", ")]
    chosen, predicted = auto_choice(stdout, n)
    return {"sent": sent, "computed": computed_bytes(stdout, n), "dt": statistics.median(dts), "peaks": peaks,
            "chosen": chosen, "predicted": predicted}

def report(name, r, rate):
    if "error" in r:
        return f"{name:>9} | failed: {r['error']}"
    busiest = max(range(len(r["sent"])), key=lambda i: r["sent"][i])
    def mb(x):
        return "?" if x is None else f"{x / 1e6:.1f}"
    per_rank = ", ".join(f"{mb(s)} ({mb(c)})" for s, c in zip(r["sent"], r["computed"]))
    ratio = "?" if r["computed"][busiest] is None else f"{r['sent'][busiest] / r['computed'][busiest]:.3f}"
    link = r["sent"][busiest] * 8 / parse_rate(rate)
    return (f"{name:>9} | {mb(r['sent'][busiest]):>8} | {ratio:>6} | {per_rank:<48} | {r['dt']:7.1f} | "
            f"{link:6.1f} | {', '.join(f'{p:.2f}' for p in r['peaks'])}")

def auto_report(rate, results, max_memory):
    """--parallel auto's check at one link rate: its prediction for every layout that fits beside the measured step,
    and whether its choice was the measured fastest of those (or within 10% of it)."""
    measured = {name: r["dt"] for r_rate, name, r in results if r_rate == rate and "dt" in r and name != "auto"}
    auto = next((r for r_rate, name, r in results if r_rate == rate and name == "auto"), None)
    if auto is None or "error" in auto or not auto["predicted"]:
        return f"--parallel auto at {rate}: " + (auto or {}).get("error", "no prediction printed (the model fits: DDP)")
    if "dt" in auto and auto["chosen"]:  # its own run measures the layout it chose, where --layouts left that out
        measured.setdefault(auto["chosen"], auto["dt"])
    lines = [f"--parallel auto at {rate}, --max_memory {max_memory} GiB: seconds a step, predicted and measured"]
    for name, seconds in auto["predicted"].items():
        m = measured.get(name)
        lines.append(f"{name:>9} | predicted {seconds:7.2f} | "
                     + (f"measured {m:7.2f} | {seconds / m:5.2f}x" if m else "not run"))
    fits = [name for name in auto["predicted"] if name in measured]
    fastest, chosen = min(fits, key=measured.get), auto["chosen"]
    close = sum(abs(auto["predicted"][name] / measured[name] - 1) <= 0.25 for name in fits)
    lines.append(f"auto chose {chosen} ({measured.get(chosen, float('nan')):.2f} s measured); the measured "
                 f"fastest that fits: {fastest} ({measured[fastest]:.2f} s): "
                 f"{measured.get(chosen, math.inf) / measured[fastest]:.2f}x its time; predictions within 25% of the "
                 f"measured: {close} of {len(fits)}")
    return "\n".join(lines)

def simulate(args):
    """--simulate: the planner's choice (parallel/layouts.py's own plan, predict and choose) for models and clusters
    this machine cannot hold, on paper: GPT-2 XL and a model twice its size on 4 to 64 nodes of --node_gib, one rank a
    node, at 1, 10 and 25 Gbit/s; a block's time from --tflops (a node's sustained matmul rate) instead of timed."""
    import common  # noqa: F401
    from parallel import layouts as L
    from model import GPTConfig
    models = {"GPT-2 XL (1.56B)": GPTConfig(block_size=1024, vocab_size=50304, n_layer=48, n_head=25, n_embd=1600),
              "2x XL (3.2B)": GPTConfig(block_size=1024, vocab_size=50304, n_layer=48, n_head=36, n_embd=2304)}
    rows, seq, batch = 1, 1024, 2**19  # build-nanogpt's step, 2^19 tokens, in micro-batches of one row of 1024
    print(f"on paper: nodes of {args.node_gib} GiB and {args.tflops} TFLOP/s (bf16), one rank a node, 50 us links; "
          f"{batch} tokens a step in micro-batches of {rows} x {seq}; fastest predicted layout that fits in "
          f"{L.HEADROOM:.0%} of the memory")
    print(f"{'model':>17} | {'nodes':>5} | {'Gbit/s':>6} | {'layout':<40} | {'step s':>7} | "
          f"{'tokens/s':>8} | GiB a rank")
    for name, config in models.items():
        block_cost, _ = L.stage_split.stage_costs(config, seq)
        block_seconds = 3 * block_cost * rows * seq / (args.tflops * 1e12)  # forward and backward
        for nodes in (4, 8, 16, 32, 64):
            def micro(dp):
                return max(1, batch // (rows * seq * dp))
            for gbit in (1, 10, 25):
                found = [L.predict(L.plan(l, config, nodes, rows, seq, micro(nodes // (l.pp * l.tp)), True), config,
                                   nodes, seq, micro(nodes // (l.pp * l.tp)), block_seconds, (gbit * 1e9 / 8, 50e-6))
                         for l in L.candidates(config, nodes,
                                               lambda pp: pp <= config.n_layer and micro(nodes // pp) >= pp,
                                               tp=False)]
                best, _ = L.choose(found, args.node_gib * 2**30, fits_alone=False)
                what = (best.describe(nodes), f"{best.seconds:7.1f}", f"{batch / best.seconds:8.0f}",
                        f"{best.memory / 2**30:.1f}") if best else ("none fits", "", "", "")
                print(f"{name:>17} | {nodes:>5} | {gbit:>6} | {what[0]:<40} | {what[1]:>7} | {what[2]:>8} | {what[3]}")

def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--rates", default="1gbit", help="comma-separated link rates (tc's form): every layout at each")
    p.add_argument("--layouts", default="", help="comma-separated names (default: all for --ranks: " +
                   ", ".join(layouts(3)) + ", and dp x pp where the ranks allow)")
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_head", type=int, default=12)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=6144, help="tokens a step (--total_batch_size); rows of one")
    p.add_argument("--steps", type=int, default=2, help="measured steps, after a first one")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--compile", default="off", choices=["off", "on", "ab"], help="torch.compile the step (default: "
                   "eager; compiling a layout costs minutes here); ab: each layout eager, then compiled (NAME+c)")
    p.add_argument("--auto", type=float, default=None, metavar="GIB", help="also run --parallel auto with --max_memory "
                   "GIB (below DDP's need) at each rate: its predicted step for every layout beside the "
                   "measured, its choice")
    p.add_argument("--ranks_per_node", type=int, default=1, help="ranks given one hostname (a node, to --parallel "
                   "auto: tensor parallel inside it, its link timed apart); every rank keeps a link of its own")
    p.add_argument("--simulate", action="store_true", help="no runs: the planner's choices for GPT-2 XL and twice "
                   "its size on 4-64 nodes at 1, 10 and 25 Gbit/s, on paper (--tflops, --node_gib)")
    p.add_argument("--tflops", type=float, default=2.0, help="--simulate: a node's sustained bf16 matmul rate")
    p.add_argument("--node_gib", type=float, default=16.0, help="--simulate: a node's memory")
    args = p.parse_args()
    if args.simulate:
        return simulate(args)
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("bench_parallel: needs root and iproute2 (ip, tc) to make network namespaces and rate-limited links; "
              "not measured")
        return
    import numpy as np  # (here: the answer without root comes before torch's import)
    import common  # noqa: F401  (before plumbing: it puts the repository root on sys.path)
    from compute import cpu
    known = layouts(args.ranks, args.n_head)
    names = [s for s in args.layouts.split(",") if s] or list(known)
    if unknown := [s for s in names if s not in known]:
        raise SystemExit(f"error: --layouts {','.join(unknown)}: not a layout on {args.ranks} ranks "
                         f"({', '.join(known)})")
    if args.compile == "ab":  # side by side, in one run: each layout eager, then compiled
        known.update({f"{name}+c": [*known[name], "compiled"] for name in names})
        names = [n for name in names for n in (name, f"{name}+c")]
    if args.ranks_per_node < 1 or args.ranks % args.ranks_per_node:
        raise SystemExit(f"error: --ranks_per_node {args.ranks_per_node}: must divide --ranks {args.ranks}")
    rates = args.rates.split(",")
    for rate in rates:
        parse_rate(rate)
    print(cpu.describe_cpu(args.threads) + f" per rank, {args.ranks} ranks sharing {os.cpu_count()} CPU(s)")
    print(f"nodes: {args.ranks // args.ranks_per_node} hostname(s), {args.ranks_per_node} rank(s) each")
    print(f"model: {args.n_layer} layers, {args.n_embd} wide, {args.n_head} heads; rows of {args.seq_len}, "
          f"{args.tokens} tokens a step, {args.dtype}; bytes and times over steps 1-{args.steps}")
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # (Ctrl-C raises KeyboardInterrupt) the finally cleans up
    with tempfile.TemporaryDirectory() as tmp, Network(args.ranks) as net:
        rng = np.random.default_rng(0)
        for name, count in (("bench_val_000000.npy", 4096), ("bench_train_000001.npy", args.tokens * (args.steps + 3))):
            np.save(os.path.join(tmp, name), rng.integers(0, 50257, count, dtype=np.uint16))
        results = []
        for rate in rates:
            net.limit(rate)
            for name in names:
                print(f"  {name} at {rate}: {' '.join(map(str, known[name]))}", flush=True)
                r = run_layout(net, known[name], args, tmp, os.path.join(tmp, f"log_{rate}_{name}"),
                               29500 + len(results))
                results.append((rate, name, r))
            if args.auto:  # (last: its predictions are compared with every layout's measured step)
                print(f"  auto at {rate}: --parallel auto --max_memory {args.auto}", flush=True)
                r = run_layout(net, ["--parallel", "auto", "--max_memory", args.auto], args, tmp,
                               os.path.join(tmp, f"log_{rate}_auto"), 29500 + len(results))
                results.append((rate, "auto", r))
        for rate in rates:
            print(f"\nlinks at {rate}: MB each rank sends a step, measured (the trainer's computed figure)")
            print(f"{'layout':>9} | {'busiest':>8} | {'/comp.':>6} | {'each rank: measured (computed)':<48} | "
                  f"{'step s':>7} | {'link s':>6} | peak GiB per rank")
            for r_rate, name, r in results:
                if r_rate == rate:
                    print(report(name, r, rate))
        print("(link s: the busiest rank's bytes at the link's rate, the least time a step spends sending)")
        for rate in rates if args.auto else []:
            print("\n" + auto_report(rate, results, args.auto))

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
