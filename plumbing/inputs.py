"""
What a run reads besides its arguments: its token shards (uint16 .npy files, memory-mapped), their
token ids (checked against the model's vocabulary, the scans cached) and OpenAI's GPT-2 weights
(from the Hugging Face hub or a folder).
"""
import glob
import os

import numpy as np

from plumbing.common import cache_dir, one_line, read_json, write_json

def find_shards(data_dir, split):  # fineweb.py names them edu_fineweb_{train,val}_NNNNNN.npy
    return sorted(f for f in glob.glob(os.path.join(data_dir, "*.npy")) if split in os.path.basename(f))

def open_shard(path):
    """Memory-map a shard: only the pages we read are loaded. Fails with one line on a bad file."""
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:
        raise SystemExit(f"error: cannot read shard {path}: {one_line(e)}")
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise SystemExit(f"error: shard {path} holds {tokens.dtype} of shape {tokens.shape}, "
                         "expected a 1-D uint16 array")
    if len(tokens) == 0:
        raise SystemExit(f"error: shard {path} is empty")
    return tokens

def check_enough_tokens(shards, files, T, what):
    # a short shard (the last one fineweb.py writes may be) just yields fewer blocks; none at all is an error
    if sum((len(s) - 1) // T for s in shards) == 0:
        raise SystemExit(f"error: the {what} shards ({', '.join(map(os.path.basename, files))}) hold fewer "
                         f"than the {T + 1} tokens one sequence of --seq_len {T} needs")

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
    if not isinstance(cache.get(key), int):  # (a cache file is input too: a damaged entry is worked out again)
        cache[key] = int(tokens.max()) if len(tokens) else -1  # (an empty split holds no id at all)
        write_json(cache_file, cache)
    return cache[key]

# model.safetensors of each, as the hub lists them: a download says its size before it starts
HUB_SIZES = {"gpt2": "548 MB", "gpt2-medium": "1.52 GB", "gpt2-large": "3.25 GB", "gpt2-xl": "6.43 GB"}

def pretrained_files(name_or_path, hub_names):
    """(config.json, model.safetensors) of OpenAI's GPT-2 on the Hugging Face hub, or in a local folder. A download
    (not in the hub's cache yet) is announced with its size first; huggingface_hub shows its progress."""
    names = ("config.json", "model.safetensors")
    if name_or_path in hub_names:
        # honours HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
        if not isinstance(try_to_load_from_cache("openai-community/" + name_or_path, names[1]), str):
            print(f"downloading openai-community/{name_or_path}'s weights from the Hugging Face hub "
                  f"({HUB_SIZES.get(name_or_path, 'size unknown')}), once: then they are read from its cache",
                  flush=True)
        try:
            config_file, weights_file = (hf_hub_download("openai-community/" + name_or_path, f) for f in names)
        except Exception as e:
            raise SystemExit(f"error: could not fetch openai-community/{name_or_path} from the Hugging Face hub "
                             f"({one_line(e)}); download {' and '.join(names)} into a folder and pass its path")
    elif os.path.isdir(name_or_path):
        config_file, weights_file = (os.path.join(name_or_path, f) for f in names)
        for f in (config_file, weights_file):
            if not os.path.isfile(f):
                raise SystemExit(f"error: {f} not found: a pretrained directory needs config.json and "
                                 "model.safetensors")
    else:
        raise SystemExit(f"error: --init_from {name_or_path!r} is neither one of {', '.join(hub_names)} "
                         "nor a directory holding config.json and model.safetensors")
    return config_file, weights_file
