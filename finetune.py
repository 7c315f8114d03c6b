"""
finetune.py: your task's examples -> the folder of token ids with a target mask that train_gpt2.py fine-tunes on.

    python finetune.py --input train.jsonl --output_dir my_task          # 10% of the examples (<= 200) for val
    python finetune.py --input openai/gsm8k --hf_config main --columns prompt=question,completion=answer \\
                       --answer_regex '#### (.*)' --output_dir gsm8k      # a Hugging Face dataset, streamed
    python finetune.py --demo                                            # a synthetic task, trained on, offline

One example per line (.jsonl) or row (.parquet, a dataset), in one of three formats: prompt/completion, Alpaca
(instruction/input/output) or chat (messages); tasks.py says how each is rendered into token ids and which are
targets (the answers and the <|endoftext|> after each). The output folder, for train_gpt2.py, per split (train, val):
    task_{split}_tokens.npy    uint16: every example's token ids, one after the other
    task_{split}_targets.npy   uint8, as long: 1 where a token is a target
    task_{split}_examples.npy  int64 (n, 3): each example's (start, answer_start, end) in the tokens
and task.json last (its presence means the folder is complete): formats, templates, counts. answer.py scores a
fine-tuned model's answers; sample.py asks it one question.
"""
import argparse
import json
import os
import random
import sys

import numpy as np

from dataloader import TASK_VERSION
from plumbing.common import ShowDefaults, atomic_write, one_line
from tasks import FIELDS, TEMPLATES, check_answer_regex, collect, open_sources, parse_columns
from tokenizer import decode

SPLITS = ("train", "val")

# -----------------------------------------------------------------------------
# 1. Every example, rendered (tasks.py), split into train and val, and written

def seeded_order(n, seed):
    """A permutation of range(n) from the seed. Only random.random() is promised to give the same numbers in
    every Python version (numpy's Generator methods and random.sample are not), so it is built from that."""
    rng = random.Random(seed)
    keys = [rng.random() for _ in range(n)]
    return sorted(range(n), key=keys.__getitem__)

