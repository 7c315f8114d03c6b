import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
import tokenizer

TEXT = ("Hello, I'm a language model, and you'll see it's 2024!\n\n  Ünïcödé — 日本語 🙂 <|endoftext|>"
        "\tdef f(x):\n        return x**2  # they've we're I'd\r\n" * 3)


def test_known_ids():
    assert tokenizer.encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    assert tokenizer.get_encoding().eot_token == tokenizer.EOT == 50256
    assert tokenizer.get_encoding().n_vocab == 50257
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


def test_same_ids_as_tiktoken_own_encoding(tmp_path, monkeypatch):
    # tiktoken's own r50k_base (the GPT-2 table) built by tiktoken's code from its cache, with no
    # network: the cache key is the sha1 of the URL it would download
    import tiktoken
    import tiktoken_ext.openai_public as openai_public
    url = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
    shutil.copy(tokenizer.RANKS_FILE, tmp_path / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    reference = tiktoken.Encoding(**openai_public.r50k_base())
    ours = tokenizer.get_encoding()
    assert ours.encode_ordinary(TEXT) == reference.encode_ordinary(TEXT)
    assert ours.encode(TEXT, allowed_special="all") == reference.encode(TEXT, allowed_special="all")
    with open(os.path.join(REPO, "train_gpt2.py")) as f:
        source = f.read()
    assert ours.encode_ordinary(source) == reference.encode_ordinary(source)


def test_hash_is_checked(tmp_path):
    bad = tmp_path / "gpt2.tiktoken"
    data = open(tokenizer.RANKS_FILE, "rb").read()
    bad.write_bytes(data.replace(b" 100\n", b" 101\n", 1))
    with pytest.raises(SystemExit, match="sha256"):
        tokenizer.load_ranks(str(bad))
    with pytest.raises(SystemExit, match="cannot read"):
        tokenizer.load_ranks(str(tmp_path / "missing.tiktoken"))


def test_works_with_network_disabled(tmp_path):
    # any attempt to open a socket fails loudly in this subprocess
    code = ("import socket\n"
            "def no_network(*a, **k): raise RuntimeError('network used')\n"
            "socket.socket = no_network; socket.create_connection = no_network; socket.getaddrinfo = no_network\n"
            "import tokenizer\n"
            "print(tokenizer.encode('Hello, world'))\n")
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / "empty-cache"))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[15496, 11, 995]"
