"""
The GPT-2 tokenizer, shared by every script in this repo, working with no network.

tiktoken.get_encoding("gpt2") downloads OpenAI's BPE files on first use. We ship the
same merge ranks in assets/gpt2.tiktoken (byte-identical to tiktoken's r50k_base file;
GPT-2 and r50k_base are the same table) and build the Encoding from it, checking the
file's sha256 first so a corrupted or swapped file fails loudly instead of silently
producing different token ids.
"""
import base64
import codecs
import functools
import hashlib
import os

import tiktoken

RANKS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "gpt2.tiktoken")
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
EOT = 50256  # <|endoftext|>: the document separator, and the only special token
VOCAB_SIZE = 50257
PADDED_VOCAB_SIZE = 50304  # the model's: 50257 rounded up to a multiple of 128, friendlier matrix shapes

# GPT-2's pre-tokenization regex as OpenAI released it. Newer tiktoken versions ship an
# equivalent but faster spelling of it; use theirs when it is there.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
try:
    from tiktoken_ext.openai_public import r50k_pat_str as GPT2_PATTERN  # noqa: F811
except ImportError:
    pass


def load_ranks(path=RANKS_FILE):
    """Read a tiktoken ranks file ('base64(token) rank' per line), verifying its hash."""
    try:
        with open(path, "rb") as f:
            contents = f.read()
    except OSError as e:
        raise SystemExit(f"error: cannot read the GPT-2 BPE ranks file {path}: {e}")
    digest = hashlib.sha256(contents).hexdigest()
    if digest != RANKS_SHA256:
        raise SystemExit(f"error: {path} has sha256 {digest}, expected {RANKS_SHA256}; "
                         "the file is corrupt or not OpenAI's GPT-2 ranks file")
    ranks = {}
    for line in contents.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=None)
def get_encoding():
    """The GPT-2 tiktoken Encoding; ids identical to tiktoken.get_encoding('gpt2')."""
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=load_ranks(),
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=VOCAB_SIZE,
    )


def encode(text):
    """Text -> token ids. Special-token text in the input is encoded as plain text."""
    return get_encoding().encode_ordinary(text)


def decode(ids):
    return get_encoding().decode(list(ids))


def write_stream(ids, out, stop=None, lstrip=False):
    """Write each token's text to out (a text file) as soon as it is whole, for ids as they come (a generator); stop
    before the token `stop`; lstrip: show no leading whitespace. Returns the ids written. A token is a sequence of
    bytes, and one character (an emoji, a Chinese character) may be split over two tokens: an incremental UTF-8
    decoder holds back an incomplete character until the next token completes it, so the stream never shows half."""
    enc, utf8, new = get_encoding(), codecs.getincrementaldecoder("utf-8")(errors="replace"), []
    for token in ids:
        if token == stop:
            break
        new.append(token)
        text = utf8.decode(enc.decode_single_token_bytes(token))
        if lstrip:
            text = text.lstrip()
            lstrip = not text
        out.write(text)
        out.flush()
    out.write(utf8.decode(b"", final=True))
    return new
