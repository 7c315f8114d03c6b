"""
answer.py: ask a model fine-tuned on a task (train_gpt2.py on a finetune.py folder) for its answers: how many it gets
right on examples (task accuracy, which train_gpt2.py also logs at each eval), or a conversation with a chat model.

    python answer.py --ckpt_path log/model_00300.pt --input val.jsonl                 # the share of right answers
    python answer.py --ckpt_path log/model_00300.pt --input openai/gsm8k --hf_config main --hf_split test \\
                     --columns prompt=question,completion=answer --answer_regex '#### (.*)'
    python answer.py --ckpt_path log_chat/model_00300.pt --chat --system "You are terse."   # your turns from stdin

A model is asked the way it was trained: its checkpoint carries the task.json of its data (export_hf.py keeps it in
the folder it writes), whose templates (tasks.py) turn an example into the prompt it learned to answer, and it learned
to end each answer with <|endoftext|>. (One answer to one --prompt: python sample.py --ckpt_path ... --prompt ....)
"""
import argparse
import os
import re
import sys
from contextlib import nullcontext

import torch
from tqdm import tqdm

import tasks
import tokenizer
from dataloader import open_split, read_task
from compute import cpu, speedups
from model import KVCache, load_model
from parallel import world
from plumbing.common import ShowDefaults, one_line

# -----------------------------------------------------------------------------
# 1. Greedy answers, many at once
#
# Task accuracy asks hundreds of prompts. One forward per new token serves a whole batch of them: the rows are
# left-padded to the longest prompt, so that all of them end in the same column and each step takes every row's next
# token from it; the KVCache's pads give each row its own positions and keep every query away from the padding
# (model.KVCache). Prompts of similar lengths share a batch (sorted by length: little padding), and a row that is
# done (<|endoftext|>, or out of room) leaves the batch and the cache.

