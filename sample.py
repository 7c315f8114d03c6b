"""
Generate text with a GPT-2: one of ours (a train_gpt2.py checkpoint) or OpenAI's.

    python sample.py --ckpt_path log/model_19073.pt --prompt "It is interesting"
    python sample.py --init_from gpt2 --prompt "Hello, I'm a language model," --num_samples 5
    python sample.py --init_from gpt2 --top_k 1            # greedy: always the most likely token
    python sample.py --init_from ./my_gpt2_dir             # config.json + model.safetensors
    python sample.py --ckpt_path log_task/model_00300.pt --prompt "What is 12 + 7?" --top_k 1

Each sample is printed token by token as it is generated, with a KV cache (GPT.generate in train_gpt2.py): the
prompt goes through the model once, and after that each step feeds only the one new token.

A model fine-tuned on a task (train_gpt2.py on a finetune.py folder; export_hf.py keeps it in task.json) answers
instead: --prompt is rendered with the template it was trained on (tasks.prompt_ids), and only the answer is
printed, up to the <|endoftext|> that ends it (one sample unless --num_samples; --top_k 1 is greedy, the answer
task accuracy scores). Scoring many answers, and chat: answer.py.
"""
import argparse
import os
import sys
import time

import torch

import tasks
import tokenizer
from compute import cpu, speedups
from model import load_model
from parallel import world
from plumbing.common import ShowDefaults


def print_samples(model, ranks, autocast):
    """train_gpt2.py's look at what the model has learned: four continuations of one prompt, printed and returned."""
    prompt = torch.tensor([tokenizer.encode("Hello, I'm a language model,")] * 4, device=ranks.device)
    gen = torch.Generator(device=ranks.device).manual_seed(42 + ranks.rank)
    with autocast:
        new = torch.stack(list(model.generate(prompt, 32, top_k=50, generator=gen)), dim=1)
    lines = [f"sample {i}: {tokenizer.decode(row)}" for i, row in enumerate(torch.cat((prompt, new), dim=1).tolist())]
    for line in lines:
        ranks.print0(line)
    return lines


def prompt_tokens(prompt, block_size):
    """Token ids of the prompt: <|endoftext|> when empty (how every training document starts),
    and only the last block_size tokens when it is longer than the model's context."""
    ids = tokenizer.encode(prompt) or [tokenizer.EOT]
    if len(ids) > block_size:
        print(f"note: the prompt is {len(ids)} tokens, longer than the model's context of {block_size}: "
              f"keeping its last {block_size}", file=sys.stderr)
        ids = ids[-block_size:]
    return ids


def stream_sample(model, ids, args, generator, answer=False):
    """Continue the prompt ids, printing each new token's text as soon as it is whole; returns the new ids. answer:
    the answer to a fine-tuned model's rendered prompt, which ends at <|endoftext|> (neither printed nor returned) or
    at the context's end, and shows no leading whitespace (the template's " " before a chat answer); greedy, it is
    what task accuracy scores."""
    max_new_tokens = min(args.max_new_tokens, model.config.block_size - len(ids)) if answer else args.max_new_tokens
    idx = torch.tensor([ids], dtype=torch.long, device=args.device)
    with speedups.autocast(args.dtype, torch.device(args.device).type):
        tokens = model.generate(idx, max(max_new_tokens, 0), args.temperature, args.top_k or None, generator)
        return tokenizer.write_stream((int(t) for t in tokens), sys.stdout, tokenizer.EOT if answer else None, answer)


def ask(model, task, args, generator):
    """--prompt to a fine-tuned model: its answer(s), each on a line. Returns how many tokens were generated."""
    prompt = args.prompt
    if args.system:  # a chat model (checked in main)
        prompt = [{"role": "system", "content": args.system}, {"role": "user", "content": args.prompt}]
    ids = tasks.prompt_ids(task, prompt)
    if len(ids) >= model.config.block_size:
        raise SystemExit(f"error: --prompt is {len(ids)} tokens once rendered with the task's template, the "
                         f"model's context is {model.config.block_size}: shorten it")
    num_samples, n = args.num_samples or 1, 0
    for i in range(num_samples):
        if num_samples > 1:
            print(f"--- sample {i + 1}/{num_samples}", flush=True)
        n += len(stream_sample(model, ids, args, generator, answer=True))
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
        n += len(stream_sample(model, ids, args, generator))
        print(flush=True)
    return n


