"""hellaswag.py: scoring against a plain reference, batching, ranks, and the download path."""
import functools
import http.server
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.multiprocessing as mp
from torch.nn import functional as F

import hellaswag
import tokenizer
from conftest import HELLASWAG_EXAMPLES, REPO, free_port, write_hellaswag
from compute import cpu
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(block_size=64, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)
EXAMPLES = HELLASWAG_EXAMPLES  # six hand-made examples in the official format (conftest.py)
# longer than a block_size-64 model's context: exercises the cropping
LONG = {"ctx": " ".join(["The committee met again on Tuesday to discuss the budget."] * 6) + " Then",
        "endings": ["they voted.", "everyone went home early to watch the football match on television.",
                    "the budget was approved by a narrow margin after a long debate.", "nothing."],
        "label": 2}


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**TINY)).eval()


@torch.no_grad()
def reference(model, examples):
    """build-nanogpt's protocol written out plainly: one example per forward, full logits."""
    sums, means, correct, correct_norm = [], [], 0, 0
    for ex in examples:
        ctx = tokenizer.encode(ex["ctx"])
        rows = [ctx + tokenizer.encode(" " + e) for e in ex["endings"]]
        T = max(len(r) for r in rows)
        tokens = torch.zeros(4, T, dtype=torch.long)
        mask = torch.zeros(4, T)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = torch.tensor(r)
            mask[i, len(ctx):len(r)] = 1
        logits, _ = model(tokens)
        losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1),
                                 reduction="none").view(4, -1)
        s = (losses * mask[:, 1:]).sum(1)
        m = s / mask[:, 1:].sum(1)
        sums.append(s)
        means.append(m)
        correct += int(s.argmin()) == ex["label"]
        correct_norm += int(m.argmin()) == ex["label"]
    return torch.stack(sums).double(), torch.stack(means).double(), correct, correct_norm


def test_scores_equal_plain_reference():
    model = tiny_model(1)
    ref_sums, ref_means, correct, correct_norm = reference(model, EXAMPLES)
    assert correct != correct_norm  # the examples tell the two scores apart
    rendered = [hellaswag.render_example(ex, model.config.block_size) for ex in EXAMPLES]
    sums, counts = hellaswag.score_endings(model, rendered, batch_size=1)
    torch.testing.assert_close(sums, ref_sums, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums / counts, ref_means, rtol=1e-5, atol=1e-5)
    r = hellaswag.evaluate(model, EXAMPLES, batch_size=4)
    assert r == {"num_total": len(EXAMPLES), "num_correct": correct, "num_correct_norm": correct_norm,
                 "acc": correct / len(EXAMPLES), "acc_norm": correct_norm / len(EXAMPLES)}


@pytest.mark.parametrize("batch_size", [2, 3, 100])
def test_batched_equals_unbatched(batch_size):
    model = tiny_model(1)
    examples = EXAMPLES + [LONG]
    rendered = [hellaswag.render_example(ex, model.config.block_size) for ex in examples]
    ctx, ends = rendered[-1]
    assert len(ctx) + max(map(len, ends)) == model.config.block_size  # LONG was cropped to fit
    one = hellaswag.score_endings(model, rendered, batch_size=1)
    many = hellaswag.score_endings(model, rendered, batch_size=batch_size)
    assert torch.equal(one[1], many[1])
    torch.testing.assert_close(one[0], many[0], rtol=1e-5, atol=1e-5)
    assert (hellaswag.evaluate(model, examples, batch_size=1)
            == hellaswag.evaluate(model, examples, batch_size=batch_size))


def test_cropping_keeps_endings_comparable():
    ctx, ends = hellaswag.render_example(LONG, 64)
    full_ctx = tokenizer.encode(LONG["ctx"])
    assert len(full_ctx) > 64 and ctx == full_ctx[-len(ctx):]  # the newest context tokens, shared by all 4
    assert ends == [tokenizer.encode(" " + e) for e in LONG["endings"]]  # endings whole
    assert len(ctx) + max(map(len, ends)) == 64
    # an ending longer than the whole context keeps its tail, after one context token
    ctx, ends = hellaswag.render_example({"ctx": "Hi", "endings": ["word " * 100, "a", "b", "c"], "label": 0}, 64)
    assert len(ctx) == 1 and len(ends[0]) == 63 and ends[1:] == [[257], [275], [269]]
    # an empty context starts from <|endoftext|>, so the first ending token is scored too
    ctx, ends = hellaswag.render_example({"ctx": "", "endings": ["a", "b", "c", "d"], "label": 0}, 64)
    assert ctx == [tokenizer.EOT]


