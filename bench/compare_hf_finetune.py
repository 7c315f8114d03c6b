"""
Are our fine-tuning defaults any good? A small GPT trained from scratch on a task, two ways, on the same examples
for the same epochs, and compared on what a user cares about: the masked val loss and the share of right answers.

    python bench/compare_hf_finetune.py --train train.jsonl --val val.jsonl --epochs 3
    python bench/compare_hf_finetune.py --synthetic chat --epochs 3     # a made-up task (reverse, alpaca, chat)

ours  the commands a user runs: `finetune.py --input train.jsonl --val_input val.jsonl --output_dir D`, then
      `train_gpt2.py --data_dir D --epochs N --n_layer .. --n_head .. --n_embd .. --block_size .. --no-compile`
      with every fine-tuning default (train_args.finetuning_defaults: rows, examples a step, learning rate, warmup,
      decay; printed on its 'fine-tuning:' line). The bench adds only flags that change no weight: --dtype and
      --threads (as for hf), --task_examples (every val example is scored), --eval_interval (evaluations at the start
      and the end only) and --checkpoint_interval 0. Its results: the last 'val' and 'task' lines of its log.txt.
hf    an independent loop, written as a Hugging Face user would: transformers' GPT2LMHeadModel from scratch (same
      shape, GPT-2's 50257 tokens, n_positions = our block size, GPT2Config's defaults otherwise, its dropout of 0.1
      included), the examples rendered by tasks.render (the same ids and target masks as ours: checked against our
      task folder), labels -100 on the non-targets, batches of --hf_batch examples padded on the right to their
      longest with an attention_mask, reshuffled each epoch; AdamW (weight decay 0.01 on all but biases and
      LayerNorms, as Trainer groups them), get_linear_schedule_with_warmup (10% of the steps), clipping at 1.0.
      Val loss: the mean over every val target token. Accuracy: transformers' generate, greedy, stopping at
      <|endoftext|>, max_new_tokens by answer.task_accuracy's rule and the context's end, scored with
      answer.answer_key (exact match after whitespace normalization, or --answer_regex).

Both run at the same time, each on --threads torch threads (1 by default: two processes on a 2-core machine;
--one_at_a_time: ours, then hf). Wall times: each side's whole run (ours: its process, startup and its two evaluations
included; hf: training and evaluation), and its training steps alone, on this CPU at this moment. To try another
default: --set NAME=VALUE runs train_gpt2.py with that constant of train_args.py changed, as if edited (the fine-tuning
defaults are EXAMPLES_PER_STEP, FINETUNE_LR, FINETUNE_ARGS: --set EXAMPLES_PER_STEP=16), and --our_flags adds flags
(--our_flags '--max_lr 1e-3'); --only ours skips the HF loop, whose result does not depend on them.
LoRA on a pretrained base, against peft: bench/compare_hf_lora.py runs this comparison.
"""
import argparse
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F

import common  # noqa: F401  (puts the repository root on sys.path)
from answer import answer_key
from dataloader import open_split, read_task
from compute import cpu
from tasks import render
from tokenizer import EOT, VOCAB_SIZE, decode, encode

REPO = common.REPO

# -----------------------------------------------------------------------------
# 1. Synthetic tasks to try it on (--synthetic NAME): made by a rule, so val prompts are new to the model and
# accuracy measures the rule learned. Small enough for a 4-layer, 128-wide model to learn some of in minutes.

WORDS = "cat dog red blue sun moon tree fish bird star car ship king queen apple bread milk rain snow fire".split()

def reverse_example(rng):
    """prompt/completion, answers of 2 to 5 words: the words in reverse order."""
    words = [rng.choice(WORDS[:10]) for _ in range(rng.randint(2, 5))]
    return {"prompt": "Reverse the words: " + " ".join(words) + "\nReversed:",
            "completion": " " + " ".join(words[::-1])}

def alpaca_example(rng):
    """Alpaca, two instructions on an input of 2 to 4 words: repeat them, or reverse them."""
    words = [rng.choice(WORDS[:10]) for _ in range(rng.randint(2, 4))]
    if rng.random() < 0.5:
        return {"instruction": "Repeat the words.", "input": " ".join(words), "output": " ".join(words)}
    return {"instruction": "Reverse the words.", "input": " ".join(words), "output": " ".join(words[::-1])}

