"""export_hf.py: our checkpoints in the Hugging Face GPT-2 layout, read by transformers with no network."""
import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import export_hf
import tokenizer
from conftest import REPO, make_shards, run_train, save_random_hf_gpt2, tiny_run_args
from model import GPT, GPTConfig, load_model
import answer
import sample
import tasks

os.environ["HF_HUB_OFFLINE"] = "1"  # everything below must work with no network

pytestmark = pytest.mark.usefixtures("one_thread")


def run_export(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "export_hf.py"), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))


def assert_same_as_transformers(ours, folder):
    """fp32 logits within 1e-5 on every real token id, and greedy generation token for token."""
    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained(folder).eval()
    ours = ours.eval()
    T = ours.config.block_size
    idx = torch.randint(0, tokenizer.VOCAB_SIZE, (2, T), generator=torch.Generator().manual_seed(0))
    idx[0, :3] = torch.tensor([0, tokenizer.VOCAB_SIZE - 2, tokenizer.EOT])  # the ends of the vocabulary too
    with torch.no_grad():
        theirs, (mine, _) = hf(idx).logits, ours(idx)
    assert theirs.shape[-1] == tokenizer.VOCAB_SIZE
    diff = (theirs - mine[..., :tokenizer.VOCAB_SIZE]).abs().max().item()
    print(f"max abs logit difference vs transformers: {diff:.2e}")
    assert diff <= 1e-5
    prompt = tokenizer.encode("The meaning of life is")
    ours_greedy = [int(t) for t in ours.generate(torch.tensor([prompt]), 12, top_k=1)]  # sample.py --top_k 1
    theirs_greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                pad_token_id=tokenizer.EOT)[0, len(prompt):].tolist()
    assert ours_greedy == theirs_greedy


def test_random_model_with_odd_shapes_and_padded_vocab(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=40, vocab_size=50304, n_layer=3, n_head=3, n_embd=48))
    with torch.no_grad():  # random biases and LayerNorms, so a mix-up of any of them shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    ckpt = tmp_path / "model_00007.pt"
    torch.save({"config": asdict(model.config), "model": model.state_dict(), "step": 7}, ckpt)
    proc = run_export(ckpt, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(export_hf.FILES)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["activation_function"], config["vocab_size"]) == \
        (["GPT2LMHeadModel"], "gpt2", "gelu_new", 50257)
    assert (config["n_positions"], config["n_embd"], config["n_layer"], config["n_head"]) == (40, 48, 3, 3)
    assert_same_as_transformers(model, str(tmp_path / "hf"))
    # GPT.from_pretrained reads it back: every weight equal, the padding rows of the vocabulary gone
    back = GPT.from_pretrained(str(tmp_path / "hf"))
    assert back.config == GPTConfig(block_size=40, vocab_size=50257, n_layer=3, n_head=3, n_embd=48)
    for name, w in back.state_dict().items():
        assert torch.equal(w, model.state_dict()[name][:50257] if "wte" in name or "lm_head" in name
                           else model.state_dict()[name]), name


def test_fine_tuned_checkpoint(tmp_path):
    save_random_hf_gpt2(tmp_path / "base")
    data = make_shards(tmp_path / "data")
    run_train(tiny_run_args(data, tmp_path / "log", "--init_from", tmp_path / "base", "--max_steps", "2",
                            "--seq_len", "32", "--eval_interval", "0"))
    ckpt = tmp_path / "log" / "model_00002.pt"
    proc = run_export(ckpt, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert "exported" in proc.stderr and proc.stdout == ""
    assert_same_as_transformers(load_model(str(ckpt))[0], str(tmp_path / "hf"))


def test_fine_tuned_on_a_task(tmp_path, capsys):
    """A checkpoint that carries its task: task.json goes into the folder, sample.py --init_from reads it, and
    transformers' greedy generate, stopping at <|endoftext|>, gives our answer to a rendered prompt token for token."""
    from conftest import save_task_checkpoint, task_of, varied_model
    from test_sample import eot_at_a_new_token
    from transformers import GPT2LMHeadModel
    model, task = varied_model(64), task_of("chat")
    ids = tasks.prompt_ids(task, [{"role": "user", "content": "What is two plus two?"}])
    ours = eot_at_a_new_token(model, ids, 6)
    assert answer.answers(model, [ids], 40)[0] == ours and len(ours) >= 6
    ckpt = save_task_checkpoint(tmp_path / "model.pt", model, task)
    proc = run_export(ckpt, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path / "hf")) == sorted([*export_hf.FILES, "task.json"])
    assert json.loads((tmp_path / "hf" / "task.json").read_text()) == task

    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    theirs = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=40, do_sample=False, eos_token_id=tokenizer.EOT,
                         pad_token_id=tokenizer.EOT)[0, len(ids):].tolist()
    assert theirs == ours + [tokenizer.EOT]  # the same answer, and they stopped where we did

    sample.main(["--init_from", str(tmp_path / "hf"), "--prompt", "What is two plus two?", "--top_k", "1",
                 "--max_new_tokens", "40", "--device", "cpu", "--dtype", "fp32"])
    out = capsys.readouterr()
    assert out.out == tokenizer.decode(ours).lstrip() + "\n" and "fine-tuned on a chat task" in out.err
    export_hf.main([str(tmp_path / "hf"), str(tmp_path / "again")])  # a re-export keeps it
    assert json.loads((tmp_path / "again" / "task.json").read_text()) == task


