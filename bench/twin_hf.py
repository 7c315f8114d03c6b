"""
Same math, over a whole run: our training loop and transformers' side by side, from the same initial weights, on the
same batches in the same order, step by step, in one process (one thread by default).

    python bench/twin_hf.py                                   # 12 x 128, 32 rows of 128 a step, bf16, 400 steps
    python bench/twin_hf.py --dtype fp32 --steps 50
    python bench/twin_hf.py --n_embd 768 --n_head 12 --steps 4 --dtype both   # GPT-2's shape
    python bench/twin_hf.py --compile --stop_at 25                            # our step under torch.compile

ours  train_gpt2.train_step on a train_gpt2.Run: our GPT, configure_optimizer (fused AdamW, decay on the matrices),
      get_lr, clipping, the chunked loss of compute/fused_loss.py, speedups.autocast.
hf    a plain loop as a transformers user writes it: GPT2LMHeadModel (export_hf.hf_config: dropout 0, the vocab padded
      like ours so the weights can be the same), logits -> F.cross_entropy in fp32, torch's AdamW with its default
      implementation (not fused), decay on all but biases and LayerNorms (the Trainer's rule), clip_grad_norm_, and
      build-nanogpt's schedule as a LambdaLR stepped after each optimizer step.

The batches are the demo's corpus (the Python standard library's source, dataloader.build_demo_shards): a loader with
--seed draws them once and both loops get each one. The initial weights are ours (torch.manual_seed(--seed)), copied
into transformers' model (its Conv1D weights transposed). Val loss: the first --val_tokens of the demo's val shard.

Each step prints both losses, both gradient norms and the largest weight difference (with its tensor). What rounding
explains is measured, not guessed: with bf16, our loop also runs in fp32 from the same weights (the yardstick), and the
bf16 twins part where their weights differ (RMS over all weights) by more than PART_FACTOR times what bf16 rounding
alone made of ours (our bf16 run against our fp32 run); with --dtype both, the fp32 twins' gap is printed beside it. The
fp32 twins part where their weights differ by more than FP32_PART of the weights' RMS. The last line names the first
step and tensor where the runs part, or says that they stayed within rounding.
"""
import argparse
import copy
import math
import time
from argparse import Namespace

import torch
import torch.nn.functional as F

import common
from dataloader import DataLoader, ValLoader, build_demo_shards
from export_hf import hf_config
from compute import cpu, speedups
from parallel import world
from plumbing.common import cache_dir
from model import CONV1D_WEIGHTS, GPT, GPTConfig
from tokenizer import PADDED_VOCAB_SIZE
from train_gpt2 import Run, train_step

PART_FACTOR = 3.0  # bf16 twins: a gap beyond 3x what bf16 rounding alone makes of our run is no longer rounding
FP32_PART = 1e-3  # fp32 twins: a gap beyond a thousandth of the weights' RMS (fp32 rounds at 6e-8)

# -----------------------------------------------------------------------------
# The two models, with the same weights

