"""
Task examples: their three formats and the templates that turn them into text, where they come from (.jsonl and
.parquet files, Hugging Face datasets), and how each becomes token ids with a target mask. A library: finetune.py
writes task folders with it, answer.py scores and talks with it, sample.py prompts a fine-tuned model with it.

One example per line (.jsonl) or row (.parquet, a dataset), its format told by its keys:
    {"prompt": ..., "completion": ...}                               prompt + completion + <|endoftext|>
    {"instruction": ..., "input": ... (optional), "output": ...}     Alpaca: TEMPLATES["alpaca"] around them
    {"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}   chat: TEMPLATES["chat"]
The targets, what the model learns to predict: each answer and the <|endoftext|> after it, not the prompts.
"""
import collections
import glob
import json
import os
import re
import sys

import numpy as np
from tqdm import tqdm

from plumbing.common import one_line
from tokenizer import EOT, encode

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
    # prompt + separator + completion: nothing between them unless finetune.py --separator says
    # (it is part of the prompt)
    "prompt_completion": {"separator": ""},
}
FORMAT_KEYS = {"prompt_completion": ("prompt", "completion"), "alpaca": ("instruction", "input", "output"),
               "chat": ("messages",)}
FIELDS = [k for keys in FORMAT_KEYS.values() for k in keys]
SUFFIXES = (".jsonl", ".parquet")

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
        described = "an empty array" if messages == [] else "a " + json_type(messages)
        raise BadExample(f"wrong type: 'messages' is {described}, not an array of turns")
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
            pieces += [(chat["assistant"], False), (chat["answer"].format(content=m["content"]), True)]
            if not m.get("cut"):   # (answer.py --chat keeps an answer that --max_new_tokens cut off without one)
                pieces.append((EOT, True))
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
    if fmt == "prompt_completion":   # exactly prompt + completion + <|endoftext|>: nothing added (but a --separator)
        prompt = nonempty(text_field(example, "prompt"), "empty prompt", "'prompt'")
        completion = nonempty(text_field(example, "completion"), "empty answer", "'completion'")
        return [(prompt + separator(templates), False), (completion, True), (EOT, True)]
    if fmt == "alpaca":
        instruction, output = text_field(example, "instruction"), text_field(example, "output")
        # "input" is optional; null is absent (datasets fill missing cells with null)
        input_text = None if example.get("input") is None else text_field(example, "input")
        prompt = alpaca_prompt(templates["alpaca"], instruction, input_text)
        return [(prompt, False), (nonempty(output, "empty answer", "'output'"), True), (EOT, True)]
    return chat_pieces(example["messages"], templates["chat"])

def separator(templates):  # what comes between a prompt and its completion (none in task.json files from before it)
    return templates.get("prompt_completion", {}).get("separator", "")

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

def fit(example, templates, train_on, max_len, too_long):
    """render()'s (ids, targets, answer_start), fitted to max_len positions (an example takes len(ids) - 1: inputs
    ids[:-1], targets ids[1:]), and a note saying what was cut (None if nothing). Longer: --too_long drop drops it;
    cut cuts its prompt from the left, keeping the last answer and its EOT whole and at least one token before them;
    a chat instead loses its oldest exchanges (drop_oldest_exchanges)."""
    ids, targets, answer_start = render(example, templates, train_on)
    excess = len(ids) - 1 - max_len
    if excess <= 0:
        return ids, targets, answer_start, None
    what = f"too long: {len(ids) - 1} positions > --max_len {max_len}"
    if too_long == "drop":
        raise BadExample(f"{what}; dropped (--too_long drop)")
    if detect_format(example) == "chat":
        return drop_oldest_exchanges(example["messages"], templates, train_on, max_len, what)
    if excess >= answer_start:
        raise BadExample(f"{what}; dropped: its last answer and <|endoftext|> alone take "
                         f"{len(ids) - answer_start} positions")
    targets = [0] + targets[excess + 1:]   # the new first token has nothing before it: never a target
    return ids[excess:], targets, answer_start - excess, f"{what}: cut {excess} prompt tokens from the left"

