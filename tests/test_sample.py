"""sample.py: KV-cached generation equals recomputing everything, seeds, and both model sources."""
import os
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

import sample
import tokenizer
from conftest import REPO, make_shards, run_train, tiny_run_args
from plumbing import cpu, speedups
from train_gpt2 import GPT, GPTConfig

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
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2)).save_pretrained(path)
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
        out += f"--- sample {i + 1}/{num_samples}\n" + (tokenizer.decode(ids) if prompt else "") + tokenizer.decode(new) + "\n"
    return out


def run_main(capsys, *argv):
    sample.main(["--device", "cpu", "--dtype", "fp32", *map(str, argv)])  # expected_output computes in fp32
    return capsys.readouterr()


def load(ckpt):
    return sample.load_model(ckpt_path=ckpt)[0].eval()


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
        new = sample.stream_sample(model, [tokenizer.EOT], 50, top_k=top_k, generator=gen, out=open(os.devnull, "w"))
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
    expected, _ = speedups.resolve_dtype("auto", "cpu", 32)  # one thread here (one_thread), as below
    cmd = [sys.executable, os.path.join(REPO, "sample.py"), "--init_from", hf_dir, "--num_samples", "1",
           "--max_new_tokens", "4", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert f"cpu: {cpu.cpu_name()}, " in proc.stderr and f"\ndtype: {expected} (" in proc.stderr
    assert f"(cpu, {expected}, KV cache)" in proc.stderr and "dtype:" not in proc.stdout
    assert expected == "fp32" or cpu.native_bf16()  # never bf16 where it is not native


# -----------------------------------------------------------------------------
# answer(): the greedy answer that task accuracy scores and the chat prints

def varied_model(block_size=48):
    """A random tiny GPT whose greedy continuations do not just repeat one token: embeddings and
    weights larger than the training init (which makes near-uniform logits and loops)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 1.0 if "wte" in name or "wpe" in name else 0.3 if p.dim() == 2 else 0.1)
    return model


@torch.no_grad()
def greedy_reference(model, ids, max_new_tokens):
    """answer() the plain way: the whole sequence through the model for every token, no cache."""
    ids, new = list(ids), []
    while len(new) < max_new_tokens and len(ids) < model.config.block_size:
        next_id = int(model(torch.tensor([ids]))[0][0, -1, :tokenizer.VOCAB_SIZE].argmax())
        if next_id == tokenizer.EOT:
            break
        new.append(next_id)
        ids.append(next_id)
    return new


def test_answer_equals_greedy_recompute():
    model = varied_model()
    prompt = tokenizer.encode("The quick brown fox")
    for ids, max_new_tokens, expected_length in [
        (prompt, 10, 10),  # stops at max_new_tokens
        (prompt, 100, 48 - len(prompt)),  # stops where the context ends: prompt + answer = block_size
        (list(range(1000, 1047)), 5, 1),  # one position left
        (list(range(1000, 1048)), 5, 0),  # none left
        (prompt, 0, 0),
    ]:
        got = sample.answer(model, ids, max_new_tokens)
        assert got == greedy_reference(model, ids, max_new_tokens)
        assert len(got) == expected_length and tokenizer.EOT not in got
    assert len(set(sample.answer(model, prompt, 100))) > 5  # a continuation that says something


def say_eot_at(model, ids, k):
    """Make <|endoftext|> the greedy pick at step k of the answer to ids; returns the k tokens before it. Its
    (tied) embedding row becomes the row of the token greedy picks there, nudged towards that step's hidden
    state, so it wins there by a hair; where that token was picked before, it may win earlier (callers check)."""
    free = greedy_reference(model, ids, k + 1)
    assert len(free) == k + 1
    with torch.no_grad():
        h = model.hidden(torch.tensor([ids + free[:k]]))[0, -1]  # the state that picks free[k]
        model.lm_head.weight[tokenizer.EOT] = model.lm_head.weight[free[k]] + 1e-3 * h / h.norm()
    return free[:k]


def test_answer_stops_at_eot():
    model = varied_model()
    prompt = tokenizer.encode("The quick brown fox")
    free = sample.answer(model, prompt, 30)
    assert len(free) == 30
    k = next(k for k in range(8, 30) if free[k] not in free[:k])  # a token greedy has not picked before
    assert say_eot_at(model, prompt, k) == free[:k]
    got = sample.answer(model, prompt, 30)
    assert got == free[:k]  # everything before, and not the <|endoftext|>
    assert greedy_reference(model, prompt, 30) == got


# -----------------------------------------------------------------------------
# answers(): many prompts a batch at a time, left-padded, as task accuracy asks them

def eot_instead_of(model, token):
    """Make <|endoftext|> the greedy pick wherever token was, and only there, in a model whose hidden state is 1
    in dimension 0 everywhere: <|endoftext|>'s lm_head row becomes token's plus 1e-3 in that dimension, so its
    logit is always token's + 1e-3."""
    with torch.no_grad():
        model.lm_head.weight[tokenizer.EOT] = model.lm_head.weight[token]
        model.lm_head.weight[tokenizer.EOT, 0] += 1e-3


def test_answers_equal_answer_one_prompt_at_a_time():
    """Prompts from 1 to 60 tokens (context 48), each with its own max_new_tokens, in batches of 4 and all in one:
    every answer is answer()'s and the no-cache loop's, in the order given; the rows stop at <|endoftext|> at
    known steps, at their max_new_tokens, at the context's end, or have no room at all."""
    model = varied_model()
    with torch.no_grad():  # the hidden state's dimension 0: 1 everywhere, for eot_instead_of
        model.transformer.ln_f.weight[0], model.transformer.ln_f.bias[0] = 0.0, 1.0
    g = torch.Generator().manual_seed(1)
    lengths = [30, 1, 47, 12, 3, 46, 20, 48, 2, 60, 25, 8, 40, 5, 17, 33]
    prompts = [torch.randint(0, tokenizer.VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]
    limits = [40, 25, 5, 25, 25, 100, 3, 5, 25, 5, 25, 0, 30, 25, 25, 25]
    free = [greedy_reference(model, ids, n) for ids, n in zip(prompts, limits)]
    # the stopping token: one that greedy picks, for the first time, at some step > 0 in several answers
    firsts = [(a.index(t), t) for a in free for t in set(a)]
    stop = max(set(t for _, t in firsts), key=lambda t: sum(k > 0 for k, u in firsts if u == t))
    eot_instead_of(model, stop)
    expected = [a[:a.index(stop)] if stop in a else a for a in free]
    assert sum(stop in a for a in free) >= 3  # several rows end at <|endoftext|>, at different steps
    assert len({len(e) for e, a in zip(expected, free) if stop in a}) >= 2
    assert any(stop not in a and len(a) == n for a, n in zip(free, limits))  # some at max_new_tokens
    assert any(stop not in a and len(ids) + len(a) == 48 and len(a) < n  # some at the context's end
               for ids, a, n in zip(prompts, free, limits))
    assert [greedy_reference(model, ids, n) for ids, n in zip(prompts, limits)] == expected
    assert [sample.answer(model, ids, n) for ids, n in zip(prompts, limits)] == expected
    for batch_size in (4, 64):
        assert sample.answers(model, prompts, limits, batch_size=batch_size) == expected
    assert sample.answers(model, prompts, 3, batch_size=5) == [sample.answer(model, ids, 3) for ids in prompts]


def test_answers_batches_prompts_of_similar_lengths():
    """Sorted by length into batches (little padding), one forward per new token for a whole batch, none after
    its last row is done, and progress advanced by each batch's prompts."""
    model = varied_model()
    g = torch.Generator().manual_seed(2)
    lengths = [9, 2, 30, 5, 14, 3, 21]
    prompts = [torch.randint(0, tokenizer.VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]
    limits = [6, 2, 4, 9, 1, 3, 5]
    forwards = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: forwards.append((kwargs["kv_cache"].pos, tuple(args[0].shape))), with_kwargs=True)

    class Progress:
        def update(self, n):
            steps.append(n)
    steps = []
    got = sample.answers(model, prompts, limits, batch_size=3, progress=Progress())
    hook.remove()
    assert got == [sample.answer(model, ids, n) for ids, n in zip(prompts, limits)]
    assert all(len(a) == n for a, n in zip(got, limits))  # no <|endoftext|> here: max_new_tokens ends each row
    prefills = [shape for pos, shape in forwards if pos == 0]
    assert prefills == [(3, 5), (3, 21), (1, 30)]  # lengths 2 3 5 | 9 14 21 | 30, left-padded to the longest
    assert len(forwards) == 9 + 6 + 4  # one per token of each batch's longest answer (limits 2 3 9 | 6 1 5 | 4)
    assert steps == [3, 3, 1]
    with pytest.raises(ValueError):
        sample.answers(model, prompts, [1, 2])
