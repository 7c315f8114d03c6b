"""answer.py: greedy answers many prompts at a time (each equal to a plain no-cache loop's), task accuracy (against a
plain loop, on one process and two ranks), scoring examples from files and datasets, and the chat, which keeps the
conversation and drops its oldest exchanges when the context is full. The expected chat prompts are written out here
from the templates as documented, not by finetune.py."""
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import answer
import dataloader
import finetune
import tasks
import tokenizer
from plumbing import checkpoints
from model import load_model
from conftest import (REPO, TINY_MODEL, checkpoints_of_each_kind, greedy_reference, record_prompts, run_train,
                      save_random_hf_gpt2, save_task_checkpoint, say_eot_at, task_of, varied_model)
from test_finetune import prepare, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

EOT, enc, decode = tokenizer.EOT, tokenizer.encode, tokenizer.decode
BLOCK = 64


# -----------------------------------------------------------------------------
# answers(): the greedy answers that task accuracy scores, one prompt at a time first

def answer_one(model, ids, max_new_tokens):
    return answer.answers(model, [ids], max_new_tokens)[0]

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
        got = answer_one(model, ids, max_new_tokens)
        assert got == greedy_reference(model, ids, max_new_tokens)
        assert len(got) == expected_length and tokenizer.EOT not in got
    assert len(set(answer_one(model, prompt, 100))) > 5  # a continuation that says something


def test_answer_stops_at_eot():
    model = varied_model()
    prompt = tokenizer.encode("The quick brown fox")
    free = answer_one(model, prompt, 30)
    assert len(free) == 30
    k = next(k for k in range(8, 30) if free[k] not in free[:k])  # a token greedy has not picked before
    assert say_eot_at(model, prompt, k) == free[:k]
    got = answer_one(model, prompt, 30)
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
    every answer is the one-prompt answer's and the no-cache loop's, in the order given; the rows stop at <|endoftext|>
    at known steps, at their max_new_tokens, at the context's end, or have no room at all."""
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
    assert [answer_one(model, ids, n) for ids, n in zip(prompts, limits)] == expected
    for batch_size in (4, 64):
        assert answer.answers(model, prompts, limits, batch_size=batch_size) == expected
    assert answer.answers(model, prompts, 3, batch_size=5) == [answer_one(model, ids, 3) for ids in prompts]


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
        lambda m, args, kwargs: forwards.append((kwargs["cache"].pos, tuple(args[0].shape))), with_kwargs=True)

    class Progress:
        def update(self, n):
            steps.append(n)
    steps = []
    got = answer.answers(model, prompts, limits, batch_size=3, progress=Progress())
    hook.remove()
    assert got == [answer_one(model, ids, n) for ids, n in zip(prompts, limits)]
    assert all(len(a) == n for a, n in zip(got, limits))  # no <|endoftext|> here: max_new_tokens ends each row
    prefills = [shape for pos, shape in forwards if pos == 0]
    assert prefills == [(3, 5), (3, 21), (1, 30)]  # lengths 2 3 5 | 9 14 21 | 30, left-padded to the longest
    assert len(forwards) == 9 + 6 + 4  # one per token of each batch's longest answer (limits 2 3 9 | 6 1 5 | 4)
    assert steps == [3, 3, 1]
    with pytest.raises(ValueError):
        answer.answers(model, prompts, [1, 2])


# -----------------------------------------------------------------------------
# task accuracy: greedy answers, scored

def tiny_model(seed=0, block_size=64):
    from model import GPT, GPTConfig
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=block_size, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)).eval()


def known_examples(model, prompts, max_new_tokens):
    """Examples whose right answer is the model's own greedy answer (every other one), or another text."""
    examples = []
    for i, prompt in enumerate(prompts):
        got = decode(greedy_reference(model, enc(prompt), max_new_tokens))
        examples.append((enc(prompt), f"  {got} " if i % 2 == 0 else got + " nope"))
    return examples


