"""
Does packing cost speed, and what does LoRA save? Our fine-tuning step on packed rows, against our pretraining step
of the same shape, against what a user would run instead on a CPU (transformers' GPT2LMHeadModel on padded batches),
and with LoRA adapters on a frozen base against full fine-tuning.

    python bench/bench_finetune.py --ab --a packed --b pretrain          # target: >= 1.0x in tokens/s
    python bench/bench_finetune.py --ab --a packed --b hf_padded         # target: >= 1.5x, at no more peak memory
    python bench/bench_finetune.py --ab --a packed,lora=16 --b packed    # target: >= 1.3x in example tokens/s
    python bench/bench_finetune.py --a packed --profile                  # where the time of one packed step goes

The examples: Alpaca-like, --example_len 50 400 tokens (uniform, seeded; capped at --seq_len), each ending with
<|endoftext|>, the last 40% of its tokens the answer (the targets). Their ids are random: speed does not depend on
them. They are written as a finetune.py folder, read back by dataloader.TaskLoader: every configuration sees the
same examples in the same (shuffled) order.

A configuration (--a, --b) is one of these names, then optional items, comma-separated:
    pretrain     train_gpt2.train_step on B x T random tokens: the pretraining step (bench_train.py's default)
    packed       train_gpt2.train_step on TaskLoader's packed rows of B x T (positions restarting at 0, attention
                 inside each example, targets on the answers only): the trainer's code path, not a copy
    hf_padded    transformers' GPT2LMHeadModel (same shape, no dropout; its default attention), N examples per
                 micro-step padded to the longest (dynamic padding, as DataCollatorWithPadding and TRL without
                 packing do), labels -100 on prompts and padding; fused AdamW, clipping at 1.0, eager, bf16 autocast
                 where ours is bf16 (Trainer's defaults). N: as many example tokens a step as a packed step has.
  items: as in bench_train.py (compile | eager, fp32 | bf16, keep | release, batch_size=N: rows for ours, examples
         for hf_padded, threads=N, loss_chunk=N, budget=F, NAME=VALUE), and lora=R (ours: train_gpt2.py --lora R,
         rank-R adapters, alpha 2R, on every target; the base frozen, in bf16 where the step is).

Counted (tokens/s): example tokens, an example's positions (tokens - 1: the last is only predicted), padding
excluded; pretrain's are all B x T. positions: what the step computes on (B x T rows for ours, N x the longest for
hf_padded). cpu A:B: tokens per CPU second (all threads), steadier than wall time on a busy machine. MFU: the FLOPs
each step executes (see step_flops) per second, against this CPU's matmul rate in the configuration's dtype. peak
RSS: during the measured steps; warm-up RSS: from the process's start, building and compiling included.
Lock-step as bench_train.py: both built in advance, each in its own process, one step of A and one of B in turns,
B first in every other pair; the per-pair ratios and their median.
"""
import argparse
import json
import resource
import shutil
import statistics
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch

import common  # before train_gpt2: it puts the repository root on sys.path
from dataloader import TaskLoader, open_split
import finetune
from compute import cpu, fused_loss, speedups
from parallel import world
from compute.fused_loss import IGNORE
from tasks import Example
from tokenizer import EOT, PADDED_VOCAB_SIZE
import lora
import train_args
import train_gpt2
from model import GPTConfig

KINDS = ("pretrain", "packed", "hf_padded")
ANSWER_SHARE = 0.4  # the last 40% of an example's tokens are its answer (EOT included): its targets
SEED = 1337  # of the examples' lengths and ids, and of TaskLoader's order

def parse_config(text):
    """'packed,eager,threads=1' -> {'kind': 'packed', 'compile': False, ...}; items as in bench_train.py."""
    kind, _, rest = text.partition(",")
    if kind not in KINDS:
        raise SystemExit(f"error: --a/--b {text!r}: the configuration starts with one of {', '.join(KINDS)}")
    items = [s.strip() for s in rest.split(",") if s.strip()]
    cfg = dict(common.parse_config(rest), kind=kind)
    if any(i in ("full", "plain") for i in items):
        raise SystemExit(f"error: --a/--b {text!r}: the training step always uses the chunked loss ('full', 'plain' "
                         "are bench_train.py's)")
    if kind == "hf_padded":
        if any(i in ("compile", "eager", "chunked") or i.startswith(("loss_chunk=", "budget=")) for i in items):
            raise SystemExit(f"error: --a/--b {text!r}: hf_padded runs transformers' model eagerly, as its Trainer "
                             "does; compile, chunked, loss_chunk, budget are ours")
        cfg.update(compile=False, loss="full", memory="keep" if "keep" in items else "release")
    return cfg

