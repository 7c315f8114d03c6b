"""
train_gpt2.py's command line: its flags and their defaults, then how a run's arguments are resolved: the command line,
or a resumed run's arguments with the flags given now; the demo's settings when there is no data; fine-tuning's
defaults for a task folder. A library: train_gpt2.py calls resolve_args, then check_args, before anything expensive.
"""
import argparse
import json
import os
import re

import clock
import dataloader
import lora
from parallel import node_disks, tensor_parallel
from parallel.pipeline import check_layout
from plumbing.checkpoints import load_checkpoint
from plumbing.common import ShowDefaults, cache_dir, one_line, read_json
from plumbing.inputs import find_shards

# -----------------------------------------------------------------------------
# The flags

def build_parser(defaults=True):
    """train_gpt2.py's flags; defaults False: none has a default (which flags the command line gives)."""
    p = argparse.ArgumentParser(formatter_class=ShowDefaults,  # --help shows every default
                                description="Train or fine-tune GPT-2 on CPUs (and GPUs).",
                                argument_default=None if defaults else argparse.SUPPRESS)
    def d(value):
        return value if defaults else argparse.SUPPRESS
    for add in (add_run_flags, add_model_flags, add_evaluation_flags, add_machine_flags, add_layout_flags,
                add_finetuning_flags):
        add(p.add_argument, d)
    return p

def add_run_flags(a, d):
    """Where the run reads and writes, what it starts from, how long it takes."""
    a("--data_dir", default=d("edu_fineweb10B"), help="folder of uint16 .npy shards named *train* / *val*")
    a("--log_dir", default=d("log"), help="checkpoints and log.txt go here")
    a("--init_from", default=d("scratch"), help="scratch | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | "
      "a Hugging Face-layout directory | one of our checkpoints (.pt)")
    a("--resume", nargs="?", const="latest", default=d(None),
      help="continue from the newest checkpoint in --log_dir, or from the given file")
    a("--overwrite", action="store_true", default=d(False), help="start afresh in a --log_dir that holds a run")
    a("--hours", "--time", type=parse_hours, default=d(None), help="train the best model this machine can in "
      "this time: hours (0.25), or 90m, 2h, 45s. It measures a family of shapes here, then sets the model, steps, "
      "schedule and intervals, and ends on time; flags given override the plan (docs/training.md) (default: off)")
    a("--seed", type=int, default=d(1337), help="weights' init and data order")
    a("--demo", action="store_true", default=d(False), help="train a small GPT on a local demo corpus")

def add_model_flags(a, d):
    """A scratch model's shape, the batch and the schedule (build-nanogpt's GPT-2 (124M) recipe by default)."""
    a("--n_layer", type=int, default=d(12), help="transformer blocks of a scratch model")
    a("--n_head", type=int, default=d(12), help="attention heads per block (divides --n_embd)")
    a("--n_embd", type=int, default=d(768), help="width of the residual stream")
    a("--block_size", type=int, default=d(1024), help="context length of a scratch model")
    a("--batch_size", type=int, default=d(8), help="sequences per micro-step and rank")
    a("--seq_len", type=int, default=d(1024), help="tokens per training sequence (<= block_size)")
    a("--total_batch_size", type=int, default=d(524288), help="tokens per optimizer step (2**19, ~0.5M)")
    a("--max_steps", type=int, default=d(19073), help="10B tokens / 2**19 tokens per step")
    a("--warmup_steps", type=int, default=d(715), help="steps of linear warmup to --max_lr")
    a("--max_lr", type=float, default=d(6e-4), help="peak learning rate, after warmup")
    a("--min_lr", type=float, default=d(6e-5), help="learning rate at the end of the cosine decay")
    a("--weight_decay", type=float, default=d(0.1), help="AdamW's decay of matrices (not biases, gains)")
    a("--grad_clip", type=float, default=d(1.0), help="clip the gradient norm to this")

