"""sample.py: KV-cached generation equals recomputing everything, seeds, both model sources; and a fine-tuned model's
answer to --prompt, rendered with the template in its checkpoint (written out here by hand), up to <|endoftext|>."""
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

import sample
import tasks
import tokenizer
from model import load_model
from model import GPT
from conftest import (REPO, checkpoints_of_each_kind, greedy_reference, make_shards, record_prompts, run_train,
                      save_random_hf_gpt2, save_task_checkpoint, say_eot_at, task_of, tiny_run_args, varied_model)
from compute import cpu

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "It is interesting"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A real checkpoint of a tiny training run (context 64 tokens)."""
    root = tmp_path_factory.mktemp("run")
    run_train(tiny_run_args(make_shards(root / "data"), root / "log", "--max_steps", "3"))
    return str(root / "log" / "model_00003.pt")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A local Hugging Face-layout GPT-2 (config.json + model.safetensors), random weights."""
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    save_random_hf_gpt2(path, n_head=2, n_embd=32, n_positions=64)
    return str(path)


@torch.no_grad()
def no_cache_generate(model, ids, n, temperature, top_k, generator):
    """The plain way: run the whole sequence (its last block_size tokens) through the model every step."""
    idx = torch.tensor([ids])
    for _ in range(n):
        logits = model(idx[:, -model.config.block_size:])[0][:, -1, :tokenizer.VOCAB_SIZE].float()
        if temperature == 0 or top_k == 1:
            next_id = logits.argmax(-1, keepdim=True)
        else:
            probs = F.softmax(logits / temperature, dim=-1)
            if top_k:
                probs, top = torch.topk(probs, top_k, dim=-1)
                next_id = torch.gather(top, -1, torch.multinomial(probs, 1, generator=generator))
            else:
                next_id = torch.multinomial(probs, 1, generator=generator)
        idx = torch.cat((idx, next_id), dim=1)
    return idx[0, len(ids):].tolist()


def expected_output(model, prompt, num_samples, n, temperature, top_k, seed):
    """What sample.py should print to stdout, computed without a KV cache."""
    gen = torch.Generator().manual_seed(seed)
    ids = tokenizer.encode(prompt)[-model.config.block_size:] or [tokenizer.EOT]
    out = ""
    for i in range(num_samples):
        new = no_cache_generate(model, ids, n, temperature, top_k, gen)
        out += (f"--- sample {i + 1}/{num_samples}\n" + (tokenizer.decode(ids) if prompt else "")
                + tokenizer.decode(new) + "\n")
    return out


def run_main(capsys, *argv):
    sample.main(["--device", "cpu", "--dtype", "fp32", *map(str, argv)])  # expected_output computes in fp32
    return capsys.readouterr()


def load(ckpt):
    return load_model(ckpt)[0].eval()


# 70 new tokens after a 3-token prompt runs past the 64-token context: the cache's fallback is covered too
@pytest.mark.parametrize("flags", [
    dict(top_k=1, temperature=1.0),  # greedy
    dict(top_k=50, temperature=0.8),  # top-k sampling
    dict(top_k=0, temperature=1.5),  # sampling from the whole vocabulary
])
def test_kv_cache_equals_full_recompute(capsys, ckpt, flags):
    out = run_main(capsys, "--ckpt_path", ckpt, "--prompt", PROMPT, "--num_samples", 2, "--max_new_tokens", 70,
                   "--seed", 7, "--top_k", flags["top_k"], "--temperature", flags["temperature"])
    want = expected_output(load(ckpt), PROMPT, 2, 70, flags["temperature"], flags["top_k"], 7)
    assert out.out == want
    assert "140 tokens" in out.err


def test_deterministic_for_a_seed(capsys, ckpt):
    args = ["--ckpt_path", ckpt, "--num_samples", 2, "--max_new_tokens", 20]
    a = run_main(capsys, *args, "--seed", 1).out
    assert a == run_main(capsys, *args, "--seed", 1).out
    b = run_main(capsys, *args, "--seed", 2).out
    assert a != b
    first, second = a.split("--- sample 2/2\n")
    assert first.removeprefix("--- sample 1/2\n") != second  # two samples, not one repeated


def test_hf_layout_directory(capsys, hf_dir):
    from transformers import GPT2LMHeadModel
    out = run_main(capsys, "--init_from", hf_dir, "--prompt", PROMPT, "--num_samples", 1, "--max_new_tokens", 20,
                   "--top_k", 1).out
    model = GPT.from_pretrained(hf_dir).eval()
    assert out == expected_output(model, PROMPT, 1, 20, 1.0, 1, 42)
    # and the same greedy continuation as transformers' own implementation of that model
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             pad_token_id=tokenizer.EOT)
    assert out.endswith(tokenizer.decode(theirs[0].tolist()) + "\n")


