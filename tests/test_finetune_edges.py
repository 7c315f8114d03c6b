"""Fine-tuning's edges, tried as a new user would (issue 28): no val split, val examples longer than any training one,
scoring a dataset's held-out split, train and val sharing prompts, a chat too long for --max_len, a chat answer cut at
--max_new_tokens, expected answers the regex cannot read, prompts that meet their completion awkwardly, and a JSON line
with a key twice. Each test fails on the code before the fix; the first two and the long chat train end to end."""
import io
import json
import os
import sys

import pytest

import answer
import dataloader
import finetune
import tasks
from plumbing import checkpoints
from conftest import (TINY_MODEL, greedy_reference, read_log, record_prompts, run_train, save_task_checkpoint,
                      task_of, varied_model)
from tokenizer import EOT, decode, encode as enc

pytestmark = pytest.mark.usefixtures("one_thread")


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def qa(i, words=1):
    return {"prompt": f"Q{i}:", "completion": " " + " ".join(["yes"] * words)}


def train(data_dir, log_dir, *extra):
    """train_gpt2.py on a task folder: the tiny model, a few steps, fp32, one thread; returns the process."""
    return run_train(["--data_dir", data_dir, "--log_dir", log_dir, *TINY_MODEL, "--max_steps", "2", "--warmup_steps",
                      "1", "--eval_interval", "1", "--checkpoint_interval", "2", "--task_examples", "2", "--dtype",
                      "fp32", "--threads", "1", *extra])


# 1. --val_examples 0 ("0: none") --------------------------------------------------------------------------------

def test_no_val_split_trains_and_logs_no_val_loss(tmp_path):
    src = write_jsonl(tmp_path / "train.jsonl", [qa(i) for i in range(12)])
    task = finetune.main(["--input", src, "--val_examples", "0", "--output_dir", str(tmp_path / "t")])
    assert task["splits"]["val"]["examples"] == 0
    proc = train(tmp_path / "t", tmp_path / "log")
    assert "validation loss" not in proc.stdout and "task accuracy" not in proc.stdout
    assert read_log(tmp_path / "log", "val") == {} and read_log(tmp_path / "log", "task") == {}
    assert len(read_log(tmp_path / "log", "train")) == 2
    assert checkpoints.load_checkpoint(str(tmp_path / "log" / "model_00002.pt"))["val_loss"] is None


# 2. val examples longer than every training example ------------------------------------------------------------

def test_val_longer_than_train_is_covered_by_the_default_and_skipped_when_it_cannot_fit(tmp_path):
    train_src = write_jsonl(tmp_path / "train.jsonl", [qa(i, 1 + i % 3) for i in range(12)])   # <= 9 positions
    long_one = {"prompt": "Say it: " + "word " * 70, "completion": " done"}
    val_src = write_jsonl(tmp_path / "val.jsonl", [long_one, qa(99)])
    task = finetune.main(["--input", train_src, "--val_input", val_src, "--output_dir", str(tmp_path / "t")])
    assert task["splits"]["train"]["longest"] <= 9 and 64 < task["splits"]["val"]["longest"] <= 128
    proc = train(tmp_path / "t", tmp_path / "log", "--block_size", "128")   # the default seq_len covers val: 128
    assert " rows of 128;" in proc.stdout and "left out" not in proc.stdout
    every = read_log(tmp_path / "log", "val")
    # an explicit --seq_len that cannot hold it: that example is left out, said once, and the run goes on
    proc = train(tmp_path / "t", tmp_path / "log64", "--block_size", "128", "--seq_len", "64")
    assert proc.stdout.count("note: 1 val example longer than --seq_len 64 positions left out of the val loss") == 1
    short_only = read_log(tmp_path / "log64", "val")
    assert len(short_only) == len(every) == 3 and short_only != every   # the val loss of the short example alone


# 3. scoring a dataset reads its held-out split -------------------------------------------------------------------

def dataset_folder(root, splits):
    """A local folder laid out like a Hub dataset, data/{split}-00000-of-00001.jsonl, 3 rows a split."""
    os.makedirs(root / "data")
    for split in splits:
        write_jsonl(root / "data" / f"{split}-00000-of-00001.jsonl",
                    [{"question": f"{split} {i}?", "answer": " yes"} for i in range(3 + (split == "train"))])
    return str(root)