def describe(cfg):
    return common.describe(cfg, [cfg["kind"], "compile" if cfg["compile"] else "eager", cfg["memory"]])

# -----------------------------------------------------------------------------
# The examples: a finetune.py folder (its own writer), read by the trainer's TaskLoader

def write_examples(out_dir, n, lo, hi, seed=SEED):
    """n examples of lo..hi tokens (uniform), random ids, each ending with EOT, the last ANSWER_SHARE of it the
    targets, written as finetune.py writes a split."""
    rng = np.random.default_rng(seed)
    examples = []
    for length in rng.integers(lo, hi + 1, n):
        ids = rng.integers(0, EOT, length, dtype=np.uint16)
        ids[-1] = EOT
        answer_start = length - max(2, round(ANSWER_SHARE * length))  # at least one answer token and the EOT
        targets = np.zeros(length, np.uint8)
        targets[answer_start:] = 1
        examples.append(Example(ids, targets, answer_start))
    finetune.write_split(out_dir, "train", examples)

def example_order(task_dir, B, T):
    """The examples in the order training takes them: TaskLoader's rows of the first epoch, end to end."""
    return [i for row in TaskLoader(task_dir, "train", B, T, seed=SEED).rows for i in row]

def padded_batch(tokens, targets, examples, indices):
    """transformers' way: the examples right-padded to the longest (pad id EOT, as GPT-2's tokenizer is set up for
    fine-tuning), attention_mask 0 on the padding, labels the target tokens and -100 elsewhere (the model shifts
    them by one itself). Returns (input_ids, attention_mask, labels), each (len(indices), longest)."""
    spans = [examples[i] for i in indices]
    longest = max(end - start for start, _, end in spans)
    ids = torch.full((len(spans), longest), EOT, dtype=torch.long)
    mask = torch.zeros((len(spans), longest), dtype=torch.long)
    labels = torch.full((len(spans), longest), IGNORE, dtype=torch.long)
    for r, (start, _, end) in enumerate(spans):
        n = end - start
        row = torch.from_numpy(tokens[start:end].astype(np.int64))
        ids[r, :n], mask[r, :n] = row, 1
        labels[r, :n] = torch.where(torch.from_numpy(targets[start:end] > 0), row, IGNORE)
    return ids, mask, labels

def step_flops(n_params, lm_head_params, n_layer, n_embd, positions, logits, spans, frozen=0):
    """The FLOPs of a training step (forward + backward) as it runs: 6 per parameter and position (2 forward,
    4 backward; 4 for a frozen one, LoRA's base: no weight gradient), lm_head's only at the positions whose logits
    are computed, and attention's scores and weighted sum, 12 n_layer n_embd per query and key in each span
    attended over (an example, a row, a padded batch row). For rows of T attended whole it is
    sizes.flops_per_token(...) per position, as bench_train.py counts. (frozen: the frozen parameters but lm_head.)"""
    lm_head_flops = (4 if frozen else 6) * lm_head_params * logits
    return ((6 * (n_params - lm_head_params) - 2 * frozen) * positions + lm_head_flops
            + 12 * n_layer * n_embd * sum(s * s for s in spans))

# -----------------------------------------------------------------------------
# The worker: one configuration in its own process, stepping when told to

