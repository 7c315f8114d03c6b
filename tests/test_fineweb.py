"""Tests for fineweb.py: shard contents, the val rule, resume after kill -9 / Ctrl-C, the streaming
(Hugging Face datasets) path on a local parquet folder, bad input, and train_gpt2.py on the result.

Run: pytest tests/test_fineweb.py -q   (about half a minute; everything is made in tmp_path)
"""
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import fineweb  # noqa: E402
from tokenizer import EOT, encode  # noqa: E402

# Documents that poke at the edges: empty ones, whitespace at both ends (the tokenizer's regex looks
# ahead at whitespace), the literal text "<|endoftext|>" (must stay ordinary text), a lone surrogate
# (not valid UTF-8), non-ASCII, Windows line ends.
EDGE_DOCS = [
    "Hello world.",
    "",
    "  leading and trailing spaces   ",
    "a document that mentions <|endoftext|> in its text",
    "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001F600",
    "lone surrogate \ud800 here",
    "line one\r\nline two\r\n\r\n",
    "\n\n\n",
    "x",
]


def words_doc(rng, n_words):
    vocab = ["the", "of", "GPT", "token", "shard", "model", "learning", "data", "42", "1999", "is", "a",
             "cat", "sat", "on", "mat", "and", "then", "it's", "we'll", "naïve", "résumé", "😀", "--", "!"]
    out = []
    for _ in range(n_words):
        out.append(rng.choice(vocab))
        out.append(rng.choice([" ", " ", " ", "  ", "\n", ". ", ", ", "\n\n"]))
    return "".join(out)


def make_docs(n, seed=0, max_words=300):
    rng = random.Random(seed)
    return [words_doc(rng, rng.randint(1, max_words)) if i % 17 else "" for i in range(n)]