def drop_oldest_exchanges(messages, templates, train_on, max_len, what):
    """A chat too long for max_len: its oldest exchanges (a user turn and its answer) go, never the system turn, until
    it fits, as answer.py --chat trims a conversation. Cutting tokens instead would keep an answer whose question was
    cut away, and the model would learn to answer what it was not asked. None that fits alone: the chat is dropped."""
    first = 1 if messages[0]["role"] == "system" else 0
    full, kept = len(render({"messages": messages}, templates, train_on)[0]), list(messages)
    while len(kept) - first > 2:
        del kept[first:first + 2]
        ids, targets, answer_start = render({"messages": kept}, templates, train_on)
        if len(ids) - 1 <= max_len:
            n = (len(messages) - len(kept)) // 2
            return ids, targets, answer_start, (f"{what}: dropped its {n} oldest exchange{'s' * (n > 1)} "
                                                f"({full - len(ids)} tokens), every answer kept with its question")
    takes = " and the system turn alone take" if first else " alone takes"
    raise BadExample(f"{what}; dropped: its last exchange{takes} "
                     f"{len(render({'messages': kept}, templates, train_on)[0]) - 1} positions")

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
    return encode(prompt + separator(templates))

# -----------------------------------------------------------------------------
# 2. Where examples come from: local .jsonl / .parquet files, or a Hugging Face dataset, streamed
#
# A source yields (where, row): where is 'file:line' for the messages, row a dict (or the BadExample that
# reading it gave). --columns renames a dataset's columns to our fields: prompt=question,completion=answer.

Source = collections.namedtuple("Source", "name rows")   # rows() -> iterator of (where, row)

def parse_columns(text):
    """--columns 'prompt=question,completion=answer' -> {"prompt": "question", "completion": "answer"}."""
    columns = {}
    for pair in filter(None, text.split(",")):
        ours, _, theirs = pair.partition("=")
        if ours.strip() not in FIELDS or not theirs.strip():
            raise SystemExit(f"error: --columns {text}: {pair!r} is not FIELD=COLUMN with FIELD one of "
                             f"{', '.join(FIELDS)}")
        columns[ours.strip()] = theirs.strip()
    return columns

def check_answer_regex(answer_regex):
    try:
        groups = re.compile(answer_regex).groups
    except re.error as e:
        raise SystemExit(f"error: --answer_regex {answer_regex!r}: {e}")
    if groups < 1:
        raise SystemExit(f"error: --answer_regex {answer_regex!r} has no group: put the answer in (...)")

