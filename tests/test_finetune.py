"""Tests for finetune.py: rendering and its templates (written out here from the documentation, not taken from
finetune.py), the target mask, bad input (one 'file:line' message each, counted, every good example kept), too-long
examples, the val choice, byte-identical output, the Hugging Face streaming path on a local folder, and the demo task.
(Scoring a model's answers is answer.py's: tests/test_answer.py.)

Run: pytest tests/test_finetune.py -q   (everything is made in tmp_path; no network)
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import dataloader  # noqa: E402
import finetune  # noqa: E402
import tasks  # noqa: E402
from tokenizer import EOT, decode, encode as enc  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
                "### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                   "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def target_runs(ids, targets):
    """The texts of the maximal runs of target tokens, in order."""
    runs, current = [], []
    for i, t in zip(ids, targets):
        if t:
            current.append(i)
        elif current:
            runs.append(decode(current))
            current = []
    return runs + ([decode(current)] if current else [])


def prepare(*args):
    """finetune.main in this process: errors come back as exceptions."""
    return finetune.main([str(a) for a in args])


def read_split(out_dir, split):
    tokens, targets, examples = dataloader.open_split(str(out_dir), split)
    return [(tokens[s:e].tolist(), targets[s:e].tolist(), a - s) for s, a, e in examples.tolist()]


def folder_bytes(out_dir):
    return {f: open(os.path.join(out_dir, f), "rb").read() for f in sorted(os.listdir(out_dir))}


# --- rendering --------------------------------------------------------------------------------

PAIRS = [("What is 2 + 2?", " 4"), ("x =", "42"), ("Translate: chat ->", " cat\n"),
         ("typed <|endoftext|> stays text:", " <|endoftext|> too"),
         ("caf\u00e9 \U0001F600", " na\u00efve \u65e5\u672c"), ("  spaces  ", "  around  ")]


@pytest.mark.parametrize("prompt,completion", PAIRS)
def test_prompt_completion_is_exactly_the_two_encodings_and_eot(prompt, completion):
    ids, targets, answer_start = tasks.render({"prompt": prompt, "completion": completion})
    assert ids == enc(prompt) + enc(completion) + [EOT]
    assert answer_start == len(enc(prompt))
    assert targets == [0] * len(enc(prompt)) + [1] * (len(enc(completion)) + 1)
    assert target_runs(ids, targets) == [completion + "<|endoftext|>"]
    assert ids.count(EOT) == 1   # the typed "<|endoftext|>" is ordinary text, never the EOT id


def test_the_mask_boundary_does_not_move_where_bpe_would_merge():
    """Encoded as one text, 'The answer is ' + '42' gives the token ' 42', half prompt and half answer: the
    pieces are encoded apart, so the answer's tokens are exactly its own."""
    assert enc("The answer is 42") != enc("The answer is ") + enc("42")
    ids, targets, _ = tasks.render({"prompt": "The answer is ", "completion": "42"})
    assert ids == enc("The answer is ") + enc("42") + [EOT]
    assert target_runs(ids, targets) == ["42<|endoftext|>"]


@pytest.mark.parametrize("given_input", [None, "", "  ", "the context"])
def test_alpaca_template_as_documented(given_input):
    example = {"instruction": "Name a colour.", "output": "Blue."}
    if given_input is not None:
        example["input"] = given_input
    ids, targets, answer_start = tasks.render(example)
    if given_input and given_input.strip():
        prompt = ALPACA_INPUT.format(instruction="Name a colour.", input=given_input)
    else:
        prompt = ALPACA_NO_INPUT.format(instruction="Name a colour.")
    assert ids == enc(prompt) + enc("Blue.") + [EOT]
    assert answer_start == len(enc(prompt))
    assert target_runs(ids, targets) == ["Blue.<|endoftext|>"]