def chat_example(rng):
    """chat, two exchanges (an optional system turn first): the answer scored, the last, needs both user turns."""
    item, have, more = rng.choice(WORDS[:10]), rng.randint(1, 20), rng.randint(1, 9)
    messages = [{"role": "system", "content": "You keep count."}] if rng.random() < 0.5 else []
    return {"messages": messages + [
        {"role": "user", "content": f"I have {have} {item}s."},
        {"role": "assistant", "content": f"You have {have} {item}s."},
        {"role": "user", "content": f"I get {more} more. How many now?"},
        {"role": "assistant", "content": f"Now you have {have + more} {item}s."}]}

SYNTHETIC = {"reverse": reverse_example, "alpaca": alpaca_example, "chat": chat_example}

def write_synthetic(name, out_dir, n_train, n_val, seed=0):
    """out_dir/train.jsonl and val.jsonl, val examples distinct from every train example."""
    rng, seen, val, train = random.Random(seed), set(), [], []
    while len(val) < n_val:
        line = json.dumps(SYNTHETIC[name](rng))
        if line not in seen:
            seen.add(line)
            val.append(line)
    while len(train) < n_train:
        line = json.dumps(SYNTHETIC[name](rng))
        if line not in seen:
            train.append(line)
    paths = [os.path.join(out_dir, f"{split}.jsonl") for split in ("train", "val")]
    for path, lines in zip(paths, (train, val)):
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
    return paths

# -----------------------------------------------------------------------------
# 2. Ours: finetune.py and train_gpt2.py, run as a user runs them

def start_ours(args, work, block_size):
    """Prepares the task folder (finetune.py) and starts train_gpt2.py on it; returns (process, task dir, log dir,
    its start and end times: [t0] now, [t0, t1] once it has ended)."""
    task_dir, log_dir = os.path.join(work, "task"), os.path.join(work, "log")
    subprocess.run([sys.executable, "finetune.py", "--input", args.train, "--val_input", args.val, "--output_dir",
                    task_dir] + (["--answer_regex", args.answer_regex] if args.answer_regex else []),
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL, preexec_fn=common.die_with_parent())
    n_val = read_task(task_dir)["splits"]["val"]["examples"]
    # --set: train_gpt2.py with one of train_args.py's constants (the fine-tuning defaults) changed, as if edited: a
    # default under test. finetuning_defaults reads them when the run starts, after these lines have set them.
    launch = ["train_gpt2.py"] if not args.set else ["-c", "import ast, train_args, train_gpt2\n"
              f"for name, value in {[s.split('=', 1) for s in args.set]!r}:\n"
              "    setattr(train_args, name, ast.literal_eval(value))\n"
              "train_gpt2.world.run_main(train_gpt2.main)"]
    command = [sys.executable] + launch + ["--data_dir", task_dir, "--log_dir", log_dir, "--epochs", str(args.epochs),
               "--n_layer", str(args.n_layer), "--n_head", str(args.n_head), "--n_embd", str(args.n_embd),
               "--block_size", str(block_size), "--no-compile", "--dtype", args.dtype, "--threads", str(args.threads),
               "--task_examples", str(n_val), "--eval_interval", "1000000000", "--checkpoint_interval", "0"]
    command += shlex.split(args.our_flags)   # (later flags win: to try other settings)
    print("ours: train_gpt2.py " + " ".join(command[1 + len(launch):]) + "".join(f" (and {s})" for s in args.set),
          flush=True)
    with open(os.path.join(work, "ours.out"), "w") as out:   # (the child has its own copy of the file)
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                   preexec_fn=common.die_with_parent())
    times = [time.time()]
    # its end time, taken when it ends: the HF loop, running meanwhile, may end later
    threading.Thread(target=lambda: (process.wait(), times.append(time.time())), daemon=True).start()
    return process, task_dir, log_dir, times

