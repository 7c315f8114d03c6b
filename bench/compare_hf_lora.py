"""
Do our LoRA defaults learn as well as peft's LoRA? One pretrained base fine-tuned with rank-R adapters on a task, two
ways, on the same examples for the same epochs: compare_hf_finetune.py's comparison (its tasks, its val loss and
accuracy, its flags), with --lora.

    python train_gpt2.py --demo --max_steps 300 --log_dir /tmp/base_log        # a small base, made here
    python export_hf.py /tmp/base_log/model_00300.pt /tmp/base_hf                # one folder both sides load
    python bench/compare_hf_lora.py --init_from /tmp/base_hf --synthetic reverse  # peft as users run it
    # the same hyperparameters
    python bench/compare_hf_lora.py --init_from /tmp/base_hf --synthetic reverse --hf_like_ours

ours  train_gpt2.py --init_from BASE --lora R --lora_alpha A on finetune.py's task folder, every other setting a
      fine-tuning default (compare_hf_finetune.py says which flags the bench adds: none that changes a weight).
peft  transformers' GPT2LMHeadModel.from_pretrained(BASE) (its dropout --hf_dropout: our export's config has none),
      wrapped by peft.get_peft_model(LoraConfig(r=R, lora_alpha=A, the four targets, fan_in_fan_out=True,
      lora_dropout=--hf_lora_dropout, bias="none")): only the adapters train, in compare_hf_finetune.py's loop
      (padded batches of --hf_batch, -100 labels, AdamW with weight decay --hf_weight_decay, linear warmup and decay
      to 0, clipping at 1.0), at --hf_lr (default 2e-4, a learning rate common in peft's recipes).
      --hf_like_ours: ours' hyperparameters instead, read from the args.json our run writes as it starts: as many
      steps (the epochs' shuffled examples dealt out evenly over them: ours packs whole examples into rows, so its
      steps hold about as many, not exactly), the same learning rate at each step (train_gpt2.get_lr: linear warmup,
      cosine to min_lr), AdamW betas (0.9, 0.95), ours' weight decay on the adapters, ours' clipping, no dropout.
      What still differs: the examples' order and grouping, and A's random initial values (each side its own).
      --same_batches (with --hf_like_ours): not those either: each step of peft's holds the examples of ours' step
      (read from ours' task folder by our loader, with ours' seed), and peft's A starts at ours' values (drawn as
      lora.init_adapters draws them): the two runs differ by their code alone.

It prints the base's val loss and accuracy (ours' evaluation at step 0), each side's after training, and whether
they are within --tolerance (issue 29's acceptance: 0.05 in val loss and in accuracy).
"""
import json
import os
import time

import torch

import compare_hf_finetune as compare
import lora
from train_gpt2 import get_lr


def build_parser():
    p = compare.build_parser()
    p.description = "Our LoRA fine-tuning against peft's, on the same pretrained base and examples."
    a = p.add_argument
    a("--init_from", required=True,
      help="the base: a Hugging Face-layout folder (export_hf.py's), loaded by both sides")
    a("--lora", type=int, default=16, help="rank R (default: %(default)s)")
    a("--lora_alpha", type=float, default=32.0, help="alpha, the scale being alpha / R (default: %(default)s)")
    a("--hf_lora_dropout", type=float, default=0.05, help="peft's lora_dropout (default: %(default)s)")
    a("--hf_like_ours", action="store_true", help="peft at ours' hyperparameters (steps, learning rates, AdamW, "
      "weight decay, clipping; no dropout): what differs is then the loop alone")
    a("--same_batches", action="store_true", help="with --hf_like_ours: ours' examples in each step and ours' first A")
    a("--tolerance", type=float, default=0.05, help="ours within this of peft in val loss and in accuracy: acceptance")
    p.set_defaults(hf_lr=2e-4, hf_dropout=0.0)
    return p


def parse_args(argv=None):
    args = compare.parse_args(argv, build_parser())
    config_file = os.path.join(args.init_from, "config.json")
    if not os.path.isfile(config_file):
        raise SystemExit(f"error: --init_from {args.init_from}: not a Hugging Face-layout folder (no config.json): "
                         "export one of our checkpoints with export_hf.py")
    if args.same_batches and not args.hf_like_ours:
        raise SystemExit("error: --same_batches is a refinement of --hf_like_ours: give both")
    if args.hf_like_ours and args.only == "hf":
        raise SystemExit("error: --hf_like_ours reads ours' settings from its run: not with --only hf")
    with open(config_file) as f:
        config = json.load(f)
    # the base's shape (for the summary line), its context (answers stop at its end), and ours' LoRA flags
    keys = ("n_layer", "n_head", "n_embd", "n_positions")
    args.n_layer, args.n_head, args.n_embd, args.block_size = (config[k] for k in keys)
    args.init_from = os.path.abspath(args.init_from)
    args.our_flags = (f"--init_from {args.init_from} --lora {args.lora} --lora_alpha {args.lora_alpha:g} "
                      f"{args.our_flags}")
    return args


def ours_settings(work, timeout=3600):
    """The arguments our run resolved: its log folder's args.json, written as it starts (before its first step)."""
    path, out, t0 = os.path.join(work, "log", "args.json"), os.path.join(work, "ours.out"), time.time()
    while not os.path.exists(path):
        with open(out) as f:
            text = f.read()
        if "Traceback" in text or "\nerror:" in "\n" + text or time.time() - t0 > timeout:
            raise SystemExit(f"error: our run wrote no {path}:\n{text[-3000:]}")
        time.sleep(1)
    with open(path) as f:
        return json.load(f)