def add_evaluation_flags(a, d):
    """Evaluations and checkpoints: how often, and how many are kept."""
    a("--eval_interval", type=int, default=d(250), help="steps between val loss measurements")
    a("--val_tokens", type=int, default=d(None), help="val loss is measured on this many tokens (default: sized to the "
      "run, a pass a tenth of the time between evaluations: 0.3 x --eval_interval x --total_batch_size, at most "
      "10485760, build-nanogpt's)")
    a("--hellaswag_interval", type=int, default=d(250), help="0 = off")
    a("--hellaswag_dir", default=d(None), help="HellaSwag cache folder (default: hellaswag.py's)")
    a("--sample_interval", type=int, default=d(250), help="0 = off")
    a("--checkpoint_interval", type=int, default=d(250), help="0 = never save a checkpoint")
    a("--keep_checkpoints", type=int, default=d(5), help="keep the newest N checkpoints (0 = all)")

def add_machine_flags(a, d):
    """How each rank computes, and how the ranks join."""
    a("--dtype", choices=["auto", "bf16", "fp32"], default=d("auto"), help="precision of the forward pass; auto = bf16 "
      "where it is fast (a CPU with AVX512-BF16 or AMX, measured; a GPU that has it), else fp32")
    a("--recompute", action="store_true", default=d(False), help="keep only each block's input for backward, which "
      "runs the block's forward again: a third more work, a fraction of the activations' memory (GPT-2 XL with LoRA)")
    a("--compile", action=argparse.BooleanOptionalAction, default=d(True),
      help="torch.compile the training step (--no-compile: run it eagerly)")
    a("--device", default=d("auto"), help="auto | cpu | cuda | cuda:N | xpu")
    a("--backend", choices=["auto", "ccl", "gloo", "nccl", "xccl"], default=d("auto"),
      help="process group backend; auto = ccl if oneccl_bindings_for_pytorch imports, else gloo (CPU), nccl, xccl")
    a("--dist_timeout", type=float, default=d(300), help="seconds a collective may wait for the other ranks")
    a("--threads", type=int, default=d(0), help="torch threads per rank (0 = physical cores / ranks per node)")
    a("--ipex", choices=["auto", "on", "off"], default=d("auto"),
      help="Intel Extension for PyTorch's ipex.optimize on CPU/XPU; auto = when installed, its gradients check "
      "right at the run's shapes and it times faster (never in a compiled run: docs/distributed.md)")

def add_layout_flags(a, d):
    """How several ranks split the training (docs/parallel.md)."""
    a("--shard", choices=["none", "full", "grads"], default=d("none"), help="none: every rank holds the whole training "
      "state (DDP); full: weights, gradients and AdamW state split across the ranks (FSDP2), for models too big for "
      "one; grads: gradients and AdamW state split, weights gathered once a step (ZeRO-2: less traffic, more memory)")
    a("--pp", type=int, default=d(1), help="pipeline parallel: the blocks cut into this many stages (pipeline.py)")
    a("--parallel", choices=["auto", "dp", "fsdp", "fsdp_grads", "pp", "tp"], default=d("auto"), help="how several "
      "ranks split the training: auto: DDP where the model fits each rank, else the layout predicted fastest from the "
      "measured links and memory (parallel/layouts.py); dp, fsdp (--shard full), fsdp_grads (--shard grads), "
      "pp (--pp = ranks), tp (--tp = ranks) force one; --shard, --pp or --tp force theirs")
    a("--max_memory", type=float, default=d(None), metavar="GIB", help="--parallel auto and --hours: GiB of training "
      "state and activations a rank may hold (default: the node's available memory shared by its ranks)")
    a("--pp_schedule", choices=["1f1b", "gpipe"], default=d("1f1b"),
      help="--pp's schedule: 1f1b (at most N micro-batches' activations held per stage) or gpipe (every forward, then "
      "every backward)")
    a("--tp", type=int, default=d(1),
      help="tensor parallel: each block split over this many ranks (tensor_parallel.py)")

