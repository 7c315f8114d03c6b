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
configuration's dtype, by compute.cpu; and, as a second line, against the median rate sustained over 1 s of
products, which a burst cannot lift: common.sustained_rate); and the peak resident memory (RSS) of each process. The
header names the CPU (model, vector ISA, native bf16 or not): every figure is that CPU's.

--dtype auto (the default): bf16 where this CPU computes it natively and faster than fp32, else fp32
(compute.speedups.resolve_dtype; without native bf16 a bf16 matmul runs ~200x slower). Each worker decides
for itself, on its own threads, and the header says why.

A configuration (--a, --b) is a comma-separated list of:
    compile | eager          torch.compile the model, or not
    chunked | full           our fused, chunked lm_head + loss, or F.cross_entropy on the full logits
    keep | release           keep freed memory for reuse (cpu.keep_freed_memory), or let glibc's
                             malloc give big blocks back to the OS at every free, as it does by default
    fp32 | bf16              the dtype (bf16: under autocast); default: --dtype, resolved
    plain                    = eager,full,release,attention=sdpa: build-nanogpt's step (cross_entropy on all logits),
                             in the dtype of --dtype; plain,bf16 is its CPU path as written (autocast bf16 always)
    loss_chunk=N             positions per chunk of the chunked loss (compute.fused_loss.LOSS_CHUNK)
    attention=auto|ours|sdpa causal attention by the kernel train_gpt2.py measures fastest here (auto), by
                             compute/attention.cpp's (ours: AMX or AVX512-BF16), or by F.scaled_dot_product_attention
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
import resource
import statistics
import time

import torch
import torch.nn.functional as F

import common  # before train_gpt2: it puts the repository root on sys.path
from compute import cpu, fused_loss, speedups
from parallel import sizes
from tokenizer import PADDED_VOCAB_SIZE
from model import GPTConfig


def describe(cfg):
    return common.describe(cfg, ["compile" if cfg["compile"] else "eager", cfg["loss"], cfg["memory"]])


# -----------------------------------------------------------------------------
# The worker: one configuration in its own process, stepping when told to (common.serve)