def answers(model, prompts, max_new_tokens, batch_size=64, progress=None):
    """The model's greedy answer (new token ids, up to <|endoftext|>, not included) to each prompt (token ids), in input
    order; max_new_tokens: one for all, or a list of one per prompt; an answer also ends where the context does.
    progress: a tqdm bar, advanced by each batch. A batch changes only the float rounding of the sums, which could flip
    only a near-tie of two tokens' logits (as bf16 or another CPU could). The caller sets autocast."""
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    if len(max_new_tokens) != len(prompts) or not all(prompts):
        raise ValueError("answers: one max_new_tokens per prompt, and no empty prompt (nothing to continue)")
    rooms = [min(n, model.config.block_size - len(ids)) for ids, n in zip(prompts, max_new_tokens)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        batch = [i for i in order[start:start + batch_size] if rooms[i] > 0]
        if batch:
            for i, new in zip(batch, greedy_batch(model, [prompts[i] for i in batch], [rooms[i] for i in batch])):
                results[i] = new
        if progress is not None:
            progress.update(len(order[start:start + batch_size]))
    return results

@torch.no_grad()
def greedy_batch(model, prompts, rooms):
    """The greedy answers to one batch of prompts, each up to <|endoftext|> or its room (>= 1) of tokens."""
    device = next(model.parameters()).device
    P = max(map(len, prompts))
    idx = torch.tensor([[tokenizer.EOT] * (P - len(ids)) + list(ids) for ids in prompts], device=device)
    # a row feeds at most room - 1 tokens after its prompt (its last one is never fed back)
    cache = KVCache(model.config.n_layer, P + max(rooms) - 1, pads=torch.tensor([P - len(ids) for ids in prompts],
                                                                               device=device))
    logits, _ = model(idx, cache=cache)
    rows, new = list(range(len(prompts))), [[] for _ in prompts]  # rows: which prompts the batch still answers
    while True:
        next_ids = logits[:, -1, :tokenizer.VOCAB_SIZE].argmax(dim=-1)  # padded vocab ids are never picked
        going = []
        for j, (row, token) in enumerate(zip(rows, next_ids.tolist())):
            if token != tokenizer.EOT:
                new[row].append(token)
                if len(new[row]) < rooms[row]:
                    going.append(j)
        if not going:
            return new
        if len(going) < len(rows):  # the rows that are done leave the batch, and the cache
            keep = torch.tensor(going, device=device)
            cache.keep(keep)
            next_ids, rows = next_ids[keep], [rows[j] for j in going]
        logits, _ = model(next_ids[:, None], cache=cache)

# -----------------------------------------------------------------------------
# 2. Task accuracy: greedy answers, scored
#
# Val loss says how likely the right answers are; accuracy says how often the model gives them. Each answer is
# compared with the expected one after collapsing whitespace, or, with an answer regex, only what its first group
# finds in each (for GSM8K '#### (.*)': the final number, not the working before it).

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
    return [(tokens[s:a].tolist(), tokenizer.decode(tokens[a:e - 1])) for s, a, e in offsets.tolist()]

def unmatched(examples, answer_regex):
    """A warning line when some expected answers have no match of the answer regex (they can only count as wrong:
    the regex or the data is off), else None."""
    n = sum(answer_key(expected, answer_regex) is None for _, expected in examples) if answer_regex else 0
    return n and f"warning: {n} of {len(examples)} expected answers have no match of --answer_regex " \
                 f"{answer_regex!r}: they count as wrong"

WARNED = set()  # the task folders whose unmatched answers this process has reported: once per run, not every eval

def task_accuracy(model, examples, autocast=None, max_new_tokens=None, answer_regex=None, n=None, ranks=None,
                  lockstep=False):
    """The share of right answers, and this rank's (prompt text, expected, got) list.

    examples: a task folder (its val split; answer_regex defaults to its task.json's) or a list of
    (prompt ids, expected text); n: the first n only. max_new_tokens: None gives each answer room for a right
    one, and cuts short a wrong one that rambles on: the expected answer's tokens + 8 (a right answer has as
    many, give or take some whitespace), twice that + 16 with a regex (the working before the answer varies).
    ranks (parallel.world.Ranks): rank r answers examples r, r + world_size, ... and the counts are summed
    over the ranks; lockstep=True: every rank answers every example (a sharded model, whose every forward
    needs all the ranks)."""
    if isinstance(examples, (str, os.PathLike)):
        task = read_task(examples)
        if task is None:
            raise SystemExit(f"error: {examples}: no task.json, not a task folder")
        answer_regex, folder = answer_regex or task["answer_regex"], examples
        examples = split_examples(folder)[:n]
        if folder not in WARNED and unmatched(examples, answer_regex) and (ranks is None or ranks.master):
            print(unmatched(examples, answer_regex), file=sys.stderr)
        WARNED.add(folder)
    examples = list(examples)[:n]
    rank, world_size = (ranks.rank, ranks.world_size) if ranks is not None and not lockstep else (0, 1)
    mine, right, results = examples[rank::world_size], 0, []
    quiet = ranks is not None and not ranks.master
    limits = [max_new_tokens or (2 * len(tokenizer.encode(expected)) + 16 if answer_regex else
                                 len(tokenizer.encode(expected)) + 8) for _, expected in mine]
    with torch.no_grad(), autocast or nullcontext(), \
            tqdm(total=len(mine), desc="task accuracy", unit="ex", leave=False, disable=quiet) as progress:
        got = answers(model, [list(prompt) for prompt, _ in mine], limits, progress=progress)
    for (prompt, expected), ids in zip(mine, got):
        text = tokenizer.decode(ids)
        right += is_right(text, expected, answer_regex)
        results.append((tokenizer.decode(prompt), expected, text))
    counts = torch.tensor([right, len(mine)], dtype=torch.long, device=ranks.device if ranks else "cpu")
    if ranks is not None and not lockstep:
        ranks.all_reduce_sum(counts)
    right, total = counts.tolist()
    return (right / total if total else float("nan")), results

def dataset_splits(name, config):
    """The names of a Hugging Face dataset's splits (read from the hub, or from a local folder)."""
    import datasets   # (here: local files need no datasets)
    try:
        return datasets.get_dataset_split_names(name, config_name=config)
    except Exception as e:
        raise SystemExit(f"error: --input {name}: cannot open it as a Hugging Face dataset (config {config}): "
                         f"{one_line(e)}")

def eval_split(args):
    """The split that scoring reads from a Hugging Face dataset: its test split, else validation, never its train split
    (finetune.py's default, which the model was probably trained on); None for local files."""
    datasets = [name for name in args.input if tasks.is_dataset(name)]
    if not datasets:
        return None
    splits = dataset_splits(datasets[0], args.hf_config)
    for name in ("test", "validation"):
        if name in splits:
            return name
    raise SystemExit(f"error: --input {datasets[0]} has no test or validation split (it has: {', '.join(splits)}); "
                     "name the split to score with --hf_split")

def score(model, task, args):
    """--input's examples, rendered as the model was trained (cut from the left to fit its context), answered and
    scored; three of them shown. Returns the accuracy."""
    answer_regex = args.answer_regex or (task or {}).get("answer_regex")
    vars(args).update(train_on="completion", too_long="cut")
    examples, _ = tasks.collect(tasks.open_sources(args.input, args, "--input"), args,
                                task["templates"] if task else tasks.TEMPLATES, model.config.block_size)
    if not examples:
        raise SystemExit(f"error: --input {' '.join(args.input)}: no usable example")
    examples = [(e.ids[:e.answer_start].tolist(), tokenizer.decode(e.ids[e.answer_start:-1])) for e in examples]
    examples = examples[:args.max_examples]
    accuracy, results = task_accuracy(model, examples, speedups.autocast(args.dtype, torch.device(args.device).type),
                                      args.max_new_tokens, answer_regex)
    if unmatched(examples, answer_regex):
        print(unmatched(examples, answer_regex), file=sys.stderr)
    right = [is_right(got, expected, answer_regex) for _, expected, got in results]
    for i, (prompt, expected, got) in enumerate(results[:3]):   # (the prompt's end: where the answer follows)
        print(f"--- example {i + 1} ({'right' if right[i] else 'wrong'})\nprompt:   {prompt[-500:]!r}\n"
              f"expected: {expected!r}\ngot:      {got!r}")
    scoring = f"the first group of {answer_regex!r}" if answer_regex else "exact match after whitespace normalization"
    split = f", split {args.hf_split}" if any(tasks.is_dataset(name) for name in args.input) else ""
    print(f"task accuracy: {accuracy:.4f} ({sum(right)}/{len(results)} examples of {' '.join(args.input)}{split}; "
          f"{scoring})")
    return accuracy

# -----------------------------------------------------------------------------
# 3. A conversation. The chat keeps it as messages and renders all of it every turn, as in training: the model has no
#    memory but what it is shown. When it no longer fits the context with room for an answer, its oldest exchanges go.

def fit_conversation(task, messages, block_size, room):
    """The rendered conversation, after dropping its oldest user/assistant exchanges (not the system turn)
    until it leaves room tokens for the answer within the context, or only the last user turn is left."""
    ids = tasks.prompt_ids(task, messages)
    first = 1 if messages[0]["role"] == "system" else 0
    while len(ids) + room > block_size and len(messages) - first > 1:
        del messages[first:first + 2]  # a user turn and its answer
        ids = tasks.prompt_ids(task, messages)
        print(f"note: the conversation no longer fits the context of {block_size} tokens with room for "
              f"--max_new_tokens {room}: dropped its oldest exchange", file=sys.stderr)
    return ids

def stream_answer(model, ids, args, generator):
    """The model's answer to the rendered conversation ids, sampled, printed as it is generated (without the
    template's " " before it), up to <|endoftext|> or the context's end; returns its ids."""
    idx = torch.tensor([ids], device=args.device)
    with speedups.autocast(args.dtype, torch.device(args.device).type):
        tokens = model.generate(idx, min(args.max_new_tokens, model.config.block_size - len(ids)), args.temperature,
                                args.top_k or None, generator)
        return tokenizer.write_stream((int(t) for t in tokens), sys.stdout, stop=tokenizer.EOT, lstrip=True)

def chat(model, task, args, lines):
    """User turns from lines (one per line, blank lines skipped); each answer, sampled with --temperature and --top_k,
    is printed on a line of its own as it is generated, and kept in the conversation. Returns how many tokens were
    generated."""
    block_size = model.config.block_size
    messages = [{"role": "system", "content": args.system}] if args.system else []
    generator = torch.Generator(device=args.device).manual_seed(args.seed)  # seeded once: the same turns, the same chat
    n = 0
    for line in lines:
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\r\n")})
        ids = fit_conversation(task, messages, block_size, args.max_new_tokens)
        if len(ids) >= block_size:
            print(f"note: this turn alone is {len(ids)} tokens once rendered, the context is {block_size}: "
                  f"skipped", file=sys.stderr)
            messages.pop()
            continue
        new = stream_answer(model, ids, args, generator)
        print(flush=True)
        n += len(new)
        text = tokenizer.decode(new)
        if not text.strip():  # the chat template has no empty answers: the exchange is forgotten
            print("note: an empty answer: this exchange is not kept", file=sys.stderr)
            messages.pop()
            continue
        # an answer that ran out of room never got the <|endoftext|> that ends the others: the history must not add one
        cut = len(new) == min(args.max_new_tokens, block_size - len(ids))
        if cut:
            print(f"note: the answer was cut at {len(new)} tokens (--max_new_tokens, or the context's end): kept "
                  "without <|endoftext|>, as the model left it", file=sys.stderr)
        messages.append({"role": "assistant", "content": text.removeprefix(" "), "cut": cut})  # (the template adds " ")
    return n

# -----------------------------------------------------------------------------
# 4. The command line

def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=ShowDefaults,  # --help shows every default
                                description="Ask a fine-tuned GPT-2 for its answers: score them on examples (--input), "
                                "or talk with a chat model (--chat).")
    a = p.add_argument
    a("--ckpt_path", help="one of our checkpoints (log/model_XXXXX.pt), or a Hugging Face-layout folder")
    a("--input", nargs="+", action="extend", default=[], metavar="PATH_OR_DATASET",
      help="examples to score, as finetune.py reads them: .jsonl/.parquet files or globs, or a Hugging Face dataset")
    a("--chat", action="store_true",
      help="talk with a model fine-tuned on chat data: your turns from stdin, one a line")
    a("--system", help="--chat: a system turn that opens the conversation")
    a("--answer_regex", help="score answers by this regex's first group (default: the model's task.json's, else the "
      "whole answer, whitespace normalized)")
    a("--hf_config", help="the Hugging Face dataset's config (e.g. main for openai/gsm8k)")
    a("--hf_split", help="its split (default: test, else validation: not the train split the model learned)")
    a("--columns", type=str, default="", help="our fields from its columns: FIELD=COLUMN,... (see finetune.py)")
    a("--max_examples", type=int, help="only the first N examples")
    a("--max_new_tokens", type=int, help="most tokens per answer (default: scoring, from the expected answer's; "
      "--chat, 100)")
    a("--temperature", type=float, default=1.0, help="--chat: <1 sharper, >1 more random, 0 = greedy")
    a("--top_k", type=int, default=50, help="--chat: sample among the k most likely tokens (0 = all; 1 = greedy)")
    a("--seed", type=int, default=42, help="--chat: seeds the sampling")
    a("--device", default="auto", help="auto | cpu | cuda | cuda:N | xpu | mps")
    a("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="precision of the forward pass")
    args = p.parse_args(argv)
    # every cheap check before loading a model
    args.columns = tasks.parse_columns(args.columns)
    if args.answer_regex is not None:
        tasks.check_answer_regex(args.answer_regex)
    if not args.ckpt_path:
        raise SystemExit("error: give --ckpt_path: the fine-tuned model to ask")
    if args.chat == bool(args.input):
        raise SystemExit("error: give --input (examples to score) or --chat (a conversation), one of them")
    if args.system is not None and not (args.chat and args.system.strip()):
        raise SystemExit("error: --system opens a --chat, and must not be empty")
    for flag in ("max_examples", "max_new_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag} must be at least 1")
    if args.top_k < 0 or args.temperature < 0:
        raise SystemExit("error: --top_k and --temperature must be >= 0")
    if not os.path.exists(args.ckpt_path):
        raise SystemExit(f"error: --ckpt_path {args.ckpt_path} not found")
    return args

def main(argv=None):
    args = parse_args(argv)
    if not args.chat:   # a dataset's split is checked before the model is loaded
        args.hf_split = args.hf_split or eval_split(args)
    cpu.warm_up_vector_math()   # results independent of thread timing (see compute/cpu.py)
    model, task = load_model(args.ckpt_path)
    print(f"loaded {args.ckpt_path}: " + (f"fine-tuned on a {task['format']} task, its templates" if task else
                                          "no task.json, finetune.py's templates"), file=sys.stderr)
    if args.chat and "chat" not in (task or {}).get("formats", {}):
        raise SystemExit(f"error: --chat needs a model fine-tuned on chat data (messages); {args.ckpt_path} is "
                         + (f"fine-tuned on {task['format']} data" if task else "a plain language model")
                         + ": ask it with python sample.py --prompt")
    args.device = world.pick_device(args.device, 0, 1)
    model.to(args.device).eval()
    args.dtype, why = speedups.resolve_dtype(args.dtype, torch.device(args.device).type, model.config.n_embd)
    print(why, file=sys.stderr)
    if not args.chat:
        return score(model, task, args)
    args.max_new_tokens = args.max_new_tokens or 100
    if sys.stdin.isatty():
        print("chat: type a message and press Enter; Ctrl-D ends", file=sys.stderr)
    return chat(model, task, args, sys.stdin)

if __name__ == "__main__":
    main()