def our_step(cfg, args, B):
    """train_gpt2.train_step, the trainer's own step, on pretraining batches or on TaskLoader's packed rows. Returns
    (step(): its figures, the model's parameter count, the dtype and why)."""
    fused_loss.LOSS_CHUNK = cfg.get("loss_chunk", fused_loss.LOSS_CHUNK)
    T, accum = args.seq_len, args.grad_accum
    config = GPTConfig(block_size=T, vocab_size=PADDED_VOCAB_SIZE,
                       n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    raw_model = common.random_model(config, cfg.get("threads") or cpu.physical_cores())
    dtype_name, dtype_line = speedups.resolve_dtype(cfg.get("dtype", args.dtype), "cpu", args.n_embd)
    if cfg.get("lora"):  # the trainer's LoRA: a frozen base, in the step's dtype, and fp32 adapters
        lora.add_adapters(raw_model, cfg["lora"], 2.0 * cfg["lora"], list(lora.TARGETS))
        for p in raw_model.parameters():
            p.data = p.data if p.requires_grad or dtype_name == "fp32" else p.data.to(torch.bfloat16)
    run_args = train_args.build_parser().parse_args(["--batch_size", str(B), "--seq_len", str(T),
                                                     "--total_batch_size", str(B * T * accum), "--dtype", dtype_name])
    run = train_gpt2.Run(run_args, world.Ranks(0, 1, 0, 1, "single"), task=None)
    run.model, run.device_type, run.dtype = raw_model, "cpu", dtype_name
    run.optimizer, _ = raw_model.configure_optimizer(run_args.weight_decay, run_args.max_lr, "cpu")
    run.train_model = speedups.compile_model(raw_model, cfg.get("budget")) if cfg["compile"] else raw_model
    run.autocast = speedups.autocast(dtype_name, "cpu")
    n_params, lm_head = sum(p.numel() for p in raw_model.parameters()), raw_model.lm_head.weight.numel()
    frozen = sum(p.numel() for p in raw_model.parameters() if not p.requires_grad) - lm_head * bool(cfg.get("lora"))
    if cfg["kind"] == "pretrain":  # the same random batches every step, as bench_train.py
        pretrain = [(torch.randint(0, EOT, (B, T)), torch.randint(0, EOT, (B, T)), None) for _ in range(accum)], None
    else:
        loader = TaskLoader(args.task_dir, "train", B, T, seed=SEED)
    done = 0

    def step():
        nonlocal done
        if cfg["kind"] == "pretrain":
            prepared, tokens, logits, spans = pretrain, B * T * accum, B * T * accum, [T] * B * accum
        else:  # the next step's rows, made before the clock starts (bench_train.py leaves data loading out too)
            row = loader.row
            prepared = loader.next_step(accum)
            assert loader.epoch == 0, "the benchmark's examples ran out"  # prepare_examples writes enough
            tokens = int(sum(loader.lengths[i] for r in loader.rows[row:loader.row] for i in r))
            logits = sum(len(packed.picked) for _, _, packed in prepared[0])  # the positions lm_head runs on
            spans = [int(n) for _, _, packed in prepared[0] for n in packed.lengths]  # packed_attention's calls
        flops = step_flops(n_params, lm_head, args.n_layer, args.n_embd, B * T * accum, logits, spans, frozen)
        run.train_loader = SimpleNamespace(next_step=lambda micro_steps: prepared)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, cpu0 = time.perf_counter(), time.process_time()
        loss, _, _, updated = train_gpt2.train_step(run, done)
        dt, cpu_time = time.perf_counter() - t0, time.process_time() - cpu0
        if not updated:  # the NaN guard skipped AdamW: this step's time would not be a step's
            raise SystemExit(f"error: step {done + 1} skipped its update (loss {loss}): not a training step to time")
        done += 1
        return {"dt": dt, "cpu": cpu_time, "loss": loss, "tokens": tokens, "positions": B * T * accum,
                "flops": flops, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}

    return step, n_params, dtype_name, dtype_line

def hf_step(cfg, args, N):
    """transformers' GPT2LMHeadModel trained on padded batches of N examples, as its Trainer does without packing."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()  # its notes on a config made from scratch say nothing about speed
    torch.set_num_threads(cfg.get("threads") or cpu.physical_cores())
    dtype_name, dtype_line = speedups.resolve_dtype(cfg.get("dtype", args.dtype), "cpu", args.n_embd)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=args.seq_len, n_embd=args.n_embd,
                                       n_layer=args.n_layer, n_head=args.n_head,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)  # Trainer's adamw_torch_fused
    autocast = speedups.autocast(dtype_name, "cpu")
    dtype_line += f"; transformers {transformers.__version__}, attention {model.config._attn_implementation}"
    tokens_, targets_, examples = open_split(args.task_dir, "train")
    order = example_order(args.task_dir, args.batch_size, args.seq_len)
    n_params, lm_head = sum(p.numel() for p in model.parameters()), model.lm_head.weight.numel()
    taken = 0

    def step():
        nonlocal taken
        batches = []
        for _ in range(args.grad_accum):
            if taken + N > len(order):
                raise SystemExit("error: the benchmark's examples ran out")  # prepare_examples writes enough
            batches.append(padded_batch(tokens_, targets_, examples, order[taken:taken + N]))
            taken += N
        n_targets = sum(int((labels[:, 1:] != IGNORE).sum()) for _, _, labels in batches)
        tokens = sum(int(mask.sum()) - len(mask) for _, mask, _ in batches)  # positions: each example's tokens - 1
        positions = sum(ids.numel() for ids, _, _ in batches)
        flops = step_flops(n_params, lm_head, args.n_layer, args.n_embd, positions, positions,
                           [ids.size(1) for ids, _, _ in batches for _ in ids])
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, cpu0 = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss_accum = 0.0
        for ids, mask, labels in batches:
            with autocast:
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            # the mean over the step's targets, as Trainer's num_items_in_batch makes it (transformers#34191)
            loss = loss * (int((labels[:, 1:] != IGNORE).sum()) / max(n_targets, 1))
            loss_accum += loss.item()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        dt, cpu_time = time.perf_counter() - t0, time.process_time() - cpu0
        return {"dt": dt, "cpu": cpu_time, "loss": loss_accum, "tokens": tokens, "positions": positions,
                "flops": flops, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}

    return step, n_params, dtype_name, dtype_line

def worker(cfg, args):
    if cfg["memory"] == "keep":
        cpu.keep_freed_memory()
    make = hf_step if cfg["kind"] == "hf_padded" else our_step
    common.serve(*make(cfg, args, cfg["batch_size"]), args.n_embd)

# -----------------------------------------------------------------------------
# The parent: the examples, the workers, warm-up, the lock-step, the report

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", default="packed", help="configuration A (default: packed)")
    p.add_argument("--b", default="pretrain", help="configuration B (default: pretrain)")
    p.add_argument("--batch_size", type=int, default=4, help="rows of --seq_len per micro-step (ours)")
    p.add_argument("--example_len", type=int, nargs=2, default=[50, 400], metavar=("MIN", "MAX"),
                   help="the examples' lengths in tokens, uniform (capped at --seq_len)")
    common.add_lockstep_flags(p, warmup=3, warmup_help="steps run first and not measured (packed: the first two "
                              "compile, the second for the shapes that change from step to step)")
    p.add_argument("--task_dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    common.check_lockstep_flags(args)
    if not 2 <= args.example_len[0] <= args.example_len[1]:
        raise SystemExit("error: --example_len MIN MAX needs 2 <= MIN <= MAX (an example is a prompt, an answer, EOT)")
    if args.worker:
        return worker(json.loads(args.worker), args)
    configs = [("A", parse_config(args.a))] + ([("B", parse_config(args.b))] if args.ab else [])
    args.task_dir = tempfile.mkdtemp(prefix="bench_finetune_")
    try:
        benchmark(args, configs)
    finally:
        shutil.rmtree(args.task_dir)

def prepare_examples(args, configs):
    """Writes the examples; sets hf_padded's examples per micro-step (unless given) to a packed step's average.
    Returns the line that describes them."""
    T = args.seq_len
    lo, hi = min(args.example_len[0], T), min(args.example_len[1], T)
    # enough for every step of every configuration in one epoch (a step of ours takes B*grad_accum rows of at most
    # T // lo examples each), twice over
    steps = args.warmup + args.steps + args.profile
    rows = max(c.get("batch_size", args.batch_size) for _, c in configs) * args.grad_accum * steps
    write_examples(args.task_dir, max(1000, 2 * rows * (T // lo + 1)), lo, hi)
    loader = TaskLoader(args.task_dir, "train", args.batch_size, T, seed=SEED)
    per_row = sum(len(row) for row in loader.rows) / len(loader.rows)
    for _, cfg in configs:
        if cfg["kind"] == "hf_padded":
            cfg.setdefault("batch_size", max(1, round(args.batch_size * per_row)))
        cfg.setdefault("batch_size", args.batch_size)
    padding = 1 - loader.lengths.sum() / (len(loader.rows) * T)
    return (f"examples: {len(loader.lengths)} of {lo}..{hi} tokens (uniform, seed {SEED}; mean "
            f"{loader.lengths.mean() + 1:.0f}), the last {ANSWER_SHARE:.0%} of each its targets; "
            f"packed {per_row:.2f} to a row of {T}, {padding:.1%} padding")

def benchmark(args, configs):
    examples_line = prepare_examples(args, configs)
    # both start at once, then build their models
    workers = [common.Worker(name, cfg, __file__, describe, ["--task_dir", args.task_dir]) for name, cfg in configs]
    for w in workers:
        w.ready()
    info = workers[0].info
    print(f"GPT: {args.n_layer} layers, {args.n_embd} wide, {info['n_params'] / 1e6:.2f}M parameters; "
          f"T={args.seq_len}, {args.grad_accum} micro-step(s) per step")
    print(examples_line)
    common.print_cpu_line(info["threads"])
    for w in workers:
        unit = "examples" if w.cfg["kind"] == "hf_padded" else f"rows of {args.seq_len}"
        print(f"{w.name}: {describe(w.cfg)} ({w.cfg['batch_size']} {unit} per micro-step); {w.info['dtype_line']}")
    common.warm_up(workers, args.warmup, args.profile)
    # a line a pair: each one's seconds, example tokens and loss, its matmul rate; A's count per second over B's, of
    # example tokens, of positions, and of example tokens per CPU second
    columns = (lambda name: f"{name + ' s':>8} {name + ' tokens':>9} {name + ' loss':>8}",
               lambda r: f"{r['dt']:8.2f} {r['tokens']:9d} {r['loss']:8.4f}")
    ratios = {"A:B": (6, common.ratio("tokens", "dt")), "pos A:B": (7, common.ratio("positions", "dt")),
              "cpu A:B": (7, common.ratio("tokens", "cpu"))}
    report(args, workers, *common.measure(workers, args.steps, columns, ratios))

def report(args, workers, results, rates, ratios):
    print()
    width = max(len(describe(w.cfg)) for w in workers)
    print(f"{'':2} {'configuration':<{width}} {'tokens/s':>9} {'pos/s':>8} {'MFU':>6} {'peak RSS':>9} "
          f"{'faults/step':>11} {'first step':>10} {'warm-up RSS':>11}")
    rss, mfu = {}, {}
    for w in workers:
        runs = results[w.name]
        seconds = sum(r["dt"] for r in runs)  # over all measured steps: a packed or padded step's tokens vary
        faults = statistics.median(r["faults"] for r in runs)
        rss[w.name] = w.close()
        # against the fastest probe: the machine's noise only ever slows a probe down
        mfu[w.name] = sum(r["flops"] for r in runs) / seconds / (max(rates[w.name]) * 1e9 or float("nan"))
        print(f"{w.name:2} {describe(w.cfg):<{width}} {sum(r['tokens'] for r in runs) / seconds:9.0f} "
              f"{sum(r['positions'] for r in runs) / seconds:8.0f} {mfu[w.name]:6.1%} {rss[w.name] / 2**30:5.2f} GiB "
              f"{faults:11.0f} {w.first:8.1f} s {w.warmup_peak['peak_rss'] / 2**30:7.2f} GiB")
    common.print_matmul_shares(workers, mfu, rates)
    print("(the columns: python bench/bench_finetune.py --help)")
    if args.ab:
        median = {k: statistics.median(v) for k, v in ratios.items()}
        print(f"A/B: A is {median['A:B']:.2f}x B in example tokens/s (median of {len(ratios['A:B'])} per-pair "
              f"ratios; min {min(ratios['A:B']):.2f}, max {max(ratios['A:B']):.2f}); in positions/s "
              f"{median['pos A:B']:.2f}x; in CPU time {median['cpu A:B']:.2f}x")
        print(f"peak RSS: A {rss['A'] / 2**30:.2f} GiB, B {rss['B'] / 2**30:.2f} GiB (A/B {rss['A'] / rss['B']:.2f})")

if __name__ == "__main__":
    main()