def peft_model(args, dropout, lora_dropout):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel
    torch.manual_seed(args.seed)
    base = GPT2LMHeadModel.from_pretrained(args.init_from, **dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"),
                                                                            dropout))
    config = LoraConfig(r=args.lora, lora_alpha=args.lora_alpha, target_modules=list(lora.TARGETS.values()),
                        fan_in_fan_out=True, lora_dropout=lora_dropout, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(base, config)


def run_peft(args, train, val, block_size):
    """compare_hf_finetune.run_hf's part: peft's adapters on the base, trained by the HF loop; its result."""
    from transformers import get_linear_schedule_with_warmup
    if not args.hf_like_ours:
        model = peft_model(args, args.hf_dropout, args.hf_lora_dropout)
        batches = compare.hf_batches(args, len(train))
        optimizer = compare.hf_optimizer(model, args.hf_lr, args.hf_weight_decay)
        warmup = round(args.hf_warmup * len(batches))
        schedule = get_linear_schedule_with_warmup(optimizer, warmup, len(batches))
        settings = (f"peft: lora_dropout {args.hf_lora_dropout:g}; {len(train)} examples x {args.epochs} epochs = "
                    f"{len(batches)} steps of {args.hf_batch} examples; lr {args.hf_lr:g} linear to 0, "
                    f"warmup {warmup}, betas (0.9, 0.999), weight decay {args.hf_weight_decay:g}, "
                    f"dropout {args.hf_dropout:g}")
        return {**compare.hf_fit_and_score(model, train, val, batches, optimizer, schedule, args, block_size),
                "settings": settings}
    ours = ours_settings(args.work_dir)
    model = peft_model(args, 0.0, 0.0)
    steps, max_lr, min_lr, warmup = ours["max_steps"], ours["max_lr"], ours["min_lr"], ours["warmup_steps"]
    generator = torch.Generator().manual_seed(args.seed)
    stream = [i for _ in range(args.epochs) for i in torch.randperm(len(train), generator=generator).tolist()]
    batches = [stream[len(stream) * s // steps:len(stream) * (s + 1) // steps] for s in range(steps)]
    if args.same_batches:
        batches = ours_batches_and_first_a(args, ours, model)
    optimizer = compare.hf_optimizer(model, max_lr, ours["weight_decay"], betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: get_lr(s, warmup, steps, max_lr, min_lr) / max_lr)
    settings = (f"peft, ours' hyperparameters: {len(train)} examples x {args.epochs} epochs = {steps} steps of "
                f"{len(stream) / steps:.1f} examples; lr {max_lr:g} -> {min_lr:g} (cosine), warmup {warmup}, betas "
                f"(0.9, 0.95), weight decay {ours['weight_decay']:g}, clip {ours['grad_clip']:g}, no dropout")
    result = compare.hf_fit_and_score(model, train, val, batches, optimizer, schedule, args, block_size,
                                      clip=ours["grad_clip"])
    return {**result, "settings": settings}


def ours_batches_and_first_a(args, ours, model):
    """Each step's examples as ours' loader deals them (train_gpt2's rows, world size 1), and ours' first A copied
    into peft's model (lora.init_adapters' draws depend on the shapes and the seed alone, not on the base)."""
    from dataloader import TaskLoader
    from model import GPT, GPTConfig
    loader = TaskLoader(ours["data_dir"], "train", ours["batch_size"], ours["seq_len"], seed=ours["seed"])
    rows = ours["total_batch_size"] // ours["seq_len"]
    batches = [[i for _ in range(rows) for i in loader._next_row()] for _ in range(ours["max_steps"])]
    drawn = lora.add_adapters(GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)), args.lora,
                              args.lora_alpha, list(lora.TARGETS), init=False)
    lora.init_adapters(drawn, ours["seed"])
    theirs = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in lora.adapters(drawn).items():
            theirs[f"base_model.model.{name}.default.weight"].copy_(p if "lora_A" in name else torch.zeros_like(p))
    return batches


def first_evaluation(work):
    """Ours' val loss and accuracy at step 0: the base's, before any adapter has moved."""
    first = {}
    with open(os.path.join(work, "log", "log.txt")) as f:
        for _, kind, value in map(str.split, f):
            first.setdefault(kind, float(value))
    return first.get("val"), first.get("task")


def main(argv=None):
    args = parse_args(argv)
    print(f"base {args.init_from}: {args.n_layer} layers x {args.n_embd} wide; LoRA r {args.lora}, alpha "
          f"{args.lora_alpha:g}", flush=True)
    results = compare.main(args=args, theirs=run_peft)
    if "ours" in results:
        val_loss, accuracy = first_evaluation(args.work_dir)
        print(f"the base, before fine-tuning (ours' step 0): val loss {val_loss:.4f}, accuracy {accuracy:.3f}")
    if len(results) == 2:
        loss_gap = results["ours"]["val loss"] - results["hf"]["val loss"]
        accuracy_gap = results["ours"]["accuracy"] - results["hf"]["accuracy"]
        within = abs(loss_gap) <= args.tolerance and abs(accuracy_gap) <= args.tolerance
        print(f"ours - peft: val loss {loss_gap:+.4f}, accuracy {accuracy_gap:+.3f}: "
              f"{'within' if within else 'NOT within'} {args.tolerance:g}")
    return results


if __name__ == "__main__":
    main()
