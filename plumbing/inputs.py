"""
What a run reads besides its arguments: the token ids of its shards (checked against the model's
vocabulary, the scans cached) and OpenAI's GPT-2 weights (from the Hugging Face hub or a folder).
"""
import os

import numpy as np

from plumbing import cache_dir, one_line, read_json, write_json

def check_token_ids(files, vocab_size, print0=None):
    """Every token id must have an embedding row: a larger one would crash training when its block comes up.
    Ids from 50257 to the padded vocabulary's end are never produced by GPT-2's tokenizer: a warning."""
    for f in files:
        top = max_token_id(f, np.load(f, mmap_mode="r"))  # remembered across runs: a 10B-token scan is slow
        if top >= vocab_size:
            raise SystemExit(f"error: shard {f} holds token id {top}, beyond the model's vocabulary of {vocab_size}")
        if top >= 50257 and print0:
            print0(f"warning: shard {f} holds token id {top}: a padding id no GPT-2 tokenizer produces")


def max_token_id(path, tokens):
    """The largest id in a memory-mapped shard, remembered in ~/.cache/gpt2-cpu/max_token_ids.json by the
    file's path, size and modification time: reading 10B tokens from a cold disk takes minutes."""
    st = os.stat(path)
    key = f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"
    cache_file = cache_dir("max_token_ids.json")
    cache = read_json(cache_file)
    if key not in cache:
        cache[key] = int(tokens.max())
        write_json(cache_file, cache)
    return cache[key]


def pretrained_files(name_or_path, hub_names):
    """(config.json, model.safetensors) of OpenAI's GPT-2 on the Hugging Face hub, or in a local folder."""
    names = ("config.json", "model.safetensors")
    if name_or_path in hub_names:
        from huggingface_hub import hf_hub_download  # honours HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT
        try:
            config_file, weights_file = (hf_hub_download("openai-community/" + name_or_path, f) for f in names)
        except Exception as e:
            raise SystemExit(f"error: could not fetch openai-community/{name_or_path} from the Hugging Face hub "
                             f"({one_line(e)}); download {' and '.join(names)} into a folder and pass its path")
    elif os.path.isdir(name_or_path):
        config_file, weights_file = (os.path.join(name_or_path, f) for f in names)
        for f in (config_file, weights_file):
            if not os.path.isfile(f):
                raise SystemExit(f"error: {f} not found: a pretrained directory needs config.json and model.safetensors")
    else:
        raise SystemExit(f"error: --init_from {name_or_path!r} is neither one of {', '.join(hub_names)} "
                         "nor a directory holding config.json and model.safetensors")
    return config_file, weights_file