def test_round_trip_from_pretrained_is_the_identity(tmp_path):
    save_random_hf_gpt2(tmp_path / "a")
    a = GPT.from_pretrained(str(tmp_path / "a"))
    export_hf.export(a, str(tmp_path / "b"))
    b = GPT.from_pretrained(str(tmp_path / "b"))
    assert a.config == b.config
    assert all(torch.equal(w, b.state_dict()[k]) for k, w in a.state_dict().items())
    export_hf.export(b, str(tmp_path / "b"))  # an earlier export is replaced in place
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]  # and nothing temporary is left beside it


CORPUS = [
    "Hello, world! It's a test: we'll see what they've done, don't we?",
    "  leading spaces, trailing spaces   \n\n\ttabs\tand\r\nwindows lines\n\n\n",
    "unicode: héllo wörld, Ελληνικά, русский, "
    "中文字符, 日本語のテキスト, 한국어, עברית, العربية",
    "emoji 🤖🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, math ∑∫√∞ ≠ ≤, symbols ©®™ ½",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # code\n\nclass A(B):\n    pass\n",
    "numbers 1234567890 3.14159 1e-8 0x1F, dates 2026-11-23, ids a1b2c3",
    "<|endoftext|>a document<|endoftext|>another one <|endoftext|>",
    "   ", "", "a", "\n", "           many          spaces          ",
]


@pytest.mark.parametrize("use_fast", [False, True], ids=["slow", "fast"])
def test_tokenizer_equals_tiktoken(tmp_path, use_fast):
    from transformers import AutoTokenizer
    export_hf.export(GPT(GPTConfig(block_size=32, n_layer=1, n_head=1, n_embd=8)), str(tmp_path / "hf"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), use_fast=use_fast)
    enc = tokenizer.get_encoding()
    source = open(os.path.join(REPO, "train_gpt2.py"), encoding="utf-8").read()
    for text in CORPUS + [source]:
        ours = enc.encode(text, allowed_special={"<|endoftext|>"})  # <|endoftext|> as the special token
        assert tok.encode(text) == ours, text
        assert tok.decode(ours) == text
    assert tok.eos_token_id == tok.bos_token_id == tokenizer.EOT and len(tok) == tokenizer.VOCAB_SIZE


def test_bad_input_is_one_line(tmp_path):
    proc = run_export(tmp_path / "missing.pt", tmp_path / "out")
    assert proc.returncode == 1 and proc.stderr.strip() == f"error: checkpoint {tmp_path / 'missing.pt'} not found"
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    proc = run_export(tmp_path / "bad.pt", tmp_path / "out")
    assert (proc.returncode == 1
            and proc.stderr.strip().startswith(f"error: cannot load checkpoint {tmp_path / 'bad.pt'}"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    model = GPT(GPTConfig(block_size=32, n_layer=1, n_head=1, n_embd=8))
    torch.save({"config": asdict(model.config), "model": model.state_dict()}, tmp_path / "ok.pt")
    proc = run_export(tmp_path / "ok.pt", tmp_path / "busy")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"error: {tmp_path / 'busy'} exists and holds other files (notes.txt, ...): "
                                   "choose another folder")
    assert os.listdir(tmp_path / "busy") == ["notes.txt"]
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]