def test_scoring_a_dataset_reads_test_else_validation_never_train(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt = save_task_checkpoint(tmp_path / "m.pt", varied_model(64), task_of("prompt_completion"))
    flags = ["--ckpt_path", ckpt, "--columns", "prompt=question,completion=answer", "--max_new_tokens", "2",
             "--device", "cpu", "--dtype", "fp32"]
    for splits, scored in ((("train", "validation", "test"), "test"), (("train", "validation"), "validation")):
        folder = dataset_folder(tmp_path / scored, splits)
        answer.main([*flags, "--input", folder])
        out = capsys.readouterr().out
        assert f"/3 examples of {folder}, split {scored};" in out and f"{scored} 0?" in out and "train 0" not in out
    folder = dataset_folder(tmp_path / "train_only", ("train",))
    with pytest.raises(SystemExit,
                       match=f"error: --input {folder} has no test or validation split \\(it has: train\\)"):
        answer.main([*flags, "--input", folder])
    answer.main([*flags, "--input", folder, "--hf_split", "train"])   # asked for by name, it is scored
    assert f"/4 examples of {folder}, split train;" in capsys.readouterr().out


# 4. train and val sharing prompts ----------------------------------------------------------------------------------

def test_val_examples_also_in_train_are_counted_and_dedup_drops_them(tmp_path, capsys):
    train_src = write_jsonl(tmp_path / "train.jsonl", [qa(i) for i in range(10)])
    # whitespace apart
    shared = [{"prompt": "Q1:  ", "completion": " other"}, {"prompt": " Q2:", "completion": " yes"}]
    val_src = write_jsonl(tmp_path / "val.jsonl", shared + [qa(50), qa(51)])
    task = finetune.main(["--input", train_src, "--val_input", val_src, "--output_dir", str(tmp_path / "a")])
    assert task["overlap"] == 2 and task["splits"]["val"]["examples"] == 4
    assert "  2 val examples also in train (same prompt): their val loss and accuracy flatter the model; --dedup " \
           "drops them" in capsys.readouterr().out
    task = finetune.main(["--input", train_src, "--val_input", val_src, "--dedup", "--output_dir", str(tmp_path / "b")])
    assert task["overlap"] == 2 and task["splits"]["val"]["examples"] == 2
    assert "  2 val examples also in train (same prompt): dropped from val (--dedup)" in capsys.readouterr().out
    tokens, _, examples = dataloader.open_split(str(tmp_path / "b"), "val")
    assert [decode(tokens[s:a]) for s, a, _ in examples.tolist()] == ["Q50:", "Q51:"]


# 5. a chat too long for --max_len loses whole exchanges ----------------------------------------------------------

LONG_CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": " ".join(f"word{i}" for i in range(360))},
                          {"role": "assistant", "content": "A long reply to a long question."},
                          {"role": "user", "content": "And now?"},
                          {"role": "assistant", "content": "Yes."}]}


