"""
Generate text with a GPT-2: one of ours (a train_gpt2.py checkpoint) or OpenAI's; or ask a fine-tuned one.

    python sample.py --ckpt_path log/model_19072.pt --prompt "It is interesting"
    python sample.py --init_from gpt2 --prompt "Hello, I'm a language model," --num_samples 5
    python sample.py --init_from gpt2 --top_k 1            # greedy: always the most likely token
    python sample.py --init_from ./my_gpt2_dir             # config.json + model.safetensors
    python sample.py --ckpt_path log_task/model_00300.pt --prompt "What is 12 + 7?" --top_k 1
    python sample.py --ckpt_path log_chat/model_00300.pt --chat --system "You are terse."   # turns from stdin

A model fine-tuned on a task (train_gpt2.py on a finetune.py folder; export_hf.py keeps it in task.json)
answers instead: --prompt is rendered with the template it was trained on (finetune.prompt_ids), and only
the answer is printed, up to the <|endoftext|> that ends it (one sample unless --num_samples; --top_k 1 is
greedy, the answer task accuracy scores). --chat needs a model fine-tuned on chat data (messages); one
trained on prompt/completion or Alpaca data has no turns to keep, so --chat is an error there. It reads
your turns from stdin, one a line, until EOF, and answers each with the whole conversation as its prompt;
when that plus --max_new_tokens no longer fits the context, the oldest exchanges go (the system turn stays).

Each sample is printed token by token as it is generated. Generation uses a KV
cache: the prompt goes through the model once, and after that each step feeds only the one new
token, reusing the keys and values of everything before it. Without the cache, step t would run
all prompt + t tokens through the model again, and the cost of a sample would grow with the
square of its length. The output is the same either way (tests/test_sample.py checks it).
"""
import argparse
import codecs
import os
import sys
import time

import torch
from torch.nn import functional as F

from plumbing import cpu, speedups, world
import tokenizer


# -----------------------------------------------------------------------------
# Generation with a KV cache. The model's attention takes the cache (train_gpt2.py) and this file
# drives it: the prompt goes through the model once, then each step feeds only the new token.

