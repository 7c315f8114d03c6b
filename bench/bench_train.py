"""
How fast does a GPT-2 training step run on this machine, and how much memory does it take?

    python bench/bench_train.py                          # our training step: GPT-2 (124M), B=4, T=1024
    python bench/bench_train.py --ab                     # lock-step A/B: our step (A) against the plain one (B)
    python bench/bench_train.py --ab --b plain,bf16      # ... against build-nanogpt's CPU path as written
    python bench/bench_train.py --ab --b compile,full    # what the chunked loss brings to the compiled step
    python bench/bench_train.py --ab --b release         # what keeping freed memory brings
    python bench/bench_train.py --profile                # where the time of one step goes (torch.profiler)

A step is what train_gpt2.py does per optimizer step: --grad_accum forward+backward passes of
B x T tokens, gradient clipping, AdamW. It reports tokens/s; MFU, the share of this CPU's matmul
rate that the step's FLOPs take at that speed (the rate: the fastest of the probes timed after every
pair of steps, each a matmul of the model's shape, (M, n_embd) @ (n_embd, 4 n_embd), in the
configuration's dtype, by plumbing.cpu); and the peak resident memory (RSS) of each process. The
header names the CPU (model, vector ISA, native bf16 or not): every figure is that CPU's.

--dtype auto (the default): bf16 where this CPU computes it natively and faster than fp32, else fp32
(plumbing.speedups.resolve_dtype; without native bf16 a bf16 matmul runs ~200x slower). Each worker decides
for itself, on its own threads, and the header says why.

A configuration (--a, --b) is a comma-separated list of:
    compile | eager          torch.compile the model, or not
    chunked | full           our fused, chunked lm_head + loss, or F.cross_entropy on the full logits
    keep | release           keep freed memory for reuse (cpu.keep_freed_memory), or let glibc's
                             malloc give big blocks back to the OS at every free, as it does by default
    fp32 | bf16              the dtype (bf16: under autocast); default: --dtype, resolved
    plain                    = eager,full,release: build-nanogpt's step (cross_entropy on all logits), in the
                             dtype of --dtype; plain,bf16 is its CPU path as written (autocast bf16 always)
    loss_chunk=N             positions per chunk of the chunked loss (train_gpt2.LOSS_CHUNK)
    budget=F                 torch.compile's activation memory budget, 0 < F <= 1 (1: keep all it can
                             for backward; default speedups.ACTIVATION_MEMORY_BUDGET)
    batch_size=N             sequences per micro-step, instead of --batch_size (A/B compares tokens/s)
    threads=N                torch threads (default: physical cores)
    NAME=VALUE               an environment variable for this configuration's process, e.g.
                             LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
Omitted items keep the defaults of train_gpt2.py, compile, chunked, keep, and the dtype of --dtype.

Why lock-step: shared and cloud machines change speed by 2x within minutes (other jobs, turbo,
noisy neighbours), so two configurations timed one after the other compare the machine's moods
as much as the code. --ab builds both configurations in advance, each in its own process, then
alternates: one step of A, one of B (B first in every other pair), and reports the ratio of each
pair. Both steps of a pair see nearly the same machine, so the median ratio is stable even when
the tokens/s of each are not.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import common  # before train_gpt2: it puts the repository root on sys.path
from plumbing import cpu, speedups
import train_gpt2
from train_gpt2 import GPTConfig


def parse_config(text):
    """'compile,chunked,loss_chunk=512' -> {'compile': True, 'loss': 'chunked', 'loss_chunk': 512}"""
    cfg = {"compile": True, "loss": "chunked", "memory": "keep"}
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
            cfg.update(compile=False, loss="full", memory="release")
        elif key in ("loss_chunk", "threads", "batch_size") and value.isdigit() and int(value) > 0:
            cfg[key] = int(value)
        elif key == "budget" and value.replace(".", "", 1).isdigit() and 0 < float(value) <= 1:
            cfg[key] = float(value)
        elif key.isupper() and value:
            cfg.setdefault("env", {})[key] = value
        else:
            raise SystemExit(f"error: unknown configuration item {item!r} in {text!r} (see python bench/bench_train.py --help)")
    return cfg


def describe(cfg):
    words = ["compile" if cfg["compile"] else "eager", cfg["loss"], cfg["memory"]] + [cfg["dtype"]] * ("dtype" in cfg)
    words += [f"{k}={cfg[k]}" for k in ("batch_size", "loss_chunk", "threads", "budget") if k in cfg]
    words += [f"{k}={os.path.basename(v)}" for k, v in cfg.get("env", {}).items()]
    return ",".join(words)


# -----------------------------------------------------------------------------
# The worker: one configuration in its own process, stepping when told to


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


def worker(cfg, args):
    if cfg["memory"] == "keep":
        cpu.keep_freed_memory()
    train_gpt2.LOSS_CHUNK = cfg.get("loss_chunk", train_gpt2.LOSS_CHUNK)
    config = GPTConfig(block_size=args.seq_len, vocab_size=train_gpt2.PADDED_VOCAB_SIZE,
                       n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    # both configurations start from the same weights and, drawn next, see the same data
    raw_model = common.random_model(config, cfg.get("threads") or cpu.physical_cores())
    optimizer, _ = raw_model.configure_optimizer(weight_decay=0.1, learning_rate=6e-4, device_type="cpu")
    B = cfg.get("batch_size", args.batch_size)
    batches = [(torch.randint(0, 50257, (B, args.seq_len)), torch.randint(0, 50257, (B, args.seq_len)))
               for _ in range(args.grad_accum)]
    model = speedups.compile_model(raw_model, cfg.get("budget")) if cfg["compile"] else raw_model
    # the dtype, decided here: the matmul rates that decide are those of this process's threads
    dtype_name, dtype_line = speedups.resolve_dtype(cfg.get("dtype", args.dtype), "cpu", args.n_embd)
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    autocast = speedups.autocast(dtype_name, "cpu")

    def step():
        # the inner loop of train_gpt2.py, without data loading, DDP and logging
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, cpu0 = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss_accum = 0.0
        for x, y in batches:
            with autocast:
                if cfg["loss"] == "full":  # build-nanogpt's way: all the logits, then cross_entropy
                    logits, _ = model(x)
                    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
                else:
                    _, loss = model(x, y)
            loss = loss / len(batches)
            loss_accum += loss.item()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
        optimizer.step()
        dt, cpu_time = time.perf_counter() - t0, time.process_time() - cpu0
        # page faults: memory the allocator gave back to the OS and asked for again, zero-filled
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return {"dt": dt, "cpu": cpu_time, "loss": loss_accum, "faults": faults}

    n_params = sum(p.numel() for p in raw_model.parameters())
    print(json.dumps({"n_params": n_params, "threads": torch.get_num_threads(),  # ready
                      "dtype": dtype_name, "dtype_line": dtype_line}), flush=True)
    for line in sys.stdin:  # one command per line, one JSON reply per line
        command = line.strip()
        if command == "step":
            reply = step()
        elif command == "rate":  # this CPU's matmul rate now, in this dtype at the model's shape: a fresh probe
            reply = {"rate": cpu.measure_matmul_rate(dtype, args.n_embd, 0.05)}
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
    """The parent's handle on a worker process."""

    def __init__(self, name, cfg, args):
        self.name, self.cfg = name, cfg
        env = dict(os.environ, **cfg.get("env", {}))
        worker_args = [a for a in sys.argv[1:] if a not in ("--ab", "--profile")]
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *worker_args, "--worker", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=common.die_with_parent())
        self.info = self.ask(None)
        self.cfg["dtype"] = self.info["dtype"]  # resolved by the worker

    def ask(self, command):
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"error: worker {self.name} ({describe(self.cfg)}) exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self):
        rss = self.ask("quit")["peak_rss"]
        self.proc.wait()
        return rss