def finish_ours(process, work, log_dir, times):
    """Waits for train_gpt2.py; its last val loss and task accuracy from log.txt, its timings, its settings line."""
    code = process.wait()
    while len(times) < 2:   # (the thread appends the end time just after wait returns)
        time.sleep(0.01)
    with open(os.path.join(work, "ours.out")) as f:
        out = f.read()
    if code:
        raise SystemExit(f"error: train_gpt2.py failed (exit code {code}):\n{out[-3000:]}")
    with open(os.path.join(log_dir, "log.txt")) as f:
        last = {kind: float(value) for _, kind, value in map(str.split, f)}   # (each kind's last line)
    settings = re.search(r"^fine-tuning: .*$", out, re.M).group(0)
    train_s = sum(float(ms) for ms in re.findall(r"^step .*\| dt (\d+)ms", out, re.M)) / 1000
    return {"val loss": last["val"], "accuracy": last["task"], "wall s": times[1] - times[0], "train s": train_s,
            "settings": settings}

# -----------------------------------------------------------------------------
# 3. Hugging Face: GPT2LMHeadModel on padded batches, as its users train it

def render_file(path):
    """Every example of a jsonl file as (ids, labels with -100 on non-targets, answer_start), by tasks.render;
    a line finetune.py would drop (not JSON, a bad example) is skipped."""
    examples = []
    with open(path) as f:
        for line in filter(str.strip, f):
            try:
                ids, targets, answer_start = render(json.loads(line))
            except ValueError:   # (BadExample is one, as is json's error)
                continue
            examples.append((ids, [i if t else -100 for i, t in zip(ids, targets)], answer_start))
    return examples

def same_as_task_folder(examples, task_dir, split):
    """Our trainer reads the task folder; the HF loop renders the jsonl: are they the same ids and targets?"""
    tokens, targets, offsets = open_split(task_dir, split)
    ids = [i for e in examples for i in e[0]]
    labels = [lab != -100 for e in examples for lab in e[1]]
    return (np.array_equal(np.asarray(tokens), ids) and np.array_equal(np.asarray(targets), labels)
            and [a - s for s, a, _ in offsets.tolist()] == [e[2] for e in examples])

def padded(batch):
    """Examples -> input_ids, attention_mask, labels, padded on the right to the batch's longest."""
    shape = (len(batch), max(len(ids) for ids, _, _ in batch))
    input_ids, labels, mask = torch.full(shape, EOT), torch.full(shape, -100), torch.zeros(shape, dtype=torch.long)
    for row, (ids, labs, _) in enumerate(batch):
        length = len(ids)
        input_ids[row, :length], labels[row, :length], mask[row, :length] = torch.tensor(ids), torch.tensor(labs), 1
    return input_ids, mask, labels

def hf_batches(args, n):
    """Each step's examples (indices of n): --epochs passes, shuffled each epoch, --hf_batch at a time."""
    generator = torch.Generator().manual_seed(args.seed)
    orders = [torch.randperm(n, generator=generator).tolist() for _ in range(args.epochs)]
    return [order[i:i + args.hf_batch] for order in orders for i in range(0, n, args.hf_batch)]

def hf_optimizer(model, lr, weight_decay, betas=(0.9, 0.999)):
    """AdamW on what trains, weight decay on all but biases and LayerNorms (as Trainer groups them)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    def no_decay(name):
        return name.endswith("bias") or ".ln_" in name
    groups = [{"params": [p for n, p in named if not no_decay(n)], "weight_decay": weight_decay},
              {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)

def hf_train(model, train, batches, optimizer, schedule, autocast, clip=1.0):
    """A step on each of batches (indices into train), the loss the mean over its targets; returns the seconds spent."""
    from tqdm import tqdm
    model.train()
    t0 = time.time()
    with tqdm(batches, desc="hf training", unit="step", leave=False) as bar:
        for indices in bar:
            input_ids, mask, labels = padded([train[j] for j in indices])
            with autocast:
                loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    return time.time() - t0

@torch.no_grad()
def hf_val_loss(model, val, autocast):
    """The mean loss over every val target token (not a mean of batch means)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(val), 16):
        input_ids, mask, labels = padded(val[i:i + 16])
        with autocast:
            logits = model(input_ids=input_ids, attention_mask=mask).logits
        total += F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                                 reduction="sum").item()
        count += int((labels[:, 1:] != -100).sum())
    return total / count