def default_val_examples(n):
    """10% of the examples, at most 200 (enough to measure accuracy to a few %), at least 1 when there are 2."""
    return min(200, max(1, n // 10)) if n >= 2 else 0

def write_split(out_dir, split, examples):
    """The three arrays of one split, each written atomically; returns its counts for task.json."""
    lengths = np.array([len(e.ids) for e in examples], np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    arrays = {
        "tokens": np.concatenate([e.ids for e in examples]) if examples else np.zeros(0, np.uint16),
        "targets": np.concatenate([e.targets for e in examples]) if examples else np.zeros(0, np.uint8),
        "examples": np.stack([starts, starts + np.array([e.answer_start for e in examples], np.int64), ends],
                             axis=1).reshape(-1, 3),
    }
    for part, array in arrays.items():
        atomic_write(os.path.join(out_dir, f"task_{split}_{part}.npy"),
                     lambda f, a=array: np.save(f, a, allow_pickle=False))
    # "longest" counts positions (tokens - 1), as --max_len and a training row do
    return {"examples": len(examples), "tokens": int(ends[-1]) if examples else 0,
            "targets": int(arrays["targets"].sum(dtype=np.int64)), "longest": int(lengths.max()) - 1 if examples else 0}

def check_output_dir(out_dir, overwrite):
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise SystemExit(f"error: --output_dir {out_dir} is a file")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise SystemExit(f"error: --output_dir {out_dir} is not empty; pass --overwrite to replace its task files")

def split(args, templates):
    """--input's examples as the train split; val: --val_input's, or --val_examples of --input's, chosen by the seed,
    whole (both splits keep the input's order: the trainer shuffles). Returns (splits, counts, the sources' names)."""
    sources = open_sources(args.input, args, "--input")
    val_sources = open_sources(args.val_input, args, "--val_input") if args.val_input else []
    examples, counts = collect(sources, args, templates, args.max_len)
    if not examples:
        raise SystemExit(f"error: --input {' '.join(args.input)}: no usable example (see the messages above)")
    names = {"inputs": [s.name for s in sources], "val_inputs": [s.name for s in val_sources]}
    if val_sources:
        val, val_counts = collect(val_sources, args, templates, args.max_len, "val examples")
        if not val:
            raise SystemExit(f"error: --val_input {' '.join(args.val_input)}: no usable example")
        for key in ("formats", "dropped", "cut", "trimmed"):
            counts[key] += val_counts[key]
        for key in ("joined", "glued"):
            counts[key] = [counts[key][0] + val_counts[key][0], counts[key][1] or val_counts[key][1]]
        return {"train": examples, "val": val}, counts, names
    n_val = default_val_examples(len(examples)) if args.val_examples is None else args.val_examples
    if n_val >= len(examples):
        raise SystemExit(f"error: --val_examples {n_val} leaves no train example ({len(examples)} usable)")
    chosen = set(seeded_order(len(examples), args.seed)[:n_val])
    return ({"train": [e for i, e in enumerate(examples) if i not in chosen],
             "val": [e for i, e in enumerate(examples) if i in chosen]}, counts, names)

def prompt_key(example):
    """An example's prompt (everything before its last answer), whitespace normalized."""
    return " ".join(decode(example.ids[:example.answer_start]).split())

def drop_overlap(splits, dedup):
    """How many val examples also stand in train (the same prompt): val loss and accuracy would flatter the model on
    them (Alpaca-style sets repeat prompts; a --val_input can share examples with --input). --dedup drops them."""
    in_train = {prompt_key(e) for e in splits["train"]}
    shared = [prompt_key(e) in in_train for e in splits["val"]]
    if dedup:
        splits["val"] = [e for e, s in zip(splits["val"], shared) if not s]
    return sum(shared)

def prepare(args):
    """--input (and --val_input) -> the task folder; returns task.json's dict."""
    check_output_dir(args.output_dir, args.overwrite)
    templates = {**TEMPLATES, "prompt_completion": {"separator": args.separator}}
    splits, counts, names = split(args, templates)
    overlap = drop_overlap(splits, args.dedup)
    formats = dict(sorted(counts["formats"].items()))
    task = {"kind": "task", "version": TASK_VERSION, "format": next(iter(formats)) if len(formats) == 1 else "mixed",
            "formats": formats, "templates": templates, "train_on": args.train_on, "max_len": args.max_len,
            "answer_regex": args.answer_regex, "splits": {}, **names, "columns": args.columns,
            "dropped": dict(sorted(counts["dropped"].items())), "too_long": args.too_long, "cut": counts["cut"],
            "trimmed": counts["trimmed"], "overlap": overlap, "dedup": args.dedup,
            **{kind: counts[kind][0] for kind in ("joined", "glued")}}
    task_path = os.path.join(args.output_dir, "task.json")
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        # first: a run stopped while rewriting leaves a folder that says it is incomplete
        if os.path.exists(task_path):
            os.remove(task_path)
        task["splits"] = {name: write_split(args.output_dir, name, splits[name]) for name in SPLITS}
        atomic_write(task_path, lambda f: f.write(json.dumps(task, indent=1).encode() + b"\n"))
    except OSError as e:   # no permission, disk full, ...: one line
        raise SystemExit(f"error: cannot write to --output_dir {args.output_dir}: {one_line(e)}")
    print_summary(args.output_dir, task, {kind: counts[kind][1] for kind in ("joined", "glued")})
    return task

BOUNDARY_ADVICE = {  # what print_summary says of tasks.boundary's two kinds, with the first example of each
    "joined": "examples whose prompt and completion tokenize differently once joined (a token across them), e.g. "
              "{}: move the space from the prompt's end to the completion's start",
    "glued": "examples with nothing between prompt and completion, e.g. {}: pass --separator '\\n' (kept in "
             "task.json, so the model is asked the same way)",
}

def print_summary(out_dir, task, first_examples):
    print(f"{out_dir}: {', '.join(f'{n:,} {fmt}' for fmt, n in task['formats'].items())}, train on {task['train_on']}")
    for name, s in task["splits"].items():
        print(f"  {name:5s} {s['examples']:,} examples, {s['tokens']:,} tokens, {s['targets']:,} targets "
              f"({s['targets'] / max(1, s['tokens']):.1%} of tokens), longest {s['longest']} positions")
    dropped = task["dropped"]
    print(f"  dropped {sum(dropped.values()):,}" + (f" ({', '.join(f'{why} {n}' for why, n in dropped.items())})"
                                                    if dropped else "") +
          f"; too long (> --max_len {task['max_len']} positions, --too_long {task['too_long']}): "
          f"{task['cut']} prompts cut from the left, {task['trimmed']} chats shortened by their oldest exchanges, "
          f"{dropped.get('too long', 0)} dropped")
    if task["overlap"]:
        print(f"  {task['overlap']:,} val examples also in train (same prompt): " +
              ("dropped from val (--dedup)" if task["dedup"] else "their val loss and accuracy flatter the model; "
               "--dedup drops them"))
    for kind, advice in BOUNDARY_ADVICE.items():
        if task[kind]:
            where, prompt, completion = first_examples[kind]
            print(f"  {task[kind]:,} " + advice.format(f"{where}: {prompt[-40:]!r} + {completion[:40]!r}"))

# -----------------------------------------------------------------------------
# 2. The offline demo's task

DEMO_DIR = "task_demo"
# How train_gpt2.py trains the demo model (DEMO_ARGS' 4 layers, 128 wide) on it from scratch: one pass over the
# 20,000 examples in 130 steps of 32 rows of 64 positions (about 128 examples a step), at 3e-3. Measured with
# these flags: val accuracy 0 at the start, 0.15 after 40 steps, 0.73 after 80, 0.86 after 120 and 130.
DEMO_TRAIN_ARGS = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, epochs=1, batch_size=32, max_lr=3e-3,
                       eval_interval=40)

def demo_answer(prompt):
    """The demo task's rule: 'Sort: 7 2 9 ->' is answered ' 2 7 9'."""
    return " " + " ".join(sorted(prompt[len("Sort:"):-len("->")].split()))

def make_demo_task(out_dir, n_train=20000, n_val=200, seed=1337):
    """A synthetic task for the offline demo: sort 3 to 6 digits. Writes out_dir/train.jsonl and val.jsonl
    (prompt/completion) and returns their paths. Made by a rule, so val holds prompts that train does not:
    accuracy measures the rule learned, not answers remembered. Why sorting: GPT-2 spells " 0" ... " 9" as one
    token each, so an example is about 15 tokens and a small model sees thousands of them a minute; the answer
    depends on every digit of the prompt (no shortcut), yet the demo model learns it from scratch on 2 cores."""
    rng = random.Random(seed)   # random() only, as in seeded_order: the same task in every Python version
    def prompt():
        digits = [str(int(rng.random() * 10)) for _ in range(3 + int(rng.random() * 4))]
        return "Sort: " + " ".join(digits) + " ->"
    val = {}
    while len(val) < n_val:   # distinct val prompts (a dict keeps their order)
        val[prompt()] = None
    train = []
    while len(train) < n_train:
        p = prompt()
        if p not in val:
            train.append(p)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, prompts in (("train", train), ("val", list(val))):
        lines = "".join(json.dumps({"prompt": p, "completion": demo_answer(p)}) + "\n" for p in prompts)
        paths.append(os.path.join(out_dir, f"{name}.jsonl"))
        atomic_write(paths[-1], lambda f, text=lines: f.write(text.encode()))
    return tuple(paths)

def demo(args):
    """--demo: the synthetic task's jsonl files and task folder in --output_dir (default task_demo), then the demo
    model trained on it from scratch by train_gpt2.py, in this process; the accuracy before and after."""
    import train_gpt2
    out_dir = args.output_dir or DEMO_DIR
    check_output_dir(out_dir, args.overwrite)
    train, val = make_demo_task(out_dir, seed=args.seed)
    # the folder now holds the two jsonl files: the task files go beside them
    vars(args).update(input=[train], val_input=[val], output_dir=out_dir, overwrite=True)
    prepare(args)
    log_dir = os.path.join(os.path.dirname(out_dir.rstrip(os.sep)), "log_" + os.path.basename(out_dir.rstrip(os.sep)))
    argv = ["--data_dir", out_dir, "--log_dir", log_dir, *(f"--{k}={v}" for k, v in DEMO_TRAIN_ARGS.items()),
            "--no-compile", "--overwrite"]
    print(f"\ntraining: python train_gpt2.py {' '.join(argv)}", flush=True)
    train_gpt2.main(argv)
    with open(os.path.join(log_dir, "log.txt")) as f:
        accuracy = [line.split() for line in f if line.split()[1:2] == ["task"]]
    ckpt = train_gpt2.list_checkpoints(log_dir)[-1]
    print(f"\ndemo finished: task accuracy {float(accuracy[0][2]):.2f} at step {accuracy[0][0]} -> "
          f"{float(accuracy[-1][2]):.2f} at step {accuracy[-1][0]} "
          f"({len(accuracy)} evals in {log_dir}/log.txt). Next:\n"
          f"  python sample.py --ckpt_path {ckpt} --prompt 'Sort: 8 3 5 1 ->' --top_k 1   # ask it\n"
          f"  python answer.py --ckpt_path {ckpt} --input {val}   # score it, with examples")

# -----------------------------------------------------------------------------
# 3. The command line

def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(map(str, argv))
    if "--eval" in argv:  # (it was here until answer.py took it)
        raise SystemExit("error: --eval is answer.py's now: python answer.py "
                         + " ".join(a for a in argv if a != "--eval"))
    p = argparse.ArgumentParser(formatter_class=ShowDefaults,  # --help shows every default
                                description="Task examples (prompt/completion, Alpaca, chat) -> token shards with "
                                "a target mask for train_gpt2.py.")
    a = p.add_argument
    a("--input", nargs="+", action="extend", default=[], metavar="PATH_OR_DATASET",
      help=".jsonl/.parquet files or globs, or a Hugging Face dataset (name or local folder)")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val_input", nargs="+", action="extend", default=[], metavar="PATH_OR_DATASET",
                     help="the val examples, read like --input (default: some of --input's)")
    val.add_argument("--val_examples", type=int, help="examples of --input held out for val, chosen by --seed "
                     "(default: 10%%, at most 200, at least 1; 0: none)")
    a("--output_dir", help=f"where the task folder goes (--demo: {DEMO_DIR})")
    a("--train_on", choices=["completion", "all"], default="completion",
      help="completion: the answers and their <|endoftext|> are the targets; all: every token (default: %(default)s)")
    a("--max_len", type=int, default=1024, help="most positions an example may take (tokens - 1; default: 1024)")
    a("--too_long", choices=["cut", "drop"], default="cut",
      help="a longer example: cut its prompt from the left, or drop it (default: %(default)s)")
    a("--separator", default="", help="text put between each prompt and its completion (prompt/completion data), "
      "e.g. '\\n'; task.json keeps it, so the model is asked the same way (\\n and \\t read as newline and tab)")
    a("--dedup", action="store_true", help="drop val examples whose prompt also stands in train")
    a("--answer_regex", help="score answers by this regex's first group, e.g. '#### (.*)' for GSM8K "
      "(default: the whole answer, whitespace normalized)")
    a("--hf_config", help="the Hugging Face dataset's config (e.g. main for openai/gsm8k)")
    a("--hf_split", default="train", help="its split (default: %(default)s)")
    a("--columns", type=str, default="", help="our fields from its columns: FIELD=COLUMN,... e.g. "
      "prompt=question,completion=answer (fields: " + ", ".join(FIELDS) + ")")
    a("--seed", type=int, default=1337, help="picks the val examples (default: %(default)s)")
    a("--overwrite", action="store_true", help="replace the task files in a non-empty --output_dir")
    a("--demo", action="store_true", help="make a small synthetic task (no network), prepare it, and train the demo "
      "model on it")
    args = p.parse_args(argv)
    # every cheap check before any work
    args.columns = parse_columns(args.columns)
    args.separator = args.separator.replace("\\n", "\n").replace("\\t", "\t")
    if args.answer_regex is not None:
        check_answer_regex(args.answer_regex)
    for flag in ("max_len", "val_examples"):
        if getattr(args, flag) is not None and getattr(args, flag) < (0 if flag == "val_examples" else 1):
            raise SystemExit(f"error: --{flag} must be {'>= 0' if flag == 'val_examples' else 'at least 1'}")
    if not args.demo and (not args.input or not args.output_dir):
        raise SystemExit("error: give --input and --output_dir (or --demo)")
    return args

def main(argv=None):
    args = parse_args(argv)
    if args.demo:
        return demo(args)
    task = prepare(args)
    print(f"next: python train_gpt2.py --init_from gpt2 --data_dir {args.output_dir}")
    return task

if __name__ == "__main__":
    main()