def test_chat_template_as_documented_multi_turn_with_system():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]
    ids, targets, answer_start = tasks.render({"messages": messages})
    expected = (enc("System: Be brief.\n") + enc("User: Hi\n") + enc("Assistant:") + enc(" Hello.") + [EOT]
                + enc("\n") + enc("User: 2+2?\n") + enc("Assistant:"))
    assert ids == expected + enc(" 4") + [EOT]
    assert answer_start == len(expected)
    # the targets are exactly each assistant content and its EOT
    assert target_runs(ids, targets) == [" Hello.<|endoftext|>", " 4<|endoftext|>"]
    # no system turn: the first user turn starts the example
    ids, targets, _ = tasks.render({"messages": messages[1:3]})
    assert ids == enc("User: Hi\n") + enc("Assistant:") + enc(" Hello.") + [EOT]


def test_train_on_all_makes_every_token_but_the_first_a_target():
    for example in ({"prompt": "Q: why?", "completion": " because"},
                    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}):
        ids, targets, answer_start = tasks.render(example, train_on="all")
        assert ids == tasks.render(example)[0] and answer_start == tasks.render(example)[2]
        assert targets == [0] + [1] * (len(ids) - 1)


def test_prompt_ids_are_what_the_model_saw_before_its_answer():
    examples = {"prompt_completion": ({"prompt": "Q: 3+4?", "completion": " 7"}, "Q: 3+4?"),
                "alpaca": ({"instruction": "Say hi.", "output": "Hi."}, "Say hi."),
                "chat": ({"messages": [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "yo"}]},
                         "hey")}
    for fmt, (example, prompt) in examples.items():
        task = {"format": fmt, "formats": {fmt: 1}, "templates": tasks.TEMPLATES}
        ids, _, answer_start = tasks.render(example)
        assert tasks.prompt_ids(task, prompt) == ids[:answer_start]
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]
    ids, _, answer_start = tasks.render({"messages": chat + [{"role": "assistant", "content": "d"}]})
    task = {"format": "chat", "formats": {"chat": 1}, "templates": tasks.TEMPLATES}
    assert tasks.prompt_ids(task, chat) == ids[:answer_start]


# --- the folder --------------------------------------------------------------------------------

def qa_rows(n, start=0):
    return [{"prompt": f"Q{i}: what is {i} + 1?", "completion": f" {i + 1}"} for i in range(start, start + n)]