def add_finetuning_flags(a, d):
    """Task data and LoRA (docs/finetuning.md)."""
    a("--epochs", type=int, default=d(None), help="task data (a finetune.py folder): passes over the training "
      "examples (sets --max_steps; default 3)")
    a("--task_examples", type=int, default=d(200), help="task data: val examples whose answers are scored at each eval")
    a("--lora", type=int, default=d(0), metavar="R", help="LoRA: train rank-R adapters on a frozen base (lora.py); "
      "0: train every weight")
    a("--lora_alpha", type=float, default=d(None), help="LoRA's scale is alpha / R (default: 2 R, a scale of 2 at any "
      "rank: changing the rank does not change how far a step moves the model)")
    a("--lora_targets", default=d("attn,proj,fc,mlp_proj"), help="the Linear layers of each block that get adapters: "
      "attn (attn.c_attn), proj (attn.c_proj), fc (mlp.c_fc), mlp_proj (mlp.c_proj) (default: all four)")

def parse_hours(text):
    """--hours / --time: '0.25' (hours), '90m', '2h', '45s' -> hours (a float). Not above zero: one error line."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*([hms]?)\s*", str(text))
    if not m:
        raise SystemExit(f"error: --hours {text}: give hours (0.25) or a time with its unit (90m, 2h, 45s)")
    hours = float(m.group(1)) / {"h": 1, "": 1, "m": 60, "s": 3600}[m.group(2)]
    if not hours > 0:
        raise SystemExit(f"error: --hours {text}: the time must be above zero")
    return hours

def check_hours(given, saved_args):
    """The flags' conflicts with --hours, before any work: --max_steps (the plan sets it: give one), and a resumed
    run's plan (a --resume keeps the run's budget and shape: another --hours would be another plan)."""
    if "hours" in given and "max_steps" in given:
        raise SystemExit("error: --hours and --max_steps both set the run's length: drop --max_steps (the plan "
                         "re-fits the steps to the clock) or drop --hours")
    if saved_args is not None and "hours" in given and given["hours"] != saved_args.get("hours"):
        was = saved_args.get("hours")
        raise SystemExit(f"error: --resume: the run was planned for {f'--hours {was:g}' if was else 'no --hours'}, "
                         f"not --hours {given['hours']:g}: resume it without --hours (or start a new --log_dir)")

# The demo: a small GPT on the Python standard library's own source, which every machine with Python has.
# 128 wide for a CPU without native bf16 (fp32): its lm_head (50304 x 128) is most of its FLOPs. Eager: a cold
# torch.compile costs more than it saves in 60 steps. Measured end to end, and why: docs/training.md.
DEMO_ARGS = dict(n_layer=4, n_head=4, n_embd=128, block_size=256, seq_len=256, batch_size=8,
                 total_batch_size=2048, max_steps=60, warmup_steps=10, max_lr=3e-3, min_lr=3e-4,
                 eval_interval=30, val_tokens=32768, sample_interval=60, hellaswag_interval=0,
                 checkpoint_interval=60, log_dir="log_demo", compile=False)

# -----------------------------------------------------------------------------
# Resolving a run's arguments

# Fine-tuning (--data_dir a folder from finetune.py): its defaults, where the flag is not given (docs/finetuning.md):
# rows as long as the longest example and about EXAMPLES_PER_STEP examples a step, so that an epoch is many steps;
# a learning rate 10x lower for a pretrained model than for one from scratch; 5% of the steps warming up, then
# cosine decay to a tenth; no HellaSwag or samples, but the task's own accuracy at each eval. Measured against a
# transformers loop on held-out synthetic tasks (bench/compare_hf_finetune.py): 16 examples a step, or 1e-3, lost.
EXAMPLES_PER_STEP = 8
FINETUNE_ARGS = dict(epochs=3, hellaswag_interval=0, sample_interval=0, task_examples=200)
FINETUNE_LR = {"scratch": 5e-4, "pretrained": 5e-5, "lora": 1e-3}  # LoRA: docs/finetuning.md says why

def finetuning_defaults(args, given, task, world_size):
    """Fill in the fine-tuning defaults for the flags not given; --epochs sets --max_steps. Returns the line to
    print."""
    if task["splits"]["train"]["examples"] == 0:
        raise SystemExit(f"error: --data_dir {args.data_dir} holds no training examples")
    vars(args).update({k: v for k, v in FINETUNE_ARGS.items() if k not in given})
    train, longest = task["splits"]["train"], max(split["longest"] for split in task["splits"].values())
    if "seq_len" not in given:  # rows as long as the longest example (val's too), rounded up to 64
        args.seq_len = min(-(-longest // 64) * 64, base_context(args), 1024)  # (a longer val example is left out)
    if "batch_size" not in given:  # rows per micro-step and rank
        per_row = args.seq_len / (train["tokens"] / train["examples"] - 1)
        args.batch_size = max(1, round(EXAMPLES_PER_STEP / per_row / world_size))
    if "total_batch_size" not in given:
        args.total_batch_size = args.batch_size * args.seq_len * world_size
    if "max_lr" not in given:
        args.max_lr = FINETUNE_LR["lora" if args.lora else "scratch" if args.init_from == "scratch" else "pretrained"]
    args.min_lr = args.min_lr if "min_lr" in given else args.max_lr / 10
    if "max_steps" not in given:
        loader = dataloader.TaskLoader(args.data_dir, "train", 1, args.seq_len, seed=args.seed)
        rows = loader.rows_in_epochs(args.epochs)
        args.max_steps = max(1, -(-rows * args.seq_len // args.total_batch_size))
    args.warmup_steps = args.warmup_steps if "warmup_steps" in given else max(1, args.max_steps // 20)
    for flag in ("eval_interval", "checkpoint_interval"):
        if flag not in given:
            setattr(args, flag, max(1, args.max_steps // 10))
    return (f"fine-tuning: {train['examples']} examples x {args.epochs} epochs = {args.max_steps} steps "
            f"of {args.total_batch_size // args.seq_len} rows of {args.seq_len}; "
            f"lr {args.max_lr:g} -> {args.min_lr:g}, warmup {args.warmup_steps}, eval every {args.eval_interval} "
            f"(flags override these)")

# what the launch decides, never a resumed run's checkpoint: the layout, and how the ranks join (train_gpt2.join_ranks)
LAUNCH_FLAGS = ("pp", "pp_schedule", "tp", "parallel", "device", "backend", "dist_timeout")

def launch_flags(argv):
    """The command line's flags, for what must be known before the ranks agree on a checkpoint: how they join (device,
    backend, --dist_timeout) and where they look for one (--log_dir)."""
    flags = build_parser().parse_args(argv)
    if not flags.dist_timeout > 0:
        raise SystemExit(f"error: --dist_timeout {flags.dist_timeout:g} must be a positive number of seconds")
    return flags

def resolve_args(argv, ranks):
    """The run's arguments: the command line, or, with --resume, the checkpoint's run arguments overridden by the
    flags given now; the demo's settings when there is no data; fine-tuning's for task data. Returns (args, the task
    or None, checkpoint, its path)."""
    args = build_parser().parse_args(argv)
    given = vars(build_parser(defaults=False).parse_args(argv))  # only the flags on the command line
    ckpt, ckpt_file, saved_args = None, None, None
    if args.resume:  # the ranks agree on the checkpoint, and each node's disk gets what it lacks of it
        ckpt_file = node_disks.resume_point(args.log_dir, args.resume, ranks)
        if ckpt_file is None:  # killed before its first checkpoint: a scheduler's requeue starts it again
            ranks.print0(f"--resume: no checkpoint in --log_dir {args.log_dir} yet: starting the run from step 0")
        else:  # (every rank maps the same file; its weights are checked as they are read)
            ckpt = load_checkpoint(ckpt_file, weights=False)
            saved_args = ckpt["args"]
    if saved_args is None and args.resume:  # the arguments the run in --log_dir started with: rank 0's, for all
        saved_args = ranks.broadcast(read_json(os.path.join(args.log_dir, "args.json")) or None)
    if saved_args is not None:
        saved = {**vars(args), **saved_args}  # a flag newer than the checkpoint keeps its default
        saved.update({k: v for k, v in given.items() if k in saved})
        saved.update(resume=args.resume, overwrite=False, log_dir=given.get("log_dir", saved["log_dir"]))
        for flag in LAUNCH_FLAGS:  # the launch decides these: a checkpoint resumes on any layout, device, network
            saved[flag] = given.get(flag, vars(args)[flag])
        args = argparse.Namespace(**saved)
    check_hours(given, saved_args)  # --hours with --max_steps, or with another run's plan
    if not args.resume and (args.demo or (not find_shards(args.data_dir, "train") and "data_dir" not in given)):
        if not args.demo:
            ranks.print0(f"no shards in {args.data_dir}/ (run fineweb.py to make them): running the demo instead")
        # (--hours: the demo's text, but the plan's model and schedule, in --log_dir)
        vars(args).update({k: v for k, v in DEMO_ARGS.items()
                           if k not in given and not (args.hours and k == "log_dir")})
        args.demo, args.data_dir = True, cache_dir("demo")
    if args.hours and saved_args is None:  # the flags the plan must leave as given
        args.explicit = {k: v for k, v in given.items() if k in clock.PLANNED}
    check_lora_resume(ckpt, ckpt_file, given)
    resolve_layout(args, given, ranks.world_size)
    if args.lora:
        args.lora_targets = lora.parse_targets(args.lora_targets)
        args.lora_alpha = 2.0 * args.lora if args.lora_alpha is None else args.lora_alpha
    task = dataloader.read_task(args.data_dir)  # a finetune.py folder, or None: pretraining shards
    if task is not None and saved_args is None:
        ranks.print0(finetuning_defaults(args, given, task, ranks.world_size))
    if args.hours and (task is not None or args.init_from != "scratch"):
        raise SystemExit("error: --hours plans a model trained from scratch on pretraining shards (or the demo's "
                         "text): drop --init_from, or --hours, for task data give --epochs")
    if args.val_tokens is None:  # sized to the run (clock.val_tokens)
        args.val_tokens = clock.val_tokens(args.eval_interval, args.total_batch_size, args.seq_len)
    if task is None and args.epochs is not None:
        raise SystemExit(f"error: --epochs is for task data (a finetune.py folder); {args.data_dir} holds pretraining "
                         "shards: use --max_steps")
    return args, task, ckpt, ckpt_file

def resolve_layout(args, given, world_size):
    """--parallel NAME sets --shard, --pp and --tp; these on the command line (or a resumed sharded run's --shard)
    are a layout forced too, so --parallel auto is left with only the runs that say nothing (then "auto" stays, for
    the trainer to decide once it has measured: parallel/layouts.py)."""
    if args.max_memory is not None and not args.max_memory > 0:
        raise SystemExit(f"error: --max_memory {args.max_memory:g}: give a positive number of GiB")
    degrees = [flag for flag in ("shard", "pp", "tp") if flag in given]
    if args.parallel != "auto" and degrees:
        raise SystemExit(f"error: --parallel {args.parallel} sets --shard, --pp and --tp: give it or --{degrees[0]}")
    if args.parallel in ("dp", "fsdp", "fsdp_grads"):
        args.shard, args.pp, args.tp = {"dp": "none", "fsdp": "full", "fsdp_grads": "grads"}[args.parallel], 1, 1
    elif args.parallel in ("pp", "tp"):  # every rank a stage, or every rank a share of each block
        args.shard, args.pp, args.tp = "none", *((world_size, 1) if args.parallel == "pp" else (1, world_size))
    elif degrees or args.shard != "none" or args.pp != 1 or args.tp != 1:
        args.parallel = "flags"  # (not a choice: args.json keeps it, and a resume decides again from its flags)

def check_lora_resume(ckpt, ckpt_file, given):
    """A LoRA run is resumed with its --lora, and a full one without; its adapters' targets and alpha (the scale of
    every step so far) as they were: one error line, before the base is loaded."""
    saved = (ckpt or {}).get("lora")
    if ckpt is not None and (given.get("lora", 0) != (saved["rank"] if saved else 0)):
        raise SystemExit(f"error: --resume {ckpt_file}: "
                         + (f"a LoRA run (--lora {saved['rank']}): resume it with --lora {saved['rank']}" if saved
                            else "not a LoRA run: resume it without --lora"))
    targets = lora.parse_targets(given["lora_targets"]) if saved and "lora_targets" in given else None
    if targets is not None and targets != saved["targets"]:
        raise SystemExit(f"error: --resume {ckpt_file}: --lora_targets {','.join(targets)}, but the run's adapters are "
                         f"on {','.join(saved['targets'])}: resume it without --lora_targets")
    if saved and given.get("lora_alpha", saved["alpha"]) != saved["alpha"]:
        raise SystemExit(f"error: --resume {ckpt_file}: --lora_alpha {given['lora_alpha']:g}, but the run's adapters "
                         f"were trained at alpha {saved['alpha']:g}: resume it without --lora_alpha")

def base_context(args):
    """The context (positions) of the model a run starts from, read from its config, not its weights: --block_size
    from scratch; a Hugging Face-layout folder's n_positions; one of our checkpoints' block_size; OpenAI's 1024."""
    if args.init_from == "scratch":
        return args.block_size
    if os.path.isfile(os.path.join(args.init_from, "config.json")):
        with open(os.path.join(args.init_from, "config.json")) as f:
            return json.load(f)["n_positions"]
    meta = os.path.join(args.init_from, "meta.pt") if os.path.isdir(args.init_from) else args.init_from
    if os.path.isfile(meta):  # (mmap: the weights are not read)
        import torch
        try:
            return torch.load(meta, map_location="cpu", weights_only=True, mmap=True)["config"]["block_size"]
        except Exception as e:
            raise SystemExit(f"error: --init_from {args.init_from}: cannot read its config ({one_line(e)})")
    return 1024