def test_packed_mask_isolates_endings():
    """In the packed row, an ending sees the context and itself, never another ending."""
    rendered = [([10, 11], [[20], [30, 31], [40], [50, 51, 52]]), ([12], [[21], [32], [41], [53]])]
    tokens, positions, group, prev = hellaswag.pack(rendered)
    assert tokens[0].tolist() == [10, 11, 20, 30, 31, 40, 50, 51, 52]
    assert positions[0].tolist() == [0, 1, 2, 2, 3, 2, 2, 3, 4]
    assert group[1].tolist() == [-1, 0, 1, 2, 3, -2, -2, -2, -2]
    assert prev[0].tolist()[2:] == [1, 1, 3, 1, 1, 6, 7]
    mask = hellaswag.attention_mask(group)[0, 0]
    assert mask[4].tolist() == [True, True, False, True, True, False, False, False, False]  # 2nd token of ending 1
    assert mask[6].tolist() == [True, True, False, False, False, False, True, False, False]  # 1st of ending 3


def test_bf16_runs_and_stays_close():
    model = tiny_model()
    rendered = [hellaswag.render_example(ex, 64) for ex in EXAMPLES]
    fp32 = hellaswag.score_endings(model, rendered, dtype="fp32", batch_size=4)
    bf16 = hellaswag.score_endings(model, rendered, dtype="bf16", batch_size=4)
    torch.testing.assert_close(bf16[0] / bf16[1], fp32[0] / fp32[1], rtol=0.02, atol=0.05)
    assert hellaswag.evaluate(model, EXAMPLES, dtype="bf16")["num_total"] == len(EXAMPLES)


def _rank_worker(rank, world_size, port, out_dir):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world_size)
    try:
        r = hellaswag.evaluate(tiny_model(2), EXAMPLES + [LONG], batch_size=2, rank=rank, world_size=world_size)
    finally:
        torch.distributed.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(r, f)


@pytest.mark.xdist_group("multiprocess-2")
def test_two_ranks_equal_one(tmp_path):
    one = hellaswag.evaluate(tiny_model(2), EXAMPLES + [LONG], batch_size=2)
    mp.spawn(_rank_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):  # every rank returns the summed totals
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == one
    assert one["num_total"] == len(EXAMPLES) + 1


# --- the download path, against a local HTTP server ---------------------------


@pytest.fixture
def server(tmp_path):
    """An http.server on 127.0.0.1 serving tmp_path/www; yields (base_url, www dir, list of requested paths)."""
    www = tmp_path / "www"
    www.mkdir()
    requested = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            requested.append(self.path)
            if self.path.endswith("truncated.jsonl"):  # promise more bytes than we send, then hang up
                self.send_response(200)
                self.send_header("Content-Length", "100000")
                self.end_headers()
                self.wfile.write(b'{"ctx": "x", ')
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(www)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/data/", www, requested
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_download_is_atomic_and_cached(server, tmp_path):
    base, www, requested = server
    write_hellaswag(www / "data", EXAMPLES)
    cache = tmp_path / "cache"
    examples = hellaswag.load_examples("val", data_dir=str(cache), base_url=base)
    assert examples == EXAMPLES
    assert sorted(os.listdir(cache)) == ["hellaswag_val.jsonl"]  # no temporary file left behind
    assert (cache / "hellaswag_val.jsonl").read_bytes() == (www / "data" / "hellaswag_val.jsonl").read_bytes()
    assert hellaswag.load_examples("val", data_dir=str(cache), base_url=base) == EXAMPLES
    assert requested == ["/data/hellaswag_val.jsonl"]  # the second load read the cache


def test_download_error_on_404(server, tmp_path):
    base, www, requested = server
    cache = tmp_path / "cache"
    with pytest.raises(hellaswag.HellaSwagError) as e:
        hellaswag.load_examples("train", data_dir=str(cache), base_url=base)
    msg = str(e.value)
    assert "404" in msg and base + "hellaswag_train.jsonl" in msg
    assert f"save it as {cache / 'hellaswag_train.jsonl'}" in msg  # where to put the file by hand
    assert os.listdir(cache) == []