def test_task_accuracy_against_a_plain_greedy_loop():
    model = tiny_model()
    prompts = [f"Question {i}: what comes next?" for i in range(6)]
    examples = known_examples(model, prompts, 5)
    accuracy, results = answer.task_accuracy(model, examples, max_new_tokens=5)
    assert accuracy == 3 / 6   # the even ones: the same answer up to whitespace
    assert [r[0] for r in results] == prompts
    assert [r[2] for r in results] == [decode(greedy_reference(model, enc(p), 5)) for p in prompts]
    assert [r[1] for r in results] == [e[1] for e in examples]
    # n: the first n only
    assert answer.task_accuracy(model, examples, max_new_tokens=5, n=2)[0] == 1 / 2
    # the regex's first group on both sides: the odd ones now match too, the even ones still do
    first_word = r"^\s*(\S+)"
    # (this seed's answers each have a first word: the regex has one to find)
    assert all(r[2].split() for r in results)
    assert answer.task_accuracy(model, examples, max_new_tokens=5, answer_regex=first_word)[0] == 1.0
    # no match in the answer: wrong
    assert answer.task_accuracy(model, examples, max_new_tokens=5, answer_regex=r"(zzz\d+)")[0] == 0.0


def test_default_answer_length_comes_from_the_expected_answer(monkeypatch):
    """Room for a right answer: the expected answer's tokens + 8; with a regex, twice that + 16."""
    model, asked = tiny_model(), []
    real_answers = answer.answers
    monkeypatch.setattr(answer, "answers", lambda m, prompts, limits, **kw: asked.extend(limits) or
                        real_answers(m, prompts, limits, **kw))
    examples = [(enc("Q: a"), " one two three"), (enc("Q: b"), "x")]
    answer.task_accuracy(model, examples)
    answer.task_accuracy(model, examples, answer_regex="(.*)")
    answer.task_accuracy(model, examples, max_new_tokens=3)
    n = [len(enc(e)) for _, e in examples]
    assert asked == [n[0] + 8, n[1] + 8, 2 * n[0] + 16, 2 * n[1] + 16, 3, 3]


def test_answer_key():
    assert answer.answer_key("  a \n b\t c ") == "a b c"
    assert answer.answer_key("so 3 + 4 = 7\n#### 7 ", "#### (.*)") == "7"
    assert answer.answer_key("no marker", "#### (.*)") is None
    assert answer.answer_key("#### 7", "#### (.*)") == answer.answer_key("x\n####  7", "#### (.*)")