def test_folder_layout_and_counts(tmp_path, capsys):
    rows = qa_rows(30) + [{"instruction": "Say hi.", "output": "Hi."},
                          {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "task"
    task = prepare("--input", src, "--output_dir", out, "--val_examples", 5, "--answer_regex", r"(\d+)")
    on_disk = json.loads((out / "task.json").read_text())
    assert on_disk == task and task["kind"] == "task" and task["version"] == 1
    assert task["format"] == "mixed" and task["formats"] == {"alpaca": 1, "chat": 1, "prompt_completion": 30}
    assert task["templates"] == tasks.TEMPLATES and task["answer_regex"] == r"(\d+)"
    assert task["train_on"] == "completion" and task["max_len"] == 1024 and task["dropped"] == {}
    rendered = [tasks.render(r) for r in rows]
    got = read_split(out, "train") + read_split(out, "val")
    assert sorted(map(str, got)) == sorted(map(str, rendered))
    for split in finetune.SPLITS:
        tokens, targets, examples = dataloader.open_split(str(out), split)
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and targets.dtype == np.uint8
        assert examples.dtype == np.int64 and examples.shape[1] == 3 and len(tokens) == len(targets)
        assert examples[0, 0] == 0 and examples[-1, 2] == len(tokens) and (examples[1:, 0] == examples[:-1, 2]).all()
        s = task["splits"][split]
        assert (s["examples"], s["tokens"], s["targets"]) == (len(examples), len(tokens), int(targets.sum()))
        assert s["longest"] == int((examples[:, 2] - examples[:, 0]).max()) - 1
        for start, answer_start, end in examples.tolist():   # expected answer = decode(tokens[a:end-1])
            assert tokens[end - 1] == EOT and targets[start] == 0
    assert task["splits"]["val"]["examples"] == 5
    out_text = capsys.readouterr().out
    assert "train 27 examples" in out_text and "val   5 examples" in out_text and "% of tokens" in out_text


def test_val_choice_is_deterministic_whole_examples_in_input_order(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", qa_rows(50))
    order = {}
    for name, seed in (("a", 1337), ("b", 1337), ("c", 7)):
        prepare("--input", src, "--output_dir", tmp_path / name, "--seed", seed)
        val = [decode(ids) for ids, _, _ in read_split(tmp_path / name, "val")]
        train = [decode(ids) for ids, _, _ in read_split(tmp_path / name, "train")]
        everything = [decode(tasks.render(r)[0]) for r in qa_rows(50)]
        assert len(val) == 5   # default: 10%
        assert sorted(val + train, key=everything.index) == everything and not set(val) & set(train)
        assert val == sorted(val, key=everything.index) and train == sorted(train, key=everything.index)
        order[name] = val
    assert order["a"] == order["b"] and order["a"] != order["c"]
    assert order["a"] != [decode(tasks.render(r)[0]) for r in qa_rows(5)]   # not simply the first ones
    assert [finetune.default_val_examples(n) for n in (0, 1, 2, 9, 10, 25, 1999, 5000)] == [0, 0, 1, 1, 1, 2, 199, 200]


def test_val_examples_zero_and_val_input(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", qa_rows(8))
    task = prepare("--input", src, "--output_dir", tmp_path / "none", "--val_examples", 0)
    assert task["splits"]["val"] == {"examples": 0, "tokens": 0, "targets": 0, "longest": 0}
    tokens, targets, examples = dataloader.open_split(str(tmp_path / "none"), "val")
    assert len(tokens) == 0 and examples.shape == (0, 3)
    val = write_jsonl(tmp_path / "val.jsonl", qa_rows(3, start=100))
    prepare("--input", src, "--val_input", val, "--output_dir", tmp_path / "given")
    assert [r[0] for r in read_split(tmp_path / "given", "val")] == [tasks.render(r)[0] for r in qa_rows(3, 100)]
    assert [r[0] for r in read_split(tmp_path / "given", "train")] == [tasks.render(r)[0] for r in qa_rows(8)]
    with pytest.raises(SystemExit, match="leaves no train example"):
        prepare("--input", src, "--output_dir", tmp_path / "all", "--val_examples", 8)


def test_same_input_gives_byte_identical_output(tmp_path):
    rows = qa_rows(40) + [{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    prepare("--input", src, "--output_dir", tmp_path / "a")
    prepare("--input", src, "--output_dir", tmp_path / "b")
    first = folder_bytes(tmp_path / "a")
    assert first == folder_bytes(tmp_path / "b")
    assert sorted(first) == ["task.json"] + sorted(f"task_{s}_{p}.npy" for s in ("train", "val")
                                                   for p in ("examples", "targets", "tokens"))
    prepare("--input", src, "--output_dir", tmp_path / "a", "--overwrite")
    assert folder_bytes(tmp_path / "a") == first


def test_a_non_empty_output_folder_needs_overwrite(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", qa_rows(5))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not empty; pass --overwrite"):
        prepare("--input", src, "--output_dir", tmp_path / "out")
    prepare("--input", src, "--output_dir", tmp_path / "out", "--overwrite")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"   # only the task files are replaced
    assert (tmp_path / "out" / "task.json").exists()
    with pytest.raises(SystemExit, match="is a file"):
        prepare("--input", src, "--output_dir", tmp_path / "out" / "notes.txt")
    with pytest.raises(SystemExit, match=r"^error: cannot write to --output_dir .*notes.txt/sub: NotADirectoryError"):
        prepare("--input", src, "--output_dir", tmp_path / "out" / "notes.txt" / "sub")


# --- bad input ---------------------------------------------------------------------------------

GOOD = [{"prompt": "p1", "completion": " c1"}, {"instruction": "i2", "input": "", "output": "o2"},
        {"messages": [{"role": "user", "content": "u3"}, {"role": "assistant", "content": "a3"}]},
        {"prompt": "p4", "completion": " c4", "id": 4}, {"instruction": "i5", "input": None, "output": "o5"}]
BAD = [  # (line, reason counted, a piece of its message)
    ('{"prompt": "x", "completion": ', "not JSON", "not JSON"),
    ('[1, 2]', "not an object", "a JSON array"),
    ('"text"', "not an object", "a JSON string"),
    ({"text": "hello"}, "unknown format", "'text'"),
    ({"prompt": "x", "messages": []}, "unknown format", "one of them"),
    ({"prompt": "x"}, "missing field", "'completion'"),
    ({"instruction": "x", "input": "y"}, "missing field", "'output'"),
    ({"prompt": "x", "completion": 3}, "wrong type", "'completion' is a number"),
    ({"instruction": "x", "input": ["y"], "output": "z"}, "wrong type", "'input' is a array"),
    ({"messages": "hi"}, "wrong type", "'messages'"),
    ({"messages": [{"role": "user", "content": "a"}, "b"]}, "wrong type", "messages[1] is a string"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "b"}]}, "missing field", "messages[0].'content'"),
    ({"prompt": "x", "completion": ""}, "empty answer", "'completion'"),
    ({"instruction": "x", "output": "  \n"}, "empty answer", "'output'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}, "empty answer",
     "messages[1].content"),
    ({"prompt": "", "completion": "y"}, "empty prompt", "'prompt'"),
    ({"instruction": " ", "output": "y"}, "empty prompt", "'instruction'"),
    ({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "b"}]}, "empty prompt",
     "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}, "roles out of order",
     "assistant, user"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                   {"role": "assistant", "content": "c"}]}, "roles out of order", "user, user, assistant"),
    ({"messages": [{"role": "user", "content": "a"}]}, "roles out of order", "ending with assistant"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "system", "content": "c"}, {"role": "user", "content": "d"},
                   {"role": "assistant", "content": "e"}]}, "roles out of order", "optional system turn"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}, "unknown role", "'bot'"),
]


