"""
How fast is one layer's causal attention, forward and backward, by PyTorch's SDPA and by our kernel?

    python bench/bench_attention.py                      # GPT-2's shape: B 4, 12 heads, T 1024, head 64, bf16
    python bench/bench_attention.py --turns 20 --seq_len 512

compute/attention.py's two ways, F.scaled_dot_product_attention(is_causal=True) and attention.causal_attention
(compute/attention.cpp: oneDNN brgemm products on AMX, or on AVX512-BF16 without AMX), on the same q, k, v laid out
as the model makes them (views of one (B, T, 3 C) tensor). Each turn times both, SDPA first in every other turn,
forward and backward separately (wall clock, torch's threads), and the per-turn ratio of the two. It prints
GFLOP/s counted as causal attention's useful work: forward 4 B H T^2 D / 2 (two products over half the scores),
backward 2.5x that (five products; SDPA and ours both recompute the scores). Only the ratios compare: the machine
changes speed between turns, both ways of one turn see nearly the same machine. After every turn it also probes
this CPU's bf16 matmul rate at the model's MLP shape (compute.cpu, as bench_train.py does, width n_head x head) and
gives each way's rate as a share of the fastest probe: what "at the matmul rate" would be.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import common  # noqa: F401 (the repository root on sys.path)
from compute import attention, cpu


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def timed(attend, q, k, v, grad):
    """(forward seconds, backward seconds) of one call, wall clock."""
    for t in (q, k, v):
        t.grad = None
    start = time.perf_counter()
    out = attend(q, k, v)
    middle = time.perf_counter()
    out.backward(grad)
    return middle - start, time.perf_counter() - middle


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=12)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--head_size", type=int, default=64)
    parser.add_argument("--turns", type=int, default=10, help="measured turns of both ways, after 2 of warm-up")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: physical cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or cpu.physical_cores())
    B, H, T, D = args.batch_size, args.n_head, args.seq_len, args.head_size
    print(f"cpu: {cpu.cpu_name()}, {torch.backends.cpu.get_cpu_capability()}, bf16 units for brgemm: "
          f"{attention.bf16_units()}, {torch.get_num_threads()} torch thread(s); torch {torch.__version__}")
    if not attention.kernel():
        raise SystemExit(f"our kernel does not run here: {attention.why_not}")
    qkv = torch.randn(B, T, 3 * H * D, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2).detach().requires_grad_() for t in qkv.split(H * D, dim=2))
    grad = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    flops = {"forward": 4 * B * H * T * T * D / 2}
    flops["backward"] = 2.5 * flops["forward"]
    ways = {"sdpa": sdpa, "ours": attention.causal_attention}
    seconds = {(w, p): [] for w in ways for p in flops}
    probes = []
    print(f"shape: B {B} x {H} heads x T {T} x head {D}, bf16; {flops['forward'] / 1e9:.2f} GFLOP forward, "
          f"{flops['backward'] / 1e9:.2f} backward (causal)")
    for turn in range(-2, args.turns):
        order = list(ways) if turn % 2 == 0 else list(reversed(ways))
        times = {w: timed(ways[w], q, k, v, grad) for w in order}
        if turn < 0:
            continue
        probes.append(cpu.measure_matmul_rate(torch.bfloat16, H * D))
        for w in ways:
            for p, s in zip(flops, times[w]):
                seconds[w, p].append(s)
        print(f"turn {turn}: " + ", ".join(f"{w} {1e3 * times[w][0]:.1f} + {1e3 * times[w][1]:.1f} ms" for w in ways)
              + f"; bf16 matmul probe {probes[-1]:.0f} GFLOP/s")
    for p in flops:
        rates = {w: flops[p] / min(seconds[w, p]) / 1e9 for w in ways}
        medians = {w: flops[p] / statistics.median(seconds[w, p]) / 1e9 for w in ways}
        ratios = sorted(a / b for a, b in zip(seconds["sdpa", p], seconds["ours", p]))
        print(f"{p:8s}: sdpa {rates['sdpa']:.0f} GFLOP/s (median {medians['sdpa']:.0f}; "
              f"{rates['sdpa'] / max(probes):.0%}), ours {rates['ours']:.0f} (median {medians['ours']:.0f}; "
              f"{rates['ours'] / max(probes):.0%}); ours is {statistics.median(ratios):.2f}x sdpa (median of "
              f"{len(ratios)} per-turn ratios; {ratios[0]:.2f}-{ratios[-1]:.2f})")
    both = [sum(seconds["sdpa", p][i] for p in flops) / sum(seconds["ours", p][i] for p in flops)
            for i in range(args.turns)]
    print(f"forward + backward: ours is {statistics.median(both):.2f}x sdpa (median of per-turn ratios); the best "
          f"(%: share of it) are against the fastest bf16 matmul probe, {max(probes):.0f} GFLOP/s")


if __name__ == "__main__":
    main()