class KVCache:
    """Keys and values of the tokens seen so far, so generation feeds one new token per forward."""

    def __init__(self, n_layer, max_len):
        self.k, self.v, self.max_len = [None] * n_layer, [None] * n_layer, max_len
        self.pos = 0  # how many positions are filled

    def update(self, layer, k, v):
        if self.k[layer] is None:  # allocate on first use, in the dtype autocast gave us
            B, nh, _, hs = k.shape
            self.k[layer] = k.new_zeros(B, nh, self.max_len, hs)
            self.v[layer] = v.new_zeros(B, nh, self.max_len, hs)
        T = k.size(2)
        self.k[layer][:, :, self.pos:self.pos + T] = k
        self.v[layer][:, :, self.pos:self.pos + T] = v
        return self.k[layer][:, :, :self.pos + T], self.v[layer][:, :, :self.pos + T]

    def keep(self, rows):
        """From now on only these batch rows (a 1-D index tensor): the others are done (answers)."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
    """Yield (B,) tensors of sampled token ids, one per step, continuing idx (B, T) with a GPT of train_gpt2.py.

    The prompt is run once to fill a KV cache, then each step feeds only the new token.
    Once the context is full there is nothing left to cache: every further step recomputes
    the last block_size tokens, so the output always equals a plain recompute."""
    block_size = model.config.block_size
    kv_cache = KVCache(model.config.n_layer, block_size)
    logits, _ = model(idx[:, -block_size:], kv_cache=kv_cache)
    for _ in range(max_new_tokens):
        logits = logits[:, -1, :tokenizer.VOCAB_SIZE].float()  # padded vocab ids are never sampled
        if temperature == 0 or top_k == 1:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = F.softmax(logits / temperature, dim=-1)
            if top_k is not None:
                probs, top_ids = torch.topk(probs, min(top_k, probs.size(-1)), dim=-1)
                next_id = torch.gather(top_ids, -1, torch.multinomial(probs, 1, generator=generator))
            else:
                next_id = torch.multinomial(probs, 1, generator=generator)
        idx = torch.cat((idx, next_id), dim=1)
        yield next_id.squeeze(1)
        if kv_cache.pos < block_size:
            logits, _ = model(next_id, kv_cache=kv_cache)
        else:
            logits, _ = model(idx[:, -block_size:])


def answer(model, ids, max_new_tokens):
    """The model's greedy answer to a rendered prompt (token ids): the new token ids, up to <|endoftext|>
    (not included), max_new_tokens, or the end of the context (prompt + answer <= block_size), whichever
    comes first. Greedy, so a prompt always gets the same answer: task accuracy scores it, and the chat
    can keep it in the conversation. The caller sets autocast."""
    room = min(max_new_tokens, model.config.block_size - len(ids))
    new = []
    if room <= 0:
        return new
    idx = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    for next_id in generate(model, idx, room, top_k=1):
        if int(next_id[0]) == tokenizer.EOT:
            break
        new.append(int(next_id[0]))
        if len(new) == room:  # done: stop before generate runs one more forward for a token we won't take
            break
    return new


# Many answers at once (task accuracy): one forward per new token serves a whole batch of prompts. Prompts
# differ in length, but each step must take every row's next token from the same column, so the rows are
# left-padded to the longest: all prompts end in the last column. The padding must change nothing: each row's
# positions start at 0 at its first real token (GPT-2's positions are learned: a prompt at positions 5.. would
# be another input), and an attention mask keeps every query away from the padding keys.

def answers(model, prompts, max_new_tokens, batch_size=64, progress=None):
    """[answer(model, ids, n) for each prompt] (a list of token id lists), batch_size prompts per forward;
    max_new_tokens: one for all, or a list of one per prompt. progress: a tqdm bar, advanced by each batch.
    Prompts of similar lengths share a batch (sorted by length: little padding); answers come in input order.
    The same tokens as answer's: a batch changes only the float rounding of its sums, which could flip only
    a near-tie of two tokens' logits (as bf16 or another CPU could)."""
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
    pads = torch.tensor([P - len(ids) for ids in prompts], device=device)[:, None]  # (B, 1)
    idx = torch.tensor([[tokenizer.EOT] * (P - len(ids)) + list(ids) for ids in prompts], device=device)
    # cache slot s of row b holds its position s - pads[b]; the slots before pads[b] are padding. A row feeds
    # at most room - 1 tokens after its prompt (its last one is never fed back)
    slots = torch.arange(P + max(rooms) - 1, device=device)
    kv_cache = KVCache(model.config.n_layer, len(slots))
    causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
    # a padding query sees itself: a mask row with no key at all gives 0 in PyTorch's CPU attention but NaN in
    # some other kernels, and a NaN would spread to the real rows (weight 0 x NaN). Nobody reads padding's output
    mask = causal & (slots[:P] >= pads)[:, None, :] | torch.eye(P, dtype=torch.bool, device=device)
    logits, _ = model(idx, kv_cache=kv_cache, positions=(slots[:P] - pads).clamp(min=0), attn_mask=mask[:, None])
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
            kv_cache.keep(keep)
            pads, next_ids, rows = pads[keep], next_ids[keep], [rows[j] for j in going]
        pos = kv_cache.pos  # the new tokens' slot: they see every real key before it, and themselves
        logits, _ = model(next_ids[:, None], kv_cache=kv_cache, positions=pos - pads,
                          attn_mask=(slots[:pos + 1] >= pads)[:, None, None, :])


def print_samples(model, ranks, autocast):
    """train_gpt2.py's look at what the model has learned: four continuations of one prompt."""
    prompt = torch.tensor([tokenizer.encode("Hello, I'm a language model,")] * 4, device=ranks.device)
    gen = torch.Generator(device=ranks.device).manual_seed(42 + ranks.rank)
    with autocast:
        new = torch.stack(list(generate(model, prompt, 32, top_k=50, generator=gen)), dim=1)
    for i, row in enumerate(torch.cat((prompt, new), dim=1).tolist()):
        ranks.print0(f"sample {i}: {tokenizer.decode(row)}")


# -----------------------------------------------------------------------------
# The command line

def load_model(ckpt_path=None, init_from=None):
    """(model, task): one of our checkpoints (log/model_XXXXX.pt), or GPT.from_pretrained(gpt2... | folder);
    task is the task.json dict a fine-tuned model carries (the checkpoint's ckpt["task"], or a task.json in
    the folder, which export_hf.py writes), None for a plain language model."""
    import train_gpt2
    path = ckpt_path or init_from
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, "meta.pt")):  # ours (a .dcp folder has meta.pt)
        ckpt = train_gpt2.load_checkpoint(path)
        model, task = train_gpt2.GPT.from_checkpoint(ckpt), ckpt.get("task")
    else:
        model, task = train_gpt2.GPT.from_pretrained(path), None
        if os.path.isfile(os.path.join(path, "task.json")):
            import finetune
            task = finetune.read_task(path)
    if ckpt_path or task:
        print(f"loaded {path}" + (f" (fine-tuned on a {task['format']} task)" if task else ""), file=sys.stderr)
    return model, task