def test_each_bad_line_gets_its_message_and_every_good_example_goes_through(tmp_path, capsys):
    lines = []
    for i, (bad, _, _) in enumerate(BAD):   # good and bad lines interleaved, and a blank line (skipped)
        lines += [GOOD[i % len(GOOD)], bad] + ([""] if i == 3 else [])
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    task = prepare("--input", src, "--output_dir", tmp_path / "out", "--val_examples", 0)
    err = capsys.readouterr().err.splitlines()
    messages = [line for line in err if line.startswith(src + ":")]
    assert len(messages) == len(BAD)
    bad_line_numbers = [n + 1 for n, row in enumerate(lines) if any(row is b for b, _, _ in BAD)]
    for message, (_, reason, piece), line_no in zip(messages, BAD, bad_line_numbers):
        assert message.startswith(f"{src}:{line_no}: {reason}: ") and piece in message, message
    expected_counts = {}
    for _, reason, _ in BAD:
        expected_counts[reason] = expected_counts.get(reason, 0) + 1
    assert task["dropped"] == expected_counts
    good = [row for row in lines if isinstance(row, dict) and any(row is g for g in GOOD)]
    assert [r[0] for r in read_split(tmp_path / "out", "train")] == [tasks.render(g)[0] for g in good]


def test_no_usable_example_is_a_one_line_error(tmp_path):
    src = write_jsonl(tmp_path / "bad.jsonl", ['{"text": "a"}', "not json", '{"prompt": "", "completion": "x"}'])
    r = subprocess.run([sys.executable, os.path.join(REPO, "finetune.py"), "--input", src, "--output_dir",
                        tmp_path / "out"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1
    assert r.stderr.splitlines()[-1] == f"error: --input {src}: no usable example (see the messages above)"
    assert len([line for line in r.stderr.splitlines() if line.startswith(src + ":")]) == 3
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,message", [
    (["--input", "{tmp}/nope.jsonl"], "error: --input {tmp}/nope.jsonl: no such file"),
    (["--input", "{tmp}/*.parquet"], "error: --input {tmp}/*.parquet: no such file"),
    (["--input", "{tmp}/notes.txt"], "error: {tmp}/notes.txt: unsupported file type"),
    (["--input", "{tmp}/ok.jsonl", "--columns", "question=prompt"], "error: --columns question=prompt:"),
    (["--input", "{tmp}/ok.jsonl", "--answer_regex", "####"], "error: --answer_regex '####' has no group"),
    (["--input", "{tmp}/ok.jsonl", "--answer_regex", "(("], "error: --answer_regex '((':"),
    (["--input", "{tmp}/ok.jsonl", "--max_len", "0"], "error: --max_len must be at least 1"),
    (["--input", "{tmp}/ok.jsonl"], "error: give --input and --output_dir"),
])
def test_bad_flags_are_one_line_errors(tmp_path, args, message):
    (tmp_path / "notes.txt").write_text("x")
    write_jsonl(tmp_path / "ok.jsonl", qa_rows(3))
    args = [a.format(tmp=tmp_path) for a in args] + (["--output_dir", str(tmp_path / "o")] if "--output_dir"
                                                      not in message and "give" not in message else [])
    with pytest.raises(SystemExit) as e:
        finetune.main(args)
    assert str(e.value.code).startswith(message.format(tmp=tmp_path)) and "\n" not in str(e.value.code)


