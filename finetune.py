"""
finetune.py: your task's examples -> the token shards with a target mask that train_gpt2.py fine-tunes on;
and how many of a fine-tuned model's answers are right.

    python finetune.py --input train.jsonl --output_dir my_task          # 10% of the examples (<= 200) for val
    python finetune.py --input openai/gsm8k --hf_config main --columns prompt=question,completion=answer \\
                       --answer_regex '#### (.*)' --output_dir gsm8k      # a Hugging Face dataset, streamed
    python finetune.py --demo                                            # a synthetic task, trained on, offline
    python finetune.py --eval --ckpt_path log/model_00300.pt --input val.jsonl   # the share of right answers

One example per line (.jsonl) or row (.parquet, a dataset), its format told by its keys:
    {"prompt": ..., "completion": ...}                               prompt + completion + <|endoftext|>
    {"instruction": ..., "input": ... (optional), "output": ...}     Alpaca: TEMPLATES["alpaca"] around them
    {"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}   chat: TEMPLATES["chat"]
The model learns to predict each answer and the <|endoftext|> after it (the targets), not the prompts, which
it is only given. The output folder, for train_gpt2.py and sample.py, per split (train, val):
    task_{split}_tokens.npy    uint16: every example's token ids, one after the other
    task_{split}_targets.npy   uint8, as long: 1 where a token is a target
    task_{split}_examples.npy  int64 (n, 3): each example's (start, answer_start, end) in the tokens
and task.json last (its presence means the folder is complete): formats, templates, counts.
"""
import argparse
import collections
import glob
import json
import os
import random
import re
import sys
from contextlib import nullcontext
from typing import NamedTuple

import numpy as np
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from fineweb import atomic_write
from plumbing import one_line
from tokenizer import EOT, decode, encode

TASK_VERSION = 1
# The plain-text templates of the two formats that need one. No new special tokens: the vocabulary stays
# GPT-2's, so OpenAI's weights fine-tune as they are and export_hf.py keeps working. They are stored in
# task.json, and by train_gpt2.py in its checkpoints, so a model is always prompted the way it was trained.
TEMPLATES = {
    # Stanford Alpaca's two prompts (with an input, without one); the output follows "### Response:\n"
    "alpaca": {
        "input": "Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        "no_input": "Below is an instruction that describes a task. Write a response that appropriately "
                    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n",
    },
    # each turn on its own line; an answer is " {content}" after "Assistant:", then <|endoftext|>, so the model
    # learns to stop; "\n" after it when the user speaks again
    "chat": {"system": "System: {content}\n", "user": "User: {content}\n", "assistant": "Assistant:",
             "answer": " {content}", "after_answer": "\n"},
}
FORMAT_KEYS = {"prompt_completion": ("prompt", "completion"), "alpaca": ("instruction", "input", "output"),
               "chat": ("messages",)}
FIELDS = [k for keys in FORMAT_KEYS.values() for k in keys]
SUFFIXES = (".jsonl", ".parquet")
SPLITS = ("train", "val")

# -----------------------------------------------------------------------------
# 1. One example -> token ids and targets
#
# An example is a list of pieces of text, each a target or not (and EOT for <|endoftext|>). Each piece is
# encoded on its own and the ids concatenated. Encoded as one text, "The answer is " + "42" gives the token
# " 42", half prompt and half answer, and the mask would have no exact place to go; a template that tokenizes
# differently in context silently masked whole examples for TRL's users (TRL #598, #1820).

class BadExample(ValueError):
    """An example we cannot use. Its message is '<reason>: <details>'; the reason is what gets counted."""

def json_type(value):
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)

def detect_format(example):
    """The format whose keys the example has: exactly one of FORMAT_KEYS."""
    if not isinstance(example, dict):
        raise BadExample(f"not an object: a JSON {json_type(example)}")
    found = [fmt for fmt, keys in FORMAT_KEYS.items() if any(k in example for k in keys)]
    if len(found) != 1:
        keys = ", ".join(map(repr, sorted(example)[:8])) or "none"
        raise BadExample(f"unknown format: keys {keys}; expected prompt/completion, instruction/input/output "
                         "or messages (one of them)")
    return found[0]

def text_field(example, key, where=""):
    if key not in example:
        raise BadExample(f"missing field: {where}'{key}'")
    if not isinstance(example[key], str):
        raise BadExample(f"wrong type: {where}'{key}' is a {json_type(example[key])}, not a string")
    return example[key]

def nonempty(text, reason, what):
    """Whitespace alone is no prompt and no answer."""
    if not text.strip():
        raise BadExample(f"{reason}: {what} is empty")
    return text