def worker(cfg, args):
    if cfg["memory"] == "keep":
        cpu.keep_freed_memory()
    fused_loss.LOSS_CHUNK = cfg.get("loss_chunk", fused_loss.LOSS_CHUNK)
    config = GPTConfig(block_size=args.seq_len, vocab_size=PADDED_VOCAB_SIZE,
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
    autocast = speedups.autocast(dtype_name, "cpu")
    dtype_line += "; " + common.choose_attention(cfg["attention"], dtype_name, B, args.seq_len, config)

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
        return {"dt": dt, "cpu": cpu_time, "loss": loss_accum, "faults": faults,
                "tokens": B * args.seq_len * len(batches)}

    n_params = sum(p.numel() for p in raw_model.parameters())
    common.serve(step, n_params, dtype_name, dtype_line, args.n_embd)


# -----------------------------------------------------------------------------
# The parent: build the workers, warm them up, alternate them, report


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", default="", help="configuration A (default: train_gpt2.py's: compile,chunked)")
    p.add_argument("--b", default="plain", help="configuration B (default: plain)")
    p.add_argument("--batch_size", type=int, default=4)
    common.add_lockstep_flags(p, warmup=2, warmup_help="steps run first and not measured (the first compiles)")
    args = p.parse_args()
    common.check_lockstep_flags(args)
    return args


def start_workers(args):
    """A's worker, then B's, each built before the next starts; prints what they measure. Returns (the workers,
    the tokens of a step of each, by name; the model's FLOPs per token)."""
    configs = [("A", common.parse_config(args.a))] + ([("B", common.parse_config(args.b))] if args.ab else [])
    workers = []
    for name, cfg in configs:
        workers.append(common.Worker(name, cfg, __file__, describe))
        workers[-1].ready()
    info = workers[0].info
    tokens = {w.name: w.cfg.get("batch_size", args.batch_size) * args.seq_len * args.grad_accum for w in workers}
    flops_per_token = sizes.flops_per_token(info["n_params"], args.n_layer, args.n_embd, args.seq_len)
    print(f"GPT: {args.n_layer} layers, {args.n_embd} wide, {info['n_params'] / 1e6:.2f}M parameters; "
          f"B={args.batch_size} T={args.seq_len}, {args.grad_accum} micro-step(s) per step; "
          f"{flops_per_token / 1e9:.3f} GFLOP per token")
    common.print_cpu_line(info["threads"])
    for w in workers:
        print(f"{w.name}: {describe(w.cfg)}, {tokens[w.name]} tokens per step; {w.info['dtype_line']}")
    return workers, tokens, flops_per_token


def report(args, workers, tokens, flops_per_token, measured):
    results, rates, ratios = measured
    print()
    width = max(len(describe(w.cfg)) for w in workers)
    print(f"{'':2} {'configuration':<{width}} {'tokens/s':>9} {'MFU':>6} {'peak RSS':>9} {'faults/step':>11} "
          f"{'first step':>10} {'warm-up RSS':>11}")
    mfu = {}
    for w in workers:
        med = statistics.median(r["dt"] for r in results[w.name])
        faults = statistics.median(r["faults"] for r in results[w.name])
        rss = w.close()
        # against the fastest probe: the machine's noise only ever slows a probe down
        mfu[w.name] = tokens[w.name] / med * flops_per_token / (max(rates[w.name]) * 1e9)
        print(f"{w.name:2} {describe(w.cfg):<{width}} {tokens[w.name] / med:9.0f} {mfu[w.name]:6.1%} "
              f"{rss / 2**30:5.2f} GiB {faults:11.0f} {w.first:8.1f} s {w.warmup_peak['peak_rss'] / 2**30:7.2f} GiB")
    common.print_matmul_shares(workers, mfu, rates)
    print(f"tokens/s: of the median step. MFU: the step's FLOPs per second "
          f"({flops_per_token / 1e9:.3f} GFLOP per token)\n"
          f"against this CPU's matmul rate in the configuration's dtype, at the model's shape (M, {args.n_embd}) @ "
          f"({args.n_embd}, {4 * args.n_embd}),\nas probed after every pair (GFLOP/s columns above).\n"
          "A:B: A's tokens/s over B's, in that pair. cpu A:B: the same in CPU time (all threads of each process),\n"
          "which leaves out the time other jobs held the cores: steadier than wall time on a busy machine.\n"
          "peak RSS: the process's most resident memory during the measured steps; warm-up RSS: during warm-up,\n"
          "compilation included. faults/step: minor page faults, memory the allocator returned to the OS and\n"
          "took back, zero-filled. first step: includes compiling.")
    if args.ab:
        ratios, cpu_ratios = ratios["A:B"], ratios["cpu A:B"]
        print(f"A/B: A is {statistics.median(ratios):.2f}x B (median of {len(ratios)} per-pair ratios; "
              f"min {min(ratios):.2f}, max {max(ratios):.2f}); in CPU time {statistics.median(cpu_ratios):.2f}x")


def main():
    args = parse_args()
    if args.worker:
        return worker(json.loads(args.worker), args)
    workers, tokens, flops_per_token = start_workers(args)
    common.warm_up(workers, args.warmup, args.profile)
    # a line a pair: each one's seconds and loss, its matmul rate; tokens/s of A over B's (with the same batch size,
    # B's step time over A's), and in CPU time
    columns = (lambda name: f"{name + ' s':>8} {name + ' loss':>9}", lambda r: f"{r['dt']:8.2f} {r['loss']:9.4f}")
    ratios = {"A:B": (6, common.ratio("tokens", "dt")), "cpu A:B": (7, common.ratio("tokens", "cpu"))}
    report(args, workers, tokens, flops_per_token, common.measure(workers, args.steps, columns, ratios))


if __name__ == "__main__":
    main()