def prompt_tokens(prompt, block_size):
    """Token ids of the prompt: <|endoftext|> when empty (how every training document starts),
    and only the last block_size tokens when it is longer than the model's context."""
    ids = tokenizer.encode(prompt) or [tokenizer.EOT]
    if len(ids) > block_size:
        print(f"note: the prompt is {len(ids)} tokens, longer than the model's context of {block_size}: "
              f"keeping its last {block_size}", file=sys.stderr)
        ids = ids[-block_size:]
    return ids


def stream_sample(model, ids, max_new_tokens, temperature=1.0, top_k=None, generator=None, dtype="fp32",
                  out=None, until_eot=False):
    """Continue the prompt ids, writing each new token's text to out as soon as it exists; returns the new ids.
    until_eot: an answer to a fine-tuned model's rendered prompt, which ends at <|endoftext|> (neither written
    nor returned) or at the context's end, and shows no leading whitespace (the template's " " before a chat
    answer); with top_k 1 it is answer().

    A token is a sequence of bytes, and one character (an emoji, a Chinese character) may be
    split over two tokens: an incremental UTF-8 decoder holds back incomplete characters until
    the next token completes them, so the stream never shows half a character."""
    out = out or sys.stdout
    device = next(model.parameters()).device
    autocast = speedups.autocast(dtype, device.type)
    enc = tokenizer.get_encoding()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    if until_eot:
        max_new_tokens = min(max_new_tokens, model.config.block_size - len(ids))
    new, shown = [], False
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    with autocast:
        for next_id in generate(model, idx, max(max_new_tokens, 0), temperature=temperature, top_k=top_k,
                                generator=generator):
            token = int(next_id[0])
            if until_eot and token == tokenizer.EOT:
                break
            new.append(token)
            text = utf8.decode(enc.decode_single_token_bytes(token))
            if until_eot and not shown:
                text = text.lstrip()
            shown = shown or bool(text)
            out.write(text)
            out.flush()
            if len(new) == max_new_tokens:  # stop before generate runs a forward for a token nobody takes
                break
    out.write(utf8.decode(b"", final=True))
    return new


# Talking to a fine-tuned model. Its checkpoint carries the task.json of the data it was fine-tuned on
# (finetune.py), whose template turns a question into the prompt the model learned to answer, and it
# learned to end each answer with <|endoftext|>. The chat keeps the conversation as messages and renders
# all of it every turn, as in training: the model has no memory but what it is shown.

def render(task, prompt):
    """The token ids a fine-tuned model continues to answer prompt (a str, or a chat's list of messages)."""
    import finetune
    return finetune.prompt_ids(task, prompt)


def fit_conversation(task, messages, block_size, room):
    """The rendered conversation, after dropping its oldest user/assistant exchanges (not the system turn)
    until it leaves room tokens for the answer within the context, or only the last user turn is left."""
    ids = render(task, messages)
    first = 1 if messages[0]["role"] == "system" else 0
    while len(ids) + room > block_size and len(messages) - first > 1:
        del messages[first:first + 2]  # a user turn and its answer
        ids = render(task, messages)
        print(f"note: the conversation no longer fits the context of {block_size} tokens with room for "
              f"--max_new_tokens {room}: dropped its oldest exchange", file=sys.stderr)
    return ids