def test_task_accuracy_from_a_task_folder_uses_its_regex(tmp_path):
    model = tiny_model(1)
    got = [decode(greedy_reference(model, enc(f"Sum {i}:"), 4)) for i in range(4)]
    assert all(g.split() for g in got)   # (this seed's answers each have a first word)
    # expected: the model's first word, then more: right by the task's regex (the first word), wrong by exact match
    rows = [{"prompt": f"Sum {i}:", "completion": f" {g.split()[0]} and then some"} for i, g in enumerate(got)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    prepare("--input", src, "--val_input", src, "--output_dir", tmp_path / "t", "--answer_regex", r"^\s*(\S+)")
    accuracy, results = answer.task_accuracy(model, str(tmp_path / "t"), max_new_tokens=4)
    assert [r[:2] for r in results] == [(r["prompt"], r["completion"]) for r in rows] and [r[2] for r in results] == got
    assert accuracy == 1.0 and not any(answer.is_right(text, expected) for _, expected, text in results)


RANK_SCRIPT = """
import os, sys, torch
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
import answer, test_answer
from parallel import world
rank = int(sys.argv[1])
torch.distributed.init_process_group("gloo", init_method="file://" + {store!r}, rank=rank, world_size=2)
ranks = world.Ranks(rank=rank, world_size=2, local_rank=rank, local_world=2, launcher="test")
model = test_answer.tiny_model()
examples = test_answer.known_examples(model, [f"Question {{i}}: what comes next?" for i in range(7)], 4)
for lockstep in (False, True):
    accuracy, results = answer.task_accuracy(model, examples, max_new_tokens=4, ranks=ranks, lockstep=lockstep)
    print(lockstep, accuracy, [r[0] for r in results], flush=True)
torch.distributed.destroy_process_group()
"""


@pytest.mark.xdist_group("multiprocess-2")
def test_task_accuracy_on_two_ranks_splits_the_examples_and_sums_the_counts(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT.format(repo=REPO, tests=os.path.dirname(os.path.abspath(__file__)),
                                         store=str(tmp_path / "store")))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    prompts = [f"Question {i}: what comes next?" for i in range(7)]
    for rank, (out, err) in enumerate(outs):
        split, lockstep = out.splitlines()
        assert split == f"False {4 / 7} {prompts[rank::2]}"        # 4 of the 7 right (the even ones), over both
        assert lockstep == f"True {4 / 7} {prompts}"              # every rank answered every example
        if rank == 1:
            assert "task accuracy" not in err                     # no progress bar but rank 0's


def test_scoring_a_hugging_face_layout_model(tmp_path, capsys):
    """answer.py --input on a random GPT-2 saved by transformers: it loads, renders with the folder's task.json
    templates, answers, and prints the accuracy and examples, agreeing with the plain greedy loop on the same
    weights."""
    from model import load_model
    folder = tmp_path / "hf"
    save_random_hf_gpt2(folder, n_head=2, n_embd=32, n_positions=64)
    templates = {**tasks.TEMPLATES,
                 "alpaca": {"input": "Do {instruction} with {input}:", "no_input": "Do {instruction}:"}}
    (folder / "task.json").write_text(json.dumps({"kind": "task", "version": 1, "format": "alpaca",
                                                  "formats": {"alpaca": 1}, "templates": templates,
                                                  "answer_regex": None}))
    model = load_model(str(folder))[0].eval()
    greedy = decode(greedy_reference(model, enc("Do sums:"), 6))
    rows = [{"instruction": "sums", "output": greedy + "\n"}, {"instruction": "more", "input": "x", "output": "no"},
            {"prompt": "", "completion": "bad line"}]
    src = write_jsonl(tmp_path / "val.jsonl", rows)
    accuracy = answer.main(["--ckpt_path", str(folder), "--input", src, "--max_new_tokens", "6",
                            "--dtype", "fp32", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert accuracy == 0.5
    assert f"{src}:3: empty prompt" in err
    assert "prompt:   'Do sums:'" in out and f"expected: {greedy + chr(10)!r}" in out and f"got:      {greedy!r}" in out
    assert "prompt:   'Do more with x:'" in out
    assert re.search(r"task accuracy: 0\.5000 \(1/2 examples of .*val\.jsonl; exact match", out)
    # a regex that the expected answers do not match: said, and every answer is wrong
    assert answer.main(["--ckpt_path", str(folder), "--input", src, "--max_new_tokens", "6",
                        "--dtype", "fp32", "--device", "cpu", "--answer_regex", "#### (.*)"]) == 0.0
    out, err = capsys.readouterr()
    assert "warning: 2 of 2 expected answers have no match of --answer_regex" in err
    assert "task accuracy: 0.0000 (0/2 examples" in out and "the first group of '#### (.*)'" in out


# -----------------------------------------------------------------------------
# the chat

def run_main(capsys, monkeypatch, *argv, stdin=""):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    answer.main(["--device", "cpu", "--dtype", "fp32", *map(str, argv)])
    return capsys.readouterr()


def chat_prompt(system, exchanges, user):
    """The chat template as documented: "System: {content}\\n", "User: {content}\\n", "Assistant:", the answer
    " {content}" and <|endoftext|> (not after an answer cut at --max_new_tokens: the model never wrote one), then
    "\\n" before the next user turn. exchanges: (question, reply) or (question, reply, cut)."""
    ids = enc(f"System: {system}\n") if system else []
    for question, reply, *cut in exchanges:
        ids += enc(f"User: {question}\n") + enc("Assistant:") + enc(f" {reply}") + [EOT] * (not any(cut)) + enc("\n")
    return ids + enc(f"User: {user}\n") + enc("Assistant:")


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_chat_keeps_the_conversation_and_drops_its_oldest_exchanges(capsys, monkeypatch, tmp_path, system):
    model = varied_model(BLOCK)
    ckpt = save_task_checkpoint(tmp_path / "model.pt", model, task_of("chat"))
    turns = ["hello there", "how are you?", "tell me more", "why?", "and then", "ok, bye"]
    seen = record_prompts(monkeypatch, answer, "stream_answer")
    out = run_main(capsys, monkeypatch, "--ckpt_path", ckpt, "--chat", "--top_k", 1, "--max_new_tokens", 6,
                   *(["--system", system] if system else []),
                   stdin="\n".join(turns[:3]) + "\n\n" + "\n".join(turns[3:]))  # a blank line is no turn

    expected_prompts, expected_out, exchanges, dropped = [], "", [], 0
    for user in turns:
        while len(chat_prompt(system, exchanges, user)) + 6 > BLOCK and exchanges:  # room for 6 new tokens
            exchanges.pop(0)
            dropped += 1
        ids = chat_prompt(system, exchanges, user)
        reply_ids = greedy_reference(model, ids, 6)
        reply = decode(reply_ids)
        assert reply.strip()
        expected_prompts.append(ids)
        expected_out += reply.lstrip() + "\n"
        exchanges.append((user, reply.removeprefix(" "), len(reply_ids) == min(6, BLOCK - len(ids))))
    assert seen == expected_prompts
    assert out.out == expected_out
    assert dropped >= 2 and out.err.count("dropped its oldest exchange") == dropped
    assert max(len(ids) for ids in seen) > BLOCK // 2  # the answers were given with the conversation before them


def test_chat_forgets_an_empty_answer(capsys, monkeypatch, tmp_path):
    model = varied_model(BLOCK)
    say_eot_at(model, chat_prompt(None, [], "hi"), 0)  # the first answer is <|endoftext|> at once
    ckpt = save_task_checkpoint(tmp_path / "model.pt", model, task_of("chat"))
    seen = record_prompts(monkeypatch, answer, "stream_answer")
    out = run_main(capsys, monkeypatch, "--ckpt_path", ckpt, "--chat", "--top_k", 1, "--max_new_tokens", 4,
                   stdin="hi\nsecond\n")
    assert seen == [chat_prompt(None, [], "hi"), chat_prompt(None, [], "second")]
    assert out.out.startswith("\n") and "an empty answer: this exchange is not kept" in out.err


def test_a_mixed_task_with_chat_data_chats(capsys, monkeypatch, tmp_path):
    model = varied_model(BLOCK)
    task = {**task_of("mixed"), "formats": {"chat": 3, "prompt_completion": 5}}
    ckpt = save_task_checkpoint(tmp_path / "model.pt", model, task)
    seen = record_prompts(monkeypatch, answer, "stream_answer")
    run_main(capsys, monkeypatch, "--ckpt_path", ckpt, "--chat", "--top_k", 1, "--max_new_tokens", 4, stdin="hi\n")
    assert seen == [chat_prompt(None, [], "hi")]


def test_bad_use_is_one_line(capsys, monkeypatch, tmp_path):
    model = varied_model(BLOCK)
    plain, completion, chat = checkpoints_of_each_kind(tmp_path, model)
    for argv, message in [
        (["--ckpt_path", plain, "--chat"],
         f"error: --chat needs a model fine-tuned on chat data (messages); {plain} is a plain language model: "
         "ask it with python sample.py --prompt"),
        (["--ckpt_path", completion, "--chat"], f"error: --chat needs a model fine-tuned on chat data (messages); "
                                                f"{completion} is fine-tuned on prompt_completion data: ask it with "
                                                "python sample.py --prompt"),
        (["--ckpt_path", chat, "--chat", "--input", "x.jsonl"],
         "error: give --input (examples to score) or --chat (a conversation), one of them"),
        (["--ckpt_path", chat], "error: give --input (examples to score) or --chat (a conversation), one of them"),
        (["--ckpt_path", chat, "--chat", "--system", " "], "error: --system opens a --chat, and must not be empty"),
        (["--ckpt_path", chat, "--input", "x.jsonl", "--system", "Be brief."],
         "error: --system opens a --chat, and must not be empty"),
        (["--ckpt_path", tmp_path / "nope.pt", "--chat"], f"error: --ckpt_path {tmp_path / 'nope.pt'} not found"),
        (["--input", "x.jsonl"], "error: give --ckpt_path: the fine-tuned model to ask"),
    ]:
        with pytest.raises(SystemExit) as e:
            run_main(capsys, monkeypatch, *argv)
        assert str(e.value) == message


def test_command_line(tmp_path):
    """The documented form in a fresh process, turns piped in; and a too-long turn is skipped, not fatal."""
    model = varied_model(BLOCK)
    ckpt = save_task_checkpoint(tmp_path / "model.pt", model, task_of("chat"))
    cmd = [sys.executable, os.path.join(REPO, "answer.py"), "--ckpt_path", ckpt, "--chat", "--top_k", "1",
           "--max_new_tokens", "5", "--device", "cpu", "--dtype", "fp32"]
    proc = subprocess.run(cmd, input="hi\n" + "word " * 70 + "\nbye\n", capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 2
    assert f"note: this turn alone is {len(chat_prompt(None, [], 'word ' * 70))} tokens once rendered" in proc.stderr


def test_a_real_fine_tuning_run(capsys, monkeypatch, tmp_path):
    """The whole path: chat data prepared by finetune.py, fine-tuned by train_gpt2.py (whose checkpoint keeps
    the task), then talked to: each answer is the greedy answer to the conversation as documented."""
    things = {"sky": "blue", "grass": "green", "sun": "yellow", "snow": "white", "coal": "black", "blood": "red"}
    with open(tmp_path / "chat.jsonl", "w") as f:
        for thing, colour in things.items():
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What colour is the {thing}?"},
                                             {"role": "assistant", "content": colour}]}) + "\n")
    finetune.main(["--input", str(tmp_path / "chat.jsonl"), "--val_examples", "2",
                   "--output_dir", str(tmp_path / "task")])
    capsys.readouterr()  # its summary
    run_train(["--data_dir", tmp_path / "task", "--log_dir", tmp_path / "log", *TINY_MODEL, "--seq_len", "64",
               "--max_steps", "2", "--warmup_steps", "1", "--max_lr", "1e-3", "--eval_interval", "0",
               "--checkpoint_interval", "2", "--task_examples", "2", "--dtype", "fp32", "--threads", "1"])
    ckpt = checkpoints.list_checkpoints(str(tmp_path / "log"))[-1]
    assert checkpoints.load_checkpoint(ckpt)["task"] == dataloader.read_task(str(tmp_path / "task"))

    turns = ["What colour is the sky?", "And the grass?"]
    seen = record_prompts(monkeypatch, answer, "stream_answer")
    out = run_main(capsys, monkeypatch, "--ckpt_path", ckpt, "--chat", "--top_k", 1, "--max_new_tokens", 8,
                   stdin="\n".join(turns) + "\n")
    model, prompts, expected, exchanges = load_model(ckpt)[0].eval(), [], "", []
    for user in turns:
        prompts.append(chat_prompt(None, exchanges, user))
        reply_ids = greedy_reference(model, prompts[-1], 8)
        reply = decode(reply_ids)
        expected += reply.lstrip() + "\n"
        if reply.strip():
            exchanges.append((user, reply.removeprefix(" "), len(reply_ids) == 8))
    assert seen == prompts and out.out == expected
