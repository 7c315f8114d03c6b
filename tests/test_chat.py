"""sample.py talks to a fine-tuned model: --prompt rendered with the template in its checkpoint, answers that
stop at <|endoftext|>, and --chat, which keeps the conversation and drops its oldest exchanges when the context
is full. The expected prompts are written out here from the templates as documented, not by finetune.py."""
import io
import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from torch.nn import functional as F

import finetune
import sample
import tokenizer
import train_gpt2
from conftest import REPO, TINY_MODEL, run_train
from test_sample import greedy_reference, say_eot_at, varied_model

pytestmark = pytest.mark.usefixtures("one_thread")

EOT, enc, decode = tokenizer.EOT, tokenizer.encode, tokenizer.decode
BLOCK = 64


def task_of(fmt, templates=finetune.TEMPLATES):
    """A task.json dict as finetune.py writes it (the fields sample.py reads, and the counts around them)."""
    return {"kind": "task", "version": 1, "format": fmt, "formats": {fmt: 20}, "templates": templates,
            "train_on": "completion", "max_len": BLOCK, "answer_regex": None}


def save(path, model, task):
    """A checkpoint as train_gpt2.py writes it for a task run: its config, weights and task."""
    torch.save({"config": asdict(model.config), "model": model.state_dict(), "step": 5, "task": task}, path)
    return str(path)


def run_main(capsys, monkeypatch, *argv, stdin=""):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    sample.main(["--device", "cpu", "--dtype", "fp32", *map(str, argv)])
    return capsys.readouterr()


def record_prompts(monkeypatch):
    """The token ids of every prompt sample.py answers, in order (stream_sample still does the work)."""
    seen, stream_sample = [], sample.stream_sample
    def recording(model, ids, *args, **kwargs):
        seen.append(list(ids))
        return stream_sample(model, ids, *args, **kwargs)
    monkeypatch.setattr(sample, "stream_sample", recording)
    return seen


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
    ckpt = save(tmp_path / "model.pt", model, task_of("prompt_completion"))
    seen = record_prompts(monkeypatch)
    out = run_main(capsys, monkeypatch, "--ckpt_path", ckpt, "--prompt", prompt, "--top_k", 1, "--max_new_tokens", 40)
    assert seen == [enc(prompt)]
    assert out.out == decode(answer).lstrip() + "\n"  # the answer alone: no prompt, no header, no <|endoftext|>
    assert f"{len(answer)} tokens in" in out.err and "fine-tuned on a prompt_completion task" in out.err
    out = run_main(capsys, monkeypatch, "--ckpt_path", ckpt, "--prompt", prompt, "--top_k", 1, "--max_new_tokens", 3)
    assert out.out == decode(answer[:3]).lstrip() + "\n"

    # the user's sampling flags still hold: two samples from the whole vocabulary, each stopping at <|endoftext|>
    out = run_main(capsys, monkeypatch, "--ckpt_path", ckpt, "--prompt", prompt, "--num_samples", 2, "--top_k", 0,
                   "--temperature", 0.7, "--seed", 3, "--max_new_tokens", 40)
    generator = torch.Generator().manual_seed(3)
    answers = [sampled_reference(model, enc(prompt), 40, 0.7, generator) for _ in range(2)]
    assert out.out == "".join(f"--- sample {i + 1}/2\n{decode(a).lstrip()}\n" for i, a in enumerate(answers))
    assert answers[0] != answers[1]


def test_the_template_is_the_checkpoints(capsys, monkeypatch, tmp_path):
    """An Alpaca-format model is prompted with the template it was trained on, which its checkpoint carries."""
    templates = {**finetune.TEMPLATES, "alpaca": {"input": "Do: {instruction}\nWith: {input}\nDone:",
                                                  "no_input": "Do: {instruction}\nDone:"}}
    model = varied_model(BLOCK)
    ckpt = save(tmp_path / "model.pt", model, task_of("alpaca", templates))
    seen = record_prompts(monkeypatch)
    out = run_main(capsys, monkeypatch, "--ckpt_path", ckpt, "--prompt", "Name a colour.", "--top_k", 1,
                   "--max_new_tokens", 8)
    ids = enc("Do: Name a colour.\nDone:")
    assert seen == [ids]
    assert out.out == decode(greedy_reference(model, ids, 8)).lstrip() + "\n"


def chat_prompt(system, exchanges, user):
    """The chat template as documented: "System: {content}\\n", "User: {content}\\n", "Assistant:", the answer
    " {content}" and <|endoftext|>, then "\\n" before the next user turn."""
    ids = enc(f"System: {system}\n") if system else []
    for question, reply in exchanges:
        ids += enc(f"User: {question}\n") + enc("Assistant:") + enc(f" {reply}") + [EOT] + enc("\n")
    return ids + enc(f"User: {user}\n") + enc("Assistant:")


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_chat_keeps_the_conversation_and_drops_its_oldest_exchanges(capsys, monkeypatch, tmp_path, system):
    model = varied_model(BLOCK)
    ckpt = save(tmp_path / "model.pt", model, task_of("chat"))
    turns = ["hello there", "how are you?", "tell me more", "why?", "and then", "ok, bye"]
    seen = record_prompts(monkeypatch)
    out = run_main(capsys, monkeypatch, "--ckpt_path", ckpt, "--chat", "--top_k", 1, "--max_new_tokens", 6,
                   *(["--system", system] if system else []),
                   stdin="\n".join(turns[:3]) + "\n\n" + "\n".join(turns[3:]))  # a blank line is no turn

    expected_prompts, expected_out, exchanges, dropped = [], "", [], 0
    for user in turns:
        while len(chat_prompt(system, exchanges, user)) + 6 > BLOCK and exchanges:  # room for 6 new tokens
            exchanges.pop(0)
            dropped += 1
        ids = chat_prompt(system, exchanges, user)
        reply = decode(greedy_reference(model, ids, 6))
        assert reply.strip()
        expected_prompts.append(ids)
        expected_out += reply.lstrip() + "\n"
        exchanges.append((user, reply.removeprefix(" ")))
    assert seen == expected_prompts
    assert out.out == expected_out
    assert dropped >= 2 and out.err.count("dropped its oldest exchange") == dropped
    assert max(len(ids) for ids in seen) > BLOCK // 2  # the answers were given with the conversation before them