def build_twins(config, seed):
    """(ours, theirs): our GPT as train_gpt2.py builds it from scratch, and transformers' GPT2LMHeadModel holding the
    same weights."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    ours = GPT(config)
    theirs = GPT2LMHeadModel(GPT2Config(**dict(hf_config(config), vocab_size=config.vocab_size)))
    with torch.no_grad():
        for name, p in ours.named_parameters():  # (lm_head.weight is wte's: named once, as in theirs)
            theirs.get_parameter(name).copy_(p.t() if name.endswith(CONV1D_WEIGHTS) else p)
    assert theirs.lm_head.weight is theirs.transformer.wte.weight
    return ours, theirs


def pairs(ours, theirs):
    """(name, our tensor, theirs in our layout) for every weight."""
    for name, p in ours.named_parameters():
        q = theirs.get_parameter(name)
        yield name, p, (q.t() if name.endswith(CONV1D_WEIGHTS) else q)


def gaps(a, b):
    """{name: (largest |difference|, RMS difference)} between the same weights of two models (ours or transformers', in
    any order)."""
    hf = [m for m in (a, b) if not isinstance(m, GPT)]
    if hf:
        triples = pairs(a if b is hf[0] else b, hf[0])
    else:
        triples = ((n, p, q) for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()))
    with torch.no_grad():
        return {n: ((p - q).abs().max().item(), (p - q).pow(2).mean().sqrt().item()) for n, p, q in triples}


def overall(model, per_tensor):
    """The RMS over every weight of the model, from per-tensor RMS values."""
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    return math.sqrt(sum(per_tensor[n] ** 2 * sizes[n] for n in per_tensor) / sum(sizes.values()))


def transformers_loss(model, x, y):
    """What a transformers user computes: the logits, then cross-entropy in fp32 (as transformers' own loss does)."""
    logits = model(x).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

# -----------------------------------------------------------------------------
# The two loops

class OneBatch:
    """Stands in for the run's DataLoader: train_step asks it for the step's batch, which the twin loop set."""
    batch = None

    def next_step(self, micro_steps):
        assert micro_steps == 1
        return [(*self.batch, None)], None


class Ours:
    """Our loop: train_gpt2.train_step on a Run as main() fills it (one rank, no accumulation; --compile: compiled)."""

    def __init__(self, model, args, dtype):
        args = Namespace(**vars(args), shard="none", pp=1, tp=1, total_batch_size=args.batch_size * args.seq_len)
        self.run = Run(args, world.Ranks(0, 1, 0, 1, "single"), None)
        self.run.train_loader, self.run.autocast = OneBatch(), speedups.autocast(dtype, "cpu")
        self.run.model = self.model = model  # (evaluation runs the plain model, as train_gpt2.evaluate does)
        self.run.train_model = speedups.compile_model(model) if args.compile else model  # as prepare_training does
        self.run.optimizer, fused = model.configure_optimizer(args.weight_decay, args.max_lr, "cpu")
        assert fused

    def step(self, step, x, y):
        self.run.train_loader.batch = (x, y)
        loss, norm, _, updated = train_step(self.run, step)
        assert updated
        return loss, norm

    def val_loss(self, batches):
        self.model.eval()
        with torch.no_grad(), self.run.autocast:
            return sum(self.model(x, y)[1].item() for x, y in batches) / len(batches)


def nanogpt_schedule(args):
    """build-nanogpt's learning rate as a multiple of max_lr (LambdaLR's form): linear warmup over warmup_steps from
    max_lr / warmup_steps, then a half cosine down to min_lr at max_steps."""
    def factor(it):
        if it < args.warmup_steps:
            return (it + 1) / args.warmup_steps
        if it >= args.max_steps:  # (LambdaLR asks for the step after the last one too)
            return args.min_lr / args.max_lr
        progress = (it - args.warmup_steps) / (args.max_steps - args.warmup_steps)
        return (args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (args.max_lr - args.min_lr)) / args.max_lr
    return factor


class Theirs:
    """A plain transformers loop."""

    def __init__(self, model, args, dtype):
        from transformers.trainer_pt_utils import get_parameter_names
        decay = [n for n in get_parameter_names(model, [torch.nn.LayerNorm]) if not n.endswith("bias")]
        params = dict(model.named_parameters())
        groups = [{"params": [p for n, p in params.items() if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in params.items() if n not in decay], "weight_decay": 0.0}]
        self.model, self.grad_clip = model, args.grad_clip
        self.optimizer = torch.optim.AdamW(groups, lr=args.max_lr, betas=(0.9, 0.95), eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, nanogpt_schedule(args))
        self.autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")

    def step(self, step, x, y):
        self.model.train()
        self.optimizer.zero_grad()
        with self.autocast:
            loss = transformers_loss(self.model, x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return loss.item(), norm.item()

    def val_loss(self, batches):
        self.model.eval()
        with torch.no_grad(), self.autocast:
            return sum(transformers_loss(self.model, x, y).item() for x, y in batches) / len(batches)

# -----------------------------------------------------------------------------
# The twin run

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "both"])
    p.add_argument("--no_yardstick", action="store_true", help="bf16: skip our fp32 run (then no verdict on the bf16 "
                   "twins; their final val losses only, 1.6x faster)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (the schedule's max_steps)")
    p.add_argument("--stop_at", type=int, default=None, help="stop after this many steps of the --steps schedule")
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=32, help="rows a step")
    p.add_argument("--seq_len", type=int, default=128, help="tokens a row (and the models' block size)")
    p.add_argument("--max_lr", type=float, default=3e-3)
    p.add_argument("--min_lr", type=float, default=None, help="default: max_lr / 10")
    p.add_argument("--warmup_steps", type=int, default=None, help="default: 10%% of --steps")
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337, help="the initial weights and the batches' order")
    p.add_argument("--val_tokens", type=int, default=32768)
    p.add_argument("--eval_every", type=int, default=100, help="val losses every N steps (and at the end)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="our step compiled, as train_gpt2.py runs it by default "
                   "(the demo runs it eager, as this bench does without the flag)")
    args = p.parse_args(argv)
    if min(args.steps, args.n_layer, args.n_head, args.n_embd, args.batch_size, args.seq_len, args.threads) <= 0:
        raise SystemExit("error: --steps, --n_layer, --n_head, --n_embd, --batch_size, --seq_len, --threads must be "
                         "positive")
    if args.n_embd % args.n_head:
        raise SystemExit(f"error: --n_embd {args.n_embd} is not a multiple of --n_head {args.n_head}")
    args.min_lr = args.max_lr / 10 if args.min_lr is None else args.min_lr
    args.warmup_steps = max(1, args.steps // 10) if args.warmup_steps is None else args.warmup_steps
    args.max_steps, args.stop_at = args.steps, min(args.stop_at or args.steps, args.steps)
    return args


def build_runs(args):
    """{name: loop}: ours and theirs in each dtype asked for; with bf16 alone, our fp32 run as the yardstick."""
    config = GPTConfig(block_size=args.seq_len, vocab_size=PADDED_VOCAB_SIZE, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    ours, theirs = build_twins(config, args.seed)
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    runs = {}
    for dtype in dtypes:
        runs[f"ours_{dtype}"] = Ours(copy.deepcopy(ours), args, dtype)
        runs[f"hf_{dtype}"] = Theirs(copy.deepcopy(theirs), args, dtype)
    if dtypes == ["bf16"] and not args.no_yardstick:
        runs["ours_fp32"] = Ours(copy.deepcopy(ours), args, "fp32")
    return runs


def parting(step, runs, found):
    """This step's gaps, {label: (largest weight difference, its tensor, RMS difference over all weights)}; records in
    `found` the first step where a pair of twins parts beyond rounding, and the tensor that has parted most. The RMS
    over all weights decides, not the largest difference: AdamW moves a weight whose gradient is near 0 by about lr
    whatever the gradient's size, so rounding that flips its sign makes a difference of 2 lr at once in any two runs
    that round differently; and a small tensor's RMS (a bias of 128) is as noisy. Tensors of fewer than 1024 weights
    are not named."""
    model = {name: run.model for name, run in runs.items()}
    ours = next(iter(model.values()))
    out = {}
    def summary(g):
        return (*max((v[0], k) for k, v in g.items()), overall(ours, {k: v[1] for k, v in g.items()}))
    big = [n for n, p in ours.named_parameters() if p.numel() >= 1024]
    if "hf_fp32" in model:
        twin32 = gaps(model["ours_fp32"], model["hf_fp32"])
        with torch.no_grad():
            scale = {n: p.pow(2).mean().sqrt().item() for n, p in model["ours_fp32"].named_parameters()}
        out["fp32 twins"] = summary(twin32)
        if "fp32" not in found and out["fp32 twins"][2] > FP32_PART * overall(ours, scale):
            n = max(big, key=lambda n: twin32[n][1] / scale[n])
            found["fp32"] = (step, n, f"RMS gap {out['fp32 twins'][2]:.2e} over all weights, {FP32_PART:g} of "
                                      f"their RMS {overall(ours, scale):.3g}; {n}'s: {twin32[n][1]:.2e} of "
                                      f"{scale[n]:.3g}")
    if "hf_bf16" in model:
        twin16 = gaps(model["ours_bf16"], model["hf_bf16"])
        out["bf16 twins"] = summary(twin16)
        if "ours_fp32" in model:
            rounding = gaps(model["ours_bf16"], model["ours_fp32"])
            out["ours bf16-fp32"] = summary(rounding)
            if "bf16" not in found and out["bf16 twins"][2] > PART_FACTOR * out["ours bf16-fp32"][2]:
                n = max(big, key=lambda n: twin16[n][1] / max(rounding[n][1], 1e-30))
                found["bf16"] = (step, n, f"RMS gap {out['bf16 twins'][2]:.2e} over all weights, "
                                          f"{PART_FACTOR:g}x bf16's own rounding (ours bf16 vs fp32: "
                                          f"{out['ours bf16-fp32'][2]:.2e}); "
                                          f"{n}'s: {twin16[n][1]:.2e} vs {rounding[n][1]:.2e}")
    return out


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cpu.keep_freed_memory()  # as train_gpt2.py does: freed logits are reused, not handed back and faulted in again
    common.print_cpu_line(args.threads)
    data_dir = cache_dir("demo")
    build_demo_shards(data_dir)
    loader = DataLoader(data_dir, "train", args.batch_size, args.seq_len, seed=args.seed)
    val = list(ValLoader(data_dir, args.seq_len, args.val_tokens, args.batch_size))
    runs = build_runs(args)
    print(f"{args.n_layer} layers x {args.n_embd} wide, {args.n_head} heads; {args.batch_size} x {args.seq_len} tokens "
          f"a step, {args.steps} steps, lr {args.max_lr:g} -> {args.min_lr:g} after {args.warmup_steps} warmup; "
          f"seed {args.seed}; runs: {', '.join(runs)}; val: {len(val) * args.batch_size * args.seq_len} tokens")
    found, finals = {}, {}
    for step in range(args.stop_at + 1):
        if step % args.eval_every == 0 or step == args.stop_at:
            finals = {name: run.val_loss(val) for name, run in runs.items()}
            print(f"step {step:4d} val | " + " | ".join(f"{n} {v:.4f}" for n, v in finals.items()), flush=True)
        if step == args.stop_at:
            break
        x, y = loader.next_batch()
        t0 = time.time()
        stats = {name: run.step(step, x, y) for name, run in runs.items()}
        dt = time.time() - t0
        line = f"step {step:4d} | lr {runs[next(iter(runs))].run.optimizer.param_groups[0]['lr']:.3e} | "
        line += " | ".join(f"{d} loss {stats['ours_' + d][0]:.5f} {stats['hf_' + d][0]:.5f} "
                           f"norm {stats['ours_' + d][1]:.4f} {stats['hf_' + d][1]:.4f}"
                           for d in ("fp32", "bf16") if "hf_" + d in stats)
        line += "".join(f" | {k} max {v:.1e} ({n.replace('transformer.', '')}) rms {r:.2e}"
                        for k, (v, n, r) in parting(step, runs, found).items())
        print(line + f" | {dt:.1f}s", flush=True)
    report(args, runs, found, finals)


def report(args, runs, found, finals):
    for d in ("fp32", "bf16"):
        if f"hf_{d}" in runs:
            diff = finals[f"ours_{d}"] - finals[f"hf_{d}"]
            print(f"{d}: final val loss ours {finals[f'ours_{d}']:.4f}, transformers {finals[f'hf_{d}']:.4f}, "
                  f"ours - transformers {diff:+.4f} (seed {args.seed})")
    verdicts = []
    for d in ("fp32", "bf16"):
        if d in found:
            step, tensor, why = found[d]
            verdicts.append(f"the {d} twins part at step {step} in {tensor} ({why})")
        elif f"hf_{d}" in runs and (d == "fp32" or "ours_fp32" in runs):
            verdicts.append(f"the {d} twins stay within rounding for {args.stop_at} steps")
    print("verdict: " + ("; ".join(verdicts) if verdicts else "none (no yardstick: --no_yardstick)"))


if __name__ == "__main__":
    main()