@torch.no_grad()
def hf_accuracy(model, val, n_positions, answer_regex, autocast):
    """Greedy answers by transformers' generate, scored as answer.task_accuracy scores ours."""
    model.eval()
    right = 0
    for ids, _, answer_start in val:
        prompt, expected = ids[:answer_start], decode(ids[answer_start:-1])
        n_expected = len(encode(expected))
        limit = 2 * n_expected + 16 if answer_regex else n_expected + 8   # answer.task_accuracy's rule
        limit = min(limit, n_positions - len(prompt))   # and the context's end, as answer.answers stops there
        with autocast:
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=limit, eos_token_id=EOT, pad_token_id=EOT)
        answer = out[0, len(prompt):].tolist() + [EOT]   # (up to the first <|endoftext|>)
        key = answer_key(decode(answer[:answer.index(EOT)]), answer_regex)
        right += key is not None and key == answer_key(expected, answer_regex)
    return right / len(val)

def hf_fit_and_score(model, train, val, batches, optimizer, schedule, args, block_size, clip=1.0):
    """hf_train, then the val loss and accuracy, and the seconds each took."""
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=args.dtype == "bf16")
    t0, train_s = time.time(), hf_train(model, train, batches, optimizer, schedule, autocast, clip)
    return {"val loss": hf_val_loss(model, val, autocast), "train s": train_s,   # (in this order: wall s comes last)
            "accuracy": hf_accuracy(model, val, block_size, args.answer_regex, autocast), "wall s": time.time() - t0}

def run_hf(args, train, val, block_size):
    from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup
    torch.manual_seed(args.seed)
    dropout = dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), args.hf_dropout)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_positions=block_size, n_embd=args.n_embd,
                                       n_layer=args.n_layer, n_head=args.n_head, bos_token_id=EOT, eos_token_id=EOT,
                                       **dropout))
    batches, optimizer = hf_batches(args, len(train)), hf_optimizer(model, args.hf_lr, args.hf_weight_decay)
    warmup = round(args.hf_warmup * len(batches))
    schedule = get_linear_schedule_with_warmup(optimizer, warmup, len(batches))
    return {**hf_fit_and_score(model, train, val, batches, optimizer, schedule, args, block_size),
            "settings": f"hf: {len(train)} examples x {args.epochs} epochs = {len(batches)} steps of {args.hf_batch} "
                        f"examples; lr {args.hf_lr:g} linear to 0, warmup {warmup}, weight decay "
                        f"{args.hf_weight_decay:g}, dropout {args.hf_dropout:g}"}

# -----------------------------------------------------------------------------
# 4. The command line

def build_parser():
    p = argparse.ArgumentParser(description="Our fine-tuning defaults against a Hugging Face loop, from scratch.")
    a = p.add_argument
    a("--train", help="training examples (.jsonl, any of finetune.py's formats)")
    a("--val", help="val examples (.jsonl)")
    a("--synthetic", choices=sorted(SYNTHETIC), help="make a task instead of --train/--val")
    a("--n_train", type=int, default=1000, help="--synthetic: training examples (default: %(default)s)")
    a("--n_val", type=int, default=200, help="--synthetic: val examples (default: %(default)s)")
    a("--epochs", type=int, default=3)
    for name, default in (("n_layer", 4), ("n_head", 4), ("n_embd", 128)):
        a(f"--{name}", type=int, default=default)
    a("--block_size", type=int, help="context of both models (default: 256, or the longest example rounded up to 64)")
    a("--answer_regex", help="score answers by this regex's first group (as finetune.py --answer_regex)")
    a("--threads", type=int, default=1, help="torch threads for each side (default: %(default)s)")
    a("--dtype", choices=["fp32", "bf16"], default="fp32", help="both sides (default: %(default)s)")
    a("--hf_lr", type=float, default=5e-4)
    a("--hf_batch", type=int, default=8, help="examples per step")
    a("--hf_warmup", type=float, default=0.1, help="share of the steps warming up")
    a("--hf_weight_decay", type=float, default=0.01)
    a("--hf_dropout", type=float, default=0.1, help="GPT2Config's default")
    a("--our_flags", default="", help="more flags for train_gpt2.py, to try other settings (e.g. '--max_lr 5e-4')")
    a("--set", action="append", default=[], metavar="NAME=VALUE",
      help="run train_gpt2.py with train_args.py's constant NAME set to VALUE (a Python literal), e.g. "
           "EXAMPLES_PER_STEP=8 or FINETUNE_LR=\"{'scratch': 5e-4, 'pretrained': 5e-5}\": a default under test")
    a("--only", choices=["ours", "hf"], help="run one side only")
    a("--one_at_a_time", action="store_true", help="ours, then hf (default: both at once)")
    a("--seed", type=int, default=1337, help="the HF loop's initial weights and order (ours: train_gpt2's --seed)")
    a("--work_dir", help="keep the task folder, log and outputs here (default: a temporary folder)")
    return p