def chat_pieces(messages, chat, last_role="assistant"):
    """[system], user, assistant, user, assistant, ... ending with last_role, as pieces."""
    if not isinstance(messages, list) or not messages:
        raise BadExample(f"wrong type: 'messages' is {'an empty array' if messages == [] else 'a ' + json_type(messages)}"
                         ", not an array of turns")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadExample(f"wrong type: messages[{i}] is a {json_type(m)}, not an object")
        text_field(m, "role", f"messages[{i}]."), text_field(m, "content", f"messages[{i}].")
        if m["role"] not in ("system", "user", "assistant"):
            raise BadExample(f"unknown role: messages[{i}].role is {m['role']!r} (use system, user or assistant)")
    roles = [m["role"] for m in messages]
    turns = roles[1:] if roles[0] == "system" else roles
    if not turns or turns != ["user", "assistant"] * (len(turns) // 2) + ["user"] * (len(turns) % 2) \
            or turns[-1] != last_role:
        raise BadExample(f"roles out of order: {', '.join(roles)} (expected an optional system turn, then user "
                         f"and assistant in turn, ending with {last_role})")
    pieces = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            nonempty(m["content"], "empty answer", f"messages[{i}].content")
            pieces += [(chat["assistant"], False), (chat["answer"].format(content=m["content"]), True), (EOT, True)]
        else:
            nonempty(m["content"], "empty prompt", f"messages[{i}].content")
            if i > 0 and messages[i - 1]["role"] == "assistant":   # after an answer's EOT, before the next user turn
                pieces.append((chat["after_answer"], False))
            pieces.append((chat[m["role"]].format(content=m["content"]), False))
    return pieces

def alpaca_prompt(alpaca, instruction, input_text):
    nonempty(instruction, "empty prompt", "'instruction'")
    if input_text and input_text.strip():
        return alpaca["input"].format(instruction=instruction, input=input_text)
    return alpaca["no_input"].format(instruction=instruction)

def example_pieces(example, templates):
    """The example as (text, is_target) pieces in order; (EOT, True) ends each answer."""
    fmt = detect_format(example)
    if fmt == "prompt_completion":   # exactly prompt + completion + <|endoftext|>: nothing added
        prompt = nonempty(text_field(example, "prompt"), "empty prompt", "'prompt'")
        completion = nonempty(text_field(example, "completion"), "empty answer", "'completion'")
        return [(prompt, False), (completion, True), (EOT, True)]
    if fmt == "alpaca":
        instruction, output = text_field(example, "instruction"), text_field(example, "output")
        # "input" is optional; null is absent (datasets fill missing cells with null)
        input_text = None if example.get("input") is None else text_field(example, "input")
        prompt = alpaca_prompt(templates["alpaca"], instruction, input_text)
        return [(prompt, False), (nonempty(output, "empty answer", "'output'"), True), (EOT, True)]
    return chat_pieces(example["messages"], templates["chat"])

def render(example, templates=TEMPLATES, train_on="completion"):
    """An example -> (ids, targets, answer_start): targets[i] is 1 where the model learns to predict ids[i]
    from ids[:i]; answer_start is where the last answer begins (what accuracy scores). --train_on all: every
    token but the first is a target (the first has nothing before it to be predicted from)."""
    ids, targets, answer_start = [], [], None
    for piece, is_target in example_pieces(example, templates):
        new = [EOT] if isinstance(piece, int) else encode(piece)   # encode_ordinary: a typed "<|endoftext|>" is text
        if is_target and not isinstance(piece, int):
            answer_start = len(ids)
        ids += new
        targets += [int(is_target)] * len(new)
    if train_on == "all":
        targets = [0] + [1] * (len(ids) - 1)
    assert targets[0] == 0 and ids[-1] == EOT and 0 < answer_start < len(ids) - 1
    return ids, targets, answer_start

def fit(ids, targets, answer_start, max_len, too_long):
    """An example takes len(ids) - 1 positions of a row (inputs ids[:-1], targets ids[1:]). Longer than
    max_len: --too_long drop, or cut the prompt from the left, keeping the last answer and its EOT whole and at
    least one token before them. Returns (ids, targets, answer_start, note); note is None if it fit."""
    excess = len(ids) - 1 - max_len
    if excess <= 0:
        return ids, targets, answer_start, None
    what = f"too long: {len(ids) - 1} positions > --max_len {max_len}"
    if too_long == "drop":
        raise BadExample(f"{what}; dropped (--too_long drop)")
    if excess >= answer_start:
        raise BadExample(f"{what}; dropped: its last answer and <|endoftext|> alone take "
                         f"{len(ids) - answer_start} positions")
    targets = [0] + targets[excess + 1:]   # the new first token has nothing before it: never a target
    return ids[excess:], targets, answer_start - excess, f"{what}: cut {excess} prompt tokens from the left"

def prompt_ids(task, prompt):
    """What a model fine-tuned on `task` (a task.json dict) continues to answer `prompt`: a string, or (chat)
    a list of messages ending with a user turn. A mixed task prompts a string in its most common format."""
    templates, fmt = task["templates"], task["format"]
    if fmt == "mixed":
        fmt = max(sorted(task["formats"]), key=task["formats"].get)
    if isinstance(prompt, list) or fmt == "chat":
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        pieces = chat_pieces(messages, templates["chat"], last_role="user")
        return [t for p, _ in pieces + [(templates["chat"]["assistant"], False)]
                for t in ([EOT] if isinstance(p, int) else encode(p))]
    if fmt == "alpaca":
        return encode(alpaca_prompt(templates["alpaca"], prompt, None))
    return encode(prompt)

# -----------------------------------------------------------------------------
# 2. Where examples come from: local .jsonl / .parquet files, or a Hugging Face dataset, streamed
#
# A source yields (where, row): where is 'file:line' for the messages, row a dict (or the BadExample that
# reading it gave). --columns renames a dataset's columns to our fields: prompt=question,completion=answer.

Source = collections.namedtuple("Source", "name rows")   # rows() -> iterator of (where, row)

def jsonl_rows(path):
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield f"{path}:{line_no}", json.loads(line)
                except ValueError as e:   # (bytes that are not UTF-8 too)
                    yield f"{path}:{line_no}", BadExample(f"not JSON: {e}")

def parquet_rows(path):
    rows = (row for batch in pq.ParquetFile(path).iter_batches(batch_size=1024) for row in batch.to_pylist())
    for row_no, row in enumerate(rows, 1):
        yield f"{path}:{row_no}", row

def hub_source(dataset, config, split, columns):
    """A Hugging Face dataset by name (or a local folder laid out like one), streamed as fineweb.py does:
    rows are downloaded as they are read."""
    import datasets   # here, so that local files work without it
    try:
        ds = datasets.load_dataset(dataset, name=config, split=split, streaming=True)
    except Exception as e:
        raise SystemExit(f"error: --input {dataset}: cannot open it as a Hugging Face dataset (config {config}, "
                         f"split {split}): {one_line(e)}")
    known = ds.column_names or []   # (None when the dataset does not say before it is read)
    missing = [c for c in columns.values() if known and c not in known]
    if missing or known and not columns and not set(known) & set(FIELDS):   # one line, not one per row
        raise SystemExit(f"error: dataset {dataset}: {f'no column {missing[0]!r}' if missing else 'none of our fields'}"
                         f" (columns: {', '.join(known)}); see --columns")
    return Source(dataset, lambda: ((f"{dataset}:{i}", row) for i, row in enumerate(ds, 1)))

def open_sources(names, args, flag):
    """--input / --val_input values -> sources, in order; every file is checked before any is read.
    A name that is no local file, folder or pattern is a dataset on the Hugging Face hub."""
    sources = []
    for name in names:
        local = any(c in name for c in "*?[") or name.lower().endswith(SUFFIXES) or os.path.isfile(name)
        if os.path.isdir(name) or not local:
            sources.append(hub_source(name, args.hf_config, args.hf_split, args.columns))
            continue
        files = sorted(f for f in glob.glob(name) if os.path.isfile(f))
        if not files:
            raise SystemExit(f"error: {flag} {name}: no such file")
        for path in files:
            if not path.lower().endswith(SUFFIXES):
                raise SystemExit(f"error: {path}: unsupported file type (use {' or '.join(SUFFIXES)})")
            try:   # readable, and a parquet file's footer is sound
                pq.ParquetFile(path) if path.lower().endswith(".parquet") else open(path, "rb").close()
            except Exception as e:
                raise SystemExit(f"error: {path}: cannot read it ({one_line(e)})")
            read = parquet_rows if path.lower().endswith(".parquet") else jsonl_rows
            sources.append(Source(path, lambda p=path, read=read: read(p)))
    return sources

# -----------------------------------------------------------------------------
# 3. All examples: rendered, bad ones reported and counted, split, written

Example = collections.namedtuple("Example", "ids targets answer_start")   # ids uint16, targets uint8 arrays

def collect(sources, args, templates, max_len, what="examples"):
    """Render every row; each bad one gets its line 'where: why' and is counted, the good ones all go on."""
    examples, counts = [], {"formats": collections.Counter(), "dropped": collections.Counter(), "cut": 0}
    bar = tqdm(desc=f"rendering {what}", unit="ex", dynamic_ncols=True, leave=False)
    for source in sources:
        for where, row in source.rows():
            bar.update()
            try:
                if isinstance(row, BadExample):
                    raise row
                if args.columns and isinstance(row, dict):   # exactly the mapped columns, under our names
                    row = {ours: row[theirs] for ours, theirs in args.columns.items() if theirs in row}
                fmt = detect_format(row)
                ids, targets, answer_start, note = fit(*render(row, templates, args.train_on), max_len, args.too_long)
            except BadExample as e:
                tqdm.write(f"{where}: {e}", file=sys.stderr)
                counts["dropped"][str(e).split(":")[0]] += 1
                continue
            if note:
                tqdm.write(f"{where}: {note}", file=sys.stderr)
                counts["cut"] += 1
            counts["formats"][fmt] += 1
            examples.append(Example(np.array(ids, np.uint16), np.array(targets, np.uint8), answer_start))
    bar.close()
    return examples, counts

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
        "examples": np.stack([starts, starts + [e.answer_start for e in examples], ends], axis=1).reshape(-1, 3),
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

def read_task(data_dir):
    """The folder's task.json as a dict, or None when it is no task folder (pretraining shards, say)."""
    path = os.path.join(data_dir, "task.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            task = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path}: cannot read it ({one_line(e)})")
    if not isinstance(task, dict) or task.get("kind") != "task" or task.get("version") != TASK_VERSION:
        raise SystemExit(f"error: {path}: not a version {TASK_VERSION} task file; run finetune.py again")
    return task

def open_split(data_dir, split):
    """(tokens, targets, examples) of a split, memory-mapped: read from disk as they are used."""
    return tuple(np.load(os.path.join(data_dir, f"task_{split}_{part}.npy"), mmap_mode="r", allow_pickle=False)
                 for part in ("tokens", "targets", "examples"))

def prepare(args):
    """--input (and --val_input) -> the task folder; returns task.json's dict."""
    check_output_dir(args.output_dir, args.overwrite)
    sources = open_sources(args.input, args, "--input")
    val_sources = open_sources(args.val_input, args, "--val_input") if args.val_input else []
    examples, counts = collect(sources, args, TEMPLATES, args.max_len)
    if not examples:
        raise SystemExit(f"error: --input {' '.join(args.input)}: no usable example (see the messages above)")
    if val_sources:
        val, val_counts = collect(val_sources, args, TEMPLATES, args.max_len, "val examples")
        if not val:
            raise SystemExit(f"error: --val_input {' '.join(args.val_input)}: no usable example")
        for key in counts:
            counts[key] += val_counts[key]
        splits = {"train": examples, "val": val}
    else:   # whole examples, chosen by the seed; both splits keep input order (the trainer shuffles)
        n_val = default_val_examples(len(examples)) if args.val_examples is None else args.val_examples
        if n_val >= len(examples):
            raise SystemExit(f"error: --val_examples {n_val} leaves no train example ({len(examples)} usable)")
        chosen = set(seeded_order(len(examples), args.seed)[:n_val])
        splits = {"train": [e for i, e in enumerate(examples) if i not in chosen],
                  "val": [e for i, e in enumerate(examples) if i in chosen]}
    formats = dict(sorted(counts["formats"].items()))
    task = {"kind": "task", "version": TASK_VERSION, "format": next(iter(formats)) if len(formats) == 1 else "mixed",
            "formats": formats, "templates": TEMPLATES, "train_on": args.train_on, "max_len": args.max_len,
            "answer_regex": args.answer_regex, "splits": {},
            "inputs": [s.name for s in sources], "val_inputs": [s.name for s in val_sources],
            "columns": args.columns, "dropped": dict(sorted(counts["dropped"].items())),
            "too_long": args.too_long, "cut": counts["cut"]}
    task_path = os.path.join(args.output_dir, "task.json")
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        if os.path.exists(task_path):   # first: a run stopped while rewriting leaves a folder that says it is incomplete
            os.remove(task_path)
        task["splits"] = {split: write_split(args.output_dir, split, splits[split]) for split in SPLITS}
        atomic_write(task_path, lambda f: f.write(json.dumps(task, indent=1).encode() + b"\n"))
    except OSError as e:   # no permission, disk full, ...: one line
        raise SystemExit(f"error: cannot write to --output_dir {args.output_dir}: {one_line(e)}")
    print_summary(args.output_dir, task)
    return task

def print_summary(out_dir, task):
    print(f"{out_dir}: {', '.join(f'{n:,} {fmt}' for fmt, n in task['formats'].items())}, train on {task['train_on']}")
    for split, s in task["splits"].items():
        print(f"  {split:5s} {s['examples']:,} examples, {s['tokens']:,} tokens, {s['targets']:,} targets "
              f"({s['targets'] / max(1, s['tokens']):.1%} of tokens), longest {s['longest']} positions")
    dropped = task["dropped"]
    print(f"  dropped {sum(dropped.values()):,}" + (f" ({', '.join(f'{why} {n}' for why, n in dropped.items())})"
                                                    if dropped else "") +
          f"; too long (> --max_len {task['max_len']} positions, --too_long {task['too_long']}): "
          f"{task['cut']} cut from the left, {dropped.get('too long', 0)} dropped")

# -----------------------------------------------------------------------------
# 4. Training on a task folder (train_gpt2.py reads it through these): packed rows, and the defaults

# Examples, each a prompt and its answer whose tokens alone are targets, are packed whole into rows of T positions, several to a row and never split across rows;
# positions restart at 0 for each example (GPT-2's are learned: the model must see an example as if it were alone)
# and attention stays inside each (train_gpt2.packed_attention). A row's unused tail is padding: attended by nothing,
# no target. train_gpt2.py's DataLoader does the same for pretraining shards, with blocks instead of examples.

IGNORE = -100  # a target that counts for nothing: F.cross_entropy's ignore_index, transformers' label for it
PICK_MULTIPLE = 1024  # pick_targets rounds up to this (train_gpt2.LOSS_CHUNK: whole chunks of the fused loss)

class Packed(NamedTuple):  # how a batch of rows is packed, for GPT.forward(..., packed=)
    positions: torch.Tensor  # (B, T): each example's positions, from 0
    lengths: torch.Tensor  # (k,): the lengths of the examples and padding, in order, row after row (they sum to B*T)
    picked: torch.Tensor  # (K,): where the targets are in the flattened rows (pick_targets)

    def to(self, device):  # (lengths stay on the CPU, where packed_attention reads them)
        return Packed(self.positions.to(device), self.lengths, self.picked.to(device))

def pick_targets(y):
    """The flat positions of y's targets, padded with one of its ignored positions to a multiple of PICK_MULTIPLE: only
    these go through lm_head and the loss. (Their count changes every batch; rounded up, torch.compile sees a few
    shapes, each compiled once, not a new one every step.)"""
    flat = y.reshape(-1)
    counted = (flat != IGNORE).nonzero().squeeze(1)
    size = min(flat.numel(), -(-counted.numel() // PICK_MULTIPLE) * PICK_MULTIPLE)
    filler = (flat == IGNORE).nonzero()[:1, 0].expand(size - counted.numel())
    return torch.cat((counted, filler))

def pack(order, lengths, T):
    """Example indices, in the given order, cut into rows of at most T positions: the next example starts a new row
    when it does not fit in this one (a greedy pass keeps the order, so a row holds examples adjacent in it)."""
    rows, row, used = [], [], 0
    for i in order:
        if used + lengths[i] > T:
            rows.append(row)
            row, used = [], 0
        row.append(int(i))
        used += int(lengths[i])
    return rows + [row] if row else rows

class TaskLoader:
    """Packed rows of a task folder's split, for training (shuffle: example order shuffled by the seed each epoch,
    then packed) or validation (the examples in order: val_batches). Like DataLoader, all ranks walk the same stream of
    rows and a micro-step takes the next world*B, rank r keeping rows r*B..(r+1)*B-1; the state is (epoch, row)."""

    def __init__(self, data_dir, split, B, T, rank=0, world_size=1, seed=1337):
        self.B, self.T, self.rank, self.world_size, self.seed = B, T, rank, world_size, seed
        self.tokens, self.targets, self.examples = open_split(data_dir, split)
        self.lengths = self.examples[:, 2] - self.examples[:, 0] - 1  # positions: inputs are an example's tokens but its last
        if len(self.examples) and self.lengths.max() > T:
            raise SystemExit(f"error: --data_dir {data_dir}: a {split} example fills {self.lengths.max()} positions, more than "
                             f"--seq_len {T}: raise --seq_len, or prepare the data with finetune.py --max_len {T}")
        summed = np.concatenate(([0], np.cumsum(self.targets, dtype=np.int64)))
        self.n_targets = summed[self.examples[:, 2]] - summed[self.examples[:, 0]]  # per example
        self.epoch, self.row = 0, 0
        self._pack()

    def _pack(self):  # a pure function of (seed, epoch), like DataLoader's orders
        self.rows = pack(np.random.default_rng([self.seed, self.epoch]).permutation(len(self.examples)), self.lengths, self.T)

    def rows_in_epochs(self, epochs):
        return sum(len(pack(np.random.default_rng([self.seed, e]).permutation(len(self.examples)), self.lengths, self.T))
                   for e in range(epochs))

    def state_dict(self):
        return {"epoch": self.epoch, "row": self.row, "seed": self.seed, "examples": len(self.examples),
                "tokens": len(self.tokens)}

    def load_state_dict(self, state):
        if [state.get(k) for k in ("seed", "examples", "tokens")] != [self.seed, len(self.examples), len(self.tokens)]:
            raise SystemExit("error: the task data in --data_dir or the --seed differ from the checkpoint's; "
                             "resuming would not continue the same data order")
        self.epoch, self.row = state["epoch"], state["row"]
        self._pack()

    def _next_row(self):
        while self.row == len(self.rows):
            self.epoch, self.row = self.epoch + 1, 0
            self._pack()
        self.row += 1
        return self.rows[self.row - 1]

    def next_step(self, micro_steps):
        """This rank's (x, y, Packed) for each micro-step of one optimizer step, and the number of targets in the whole
        step, on all ranks: the loss is their mean, so every micro-batch's share is weighed by its own targets."""
        rows = [self._next_row() for _ in range(micro_steps * self.world_size * self.B)]
        n_targets = int(sum(self.n_targets[i] for row in rows for i in row))
        mine = [rows[(m * self.world_size + self.rank) * self.B:][:self.B] for m in range(micro_steps)]
        return [self.batch(r) for r in mine], n_targets

    def val_batches(self):
        """Every example of the split once, in order, this rank's rows (row i goes to rank i % world_size), B at a time."""
        mine = pack(range(len(self.examples)), self.lengths, self.T)[self.rank::self.world_size]
        return [self.batch(mine[i:i + self.B]) for i in range(0, len(mine), self.B)]

    def batch(self, rows):
        """x, y (B, T) and their Packed layout; y is IGNORE where a token is not a target, and on the padding."""
        x = np.full((len(rows), self.T), EOT, dtype=np.int64)
        y = np.full((len(rows), self.T), IGNORE, dtype=np.int64)
        positions, lengths = np.zeros((len(rows), self.T), dtype=np.int64), []
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                start, _, end = self.examples[i]
                n = end - start - 1
                x[r, at:at + n] = self.tokens[start:end - 1]
                y[r, at:at + n] = np.where(self.targets[start + 1:end] > 0, self.tokens[start + 1:end].astype(np.int64), IGNORE)
                positions[r, at:at + n] = np.arange(n)
                lengths.append(n)
                at += n
            if at < self.T:  # the padding: one more "example" that nothing else sees
                positions[r, at:] = np.arange(self.T - at)
                lengths.append(self.T - at)
        y = torch.from_numpy(y)
        return torch.from_numpy(x), y, Packed(torch.from_numpy(positions), torch.tensor(lengths), pick_targets(y))

# Fine-tuning (--data_dir a folder from finetune.py): its defaults, where the flag is not given (docs/finetuning.md):
# rows as long as the longest example and about EXAMPLES_PER_STEP examples a step, so that an epoch is many steps;
# a learning rate 10x lower for a pretrained model than for one from scratch; 5% of the steps warming up, then
# cosine decay to a tenth; no HellaSwag or samples, but the task's own accuracy at each eval. Measured against a
# transformers loop on held-out synthetic tasks (bench/compare_hf_finetune.py): 16 examples a step, or 1e-3, lost.
EXAMPLES_PER_STEP = 8
FINETUNE_ARGS = dict(epochs=3, hellaswag_interval=0, sample_interval=0, task_examples=200)
FINETUNE_LR = {"scratch": 5e-4, "pretrained": 5e-5}

def training_defaults(args, given, task, world_size):
    """Fill in the fine-tuning defaults for the flags not given; --epochs sets --max_steps. Returns the line to print."""
    if task["splits"]["train"]["examples"] == 0:
        raise SystemExit(f"error: --data_dir {args.data_dir} holds no training examples")
    vars(args).update({k: v for k, v in FINETUNE_ARGS.items() if k not in given})
    train = task["splits"]["train"]
    if "seq_len" not in given:  # rows as long as the longest example, rounded up to 64
        args.seq_len = min(-(-train["longest"] // 64) * 64, args.block_size, 1024)
    if "batch_size" not in given:  # rows per micro-step and rank
        per_row = args.seq_len / (train["tokens"] / train["examples"] - 1)
        args.batch_size = max(1, round(EXAMPLES_PER_STEP / per_row / world_size))
    if "total_batch_size" not in given:
        args.total_batch_size = args.batch_size * args.seq_len * world_size
    if "max_lr" not in given:
        args.max_lr = FINETUNE_LR["scratch" if args.init_from == "scratch" else "pretrained"]
    args.min_lr = args.min_lr if "min_lr" in given else args.max_lr / 10
    if "max_steps" not in given:
        rows = TaskLoader(args.data_dir, "train", 1, args.seq_len, seed=args.seed).rows_in_epochs(args.epochs)
        args.max_steps = max(1, -(-rows * args.seq_len // args.total_batch_size))
    args.warmup_steps = args.warmup_steps if "warmup_steps" in given else max(1, args.max_steps // 20)
    for flag in ("eval_interval", "checkpoint_interval"):
        if flag not in given:
            setattr(args, flag, max(1, args.max_steps // 10))
    return (f"fine-tuning: {train['examples']} examples x {args.epochs} epochs = {args.max_steps} steps "
            f"of {args.total_batch_size // args.seq_len} rows of {args.seq_len}; lr {args.max_lr:g} -> {args.min_lr:g}, "
            f"warmup {args.warmup_steps}, eval every {args.eval_interval} (flags override these)")

# -----------------------------------------------------------------------------
# 5. Task accuracy: greedy answers, scored
#
# Val loss says how likely the right answers are; accuracy says how often the model gives them. Each prompt
# is answered greedily (sample.answers: many prompts per forward, the KV cache, stopping at <|endoftext|>) and
# compared with the expected answer after collapsing whitespace, or, with an answer regex, only what its first
# group finds in each (for GSM8K '#### (.*)': the final number, not the working before it).

def answer_key(text, answer_regex=None):
    """What is compared: the whole text, or the regex's first group in it (None: it found nothing)."""
    if answer_regex:
        found = re.search(answer_regex, text)
        if found is None or found.group(1) is None:
            return None
        text = found.group(1)
    return " ".join(text.split())

def is_right(got, expected, answer_regex=None):
    key = answer_key(got, answer_regex)
    return key is not None and key == answer_key(expected, answer_regex)

def split_examples(data_dir, split="val"):
    """A task folder's examples as (prompt ids, expected answer text)."""
    tokens, _, offsets = open_split(data_dir, split)
    return [(tokens[s:a].tolist(), decode(tokens[a:e - 1])) for s, a, e in offsets.tolist()]

def task_accuracy(model, examples, autocast=None, max_new_tokens=None, answer_regex=None, n=None, ranks=None,
                  lockstep=False):
    """The share of right answers, and this rank's (prompt text, expected, got) list.

    examples: a task folder (its val split; answer_regex defaults to its task.json's) or a list of
    (prompt ids, expected text); n: the first n only. max_new_tokens: None gives each answer room for a right
    one, and cuts short a wrong one that rambles on: the expected answer's tokens + 8 (a right answer has as
    many, give or take some whitespace), twice that + 16 with a regex (the working before the answer varies).
    ranks (train_gpt2's world.Ranks): rank r answers examples r, r + world_size, ... and the counts are summed
    over the ranks; lockstep=True: every rank answers every example (a sharded model, whose every forward
    needs all the ranks)."""
    import sample
    if isinstance(examples, (str, os.PathLike)):
        task = read_task(examples)
        if task is None:
            raise SystemExit(f"error: {examples}: no task.json, not a task folder")
        answer_regex = answer_regex or task["answer_regex"]
        examples = split_examples(examples)
    examples = list(examples)[:n]
    rank, world_size = (ranks.rank, ranks.world_size) if ranks is not None and not lockstep else (0, 1)
    mine, right, results = examples[rank::world_size], 0, []
    quiet = ranks is not None and not ranks.master
    limits = [max_new_tokens or (2 * len(encode(expected)) + 16 if answer_regex else len(encode(expected)) + 8)
              for _, expected in mine]
    with torch.no_grad(), autocast or nullcontext(), \
            tqdm(total=len(mine), desc="task accuracy", unit="ex", leave=False, disable=quiet) as progress:
        answers = sample.answers(model, [list(prompt) for prompt, _ in mine], limits, progress=progress)
    for (prompt, expected), ids in zip(mine, answers):
        got = decode(ids)
        right += is_right(got, expected, answer_regex)
        results.append((decode(prompt), expected, got))
    counts = torch.tensor([right, len(mine)], dtype=torch.long, device=ranks.device if ranks else "cpu")
    if ranks is not None and not lockstep:
        ranks.all_reduce_sum(counts)
    right, total = counts.tolist()
    return (right / total if total else float("nan")), results

def evaluate(args):
    """--eval: a checkpoint (ours, or a Hugging Face-layout folder) answers --input's examples."""
    import train_gpt2
    from plumbing import cpu, speedups, world
    cpu.warm_up_vector_math()   # results independent of thread timing (see plumbing/cpu.py)
    path = args.ckpt_path
    if not os.path.exists(path):
        raise SystemExit(f"error: --ckpt_path {path} not found")
    sources = open_sources(args.input, args, "--input")
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, "meta.pt")):   # one of ours: load it once
        ckpt = train_gpt2.load_checkpoint(path)
        task, model = ckpt.get("task"), train_gpt2.GPT.from_checkpoint(ckpt)
        del ckpt
    else:                                                 # a Hugging Face-layout folder, maybe with our task.json
        task, model = read_task(path), train_gpt2.load_model(path)
    print(f"loaded {path}: " + (f"fine-tuned on a {task['format']} task, its templates" if task else
                                "no task.json, finetune.py's templates"), file=sys.stderr)
    templates = task["templates"] if task else TEMPLATES
    answer_regex = args.answer_regex or (task or {}).get("answer_regex")
    # the prompts as the model was trained on them, cut from the left to fit its context
    examples, _ = collect(sources, args, templates, model.config.block_size)
    if not examples:
        raise SystemExit(f"error: --input {' '.join(args.input)}: no usable example")
    examples = [(e.ids[:e.answer_start].tolist(), decode(e.ids[e.answer_start:-1])) for e in examples]
    examples = examples[:args.max_examples]
    device = world.pick_device(args.device, 0, 1)
    model.to(device).eval()
    dtype, why = speedups.resolve_dtype(args.dtype, torch.device(device).type, model.config.n_embd)
    print(why, file=sys.stderr)
    accuracy, results = task_accuracy(model, examples, speedups.autocast(dtype, torch.device(device).type),
                                      args.max_new_tokens, answer_regex)
    unmatched = sum(answer_key(expected, answer_regex) is None for _, expected in examples)
    if unmatched:
        print(f"warning: {unmatched} expected answers have no match of --answer_regex: they count as wrong",
              file=sys.stderr)
    right = [is_right(got, expected, answer_regex) for _, expected, got in results]
    for i, (prompt, expected, got) in enumerate(results[:3]):   # (the prompt's end: where the answer follows)
        print(f"--- example {i + 1} ({'right' if right[i] else 'wrong'})\nprompt:   {prompt[-500:]!r}\n"
              f"expected: {expected!r}\ngot:      {got!r}")
    scoring = f"the first group of {answer_regex!r}" if answer_regex else "exact match after whitespace normalization"
    print(f"task accuracy: {accuracy:.4f} ({sum(right)}/{len(results)} examples of {' '.join(args.input)}; {scoring})")
    return accuracy

# -----------------------------------------------------------------------------
# 6. The offline demo's task

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
    from plumbing.checkpoints import list_checkpoints
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
    ckpt = list_checkpoints(log_dir)[-1]
    print(f"\ndemo finished: task accuracy {float(accuracy[0][2]):.2f} at step {accuracy[0][0]} -> "
          f"{float(accuracy[-1][2]):.2f} at step {accuracy[-1][0]} ({len(accuracy)} evals in {log_dir}/log.txt). Next:\n"
          f"  python sample.py --ckpt_path {ckpt} --prompt 'Sort: 8 3 5 1 ->' --top_k 1   # ask it\n"
          f"  python finetune.py --eval --ckpt_path {ckpt} --input {val}   # score it, with examples")

# -----------------------------------------------------------------------------
# 7. The command line

def parse_columns(text):
    """'prompt=question,completion=answer' -> {"prompt": "question", "completion": "answer"}."""
    columns = {}
    for pair in filter(None, text.split(",")):
        ours, _, theirs = pair.partition("=")
        if ours.strip() not in FIELDS or not theirs.strip():
            raise SystemExit(f"error: --columns {text}: {pair!r} is not FIELD=COLUMN with FIELD one of "
                             f"{', '.join(FIELDS)}")
        columns[ours.strip()] = theirs.strip()
    return columns

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Task examples (prompt/completion, Alpaca, chat) -> token shards with "
                                "a target mask for train_gpt2.py; --eval: a model's answer accuracy.")
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
    a("--eval", action="store_true", help="score --ckpt_path's answers to --input's examples")
    a("--ckpt_path", help="--eval: one of our checkpoints, or a Hugging Face-layout folder")
    a("--max_examples", type=int, help="--eval: only the first N examples")
    a("--max_new_tokens", type=int, help="--eval: most tokens per answer (default: from the expected answer's)")
    a("--device", default="auto", help="--eval: auto | cpu | cuda | cuda:N | xpu | mps")
    a("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="--eval: precision of the forward pass")
    args = p.parse_args(argv)
    # every cheap check before any work
    args.columns = parse_columns(args.columns)
    if args.answer_regex is not None:
        try:
            groups = re.compile(args.answer_regex).groups
        except re.error as e:
            raise SystemExit(f"error: --answer_regex {args.answer_regex!r}: {e}")
        if groups < 1:
            raise SystemExit(f"error: --answer_regex {args.answer_regex!r} has no group: put the answer in (...)")
    for flag in ("max_len", "val_examples", "max_examples", "max_new_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < (0 if flag == "val_examples" else 1):
            raise SystemExit(f"error: --{flag} must be {'>= 0' if flag == 'val_examples' else 'at least 1'}")
    if args.eval and (not args.ckpt_path or not args.input):
        raise SystemExit("error: --eval needs --ckpt_path and --input")
    if not args.eval and not args.demo and (not args.input or not args.output_dir):
        raise SystemExit("error: give --input and --output_dir (or --demo, or --eval)")
    return args

def main(argv=None):
    args = parse_args(argv)
    if args.eval:
        return evaluate(args)
    if args.demo:
        return demo(args)
    task = prepare(args)
    print(f"next: python train_gpt2.py --init_from gpt2 --data_dir {args.output_dir}")
    return task

if __name__ == "__main__":
    main()