def unique_keys(pairs):
    """json's object_pairs_hook: a key given twice is an error, not (as json.loads has it) the last one silently
    winning."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise BadExample(f"duplicate key: {twice!r} appears {keys.count(twice)} times")
    return dict(pairs)

def jsonl_rows(path):
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield f"{path}:{line_no}", json.loads(line, object_pairs_hook=unique_keys)
                except BadExample as e:
                    yield f"{path}:{line_no}", e
                except ValueError as e:   # (bytes that are not UTF-8 too)
                    yield f"{path}:{line_no}", BadExample(f"not JSON: {e}")

def dataset_source(where, columns, failure, **load_dataset_args):
    """Rows that datasets.load_dataset reads, streamed: a Hugging Face dataset by name (or a local folder laid out like
    one), downloaded as it is read, as fineweb.py does; or a local .parquet file. failure: what an error line says."""
    import datasets   # here, so that .jsonl files work without it
    try:
        ds = datasets.load_dataset(**load_dataset_args, streaming=True)
    except Exception as e:
        raise SystemExit(f"error: {failure} ({one_line(e)})")
    known = ds.column_names or []   # (None when the dataset does not say before it is read)
    missing = [c for c in columns.values() if known and c not in known]
    if missing or known and not columns and not set(known) & set(FIELDS):   # one line, not one per row
        raise SystemExit(f"error: dataset {where}: {f'no column {missing[0]!r}' if missing else 'none of our fields'}"
                         f" (columns: {', '.join(known)}); see --columns")
    return Source(where, lambda: ((f"{where}:{i}", row) for i, row in enumerate(ds, 1)))

# no local .jsonl/.parquet file or pattern: a Hugging Face dataset (or a folder laid out like one)
def is_dataset(name):
    return os.path.isdir(name) or not (any(c in name for c in "*?[") or name.lower().endswith(SUFFIXES) or
                                       os.path.isfile(name))

def open_sources(names, args, flag):
    """--input / --val_input values -> sources, in order; every file is checked before any is read.
    A name that is no local file, folder or pattern is a dataset on the Hugging Face hub."""
    sources = []
    for name in names:
        if is_dataset(name):
            sources.append(dataset_source(name, args.columns, f"--input {name}: cannot open it as a Hugging Face "
                                          f"dataset (config {args.hf_config}, split {args.hf_split})",
                                          path=name, name=args.hf_config, split=args.hf_split))
            continue
        files = sorted(f for f in glob.glob(name) if os.path.isfile(f))
        if not files:
            raise SystemExit(f"error: {flag} {name}: no such file")
        for path in files:
            if not path.lower().endswith(SUFFIXES):
                raise SystemExit(f"error: {path}: unsupported file type (use {' or '.join(SUFFIXES)})")
            if path.lower().endswith(".parquet"):   # (its footer is read, and checked, here)
                sources.append(dataset_source(path, args.columns, f"{path}: cannot read it", path="parquet",
                                              data_files=path, split="train"))
                continue
            try:
                open(path, "rb").close()
            except OSError as e:
                raise SystemExit(f"error: {path}: cannot read it ({one_line(e)})")
            sources.append(Source(path, lambda p=path: jsonl_rows(p)))
    return sources

# -----------------------------------------------------------------------------
# 3. Every example of some sources, rendered; the bad ones reported and counted

Example = collections.namedtuple("Example", "ids targets answer_start")   # ids uint16, targets uint8 arrays

def collect(sources, args, templates, max_len, what="examples"):
    """Render every row; each bad one gets its line 'where: why' and is counted, the good ones all go on. Also counted:
    the formats, what was cut, and the prompts whose boundary with their answer a user should look at (boundary)."""
    examples, counts = [], {"formats": collections.Counter(), "dropped": collections.Counter(), "cut": 0,
                            "trimmed": 0, "joined": [0, None], "glued": [0, None]}
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
                ids, targets, answer_start, note = fit(row, templates, args.train_on, max_len, args.too_long)
            except BadExample as e:
                tqdm.write(f"{where}: {e}", file=sys.stderr)
                counts["dropped"][str(e).split(":")[0]] += 1
                continue
            if note:
                tqdm.write(f"{where}: {note}", file=sys.stderr)
                counts["trimmed" if fmt == "chat" else "cut"] += 1
            for kind in boundary(row, fmt, templates):
                counts[kind][0] += 1
                counts[kind][1] = counts[kind][1] or (where, row["prompt"] + separator(templates), row["completion"])
            counts["formats"][fmt] += 1
            examples.append(Example(np.array(ids, np.uint16), np.array(targets, np.uint8), answer_start))
    bar.close()
    return examples, counts

# Where a prompt meets its answer: encoded apart (see render), the boundary is exact, but two kinds of prompt/completion
# data train on tokens the user probably did not mean. joined: "The answer is " + "42" trains on ' ' + '42' where the
# joined text has ' 42': consistent, but a pretrained GPT-2 rarely saw that split, and re-tokenizing the joined text
# gives other ids (the space belongs at the completion's start). glued: "What is 3 plus 3?" + "3 plus 3 is 6." has
# nothing between them, so the model learns answers glued to the question mark (finetune.py --separator "\n" is the
# usual fix).

def boundary(example, fmt, templates):
    """Which of 'joined' and 'glued' (above) this example is: a list of none, one or both."""
    if fmt != "prompt_completion":
        return []
    prompt, completion = example["prompt"] + separator(templates), example["completion"]
    kinds = ["joined"] if encode(prompt) + encode(completion) != encode(prompt + completion) else []
    return kinds + (["glued"] if not prompt[-1].isspace() and not completion[0].isspace() else [])
