"""
How much faster is generating with the KV cache than recomputing the whole sequence every step?

    python bench/bench_generate.py                      # GPT-2 (124M) shape, random weights, 256 new tokens
    python bench/bench_generate.py --new_tokens 512 --dtype fp32   # default: auto, bf16 where this CPU has it natively

The weights are random (GPT(GPTConfig())): speed does not depend on them, and it needs no download.
Both ways decode greedily from the same prompt, so in fp32 they produce the same tokens (the script
checks it). They run in lockstep in one process, a token of one, then a token of the other,
because a shared machine's speed drifts and only numbers measured side by side compare.
    KV cache  GPT.generate: the prompt once, then one token per forward (what sample.py does)
    plain     build-nanogpt's loop: the whole sequence through the model for every new token
"""
import argparse
import time

import torch

import common  # before tokenizer and train_gpt2: it puts the repository root on sys.path
from compute import cpu, speedups
import tokenizer
from model import GPTConfig


@torch.no_grad()
def plain_generate(model, idx, n):
    """build-nanogpt's sampling loop, greedy: yields the (B,) new ids of each step."""
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size:])
        next_id = logits[:, -1, :tokenizer.VOCAB_SIZE].argmax(dim=-1, keepdim=True)
        idx = torch.cat((idx, next_id), dim=1)
        yield next_id.squeeze(1)


def main():
    p = argparse.ArgumentParser(description="KV-cached vs plain generation speed")
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--prompt", default="Hello, I'm a language model,")
    p.add_argument("--num_samples", type=int, default=1, help="sequences generated together (batch)")
    common.add_dtype_and_threads(p)
    args = p.parse_args()
    model = common.random_model(GPTConfig(), args.threads).eval()  # GPT-2 (124M) shape
    # now that the threads are set
    args.dtype, dtype_line = speedups.resolve_dtype(args.dtype, "cpu", model.config.n_embd)
    print(cpu.describe_cpu(torch.get_num_threads()))
    print(dtype_line)
    idx = torch.tensor([tokenizer.encode(args.prompt)] * args.num_samples)
    n = args.new_tokens
    print(f"GPT-2 124M shape, random weights; {idx.size(1)}-token prompt, {n} new tokens x {args.num_samples}; "
          f"{args.dtype}; {torch.get_num_threads()} threads", flush=True)
    # The two run in lockstep, one token each in turn, each with its own stopwatch: the machine's
    # speed drifts by 2x within minutes, and this way the drift hits both alike.
    ways = {"KV cache": model.generate(idx, n, top_k=1), "plain": plain_generate(model, idx, n)}
    seconds = {name: 0.0 for name in ways}
    tokens = {name: [] for name in ways}
    with speedups.autocast(args.dtype, "cpu"):
        for step in range(n):
            for name, gen in ways.items():
                t0 = time.perf_counter()
                tokens[name].append(next(gen))
                seconds[name] += time.perf_counter() - t0
            if (step + 1) % 64 == 0 or step + 1 == n:
                print(f"{step + 1:4d} tokens: " + ", ".join(
                    f"{name} {seconds[name]:.1f}s ({(step + 1) * idx.size(0) / seconds[name]:.1f} tokens/s)"
                    for name in ways), flush=True)
    cached, plain = (torch.stack(tokens[name], dim=1) for name in ways)
    same = (cached == plain).all(dim=0).long().cumprod(0).sum().item()
    if same < n:  # in fp32 they agree; bf16 rounds differently in the two ways and may flip a near tie
        print(f"warning: the two ways agree on the first {same} of {n} tokens only")
    rate = {name: n * idx.size(0) / seconds[name] for name in ways}
    print(f"\n{'the same tokens both ways' if same == n else 'see the warning'}; tokens/s: "
          f"KV cache {rate['KV cache']:.1f}, plain {rate['plain']:.1f}: x{rate['KV cache'] / rate['plain']:.1f} "
          "with the KV cache")


if __name__ == "__main__":
    main()