def chat(model, task, args, generator, lines):
    """User turns from lines (one per line, blank lines skipped); each answer is printed on a line of its own
    and kept in the conversation. Returns how many tokens were generated."""
    block_size = model.config.block_size
    messages = [{"role": "system", "content": args.system}] if args.system else []
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
        new = stream_sample(model, ids, args.max_new_tokens, args.temperature, args.top_k or None, generator,
                            args.dtype, until_eot=True)
        print(flush=True)
        n += len(new)
        text = tokenizer.decode(new)
        if not text.strip():  # the chat template has no empty answers: the exchange is forgotten
            print("note: an empty answer: this exchange is not kept", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": text.removeprefix(" ")})  # the template adds " "
    return n


def ask(model, task, args, generator):
    """--prompt to a fine-tuned model: its answer(s), each on a line. Returns how many tokens were generated."""
    prompt = args.prompt
    if args.system:  # a chat model (checked in main)
        prompt = [{"role": "system", "content": args.system}, {"role": "user", "content": args.prompt}]
    ids = render(task, prompt)
    if len(ids) >= model.config.block_size:
        raise SystemExit(f"error: --prompt is {len(ids)} tokens once rendered with the task's template, the "
                         f"model's context is {model.config.block_size}: shorten it")
    num_samples, n = args.num_samples or 1, 0
    for i in range(num_samples):
        if num_samples > 1:
            print(f"--- sample {i + 1}/{num_samples}", flush=True)
        n += len(stream_sample(model, ids, args.max_new_tokens, args.temperature, args.top_k or None,
                               generator, args.dtype, until_eot=True))
        print(flush=True)
    return n


def continue_text(model, args, generator):
    """A plain language model: --num_samples continuations of --prompt, each printed after it."""
    prompt = "Hello, I'm a language model," if args.prompt is None else args.prompt
    ids = prompt_tokens(prompt, model.config.block_size)
    num_samples, n = args.num_samples or 5, 0
    for i in range(num_samples):
        print(f"--- sample {i + 1}/{num_samples}", flush=True)
        if prompt:
            print(tokenizer.decode(ids), end="", flush=True)
        n += len(stream_sample(model, ids, args.max_new_tokens, args.temperature, args.top_k or None,
                               generator, args.dtype))
        print(flush=True)
    return n


def main(argv=None):
    p = argparse.ArgumentParser(description="Sample text from a GPT-2 (ours or OpenAI's), with a KV cache; "
                                            "ask a fine-tuned one (--prompt, --chat).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt_path", help="a checkpoint written by train_gpt2.py, e.g. log/model_19072.pt")
    src.add_argument("--init_from", help="gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a Hugging Face-layout folder")
    p.add_argument("--prompt", help="text to continue ('' = from scratch; default \"Hello, I'm a language model,\"); "
                                    "to a fine-tuned model: the question, rendered with its task's template")
    p.add_argument("--chat", action="store_true", help="a fine-tuned chat model: your turns from stdin, one a line")
    p.add_argument("--system", help="to a fine-tuned chat model: a system turn that opens the conversation")
    p.add_argument("--num_samples", type=int, help="default 5; 1 for a fine-tuned model")
    p.add_argument("--max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="<1 sharper, >1 more random, 0 = greedy")
    p.add_argument("--top_k", type=int, default=50, help="sample among the k most likely tokens (0 = all; 1 = greedy)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | xpu | mps")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="precision of the forward pass; "
                   "auto = bf16 where this machine computes it natively and faster, else fp32")
    args = p.parse_args(argv)
    cpu.warm_up_vector_math()  # results independent of thread timing (see plumbing/cpu.py)

    # every cheap check before loading a model
    if args.ckpt_path and not os.path.exists(args.ckpt_path):
        raise SystemExit(f"error: --ckpt_path {args.ckpt_path} not found")
    for flag in ("num_samples", "max_new_tokens", "top_k", "temperature"):
        if getattr(args, flag) is not None and getattr(args, flag) < (1 if flag == "num_samples" else 0):
            raise SystemExit(f"error: --{flag} must be {'positive' if flag == 'num_samples' else '>= 0'}")
    if args.chat and args.prompt is not None:
        raise SystemExit("error: --chat reads your turns from stdin: give no --prompt")
    if args.system is not None and not args.system.strip():
        raise SystemExit("error: --system is empty")
    args.device = world.pick_device(args.device, 0, 1)

    model, task = load_model(args.ckpt_path, args.init_from)
    source = args.ckpt_path or args.init_from
    if (args.chat or args.system is not None) and "chat" not in (task or {}).get("formats", {}):
        raise SystemExit(f"error: --{'chat' if args.chat else 'system'} needs a model fine-tuned on chat data "
                         f"(messages); {source} is " + (f"fine-tuned on {task['format']} data" if task else
                                                        "a plain language model") + ": use --prompt")
    if task is not None and not args.chat and not (args.prompt or "").strip():
        raise SystemExit(f"error: {source} is fine-tuned on a task: ask it something with --prompt, or --chat")
    model.to(args.device).eval()
    if torch.device(args.device).type == "cpu":  # (stderr: stdout is the samples alone)
        print(cpu.describe_cpu(torch.get_num_threads()), file=sys.stderr)
    args.dtype, why = speedups.resolve_dtype(args.dtype, torch.device(args.device).type, model.config.n_embd)
    print(why, file=sys.stderr)
    # one generator, seeded once: the same command prints the same samples
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    t0 = time.time()
    if args.chat:
        if sys.stdin.isatty():
            print("chat: type a message and press Enter; Ctrl-D ends", file=sys.stderr)
        n = chat(model, task, args, generator, sys.stdin)
    else:
        n = ask(model, task, args, generator) if task is not None else continue_text(model, args, generator)
    dt = time.time() - t0
    print(f"{n} tokens in {dt:.1f}s: {n / max(dt, 1e-9):.1f} tokens/s ({args.device}, {args.dtype}, KV cache)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
