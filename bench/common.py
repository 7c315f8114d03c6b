"""
What the benchmarks in this folder share. Each is run from the repository root as
`python bench/bench_X.py`; Python then puts bench/ (the script's folder) on sys.path, so
`import common` finds this file, and this file puts the repository root there too, so that the
scripts can import train_gpt2, hellaswag and tokenizer like any script at the top level.
A library: the flags, the random-weight model, children that die with the benchmark, and the
lock-step workers of bench_train.py and bench_finetune.py.
"""
import argparse
import ctypes
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from compute import cpu  # noqa: E402
from model import GPT  # noqa: E402


def add_dtype(parser):
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                        help="bf16: under autocast; auto (default): bf16 where this CPU computes it natively and "
                             "faster than fp32, else fp32")


def add_dtype_and_threads(parser):
    """The two flags every benchmark has: the precision it measures in, and the torch threads."""
    add_dtype(parser)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")


def random_model(config, threads=0):
    """A GPT of this shape with random weights, the same ones every run (seed 0), on `threads`
    torch threads (0: torch's default). Speed does not depend on the weights, and random ones need
    no download."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    return GPT(config)


# -----------------------------------------------------------------------------
# Child processes die with the benchmark. A benchmark killed with SIGKILL (a test's timeout, the OOM
# killer, kill -9) gets no chance to stop the processes it started. A worker between steps notices (its
# stdin ends), but one in the middle of a step computes on until the step ends, unaware that nobody
# will read its result: a bf16 step on a CPU without native bf16 kept a core busy 12 minutes after a
# test's timeout. Linux can signal a process when its parent dies: prctl(PR_SET_PDEATHSIG), which the
# child asks for between fork and exec (it survives exec).

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(sig=signal.SIGKILL):
    """preexec_fn for subprocess.Popen and subprocess.run: the child gets `sig` when this process dies.
    Linux only; elsewhere None, which Popen takes as no preexec_fn. It covers that child alone, not the
    processes it starts in turn. Call Popen from the main thread: the signal comes when the thread that
    started the child ends, and only the main thread lasts as long as the process. (A preexec_fn runs
    Python between fork and exec, where a lock held by another thread of the parent would never be
    released; this one takes none: prctl is looked up beforehand, getppid and kill are plain calls.)"""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None).prctl  # looked up now, in the parent
    parent = os.getpid()

    def preexec():
        prctl(PR_SET_PDEATHSIG, int(sig))
        # The parent may have died between fork and prctl: nobody would send the signal then, and the
        # child already has a new parent (init, or a subreaper). So check, and go at once if so.
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


# -----------------------------------------------------------------------------
# Lock-step workers (bench_train.py, bench_finetune.py). Shared and cloud machines change speed by 2x within
# minutes, so two configurations timed one after the other compare the machine's moods as much as the code. Each
# configuration is built in advance in its own process (its own threads, allocator, peak memory), and the parent
# asks them for one step each in turns: both steps of a pair see nearly the same machine.


def parse_config(text):
    """A configuration's items (bench_train.py's docstring lists them), for a worker:
    'compile,chunked,loss_chunk=512' -> {'compile': True, 'loss': 'chunked', 'memory': 'keep', 'loss_chunk': 512}"""
    cfg = {"compile": True, "loss": "chunked", "memory": "keep", "attention": "auto"}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        if item in ("compile", "eager"):
            cfg["compile"] = item == "compile"
        elif item in ("chunked", "full"):
            cfg["loss"] = item
        elif item in ("keep", "release"):
            cfg["memory"] = item
        elif item in ("fp32", "bf16"):
            cfg["dtype"] = item
        elif item == "plain":
            cfg.update(compile=False, loss="full", memory="release", attention="sdpa")
        elif key == "attention" and value in ("auto", "ours", "sdpa"):
            cfg[key] = value
        elif key in ("loss_chunk", "threads", "batch_size", "lora") and value.isdigit() and int(value) > 0:
            cfg[key] = int(value)
        elif key == "budget" and value.replace(".", "", 1).isdigit() and 0 < float(value) <= 1:
            cfg[key] = float(value)
        elif key.isupper() and value:
            cfg.setdefault("env", {})[key] = value
        else:
            raise SystemExit(f"error: unknown configuration item {item!r} in {text!r} "
                             "(see python bench/bench_train.py --help)")
    return cfg


def choose_attention(how, dtype, batch_size, seq_len, config):
    """A worker's causal attention (a configuration's attention=auto|ours|sdpa); returns the line saying which."""
    from compute import attention
    line = attention.choose(dtype, batch_size, config.n_head, seq_len, config.n_embd // config.n_head)
    if how != "auto":
        attention.chosen = how == "ours" and bool(attention.kernel())
        line = f"attention: {'ours' if attention.chosen else 'PyTorch' + chr(39) + 's'} (attention={how}; {line})"
    return line or "attention: PyTorch's (fp32)"


def describe(cfg, words):
    """A configuration's name, for its lines: the script's `words` for it, then its dtype and the items with a value."""
    words = (words + [cfg["dtype"]] * ("dtype" in cfg)
             + [f"attention={cfg['attention']}"] * (cfg.get("attention", "auto") != "auto"))
    words += [f"{k}={cfg[k]}" for k in ("lora", "batch_size", "loss_chunk", "threads", "budget") if k in cfg]
    words += [f"{k}={os.path.basename(v)}" for k, v in cfg.get("env", {}).items()]
    return ",".join(words)


def add_lockstep_flags(parser, warmup, warmup_help):
    """The flags both lock-step benchmarks have; each adds --a, --b, --batch_size and its own."""
    parser.add_argument("--ab", action="store_true", help="lock-step A/B of configurations --a and --b")
    parser.add_argument("--steps", type=int, default=6, help="measured steps (pairs, with --ab)")
    parser.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's table of one step of A")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--grad_accum", type=int, default=1, help="micro-steps per optimizer step")
    add_dtype(parser)
    parser.add_argument("--n_layer", type=int, default=12)
    parser.add_argument("--n_head", type=int, default=12)
    parser.add_argument("--n_embd", type=int, default=768)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # set by Worker: this process is one


def check_lockstep_flags(args):
    if min(args.steps, args.batch_size, args.seq_len, args.grad_accum) <= 0 or args.warmup < 1:
        raise SystemExit("error: --steps, --batch_size, --seq_len, --grad_accum must be positive, --warmup at least 1")


def peak_rss():
    """The most resident memory of this process, in bytes, since it started or since reset_peak_rss()."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # not Linux: the peak since the start
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def reset_peak_rss():
    """Linux resets the high-water mark when "5" is written to /proc/self/clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def sustained_rate(dtype, width, seconds=1.0):
    """GFLOP/s of `seconds` of back-to-back products at the probe's shape, (M, width) @ (width, 4 width): the rate the
    CPU keeps up. The fastest single product can catch a burst: on a 2-core Xeon with AMX (a cloud VM), single bf16
    products reached 2.0-2.3 TFLOP/s for moments while whole seconds of them ran at 600-810 GFLOP/s, and a training
    step timed during such a moment was no faster. M grows 4x at a time from 16 rows up to 1024 while a product takes
    under 0.05 s (PyTorch's bf16 fallback runs ~1 GFLOP/s on a CPU without native bf16)."""
    rows, b = 16, torch.randn(width, 4 * width, dtype=dtype)
    while True:
        a = torch.randn(rows, width, dtype=dtype)
        start = time.perf_counter()
        a @ b
        if rows >= 1024 or 4 * (time.perf_counter() - start) > 0.05:
            break
        rows *= 4
    products, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        products += 1
    return 2 * rows * width * 4 * width * products / elapsed / 1e9


def serve(step, n_params, dtype_name, dtype_line, n_embd):
    """The worker's side, once its configuration is built: says it is ready, then runs the parent's commands, one
    per line of stdin, one JSON reply per line of stdout. step() runs one training step and returns its figures."""
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    print(json.dumps({"n_params": n_params, "threads": torch.get_num_threads(),  # ready
                      "dtype": dtype_name, "dtype_line": dtype_line}), flush=True)
    for line in sys.stdin:  # (its end, the parent gone, ends the worker between steps)
        command = line.strip()
        if command == "step":
            reply = step()
        elif command == "rate":  # this CPU's matmul rate now, in this dtype at the model's shape: a fresh probe
            reply = {"rate": cpu.measure_matmul_rate(dtype, n_embd, 0.05), "sustained": sustained_rate(dtype, n_embd)}
        elif command == "profile":
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                reply = step()
            reply["table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        elif command == "reset_peak":  # after warm-up: from now on, the peak of the training steps alone
            reply = {"peak_rss": peak_rss(), "reset": reset_peak_rss()}
        elif command == "quit":
            reply = {"peak_rss": peak_rss()}
        print(json.dumps(reply), flush=True)
        if command == "quit":
            break


class Worker:
    """The parent's handle on a worker process: `script` run again with this command line's flags (less --ab and
    --profile), `extra` flags and --worker cfg. It starts at once; ready() waits until it has built its model.
    describe(cfg) names the configuration in an error."""

    def __init__(self, name, cfg, script, describe, extra=()):
        self.name, self.cfg, self.describe = name, cfg, describe
        self.sustained = []  # the sustained matmul rate probed after each pair (sustained_rate)
        env = dict(os.environ, **cfg.get("env", {}))
        flags = [a for a in sys.argv[1:] if a not in ("--ab", "--profile")]
        command = [sys.executable, os.path.abspath(script), *flags, *extra, "--worker", json.dumps(cfg)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=die_with_parent())

    def ready(self):
        self.info = self.ask(None)
        self.cfg["dtype"] = self.info["dtype"]  # resolved by the worker

    def ask(self, command):
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"error: worker {self.name} ({self.describe(self.cfg)}) exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self):
        """Ends the worker; returns its peak RSS during the measured steps (where it could not be reset after
        warm-up, the peak since the start)."""
        rss = self.ask("quit")["peak_rss"]
        self.proc.wait()
        return rss if self.warmup_peak["reset"] else max(rss, self.warmup_peak["peak_rss"])


def warm_up(workers, steps, profile):
    """`steps` unmeasured steps of each worker, one configuration after the other (the first steps compile); each
    worker's first step time (w.first) and warm-up peak RSS (w.warmup_peak) kept. profile: A's table of one step."""
    for w in workers:
        for i in range(steps):
            r = w.ask("step")
            if i == 0:
                w.first = r["dt"]
            print(f"{w.name} warm-up step {i + 1}: {r['dt']:.2f} s, loss {r['loss']:.4f}", flush=True)
    if profile:
        r = workers[0].ask("profile")
        print(f"profile of one step of A ({r['dt']:.2f} s):\n{r['table']}")
    for w in workers:
        w.warmup_peak = w.ask("reset_peak")


def ratio(count, clock):
    """A:B in a pair: A's count (of a step's reply: "tokens", "positions") per second of "dt" (wall) or "cpu" time,
    over B's."""
    return lambda a, b: a[count] / a[clock] / (b[count] / b[clock])


def measure(workers, steps, columns, ratios):
    """The measured steps, interleaved: one step of each worker in turns (B first in every other pair), then each
    probes this CPU's matmul rate in its dtype. A line a pair: each worker's columns, its rate, with two workers the
    ratios of A to B in this pair, and the load average. columns: (a worker's name -> its headers, a step's reply ->
    its columns); ratios: {header: (width, ratio)}. Returns each worker's replies and rates, by name, and the ratios'
    values, by header."""
    headers, row = columns
    results, rates = {w.name: [] for w in workers}, {w.name: [] for w in workers}
    ratios = ratios if len(workers) == 2 else {}
    values = {k: [] for k in ratios}
    print(f"{'step':>4} " + " ".join(headers(w.name) for w in workers) + " "
          + " ".join(f"{w.name + ' GFLOP/s':>10}" for w in workers)
          + "".join(f" {k:>{width}}" for k, (width, _) in ratios.items()) + "  load")
    for i in range(steps):
        turn = workers if i % 2 == 0 else workers[::-1]
        now = {w.name: w.ask("step") for w in turn}
        for w in workers:
            probe = w.ask("rate")
            rates[w.name].append(probe["rate"])
            w.sustained.append(probe["sustained"])
            results[w.name].append(now[w.name])
        line = f"{i + 1:4d} " + " ".join(row(now[w.name]) for w in workers) + " "
        line += " ".join(f"{cpu.rate_text(rates[w.name][-1]):>10}" for w in workers)
        for k, (width, a_to_b) in ratios.items():
            values[k].append(a_to_b(now["A"], now["B"]))
            line += f" {values[k][-1]:{width}.2f}"
        # the load average: how many processes wanted a CPU (this benchmark itself is about 1)
        print(line + f"  {os.getloadavg()[0]:4.1f}", flush=True)
    return results, rates, values


def print_cpu_line(threads):
    """Which CPU every figure comes from: its model, vector ISA and whether it has native bf16."""
    print(f"{cpu.describe_cpu(threads)}; {os.cpu_count()} CPUs, torch {torch.__version__}")


def print_matmul_shares(workers, mfu, rates):
    for w in workers:
        sustained = statistics.median(w.sustained)
        print(f"{w.name}: {mfu[w.name]:.1%} of this CPU's {w.cfg['dtype']} matmul rate, "
              f"{cpu.rate_text(max(rates[w.name]))} GFLOP/s (the fastest probe); "
              f"{mfu[w.name] * max(rates[w.name]) / sustained:.1%} of its sustained rate, {cpu.rate_text(sustained)} "
              f"GFLOP/s (the median of 1 s of products after each pair)")