def test_empty_prompt_starts_from_eot(capsys, ckpt):
    out = run_main(capsys, "--ckpt_path", ckpt, "--prompt", "", "--num_samples", 1, "--max_new_tokens", 10,
                   "--top_k", 1).out
    assert out == expected_output(load(ckpt), "", 1, 10, 1.0, 1, 42)


def test_long_prompt_is_cropped(capsys, ckpt):
    prompt = "one two three four five six seven eight nine ten " * 10  # 100 tokens > 64
    out = run_main(capsys, "--ckpt_path", ckpt, "--prompt", prompt, "--num_samples", 1, "--max_new_tokens", 5,
                   "--top_k", 1)
    assert out.out == expected_output(load(ckpt), prompt, 1, 5, 1.0, 1, 42)
    assert "keeping its last 64" in out.err


def test_padded_vocab_is_never_sampled(ckpt):
    model = load(ckpt)
    with torch.no_grad():  # make the padded ids (50257..50303) by far the most likely ones
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[tokenizer.VOCAB_SIZE:] = 10.0
    assert model.config.vocab_size > tokenizer.VOCAB_SIZE
    gen = torch.Generator().manual_seed(0)
    for top_k in (None, 1, 100):
        new = [int(t) for t in model.generate(torch.tensor([[tokenizer.EOT]]), 50, top_k=top_k, generator=gen)]
        assert len(new) == 50 and max(new) < tokenizer.VOCAB_SIZE