def test_a_long_chat_keeps_every_answer_with_its_question_and_trains(tmp_path, capsys):
    short = [{"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello."}]}
             for i in range(8)]
    too_long_alone = {"messages": [{"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "no"}]}
    src = write_jsonl(tmp_path / "chat.jsonl", [LONG_CHAT, too_long_alone] + short[:6])
    val = write_jsonl(tmp_path / "val.jsonl", short[6:])
    task = finetune.main(["--input", src, "--val_input", val, "--max_len", "200", "--output_dir", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert f"{src}:1: too long: " in err and "dropped its 1 oldest exchange" in err
    assert f"{src}:2: too long: " in err and "dropped: its last exchange alone takes" in err
    assert task["trimmed"] == 1 and task["cut"] == 0 and task["dropped"] == {"too long": 1}
    kept = {"messages": [LONG_CHAT["messages"][0]] + LONG_CHAT["messages"][3:]}   # system, the last exchange
    ids, targets, _ = tasks.render(kept)
    tokens, target_mask, examples = (a for a in dataloader.open_split(str(tmp_path / "t"), "train"))
    rows = [(tokens[s:e].tolist(), target_mask[s:e].tolist()) for s, _, e in examples.tolist()]
    assert (ids, targets) in rows   # exactly the chat without its first exchange
    assert [t for t, m in zip(ids, targets) if m] == enc(" Yes.") + [EOT]   # the only targets: the last answer, its EOT
    train(tmp_path / "t", tmp_path / "log")
    assert len(read_log(tmp_path / "log", "train")) == 2 and len(read_log(tmp_path / "log", "val")) == 3


# 6. smaller things that misled ---------------------------------------------------------------------------------------

def test_a_chat_answer_cut_at_max_new_tokens_is_kept_without_eot(tmp_path, monkeypatch, capsys):
    model = varied_model(64)
    ckpt = save_task_checkpoint(tmp_path / "m.pt", model, task_of("chat"))
    seen = record_prompts(monkeypatch, answer, "stream_answer")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nmore\n"))
    answer.main(["--ckpt_path", ckpt, "--chat", "--top_k", "1", "--max_new_tokens", "3", "--device", "cpu",
                 "--dtype", "fp32"])
    first = greedy_reference(model, seen[0], 3)
    assert len(first) == 3 and "note: the answer was cut at 3 tokens" in capsys.readouterr().err
    reply = decode(first).removeprefix(" ")
    # the second prompt holds the first answer as the model left it: no <|endoftext|> after it
    assert seen[1] == (enc("User: hi\n") + enc("Assistant:") + enc(f" {reply}") + enc("\n") + enc("User: more\n")
                       + enc("Assistant:"))


def test_expected_answers_the_regex_cannot_read_are_reported_once_in_training(tmp_path):
    rows = [{"prompt": f"Sum {i}:", "completion": f" {i}\n#### {i}" if i % 2 else f" {i}"} for i in range(12)]
    src = write_jsonl(tmp_path / "train.jsonl", rows)
    finetune.main(["--input", src, "--val_input", src, "--answer_regex", "#### (.*)", "--output_dir",
                   str(tmp_path / "t")])
    proc = train(tmp_path / "t", tmp_path / "log", "--task_examples", "12")
    warning = "warning: 6 of 12 expected answers have no match of --answer_regex '#### (.*)': they count as wrong"
    assert (proc.stdout + proc.stderr).count(warning) == 1 and len(read_log(tmp_path / "log", "task")) == 3


def test_prompts_that_tokenize_differently_joined_are_counted_with_advice(tmp_path, capsys):
    rows = [{"prompt": "The answer is ", "completion": "42"}, {"prompt": "Q: 2 + 2 =", "completion": " 4"}] * 3
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    task = finetune.main(["--input", src, "--val_examples", "0", "--output_dir", str(tmp_path / "t")])
    assert enc("The answer is ") + enc("42") != enc("The answer is 42")   # (what makes the first kind differ)
    assert task["joined"] == 3 and task["glued"] == 0
    out = capsys.readouterr().out
    assert ("  3 examples whose prompt and completion tokenize differently once joined (a token across them), e.g. "
            f"{src}:1: 'The answer is ' + '42': move the space from the prompt's end to the completion's start") in out


def test_glued_prompts_are_counted_and_a_separator_goes_into_training_and_answering(tmp_path, capsys):
    rows = [{"prompt": f"What is {i} plus {i}?", "completion": f"{i} plus {i} is {2 * i}."} for i in range(6)]
    src = write_jsonl(tmp_path / "gsm.jsonl", rows)
    task = finetune.main(["--input", src, "--val_examples", "0", "--output_dir", str(tmp_path / "a")])
    assert task["glued"] == 6
    assert (f"  6 examples with nothing between prompt and completion, e.g. {src}:1: 'What is 0 plus 0?' + "
            "'0 plus 0 is 0.': pass --separator '\\n'") in capsys.readouterr().out
    task = finetune.main(["--input", src, "--val_examples", "0", "--separator", "\\n", "--output_dir",
                          str(tmp_path / "b")])
    assert task["glued"] == 0 and task["templates"]["prompt_completion"] == {"separator": "\n"}
    tokens, targets, examples = dataloader.open_split(str(tmp_path / "b"), "train")
    s, a, e = examples[1].tolist()
    assert tokens[s:e].tolist() == enc("What is 1 plus 1?\n") + enc("1 plus 1 is 2.") + [EOT] and a - s == len(
        enc("What is 1 plus 1?\n"))
    assert (tasks.prompt_ids(dataloader.read_task(str(tmp_path / "b")), "What is 7 plus 7?")
            == enc("What is 7 plus 7?\n"))


def test_a_json_line_with_a_key_twice_is_rejected_with_its_place(tmp_path, capsys):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"prompt": "a", "prompt": "b", "completion": " c"}\n' + json.dumps(qa(1)) + "\n"
                    + '{"messages": [{"role": "user", "role": "assistant", "content": "x"}]}\n')
    task = finetune.main(["--input", str(path), "--val_examples", "0", "--output_dir", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert f"{path}:1: duplicate key: 'prompt' appears 2 times" in err
    assert f"{path}:3: duplicate key: 'role' appears 2 times" in err
    assert task["dropped"] == {"duplicate key": 2} and task["splits"]["train"]["examples"] == 1