# -----------------------------------------------------------------------------
# The parent: build the workers, warm them up, alternate them, report


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ab", action="store_true", help="lock-step A/B of configurations --a and --b")
    p.add_argument("--a", default="", help="configuration A (default: train_gpt2.py's: compile,chunked)")
    p.add_argument("--b", default="plain", help="configuration B (default: plain)")
    p.add_argument("--steps", type=int, default=6, help="measured steps (pairs, with --ab)")
    p.add_argument("--warmup", type=int, default=2, help="steps run first and not measured (the first compiles)")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's table of one step of A")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--grad_accum", type=int, default=1, help="micro-steps per optimizer step")
    common.add_dtype(p)
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_head", type=int, default=12)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if min(args.steps, args.batch_size, args.seq_len, args.grad_accum) <= 0 or args.warmup < 1:
        raise SystemExit("error: --steps, --batch_size, --seq_len, --grad_accum must be positive, --warmup at least 1")
    if args.worker:
        return worker(json.loads(args.worker), args)

    configs = [("A", parse_config(args.a))] + ([("B", parse_config(args.b))] if args.ab else [])
    workers = [Worker(name, cfg, args) for name, cfg in configs]
    info = workers[0].info
    tokens = {w.name: w.cfg.get("batch_size", args.batch_size) * args.seq_len * args.grad_accum for w in workers}
    flops_per_token = cpu.flops_per_token(info["n_params"], args.n_layer, args.n_embd, args.seq_len)
    print(f"GPT: {args.n_layer} layers, {args.n_embd} wide, {info['n_params'] / 1e6:.2f}M parameters; "
          f"B={args.batch_size} T={args.seq_len}, {args.grad_accum} micro-step(s) per step; "
          f"{flops_per_token / 1e9:.3f} GFLOP per token")
    # which CPU every figure below comes from: its model, vector ISA and whether it has native bf16
    print(f"{cpu.describe_cpu(info['threads'])}; {os.cpu_count()} CPUs, torch {torch.__version__}")
    for w in workers:
        print(f"{w.name}: {describe(w.cfg)}, {tokens[w.name]} tokens per step; {w.info['dtype_line']}")

    # warm-up, one configuration after the other: the first step compiles
    first = {}
    for w in workers:
        for i in range(args.warmup):
            r = w.ask("step")
            first.setdefault(w.name, r["dt"])
            print(f"{w.name} warm-up step {i + 1}: {r['dt']:.2f} s, loss {r['loss']:.4f}", flush=True)
    if args.profile:
        r = workers[0].ask("profile")
        print(f"profile of one step of A ({r['dt']:.2f} s):\n{r['table']}")
    warmup_peak = {w.name: w.ask("reset_peak") for w in workers}

    # measured steps, interleaved; after every pair each worker probes the matmul rate in its dtype
    results = {w.name: [] for w in workers}
    rates = {w.name: [] for w in workers}
    ratios, cpu_ratios = [], []
    header = " ".join(f"{w.name + ' s':>8} {w.name + ' loss':>9}" for w in workers)
    print(f"{'step':>4} {header} " + " ".join(f"{w.name + ' GFLOP/s':>10}" for w in workers)
          + (f" {'A:B':>6} {'cpu A:B':>7}" if args.ab else "") + "  load")
    for i in range(args.steps):
        order = workers if i % 2 == 0 else workers[::-1]
        now = {w.name: w.ask("step") for w in order}
        for w in workers:
            rates[w.name].append(w.ask("rate")["rate"])
        for name, r in now.items():
            results[name].append(r)
        cols = " ".join(f"{now[w.name]['dt']:8.2f} {now[w.name]['loss']:9.4f}" for w in workers)
        line = f"{i + 1:4d} {cols} " + " ".join(f"{rates[w.name][-1]:10.0f}" for w in workers)
        if args.ab:
            # tokens/s of A over tokens/s of B: with the same batch size, B's step time over A's
            ratios.append(tokens["A"] / now["A"]["dt"] / (tokens["B"] / now["B"]["dt"]))
            cpu_ratios.append(tokens["A"] / now["A"]["cpu"] / (tokens["B"] / now["B"]["cpu"]))
            line += f" {ratios[-1]:6.2f} {cpu_ratios[-1]:7.2f}"
        # the load average: how many processes wanted a CPU (this benchmark itself is about 1)
        print(line + f"  {os.getloadavg()[0]:4.1f}", flush=True)

    print()
    width = max(len(describe(w.cfg)) for w in workers)
    print(f"{'':2} {'configuration':<{width}} {'tokens/s':>9} {'MFU':>6} {'peak RSS':>9} {'faults/step':>11} "
          f"{'first step':>10} {'warm-up RSS':>11}")
    mfu = {}
    for w in workers:
        med = statistics.median(r["dt"] for r in results[w.name])
        faults = statistics.median(r["faults"] for r in results[w.name])
        rss = w.close()
        if not warmup_peak[w.name]["reset"]:  # no way to reset it here: the peak since the start
            rss = max(rss, warmup_peak[w.name]["peak_rss"])
        # against the fastest probe: the machine's noise only ever slows a probe down
        mfu[w.name] = tokens[w.name] / med * flops_per_token / (max(rates[w.name]) * 1e9)
        print(f"{w.name:2} {describe(w.cfg):<{width}} {tokens[w.name] / med:9.0f} {mfu[w.name]:6.1%} "
              f"{rss / 2**30:5.2f} GiB {faults:11.0f} {first[w.name]:8.1f} s {warmup_peak[w.name]['peak_rss'] / 2**30:7.2f} GiB")
    for w in workers:
        print(f"{w.name}: {mfu[w.name]:.1%} of this CPU's {w.cfg['dtype']} matmul rate, {max(rates[w.name]):.0f} GFLOP/s "
              f"(the fastest probe)")
    print(f"tokens/s: of the median step. MFU: the step's FLOPs per second ({flops_per_token / 1e9:.3f} GFLOP per token)\n"
          f"against this CPU's matmul rate in the configuration's dtype, at the model's shape (M, {args.n_embd}) @ "
          f"({args.n_embd}, {4 * args.n_embd}),\nas probed after every pair (GFLOP/s columns above).\n"
          "A:B: A's tokens/s over B's, in that pair. cpu A:B: the same in CPU time (all threads of each process),\n"
          "which leaves out the time other jobs held the cores: steadier than wall time on a busy machine.\n"
          "peak RSS: the process's most resident memory during the measured steps; warm-up RSS: during warm-up,\n"
          "compilation included. faults/step: minor page faults, memory the allocator returned to the OS and\n"
          "took back, zero-filled. first step: includes compiling.")
    if args.ab:
        print(f"A/B: A is {statistics.median(ratios):.2f}x B (median of {len(ratios)} per-pair ratios; "
              f"min {min(ratios):.2f}, max {max(ratios):.2f}); in CPU time {statistics.median(cpu_ratios):.2f}x")


if __name__ == "__main__":
    main()
