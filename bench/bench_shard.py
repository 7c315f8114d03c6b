"""
How much memory does sharding save per rank, and what does it cost in speed?

    python bench/bench_shard.py --modes full                      # GPT-2 medium shape, fully sharded over 3 ranks
    python bench/bench_shard.py --modes none --ranks 2            # the same under DDP (3 ranks need > 23 GiB)
    python bench/bench_shard.py --model large --modes full        # GPT-2 large, fully sharded over 3 ranks
    python bench/bench_shard.py --model xl --ranks 8 --modes full --steps 2

Each configuration is a real train_gpt2.py run under torchrun (random init, random tokens, B=1, T=1024,
no compile, no evaluation, no checkpoints), so what is measured is exactly what training does: the
per-rank peak resident memory (the trainer's last line) and the tokens/s of the steps after the first.
All ranks share this machine's cores, so tokens/s is a comparison between modes, not a cluster's speed.
"""
import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import torch

import common  # before plumbing: it puts the repository root on sys.path
from compute import cpu, speedups
from model import GPTConfig
from parallel import sizes
from tokenizer import PADDED_VOCAB_SIZE

REPO = common.REPO
SHAPES = {"small": (12, 12, 768), "medium": (24, 16, 1024), "large": (36, 20, 1280), "xl": (48, 25, 1600)}

def run(mode, args, data_dir, log_dir):
    n_layer, n_head, n_embd = SHAPES[args.model]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           os.path.join(REPO, "train_gpt2.py"), "--data_dir", data_dir, "--log_dir", log_dir,
           "--n_layer", n_layer, "--n_head", n_head, "--n_embd", n_embd, "--batch_size", 1, "--seq_len", args.seq_len,
           "--total_batch_size", args.seq_len * args.ranks, "--max_steps", args.steps, "--warmup_steps", 1,
           "--eval_interval", 0, "--sample_interval", 0, "--hellaswag_interval", 0, "--checkpoint_interval", 0,
           "--no-compile", "--dtype", args.dtype, "--shard", mode]
    # SIGTERM, not SIGKILL, when this script dies: torchrun then stops its ranks too (they stop at the next
    # step, and torchrun kills those that take too long); killed outright it would leave them running
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, cwd=REPO,
                          preexec_fn=common.die_with_parent(signal.SIGTERM))
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return {"mode": mode, "error": f"exit {proc.returncode}: {tail}"}
    peaks = [float(x) for x in re.search(r"peak memory per rank: (.*) GiB", proc.stdout).group(1).split(", ")]
    tok_s = [float(x) for x in re.findall(r"tok/sec (\d+)", proc.stdout)][1:]  # the first step warms up
    return {"mode": mode, "peaks": peaks, "tok_s": statistics.median(tok_s) if tok_s else float("nan")}

def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", choices=SHAPES, default="medium")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--modes", default="none,full", help="comma-separated --shard values, run one after the other")
    p.add_argument("--steps", type=int, default=3)
    common.add_dtype(p)
    p.add_argument("--seq_len", type=int, default=1024)
    args = p.parse_args()
    n_layer, n_head, n_embd = SHAPES[args.model]
    # auto is decided here, for the threads each rank will have (its share of the cores), and passed on
    torch.set_num_threads(max(1, cpu.physical_cores() // args.ranks))
    args.dtype, dtype_line = speedups.resolve_dtype(args.dtype, "cpu", n_embd)
    print(cpu.describe_cpu(torch.get_num_threads()) + " per rank")
    print(dtype_line)
    config = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=PADDED_VOCAB_SIZE)
    n_params = sizes.parameters(config)[0]  # blocks, embeddings (lm_head tied)
    print(f"GPT-2 {args.model} shape: {n_params / 1e6:.0f}M parameters, {args.ranks} ranks, B=1, T={args.seq_len}, "
          f"{args.dtype}; training state (weights, gradients, AdamW) {sizes.gib(sizes.STATE_BYTES * n_params)} in all")
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        for name, n in (("bench_val_000000.npy", 4096),
                        ("bench_train_000001.npy", (args.seq_len + 1) * args.ranks * (args.steps + 2))):
            np.save(os.path.join(tmp, name), rng.integers(0, 50257, n, dtype=np.uint16))
        print(f"{'--shard':>8} | {'peak RSS per rank (GiB)':>26} | {'max':>6} | {'tokens/s':>8}")
        for mode in args.modes.split(","):
            r = run(mode, args, tmp, os.path.join(tmp, f"log_{mode}"))
            if "error" in r:
                print(f"{mode:>8} | failed: {r['error']}")
                continue
            print(f"{mode:>8} | {', '.join(f'{x:.2f}' for x in r['peaks']):>26} | {max(r['peaks']):6.2f} | "
                  f"{r['tok_s']:8.0f}", flush=True)

if __name__ == "__main__":
    main()