def write_jsonl(path, docs, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": len(d)}) + "\n")


def write_parquet(path, docs, **extra_columns):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": docs, **extra_columns}), path, row_group_size=7)


def expected_tokens(docs):
    out = []
    for d in docs:
        if d:
            out += [EOT] + encode(d)
    return np.array(out, dtype=np.uint16)


def shard_files(out_dir):
    """The shards in input order: by their index (val_000000 first), not alphabetically."""
    return sorted(glob.glob(os.path.join(out_dir, "*.npy")), key=lambda f: f[-10:])


def read_all(out_dir):
    return np.concatenate([np.load(f) for f in shard_files(out_dir)])


def run(*args):
    """fineweb.main in this process (quicker than a subprocess, and errors come back as exceptions)."""
    return fineweb.main([str(a) for a in args] + ["--workers", "2"])


def cli(*args, **kwargs):
    return subprocess.run([sys.executable, os.path.join(REPO, "fineweb.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, **kwargs)


def check_layout(out_dir, prefix, docs, shard_size, val_tokens):
    """Names, dtype, sizes, the whole-document val shard, and the exact token stream."""
    files = [os.path.basename(f) for f in shard_files(out_dir)]
    n = len(files)
    assert files == [f"{prefix}_val_000000.npy"] + [f"{prefix}_train_{i:06d}.npy" for i in range(1, n)]
    arrays = [np.load(f) for f in shard_files(out_dir)]
    for a in arrays:
        assert a.dtype == np.uint16 and a.ndim == 1
    assert all(len(a) == shard_size for a in arrays[1:-1]) and 0 < len(arrays[-1]) <= shard_size
    # val: whole documents, the fewest that reach val_tokens
    val = arrays[0]
    lengths = [1 + len(encode(d)) for d in docs if d]
    ends = np.cumsum(lengths)
    assert len(val) in set(ends.tolist()), "val must end at a document boundary"
    assert len(val) >= val_tokens and len(val) - lengths[list(ends).index(len(val))] < val_tokens
    assert val[0] == EOT and (len(arrays) == 1 or arrays[1][0] == EOT)
    np.testing.assert_array_equal(np.concatenate(arrays), expected_tokens(docs))


# --- contents --------------------------------------------------------------------------------

def test_local_txt_jsonl_parquet(tmp_path):
    docs = make_docs(120, seed=1)
    write_jsonl(tmp_path / "b.jsonl", EDGE_DOCS + docs[:40])
    write_jsonl(tmp_path / "c.jsonl", docs[40:80])
    write_parquet(tmp_path / "d.parquet", docs[80:])
    (tmp_path / "txt").mkdir()
    txt_docs = ["first text file\n", "second, with unicode \u00e9\n", ""]
    for i, d in enumerate(txt_docs):
        (tmp_path / "txt" / f"{i}.txt").write_bytes(d.encode())
    out = tmp_path / "out"
    manifest = run("--input", tmp_path / "txt", "--input", tmp_path / "b.jsonl", "--input", tmp_path / "c.jsonl",
                   "--input", tmp_path / "*.parquet", "--output_dir", out, "--shard_size", 1000,
                   "--val_tokens", 700, "--batch_chars", 500)
    all_docs = txt_docs + EDGE_DOCS + docs
    check_layout(out, "data", all_docs, 1000, 700)
    assert manifest["complete"]
    assert manifest["totals"]["docs"] == sum(1 for d in all_docs if d)
    assert not glob.glob(str(out / "*.tmp"))


def test_tokenizing_shows_its_progress_against_the_inputs_rows(tmp_path, monkeypatch, capsys):
    """Local files' rows are known before tokenizing (a .jsonl's lines, a .parquet's footer, a .txt is one):
    in a log (not a terminal) a line each tenth, with the total and an ETA; the last says 100% and the tokens."""
    from plumbing import progress
    monkeypatch.setattr(progress, "QUIET_S", 0)  # (a pass this short would print nothing)
    docs = make_docs(40, seed=3)
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", docs[:12])
    with open(tmp_path / "in" / "a.jsonl", "a") as f:  # a blank line, then a last line with no newline
        f.write("\n" + json.dumps({"text": docs[12]}))
    write_parquet(tmp_path / "in" / "b.parquet", docs[13:39])
    (tmp_path / "in" / "c.txt").write_text(docs[39] or "x")
    total = 14 + 26 + 1  # rows: the jsonl's 14 lines, the parquet's 26, the txt
    manifest = run("--input", tmp_path / "in", "--output_dir", tmp_path / "out", "--shard_size", 2000,
                   "--val_tokens", 500, "--batch_chars", 1)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tokenizing: ")]
    shown = [re.match(rf"tokenizing: (\d+)% \((\d+)/{total} documents, ([\d,]+) tokens, "
                      r"(\d+) shards\), \d+s, ETA \d+s$", ln) for ln in lines]
    assert all(shown) and len(shown) >= 5, lines
    percents = [int(m[1]) for m in shown]
    assert percents == sorted(set(percents)) and percents[-1] == 100 and int(shown[-1][2]) == total
    assert int(shown[-1][3].replace(",", "")) == manifest["totals"]["tokens"]


def test_tokenize_batch_matches_per_document_encoding():
    rng = random.Random(5)
    atoms = [" ", "  ", "\n", "\t", "\r\n", "a", " cat", "'s", "'ll", "123", "é", "日本", "😀", "!",
             "<|endoftext|>", "<|", "endoftext", "|>", "\u00a0", "\ud83d"]
    texts = ["".join(rng.choice(atoms) for _ in range(rng.randint(0, 25))) for _ in range(3000)]
    tokens, ends = fineweb.tokenize_batch(texts)
    assert tokens.dtype == np.uint16 and len(ends) == len(texts) and ends[-1] == len(tokens)
    np.testing.assert_array_equal(tokens, expected_tokens(texts))
    starts = np.concatenate([[0], ends[:-1]])
    for i in range(0, len(texts), 97):
        assert tokens[starts[i]:ends[i]].tolist() == ([EOT] + encode(texts[i]) if texts[i] else [])


def test_shards_do_not_depend_on_workers_or_batches(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", make_docs(300, seed=2))
    common = ["--input", tmp_path / "a.jsonl", "--shard_size", 3000, "--val_tokens", 1000]
    fineweb.main([str(a) for a in common] + ["--output_dir", str(tmp_path / "w1"),
                                             "--workers", "1", "--batch_chars", "50"])
    fineweb.main([str(a) for a in common] + ["--output_dir", str(tmp_path / "w2"),
                                             "--workers", "2", "--batch_chars", "3000"])
    a, b = shard_files(tmp_path / "w1"), shard_files(tmp_path / "w2")
    assert [os.path.basename(f) for f in a] == [os.path.basename(f) for f in b] and len(a) > 3
    for x, y in zip(a, b):
        assert open(x, "rb").read() == open(y, "rb").read()


def test_val_zero_and_val_larger_than_input(tmp_path, capsys):
    docs = make_docs(30, seed=3)
    write_jsonl(tmp_path / "a.jsonl", docs)
    run("--input", tmp_path / "a.jsonl", "--output_dir", tmp_path / "noval", "--shard_size", 500, "--val_tokens", 0)
    files = [os.path.basename(f) for f in shard_files(tmp_path / "noval")]
    assert files[0] == "data_train_000001.npy" and not any("val" in f for f in files)
    np.testing.assert_array_equal(read_all(tmp_path / "noval"), expected_tokens(docs))
    run("--input", tmp_path / "a.jsonl", "--output_dir", tmp_path / "allval", "--shard_size", 10**6)
    assert [os.path.basename(f) for f in shard_files(tmp_path / "allval")] == ["data_val_000000.npy"]
    assert "no train shard" in capsys.readouterr().err


# --- resume ----------------------------------------------------------------------------------

def test_resume_from_every_shard_is_byte_identical(tmp_path):
    """Cut a finished run back to k shards, as an interruption would leave it, and finish it again."""
    docs = make_docs(100, seed=4)
    write_jsonl(tmp_path / "a.jsonl", docs[:60])
    write_parquet(tmp_path / "b.parquet", docs[60:])
    out = tmp_path / "out"
    args = ["--input", tmp_path / "a.jsonl", "--input", tmp_path / "b.parquet", "--output_dir", out,
            "--shard_size", 4000, "--val_tokens", 900, "--batch_chars", 3000]
    run(*args)
    reference = {f: open(f, "rb").read() for f in shard_files(out)}
    manifest_path = out / "data_manifest.json"
    full = json.loads(manifest_path.read_text())
    assert any(s["end"][2] > 0 for s in full["shards"]), "want shards that end inside a document"
    for k in range(len(full["shards"])):
        m = dict(full, complete=False, shards=full["shards"][:k])
        del m["totals"]
        manifest_path.write_text(json.dumps(m))
        for s in full["shards"][k:]:
            os.remove(out / s["file"])
        run(*args)
        assert {f: open(f, "rb").read() for f in shard_files(out)} == reference
        assert json.loads(manifest_path.read_text())["totals"] == full["totals"]
    # a shard lost from a finished folder is noticed and made again
    os.remove(out / full["shards"][2]["file"])
    run(*args)
    assert {f: open(f, "rb").read() for f in shard_files(out)} == reference


def wait_for_shards(out_dir, prefix, n, proc, timeout=60):
    path = os.path.join(out_dir, f"{prefix}_manifest.json")
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        try:
            with open(path) as f:
                if len(json.load(f)["shards"]) >= n:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    raise AssertionError("no progress")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupt_then_rerun_is_byte_identical(tmp_path, sig):
    """A real interruption of the command line: kill -9 can land anywhere, also in the middle of
    writing a shard or the manifest."""
    for i in range(3):
        write_jsonl(tmp_path / f"part{i}.jsonl", make_docs(400, seed=10 + i, max_words=600))
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["--input", str(tmp_path / "part*.jsonl"), "--shard_size", "10000", "--val_tokens", "5000",
            "--batch_chars", "20000"]
    fineweb.main(args + ["--output_dir", str(ref)])
    n_shards = len(shard_files(ref))
    assert n_shards > 40
    # one worker: slower, so that most of the run is still ahead when the signal comes
    args += ["--workers", "1"]
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "fineweb.py"), *args, "--output_dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    wait_for_shards(out, "data", 2, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    manifest = json.loads((out / "data_manifest.json").read_text())
    assert not manifest["complete"] and len(manifest["shards"]) < n_shards
    for f in shard_files(out)[1:]:   # whatever has a final name is whole
        assert len(np.load(f)) == 10000

    again = cli(*args, "--output_dir", out)
    assert again.returncode == 0, again.stderr
    assert "resuming after" in again.stdout
    assert [os.path.basename(f) for f in shard_files(out)] == [os.path.basename(f) for f in shard_files(ref)]
    for a, b in zip(shard_files(out), shard_files(ref)):
        assert open(a, "rb").read() == open(b, "rb").read()
    assert not glob.glob(str(out / "*.tmp"))


def test_finished_folder_is_left_alone_unless_overwrite(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", make_docs(40, seed=6))
    out = tmp_path / "out"
    args = ["--input", tmp_path / "a.jsonl", "--output_dir", out, "--shard_size", 800, "--val_tokens", 300]
    run(*args)
    stamps = {f: os.stat(f).st_mtime_ns for f in shard_files(out)}
    r = cli(*args)
    assert r.returncode == 0 and "already complete" in r.stdout
    assert {f: os.stat(f).st_mtime_ns for f in shard_files(out)} == stamps
    # other settings: refused, nothing touched
    r = cli(*args[:-2], "--val_tokens", 100)
    assert r.returncode != 0 and r.stderr.strip().startswith("error:") and "val_tokens" in r.stderr
    assert {f: os.stat(f).st_mtime_ns for f in shard_files(out)} == stamps
    run(*args[:-2], "--val_tokens", 100, "--overwrite")
    check_layout(out, "data", [json.loads(l)["text"] for l in open(tmp_path / "a.jsonl")], 800, 100)
    # shards that this script did not make (say, from build-nanogpt's fineweb.py)
    os.remove(out / "data_manifest.json")
    r = cli(*args)
    assert r.returncode != 0 and "--overwrite" in r.stderr


# --- the Hugging Face streaming path -------------------------------------------------------

FINEWEB_EDU_README = """---
configs:
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
---
# a local stand-in for HuggingFaceFW/fineweb-edu: same config name, same columns
"""


def make_fineweb_edu_folder(root, docs, n_files=3):
    """A folder laid out like the FineWeb-Edu repository on the Hub (config sample-10BT), with its columns."""
    (root / "sample" / "10BT").mkdir(parents=True)
    (root / "README.md").write_text(FINEWEB_EDU_README)
    per = -(-len(docs) // n_files)
    for i in range(n_files):
        part = docs[i * per:(i + 1) * per]
        n = len(part)
        write_parquet(root / "sample" / "10BT" / f"{i:03d}_00000.parquet", part,
                      id=[f"<urn:uuid:{i}-{j}>" for j in range(n)], dump=["CC-MAIN-2024-10"] * n,
                      url=[f"https://example.com/{i}/{j}" for j in range(n)], file_path=["s3://x"] * n,
                      language=["en"] * n, language_score=[0.95] * n, token_count=[len(d) // 4 for d in part],
                      score=[3.1] * n, int_score=[3] * n)


def test_streaming_path_on_local_fineweb_edu_folder(tmp_path, monkeypatch):
    """--dataset with the default --name sample-10BT and --split train: exactly the load_dataset(...,
    streaming=True) call the Hub path makes, on a local folder instead of the Hub repository."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))    # no cache outside tmp_path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")              # the folder is local: nothing may go to the network
    docs = make_docs(90, seed=7) + [d for d in EDGE_DOCS if "\ud800" not in d]   # parquet holds valid UTF-8 only
    make_fineweb_edu_folder(tmp_path / "fineweb-edu", docs)
    out = tmp_path / "edu"
    args = ["--dataset", tmp_path / "fineweb-edu", "--output_dir", out, "--shard_size", 1500,
            "--val_tokens", 600, "--batch_chars", 2000]
    run(*args)
    check_layout(out, "edufineweb", docs, 1500, 600)
    manifest_path = out / "edufineweb_manifest.json"
    full = json.loads(manifest_path.read_text())
    assert full["units"] == 3
    reference = {f: open(f, "rb").read() for f in shard_files(out)}
    # resume in the middle of the second and third data file (the files before are skipped unread)
    for k in (len(full["shards"]) // 2, len(full["shards"]) - 1):
        m = dict(full, complete=False, shards=full["shards"][:k])
        manifest_path.write_text(json.dumps(m))
        for s in full["shards"][k:]:
            os.remove(out / s["file"])
        run(*args)
        assert {f: open(f, "rb").read() for f in shard_files(out)} == reference


@pytest.mark.parametrize("source", ["footers", "card"])
def test_streaming_progress_has_a_total(tmp_path, monkeypatch, capsys, source):
    """A stream does not know its length, but a parquet dataset's files say their rows in their footers (read
    without the data), and a dataset card's dataset_info may say them too (used where the footers cannot be read)."""
    from plumbing import progress
    monkeypatch.setattr(progress, "QUIET_S", 0)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = make_docs(60, seed=5)
    make_fineweb_edu_folder(tmp_path / "fineweb-edu", docs)
    if source == "card":
        card = ("dataset_info:\n- config_name: sample-10BT\n  splits:\n  - name: train\n    num_bytes: 1000\n"
                f"    num_examples: {len(docs)}\n---\n")
        (tmp_path / "fineweb-edu" / "README.md").write_text(FINEWEB_EDU_README.replace("---\n#", card + "#"))
        monkeypatch.setattr(fineweb, "parquet_rows", lambda *args: None)
    run("--dataset", tmp_path / "fineweb-edu", "--output_dir", tmp_path / "edu", "--shard_size", 1500,
        "--val_tokens", 600, "--batch_chars", 1)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tokenizing: ")]
    assert len(lines) >= 5 and all(f"/{len(docs)} documents, " in ln for ln in lines), lines
    assert lines[-1].startswith(f"tokenizing: 100% ({len(docs)}/{len(docs)} documents, ")


def test_streaming_missing_text_column(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_fineweb_edu_folder(tmp_path / "fw", make_docs(10, seed=8), n_files=1)
    with pytest.raises(SystemExit, match="no 'content' column"):
        run("--dataset", tmp_path / "fw", "--text_field", "content", "--output_dir", tmp_path / "o")


# --- bad input -------------------------------------------------------------------------------

def error_of(*args):
    with pytest.raises(SystemExit) as e:
        run(*args)
    message = str(e.value.code)
    assert message.startswith("error:") and "\n" not in message, message
    return message


def test_bad_inputs_fail_with_one_clear_error_naming_the_file(tmp_path, monkeypatch):
    out = tmp_path / "out"   # a failed run that wrote no shard leaves nothing in the way of the next
    assert str(tmp_path / "nope" / "*.txt") in error_of("--input", tmp_path / "nope" / "*.txt", "--output_dir", out)
    assert "missing.jsonl" in error_of("--input", tmp_path / "missing.jsonl", "--output_dir", out)

    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    assert "broken.parquet" in error_of("--input", tmp_path / "broken.parquet", "--output_dir", out)

    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "nocol.parquet")
    msg = error_of("--input", tmp_path / "nocol.parquet", "--output_dir", out)
    assert "nocol.parquet" in msg and "'text'" in msg

    (tmp_path / "nofield.jsonl").write_text('{"content": "a"}\n')
    assert "nofield.jsonl" in error_of("--input", tmp_path / "nofield.jsonl", "--output_dir", out)
    # a field missing further down is found while reading, still naming the file and line
    (tmp_path / "late.jsonl").write_text('{"text": "a"}\n' * 5 + '{"body": "b"}\n')
    msg = error_of("--input", tmp_path / "late.jsonl", "--output_dir", out)
    assert "late.jsonl line 6" in msg
    (tmp_path / "array.json").write_text('[{"text": "a"}, {"text": "b"}]')   # JSON arrays: not read
    assert "array.json: unsupported file type" in error_of("--input", tmp_path / "array.json", "--output_dir", out)
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    assert "latin1.txt" in error_of("--input", tmp_path / "latin1.txt", "--output_dir", out)
    (tmp_path / "notes.md").write_text("hi")
    assert "notes.md" in error_of("--input", tmp_path / "notes.md", "--output_dir", out)
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    assert "no text" in error_of("--input", tmp_path / "empty.jsonl", "--output_dir", out)


def test_cli_error_is_one_line_and_help_works(tmp_path):
    r = cli("--input", tmp_path / "none*.jsonl", "--output_dir", tmp_path / "o")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error:")
    assert not (tmp_path / "o").exists()          # checked before anything was made
    assert cli("--help").returncode == 0


# --- the trainer reads what we write -------------------------------------------------------

def test_train_gpt2_trains_on_the_shards(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", make_docs(120, seed=9))
    data = tmp_path / "shards"
    r = cli("--input", tmp_path / "a.jsonl", "--output_dir", data, "--shard_size", 100000, "--val_tokens", 2000)
    assert r.returncode == 0, r.stderr
    assert os.path.exists(os.path.join(REPO, "train_gpt2.py")), "train_gpt2.py is missing"
    t = subprocess.run([sys.executable, os.path.join(REPO, "train_gpt2.py"), "--data_dir", str(data),
                        "--log_dir", str(tmp_path / "log"), "--n_layer", "2", "--n_head", "2", "--n_embd", "64",
                        "--block_size", "64", "--seq_len", "32", "--batch_size", "4", "--total_batch_size", "128",
                        "--max_steps", "5", "--eval_interval", "5", "--val_tokens", "256",
                        "--sample_interval", "0", "--hellaswag_interval", "0", "--dtype", "fp32"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert t.returncode == 0, t.stdout[-2000:] + t.stderr[-2000:]
    assert "validation loss" in t.stdout