def check_args(args, world_size):
    """Every flag that can be checked alone, before anything expensive."""
    if not os.path.isdir(args.data_dir) and not args.demo:
        raise SystemExit(f"error: --data_dir {args.data_dir} does not exist (make shards with fineweb.py)")
    if args.seq_len > args.block_size and args.init_from == "scratch":
        raise SystemExit(f"error: --seq_len {args.seq_len} is longer than --block_size {args.block_size}")
    # world = data-parallel replicas x pipeline stages (--pp) x tensor-parallel ranks (--tp)
    replicas = check_layout(args, tensor_parallel.check_layout(args, world_size))
    tokens_per_micro = args.batch_size * args.seq_len * replicas
    planned = args.hours and "total_batch_size" not in getattr(args, "explicit", {})
    if args.total_batch_size % tokens_per_micro and not planned:  # (--hours: checked again once planned)
        raise SystemExit(f"error: --total_batch_size {args.total_batch_size} is not divisible by --batch_size "
                         f"{args.batch_size} x --seq_len {args.seq_len} x {replicas} data-parallel replica(s) = "
                         f"{tokens_per_micro}")
    for flag in ("batch_size", "seq_len", "max_steps", "n_layer", "n_head", "n_embd"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"error: --{flag} must be positive")
    if args.n_embd % args.n_head:
        raise SystemExit(f"error: --n_embd {args.n_embd} is not divisible by --n_head {args.n_head}")
    if args.threads < 0:
        raise SystemExit(f"error: --threads {args.threads} must be 0 (automatic) or positive")
    if args.lora < 0 or (args.lora and not args.lora_alpha > 0):
        raise SystemExit(f"error: --lora {args.lora} --lora_alpha {args.lora_alpha:g}: the rank must be >= 0 "
                         "(0: no LoRA), alpha positive")
    if args.lora and args.ipex == "on":
        raise SystemExit("error: --ipex on with --lora: ipex.optimize replaces the Linear layers that carry the "
                         "adapters; pass --ipex off")