def test_download_error_on_cut_connection(server, tmp_path):
    base, www, requested = server
    with pytest.raises(hellaswag.HellaSwagError, match="could not download"):
        hellaswag.download("truncated", data_dir=str(tmp_path / "cache"), base_url=base)
    assert os.listdir(tmp_path / "cache") == []


@pytest.mark.parametrize("bad, problem", [
    ({"ctx": "a", "endings": ["1", "2", "3"], "label": 0}, "'endings' list of 4 strings"),
    ({"ctx": "a", "endings": ["1", "2", "3", "4"], "label": 4}, "'label' 4"),
    ({"endings": ["1", "2", "3", "4"], "label": 0}, "no string 'ctx'"),
    ({"ctx": "a", "endings": ["1", "2", "3", "4"]}, "no 'label'"),
    ("not json", "line 3 is not JSON"),
])
def test_download_rejects_malformed_line(server, tmp_path, bad, problem):
    base, www, requested = server
    (www / "data").mkdir()
    with open(www / "data" / "hellaswag_val.jsonl", "w") as f:
        f.write(json.dumps(EXAMPLES[0]) + "\n" + json.dumps(EXAMPLES[1]) + "\n")
        f.write((bad if isinstance(bad, str) else json.dumps(bad)) + "\n")
    cache = tmp_path / "cache"
    with pytest.raises(hellaswag.HellaSwagError) as e:
        hellaswag.load_examples("val", data_dir=str(cache), base_url=base)
    assert problem in str(e.value) and "line 3" in str(e.value)
    assert os.listdir(cache) == []  # the bad file never reached the cache


def test_corrupt_cache_file_says_what_to_do(tmp_path):
    write_hellaswag(tmp_path, EXAMPLES[:2] + [{"ctx": 1}])
    with pytest.raises(hellaswag.HellaSwagError, match=r"line 3 .*delete .*hellaswag_val.jsonl"):
        hellaswag.load_examples("val", data_dir=str(tmp_path))


def test_cli_downloads_and_evaluates_a_checkpoint(server, tmp_path):
    """python hellaswag.py -m model_XXXXX.pt with HELLASWAG_URL pointing at the local server."""
    base, www, requested = server
    write_hellaswag(www / "data", EXAMPLES + [LONG])
    model = tiny_model(3)
    ckpt = tmp_path / "model_00010.pt"
    torch.save({"model": model.state_dict(), "config": TINY, "step": 10}, ckpt)
    expected = hellaswag.evaluate(model, EXAMPLES[:5], batch_size=1)
    env = dict(os.environ, HELLASWAG_URL=base, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = [sys.executable, os.path.join(REPO, "hellaswag.py"), "-m", str(ckpt), "--data_dir", str(tmp_path / "hs"),
           "--limit", "5", "--batch_size", "3", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"5 acc: {expected['acc']:.4f} acc_norm: {expected['acc_norm']:.4f}" in proc.stdout
    assert os.path.isfile(tmp_path / "hs" / "hellaswag_val.jsonl")
    assert "dtype: fp32 (--dtype fp32;" in proc.stdout  # fp32 unless asked: the published scores' protocol
    proc = subprocess.run(cmd + ["--dtype", "auto"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "dtype: " in proc.stdout and "warning" not in proc.stdout, proc.stderr
    auto = "bf16" if "dtype: bf16 (" in proc.stdout else "fp32"
    assert f"dtype: {auto} (" in proc.stdout and (auto == "fp32" or cpu.native_bf16())
    # bad input: one clear line, before any model is loaded
    proc = subprocess.run(cmd[:3] + [str(tmp_path / "missing.pt")], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: -m ")


def test_a_download_says_its_size_and_shows_progress_in_a_log(server, tmp_path, capsys, monkeypatch):
    from plumbing import progress
    monkeypatch.setattr(progress, "QUIET_S", 0)  # (a real download shows lines once it has run 10 s)
    base, www, requested = server
    write_hellaswag(www / "data", EXAMPLES)
    size = (www / "data" / "hellaswag_val.jsonl").stat().st_size
    hellaswag.download("val", data_dir=str(tmp_path / "cache"), base_url=base)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"downloading {base}hellaswag_val.jsonl ({size / 1e6:.1f} MB), once, into "
                      f"{tmp_path / 'cache' / 'hellaswag_val.jsonl'}")
    assert out[-1].startswith(f"hellaswag_val.jsonl: 100% ({size}/{size} bytes)")