def test_chat_forgets_an_empty_answer(capsys, monkeypatch, tmp_path):
    model = varied_model(BLOCK)
    say_eot_at(model, chat_prompt(None, [], "hi"), 0)  # the first answer is <|endoftext|> at once
    ckpt = save(tmp_path / "model.pt", model, task_of("chat"))
    seen = record_prompts(monkeypatch)
    out = run_main(capsys, monkeypatch, "--ckpt_path", ckpt, "--chat", "--top_k", 1, "--max_new_tokens", 4,
                   stdin="hi\nsecond\n")
    assert seen == [chat_prompt(None, [], "hi"), chat_prompt(None, [], "second")]
    assert out.out.startswith("\n") and "an empty answer: this exchange is not kept" in out.err


def test_a_mixed_task_with_chat_data_chats(capsys, monkeypatch, tmp_path):
    model = varied_model(BLOCK)
    task = {**task_of("mixed"), "formats": {"chat": 3, "prompt_completion": 5}}
    ckpt = save(tmp_path / "model.pt", model, task)
    seen = record_prompts(monkeypatch)
    run_main(capsys, monkeypatch, "--ckpt_path", ckpt, "--chat", "--top_k", 1, "--max_new_tokens", 4, stdin="hi\n")
    assert seen == [chat_prompt(None, [], "hi")]


def test_bad_use_is_one_line(capsys, monkeypatch, tmp_path):
    model = varied_model(BLOCK)
    plain = tmp_path / "plain.pt"
    torch.save({"config": asdict(model.config), "model": model.state_dict()}, plain)
    completion, chat = save(tmp_path / "qa.pt", model, task_of("prompt_completion")), save(tmp_path / "chat.pt", model,
                                                                                             task_of("chat"))
    for argv, message in [
        (["--ckpt_path", plain, "--chat"],
         f"error: --chat needs a model fine-tuned on chat data (messages); {plain} is a plain language model: "
         "use --prompt"),
        (["--ckpt_path", completion, "--chat"], f"error: --chat needs a model fine-tuned on chat data (messages); "
                                                f"{completion} is fine-tuned on prompt_completion data: use --prompt"),
        (["--ckpt_path", completion, "--prompt", "hi", "--system", "Be brief."],
         f"error: --system needs a model fine-tuned on chat data (messages); {completion} is fine-tuned on "
         f"prompt_completion data: use --prompt"),
        (["--ckpt_path", chat, "--chat", "--prompt", "hi"],
         "error: --chat reads your turns from stdin: give no --prompt"),
        (["--ckpt_path", chat, "--chat", "--system", " "], "error: --system is empty"),
        (["--ckpt_path", completion], f"error: {completion} is fine-tuned on a task: ask it something with --prompt, "
                                      "or --chat"),
        (["--ckpt_path", completion, "--prompt", "word " * 70],
         f"error: --prompt is {len(enc('word ' * 70))} tokens once rendered with the task's template, the model's "
         f"context is {BLOCK}: shorten it"),
    ]:
        with pytest.raises(SystemExit) as e:
            run_main(capsys, monkeypatch, *argv)
        assert str(e.value) == message


def test_command_line(tmp_path):
    """The documented form in a fresh process, turns piped in; and a too-long turn is skipped, not fatal."""
    model = varied_model(BLOCK)
    ckpt = save(tmp_path / "model.pt", model, task_of("chat"))
    cmd = [sys.executable, os.path.join(REPO, "sample.py"), "--ckpt_path", ckpt, "--chat", "--top_k", "1",
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
    ckpt = train_gpt2.list_checkpoints(str(tmp_path / "log"))[-1]
    assert train_gpt2.load_checkpoint(ckpt)["task"] == finetune.read_task(str(tmp_path / "task"))

    turns = ["What colour is the sky?", "And the grass?"]
    seen = record_prompts(monkeypatch)
    out = run_main(capsys, monkeypatch, "--ckpt_path", ckpt, "--chat", "--top_k", 1, "--max_new_tokens", 8,
                   stdin="\n".join(turns) + "\n")
    model, prompts, expected, exchanges = sample.load_model(ckpt)[0].eval(), [], "", []
    for user in turns:
        prompts.append(chat_prompt(None, exchanges, user))
        reply = decode(greedy_reference(model, prompts[-1], 8))
        expected += reply.lstrip() + "\n"
        if reply.strip():
            exchanges.append((user, reply.removeprefix(" ")))
    assert seen == prompts and out.out == expected
