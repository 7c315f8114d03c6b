"""
How much faster is hellaswag.py's scoring than build-nanogpt's one example per forward pass?

    python bench/bench_hellaswag.py                     # GPT-2 (124M) shape, random weights, 4 rounds of 16 examples
    python bench/bench_hellaswag.py --rounds 8 --batch_sizes 8 16 32 --dtype fp32   # default: auto
    python bench/bench_hellaswag.py --model demo        # the small model of train_gpt2.py --demo

The weights are random (GPT(GPTConfig())): speed does not depend on them, and it needs no download.
The examples are synthetic but shaped like HellaSwag's: English words, a third with short contexts
and endings like its ActivityNet part, two thirds longer like its WikiHow part. Ways of scoring
the same examples, taking turns in one process:
    per-example      build-nanogpt's loop: 4 rows per forward, logits at every position
    batch 1          hellaswag.score_endings, one example per forward
    batch N          hellaswag.score_endings, N examples per forward (evaluate()'s way)
All must pick the same endings; the script checks it.
"""
import argparse
import functools
import random
import re
import time

import torch
from torch.nn import functional as F

import common  # before hellaswag, tokenizer and train_gpt2: it puts the repository root on sys.path
import hellaswag
import tokenizer
from compute import cpu, speedups
from train_args import DEMO_ARGS
from model import GPTConfig
from tokenizer import PADDED_VOCAB_SIZE


def synthetic_rounds(rounds, size, n_total=10042, seed=0):
    """`rounds` lists of `size` examples. A full evaluation sorts all 10,042 examples by length, so
    each batch holds near-equal lengths; to time batches like those, we draw the lengths of
    n_total examples, sort them, and take each round from consecutive ones, the rounds spread
    evenly from the shortest to the longest."""
    rng = random.Random(seed)
    shapes = []
    for i in range(n_total):
        if i % 3 == 0:  # ActivityNet-like: a short scene, short endings
            shapes.append((rng.randint(15, 40), [rng.randint(8, 25) for _ in range(4)]))
        else:  # WikiHow-like: a how-to paragraph, longer endings
            shapes.append((rng.randint(40, 110), [rng.randint(15, 50) for _ in range(4)]))
    shapes.sort(key=lambda s: s[0] + sum(s[1]))
    enc = tokenizer.get_encoding()
    words = [w for w in (enc.decode([i]) for i in range(256, 20000)) if re.fullmatch(r" [a-z]{3,}", w)]

    def text(n_words):  # about one token per word
        return "".join(rng.choice(words) for _ in range(n_words)).strip() + "."

    out = []
    for r in range(rounds):
        start = round((r + 0.5) / rounds * (n_total - size))
        out.append([{"ctx": text(ctx), "endings": [text(k) for k in ends], "label": rng.randint(0, 3)}
                    for ctx, ends in shapes[start:start + size]])
    return out


@torch.no_grad()
def per_example(model, examples, dtype):
    """build-nanogpt's way, one example (4 rows) per forward, full logits; returns (N, 4) mean losses."""
    out = []
    for ex in examples:
        ctx = tokenizer.encode(ex["ctx"])
        rows = [ctx + tokenizer.encode(" " + e) for e in ex["endings"]]
        tokens = torch.zeros(4, max(map(len, rows)), dtype=torch.long)
        mask = torch.zeros_like(tokens, dtype=torch.float)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = torch.tensor(row)
            mask[i, len(ctx):len(row)] = 1
        with speedups.autocast(dtype, "cpu"):
            logits, _ = model(tokens)
        losses = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        out.append((losses.view(4, -1) * mask[:, 1:]).sum(1) / mask[:, 1:].sum(1))
    return torch.stack(out).double()


def main():
    p = argparse.ArgumentParser(description="Batched vs one-example-per-forward HellaSwag scoring speed")
    p.add_argument("--model", default="124M", choices=["124M", "demo"],
                   help="GPT-2 124M's shape, or train_gpt2.py's demo model (4 layers, 256 wide)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of max(batch_sizes) examples each")
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[16])
    common.add_dtype_and_threads(p)
    args = p.parse_args()
    demo_shape = {k: DEMO_ARGS[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}
    config = GPTConfig() if args.model == "124M" else GPTConfig(vocab_size=PADDED_VOCAB_SIZE, **demo_shape)
    model = common.random_model(config, args.threads).eval()
    args.dtype, dtype_line = speedups.resolve_dtype(args.dtype, "cpu", config.n_embd)  # now that the threads are set
    print(cpu.describe_cpu(torch.get_num_threads()))
    print(dtype_line)
    rounds = synthetic_rounds(args.rounds, max(args.batch_sizes))
    rendered = [[hellaswag.render_example(ex, config.block_size) for ex in exs] for exs in rounds]
    flat = [r for rnd in rendered for r in rnd]
    n_ctx = sum(len(ctx) for ctx, _ in flat) / len(flat)
    n_end = sum(len(e) for _, ends in flat for e in ends) / (4 * len(flat))
    print(f"{len(flat)} synthetic examples: {n_ctx:.0f} context tokens and {n_end:.0f} tokens per ending on average; "
          f"{args.model} model, random weights; {args.dtype}; {torch.get_num_threads()} threads", flush=True)

    def batched(exs, rnd, batch_size):  # hellaswag.py's way: every ending of a round in batches
        scores, counts = hellaswag.score_endings(model, rnd, dtype=args.dtype, batch_size=batch_size)
        return scores / counts

    methods = {"per-example (build-nanogpt)": lambda exs, rnd: per_example(model, exs, args.dtype)}
    for bs in [1] + [b for b in args.batch_sizes if b != 1]:
        methods[f"hellaswag.py, batch {bs}"] = functools.partial(batched, batch_size=bs)
    # The machine's speed drifts by 2x and more within minutes, so the methods take turns round by
    # round (who goes first rotates) and each method's time is summed over all rounds: drift hits all alike.
    names = list(methods)
    times = {name: 0.0 for name in names}
    means = {name: [] for name in names}
    for r, (exs, rnd) in enumerate(zip(rounds, rendered)):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            means[name].append(methods[name](exs, rnd))
            times[name] += time.perf_counter() - t0
        print(f"round {r + 1}: " + ", ".join(f"{name} {t:.0f}s" for name, t in times.items()), flush=True)
    means = {name: torch.cat(m) for name, m in means.items()}
    ref = means[names[0]]
    assert all(torch.equal(ref.argmin(1), m.argmin(1)) for m in means.values()), "the methods picked different endings"
    worst = max((m - ref).abs().max().item() for m in means.values())
    print(f"\nall methods picked the same endings (largest difference in a mean loss: {worst:.1e})")
    for name, t in times.items():
        print(f"  {name:28s} {len(flat) / t:6.2f} examples/s   x{times[names[0]] / t:.2f} vs per-example, "
              f"x{times[names[1]] / t:.2f} vs batch 1")


if __name__ == "__main__":
    main()