# --- too long ----------------------------------------------------------------------------------

def test_too_long_cut_keeps_the_answer_and_eot_drop_drops(tmp_path, capsys):
    long_prompt = " ".join(f"word{i}" for i in range(40))
    rows = [{"prompt": long_prompt, "completion": " the answer"},                     # cut from the left
            {"prompt": "short", "completion": " ok"},                                 # fits
            {"prompt": "p", "completion": " " + " ".join(["long"] * 40)},             # its answer alone is too long
            {"messages": [{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "first"},
                          {"role": "user", "content": "again"}, {"role": "assistant", "content": "second"}]}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    task = prepare("--input", src, "--output_dir", tmp_path / "cut", "--max_len", 20, "--val_examples", 0)
    err = capsys.readouterr().err
    assert f"{src}:1: too long: " in err and "cut" in err and f"{src}:3: too long: " in err
    assert (task["cut"] == 1 and task["trimmed"] == 1 and task["dropped"] == {"too long": 1}
            and task["too_long"] == "cut")
    got = read_split(tmp_path / "cut", "train")
    assert len(got) == 3
    for (ids, targets, answer_start), row in zip(got, [rows[0], rows[1]]):
        full, full_targets, full_answer = tasks.render(row)
        assert len(ids) - 1 <= 20 and ids == full[-len(ids):]   # cut from the left only
        assert answer_start >= 1 and ids[answer_start:] == full[full_answer:]   # the last answer and EOT whole
        assert targets[0] == 0 and targets[1:] == full_targets[-len(ids) + 1:]
    assert len(got[0][0]) - 1 == 20 and got[1][0] == tasks.render(rows[1])[0]
    # the chat loses its whole first exchange (tests/test_finetune_edges.py says why), not tokens of it
    assert got[2] == tasks.render({"messages": rows[3]["messages"][2:]})

    task = prepare("--input", src, "--output_dir", tmp_path / "drop", "--max_len", 20, "--too_long", "drop",
                   "--val_examples", 0)
    err = capsys.readouterr().err
    assert task["cut"] == 0 and task["dropped"] == {"too long": 3} and "(--too_long drop)" in err
    assert [r[0] for r in read_split(tmp_path / "drop", "train")] == [tasks.render(rows[1])[0]]


def test_cut_at_the_limit():
    example = {"prompt": "a b c d e", "completion": " f"}
    ids, targets, answer_start = tasks.render(example)
    n = len(ids)

    def fit(max_len):
        return tasks.fit(example, tasks.TEMPLATES, "completion", max_len, "cut")

    assert fit(n - 1)[3] is None   # exactly fits
    cut_ids, cut_targets, cut_answer, note = fit(n - 2)
    assert cut_ids == ids[1:] and cut_answer == answer_start - 1 and note
    shortest = len(ids) - answer_start   # one prompt token + the answer and EOT: that many positions
    assert fit(shortest)[2] == 1
    with pytest.raises(tasks.BadExample, match="too long"):
        fit(shortest - 1)


# --- other sources -----------------------------------------------------------------------------

GSM_LIKE = [{"question": f"Tom has {i} apples and buys 2. How many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}",
             "source": "handmade"} for i in range(12)]


def test_parquet_and_globs_and_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = qa_rows(9)
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in ("prompt", "completion")}), tmp_path / "a.parquet",
                   row_group_size=4)
    write_jsonl(tmp_path / "b.jsonl", qa_rows(3, start=50))
    prepare("--input", str(tmp_path / "*"), "--output_dir", tmp_path / "out", "--val_examples", 0)
    assert [r[0] for r in read_split(tmp_path / "out", "train")] == \
        [tasks.render(r)[0] for r in qa_rows(9) + qa_rows(3, start=50)]
    # --columns maps a local file's keys too; only the mapped ones are kept
    src = write_jsonl(tmp_path / "gsm.jsonl", GSM_LIKE)
    prepare("--input", src, "--columns", "prompt=question,completion=answer", "--output_dir", tmp_path / "gsm",
            "--val_examples", 0)
    assert [r[0] for r in read_split(tmp_path / "gsm", "train")] == \
        [tasks.render({"prompt": r["question"], "completion": r["answer"]})[0] for r in GSM_LIKE]