def test_command_line(ckpt, tmp_path):
    """The documented form, in a fresh process; and a missing checkpoint is one clear line."""
    cmd = [sys.executable, os.path.join(REPO, "sample.py"), "--ckpt_path", ckpt, "--prompt", PROMPT,
           "--num_samples", "2", "--max_new_tokens", "8", "--device", "cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(f"\n{PROMPT}") == 2
    proc = subprocess.run(cmd[:3] + [str(tmp_path / "nope.pt")], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and proc.stderr.strip() == f"error: --ckpt_path {tmp_path / 'nope.pt'} not found"


def test_dtype_follows_the_cpu_by_default(hf_dir, tmp_path, monkeypatch):
    """No --dtype: bf16 only where this CPU computes it natively and faster (train_gpt2.py's decision),
    said on stderr with the CPU it was made on; stdout stays the samples alone."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cmd = [sys.executable, os.path.join(REPO, "sample.py"), "--init_from", hf_dir, "--num_samples", "1",
           "--max_new_tokens", "4", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    # (its own measurement decides: on an AMX Xeon at this width bf16 is ~1.3x fp32, near the 1.25 line, so a second
    # measurement made here could land on the other side)
    expected = re.search(r"\ndtype: (bf16|fp32) \(", proc.stderr).group(1)
    assert f"cpu: {cpu.cpu_name()}, " in proc.stderr
    assert f"(cpu, {expected}, KV cache)" in proc.stderr and "dtype:" not in proc.stdout
    assert expected == "fp32" or cpu.native_bf16()  # never bf16 where it is not native


# -----------------------------------------------------------------------------
# a fine-tuned model: --prompt rendered with its checkpoint's template, the answer alone, up to <|endoftext|>

EOT, enc, decode = tokenizer.EOT, tokenizer.encode, tokenizer.decode
BLOCK = 64


def eot_at_a_new_token(model, ids, at_least):
    """Make the model's greedy answer to ids end with <|endoftext|> after at_least or more tokens (at a
    token not picked before, so it cannot win earlier); returns the answer."""
    free = greedy_reference(model, ids, 40)
    k = next(k for k in range(at_least, 40) if free[k] not in free[:k])
    return say_eot_at(model, ids, k)


@torch.no_grad()
def sampled_reference(model, ids, max_new_tokens, temperature, generator):
    """A sampled answer the plain way (no KV cache, the whole vocabulary), stopping at <|endoftext|>."""
    ids, new = list(ids), []
    while len(new) < max_new_tokens and len(ids) < model.config.block_size:
        logits = model(torch.tensor([ids]))[0][:, -1, :tokenizer.VOCAB_SIZE].float()
        next_id = int(torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=generator))
        if next_id == EOT:
            break
        new.append(next_id)
        ids.append(next_id)
    return new


def test_prompt_gets_the_answer_up_to_eot(capsys, monkeypatch, tmp_path):
    model = varied_model(BLOCK)
    prompt = "Q: What is two plus two?\nA:"
    answer = eot_at_a_new_token(model, enc(prompt), 5)  # prompt/completion: the prompt exactly, nothing added
    ckpt = save_task_checkpoint(tmp_path / "model.pt", model, task_of("prompt_completion"))
    seen = record_prompts(monkeypatch, sample, "stream_sample")
    out = run_main(capsys, "--ckpt_path", ckpt, "--prompt", prompt, "--top_k", 1, "--max_new_tokens", 40)
    assert seen == [enc(prompt)]
    assert out.out == decode(answer).lstrip() + "\n"  # the answer alone: no prompt, no header, no <|endoftext|>
    assert f"{len(answer)} tokens in" in out.err and "fine-tuned on a prompt_completion task" in out.err
    out = run_main(capsys, "--ckpt_path", ckpt, "--prompt", prompt, "--top_k", 1, "--max_new_tokens", 3)
    assert out.out == decode(answer[:3]).lstrip() + "\n"

    # the user's sampling flags still hold: two samples from the whole vocabulary, each stopping at <|endoftext|>
    out = run_main(capsys, "--ckpt_path", ckpt, "--prompt", prompt, "--num_samples", 2, "--top_k", 0,
                   "--temperature", 0.7, "--seed", 3, "--max_new_tokens", 40)
    generator = torch.Generator().manual_seed(3)
    answers = [sampled_reference(model, enc(prompt), 40, 0.7, generator) for _ in range(2)]
    assert out.out == "".join(f"--- sample {i + 1}/2\n{decode(a).lstrip()}\n" for i, a in enumerate(answers))
    assert answers[0] != answers[1]


def test_the_template_is_the_checkpoints(capsys, monkeypatch, tmp_path):
    """An Alpaca-format model is prompted with the template it was trained on, which its checkpoint carries."""
    templates = {**tasks.TEMPLATES, "alpaca": {"input": "Do: {instruction}\nWith: {input}\nDone:",
                                                  "no_input": "Do: {instruction}\nDone:"}}
    model = varied_model(BLOCK)
    ckpt = save_task_checkpoint(tmp_path / "model.pt", model, task_of("alpaca", templates))
    seen = record_prompts(monkeypatch, sample, "stream_sample")
    out = run_main(capsys, "--ckpt_path", ckpt, "--prompt", "Name a colour.", "--top_k", 1,
                   "--max_new_tokens", 8)
    ids = enc("Do: Name a colour.\nDone:")
    assert seen == [ids]
    assert out.out == decode(greedy_reference(model, ids, 8)).lstrip() + "\n"


def test_bad_use_is_one_line(capsys, tmp_path):
    model = varied_model(BLOCK)
    plain, completion, chat = checkpoints_of_each_kind(tmp_path, model)
    for argv, message in [
        (["--ckpt_path", completion, "--prompt", "hi", "--system", "Be brief."],
         f"error: --system needs a model fine-tuned on chat data (messages); {completion} is fine-tuned on "
         f"prompt_completion data"),
        (["--ckpt_path", plain, "--prompt", "hi", "--system", "Be brief."],
         f"error: --system needs a model fine-tuned on chat data (messages); {plain} is a plain language model"),
        (["--ckpt_path", chat, "--prompt", "hi", "--system", " "], "error: --system is empty"),
        (["--ckpt_path", completion], f"error: {completion} is fine-tuned on a task: ask it something with --prompt, "
                                      f"or talk with it with python answer.py --ckpt_path {completion} --chat"),
        (["--ckpt_path", completion, "--prompt", "word " * 70],
         f"error: --prompt is {len(enc('word ' * 70))} tokens once rendered with the task's template, the model's "
         f"context is {BLOCK}: shorten it"),
        (["--ckpt_path", chat, "--chat"], "error: --chat is answer.py's now: python answer.py --ckpt_path CHECKPOINT "
                                          "--chat"),
    ]:
        with pytest.raises(SystemExit) as e:
            run_main(capsys, *argv)
        assert str(e.value) == message


def test_a_system_turn_opens_a_chat_models_prompt(capsys, monkeypatch, tmp_path):
    model = varied_model(BLOCK)
    ckpt = save_task_checkpoint(tmp_path / "model.pt", model, task_of("chat"))
    seen = record_prompts(monkeypatch, sample, "stream_sample")
    run_main(capsys, "--ckpt_path", ckpt, "--prompt", "hi", "--system", "Be brief.", "--top_k", 1,
             "--max_new_tokens", 4)
    assert seen == [enc("System: Be brief.\n") + enc("User: hi\n") + enc("Assistant:")]