def parse_args(argv=None, parser=None):
    args = (parser or build_parser()).parse_args(argv)
    if bool(args.train) != bool(args.val) or bool(args.train) == bool(args.synthetic):
        raise SystemExit("error: give --train and --val, or --synthetic NAME")
    import train_args
    for name_value in [s for s in args.set if "=" not in s or not hasattr(train_args, s.split("=")[0])][:1]:
        raise SystemExit(f"error: --set {name_value}: not NAME=VALUE with NAME a constant of train_args.py")
    for path in [p for p in (args.train, args.val) if p and not os.path.isfile(p)][:1]:
        raise SystemExit(f"error: {path}: no such file")
    return args

def main(argv=None, args=None, theirs=None):
    """args: parse_args's (default: of argv); theirs: the Hugging Face side, with run_hf's arguments and result
    (default)."""
    args = args or parse_args(argv)
    work = args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="compare_hf_")
    os.makedirs(work, exist_ok=True)
    if args.synthetic:
        args.train, args.val = write_synthetic(args.synthetic, work, args.n_train, args.n_val)
    args.train, args.val = os.path.abspath(args.train), os.path.abspath(args.val)
    torch.set_num_threads(args.threads)
    print(cpu.describe_cpu(args.threads), f"(each side); {args.dtype}; work dir {work}", flush=True)
    train, val = render_file(args.train), render_file(args.val)
    block_size = args.block_size or max(256, -(-max(len(e[0]) - 1 for e in train + val) // 64) * 64)
    results = {}
    if args.only != "hf":
        ours = start_ours(args, work, block_size)
        if not all(same_as_task_folder(examples, ours[1], split)
                   for examples, split in ((train, "train"), (val, "val"))):
            raise SystemExit("error: finetune.py's task folder holds other examples than tasks.render gives "
                             "(an example longer than --max_len 1024, cut by finetune.py?)")
        if args.one_at_a_time or args.only == "ours":
            results["ours"] = finish_ours(ours[0], work, *ours[2:])
    if args.only != "ours":
        results["hf"] = (theirs or run_hf)(args, train, val, block_size)
    if "ours" not in results and args.only != "hf":
        results["ours"] = finish_ours(ours[0], work, *ours[2:])
    print(f"\n{len(train)} train / {len(val)} val examples ({os.path.basename(args.train)}, "
          f"{os.path.basename(args.val)}), {args.epochs} epochs, {args.n_layer} layers x {args.n_embd} wide, "
          f"{args.n_head} heads, context {block_size}")
    print(cpu.describe_cpu(args.threads) + f" each, {args.dtype}" + (", at the same time" if len(results) == 2 and
                                                                     not args.one_at_a_time else ""))
    print("\n".join([f"{'':6s} {'val loss':>9s} {'accuracy':>9s} {'wall s':>8s} {'train s':>8s}"] + [
        f"{name:6s} {r['val loss']:9.4f} {r['accuracy']:9.3f} {r['wall s']:8.1f} {r['train s']:8.1f}" for name, r in
        results.items()] + [f"  {r['settings']}" for r in results.values()]))
    if len(results) == 2:
        ours, hf = results["ours"], results["hf"]
        worse = ["val loss"] * (ours["val loss"] > hf["val loss"]) + ["accuracy"] * (ours["accuracy"] < hf["accuracy"])
        print("ours is WORSE in " + " and ".join(worse) if worse else "ours is no worse")
    return results

if __name__ == "__main__":
    main()