def test_hugging_face_streaming_path_on_a_local_dataset_folder(tmp_path, monkeypatch):
    """A dataset name goes to datasets.load_dataset(..., streaming=True): here a local folder laid out like
    a Hub dataset (data/train-*.jsonl, data/test-*.jsonl), with --hf_split and --columns as for GSM8K."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ds = tmp_path / "gsm_like"
    (ds / "data").mkdir(parents=True)
    write_jsonl(ds / "data" / "train-00000-of-00001.jsonl", GSM_LIKE[:8])
    write_jsonl(ds / "data" / "test-00000-of-00001.jsonl",
                GSM_LIKE[8:] + [{"question": "q", "answer": "", "source": "x"}])
    flags = ["--columns", "prompt=question,completion=answer", "--answer_regex", "#### (.*)"]
    task = prepare("--input", ds, "--output_dir", tmp_path / "out", "--val_examples", 0, *flags)
    assert [r[0] for r in read_split(tmp_path / "out", "train")] == \
        [tasks.render({"prompt": r["question"], "completion": r["answer"]})[0] for r in GSM_LIKE[:8]]
    assert task["inputs"] == [str(ds)]
    task = prepare("--input", ds, "--hf_split", "test", "--output_dir", tmp_path / "test", "--val_examples", 0, *flags)
    assert task["splits"]["train"]["examples"] == 4 and task["dropped"] == {"empty answer": 1}
    with pytest.raises(SystemExit, match=r"none of our fields \(columns: question, answer, source\); see --columns"):
        prepare("--input", ds, "--output_dir", tmp_path / "z")   # GSM8K's columns without --columns
    with pytest.raises(SystemExit, match="no column 'query'"):
        prepare("--input", ds, "--columns", "prompt=query,completion=answer", "--output_dir", tmp_path / "x")
    with pytest.raises(SystemExit, match="cannot open it as a Hugging Face dataset"):
        prepare("--input", "no-such-user/no-such-dataset", "--output_dir", tmp_path / "y")


def test_the_old_eval_form_names_the_new_command(tmp_path):
    with pytest.raises(SystemExit) as e:
        finetune.main(["--eval", "--ckpt_path", "log/model_00300.pt", "--input", "val.jsonl"])
    assert str(e.value) == ("error: --eval is answer.py's now: "
                            "python answer.py --ckpt_path log/model_00300.pt --input val.jsonl")


# --- the demo task (finetune.py --demo itself, its wiring and training: tests/test_finetune_train.py) ---

def test_demo_task_follows_its_rule_and_val_is_unseen(tmp_path):
    train, val = finetune.make_demo_task(str(tmp_path / "d"), n_train=300, n_val=40, seed=5)
    rows = {name: [json.loads(line) for line in open(path)] for name, path in (("train", train), ("val", val))}
    assert len(rows["train"]) == 300 and len(rows["val"]) == 40
    for row in rows["train"] + rows["val"]:
        assert finetune.demo_answer(row["prompt"]) == row["completion"]
    assert not {r["prompt"] for r in rows["val"]} & {r["prompt"] for r in rows["train"]}
    again = finetune.make_demo_task(str(tmp_path / "e"), n_train=300, n_val=40, seed=5)
    assert [open(p, "rb").read() for p in again] == [open(p, "rb").read() for p in (train, val)]