def parse_args(argv):
    if "--chat" in (sys.argv[1:] if argv is None else argv):  # (it was here until answer.py took it)
        raise SystemExit("error: --chat is answer.py's now: python answer.py --ckpt_path CHECKPOINT --chat")
    p = argparse.ArgumentParser(formatter_class=ShowDefaults,  # --help shows every default
                                description="Sample text from a GPT-2 (ours or OpenAI's), with a KV cache; "
                                "ask a fine-tuned one (--prompt).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt_path", help="a checkpoint written by train_gpt2.py, e.g. log/model_19073.pt")
    src.add_argument("--init_from", help="gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a Hugging Face-layout folder")
    p.add_argument("--prompt", help="text to continue ('' = from scratch; default \"Hello, I'm a language model,\"); "
                                    "to a fine-tuned model: the question, rendered with its task's template")
    p.add_argument("--system", help="to a fine-tuned chat model: a system turn before --prompt")
    p.add_argument("--num_samples", type=int, help="default 5; 1 for a fine-tuned model")
    p.add_argument("--max_new_tokens", type=int, default=100, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=1.0, help="<1 sharper, >1 more random, 0 = greedy")
    p.add_argument("--top_k", type=int, default=50, help="sample among the k most likely tokens (0 = all; 1 = greedy)")
    p.add_argument("--seed", type=int, default=42, help="the same seed prints the same samples")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | xpu | mps")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="precision of the forward pass; "
                   "auto = bf16 where this machine computes it natively and faster, else fp32")
    args = p.parse_args(argv)
    # every cheap check before loading a model
    if args.ckpt_path and not os.path.exists(args.ckpt_path):
        raise SystemExit(f"error: --ckpt_path {args.ckpt_path} not found")
    for flag in ("num_samples", "max_new_tokens", "top_k", "temperature"):
        if getattr(args, flag) is not None and getattr(args, flag) < (1 if flag == "num_samples" else 0):
            raise SystemExit(f"error: --{flag} must be {'positive' if flag == 'num_samples' else '>= 0'}")
    if args.system is not None and not args.system.strip():
        raise SystemExit("error: --system is empty")
    return args


def main(argv=None):
    args = parse_args(argv)
    cpu.warm_up_vector_math()  # results independent of thread timing (see compute/cpu.py)
    args.device = world.pick_device(args.device, 0, 1)
    model, task = load_model(args.ckpt_path or args.init_from)
    source = args.ckpt_path or args.init_from
    if args.ckpt_path or task:
        print(f"loaded {source}" + (f" (fine-tuned on a {task['format']} task)" if task else ""), file=sys.stderr)
    if args.system is not None and "chat" not in (task or {}).get("formats", {}):
        raise SystemExit(f"error: --system needs a model fine-tuned on chat data (messages); {source} is "
                         + (f"fine-tuned on {task['format']} data" if task else "a plain language model"))
    if task is not None and not (args.prompt or "").strip():
        raise SystemExit(f"error: {source} is fine-tuned on a task: ask it something with --prompt, or talk with it "
                         f"with python answer.py --ckpt_path {source} --chat")
    model.to(args.device).eval()
    if torch.device(args.device).type == "cpu":  # (stderr: stdout is the samples alone)
        print(cpu.describe_cpu(torch.get_num_threads()), file=sys.stderr)
    args.dtype, why = speedups.resolve_dtype(args.dtype, torch.device(args.device).type, model.config.n_embd)
    print(why, file=sys.stderr)
    # one generator, seeded once: the same command prints the same samples
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    t0 = time.time()
    n = ask(model, task, args, generator) if task is not None else continue_text(model, args, generator)
    dt = time.time() - t0
    print(f"{n} tokens in {dt:.1f}s: {n / max(dt, 1e-9):.1f} tokens/s ({args.device}, {args.dtype}, KV cache)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
