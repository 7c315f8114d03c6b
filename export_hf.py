"""
export_hf.py: one of our checkpoints -> a folder in the Hugging Face GPT-2 layout, tokenizer included,
that transformers, lm-eval and llama.cpp's converter read with no network.

    python export_hf.py log/model_19073.pt gpt2_ours/
    python export_hf.py log_lora/model_00300.pt my_adapter/ --adapter    # peft's layout (a LoRA run's adapters)
    python -c "from transformers import pipeline; print(pipeline('text-generation', 'gpt2_ours')('Hello,'))"
    lm_eval --model hf --model_args pretrained=gpt2_ours --tasks hellaswag
    python llama.cpp/convert_hf_to_gguf.py gpt2_ours

What goes into the folder:
  config.json             GPT2LMHeadModel's settings: our shapes, tanh GELU ("gelu_new"), no dropout
  model.safetensors       the weights under transformers' names; the four big matrices of each block
                          transposed, because GPT-2's "Conv1D" stores them (in, out) where nn.Linear
                          stores (out, in); the padding rows 50257..50303 of the vocabulary dropped
                          (no token id ever reaches them); lm_head left out: it is wte (tied weights)
  generation_config.json  <|endoftext|> as the start and end of text
  vocab.json, merges.txt  GPT-2's byte-level BPE, derived from our assets/gpt2.tiktoken (below)
  tokenizer_config.json, special_tokens_map.json
  task.json               only for a fine-tuned model: the task.json of the data it was fine-tuned on
                          (finetune.py), whose template renders a question as the prompt the model answers;
                          sample.py and answer.py read it (and transformers ignores it)
A LoRA checkpoint (train_gpt2.py --lora R) exports merged, W + (alpha/R) B A: a plain GPT-2 folder as above. With
--adapter, its adapters alone, in peft's layout (adapter_config.json, adapter_model.safetensors), which
peft.PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), folder) loads onto the base.
"""
import argparse
import json
import os
import shutil
import sys

import lora
from model import CONV1D_WEIGHTS, load_model
import tokenizer
from plumbing.common import ShowDefaults
from plumbing.checkpoints import load_checkpoint

FILES = ("config.json", "model.safetensors", "generation_config.json", "vocab.json", "merges.txt",
         "tokenizer_config.json", "special_tokens_map.json")
TASK_FILE = "task.json"  # written as well when the model is fine-tuned on a task
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # --adapter: peft's layout
EOT_TEXT = "<|endoftext|>"

# -----------------------------------------------------------------------------
# The model: our state dict under transformers' names and layout

def hf_config(config):
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
            "vocab_size": tokenizer.VOCAB_SIZE, "n_positions": config.block_size, "n_ctx": config.block_size,
            "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "scale_attn_weights": True, "tie_word_embeddings": True, "use_cache": True,
            "bos_token_id": tokenizer.EOT, "eos_token_id": tokenizer.EOT, "torch_dtype": "float32"}

def hf_weights(model):
    """{transformers name: tensor}. safetensors stores each tensor once and contiguous, so the tied
    lm_head (the same tensor as wte) is left out, as save_pretrained does: transformers re-ties it."""
    if model.config.vocab_size < tokenizer.VOCAB_SIZE:
        raise SystemExit(f"error: the model has only {model.config.vocab_size} token ids, "
                         f"GPT-2 needs {tokenizer.VOCAB_SIZE}")
    weights = {}
    for name, w in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        w = w.detach().float()
        if name.endswith(CONV1D_WEIGHTS):
            w = w.t()
        if name == "transformer.wte.weight":
            w = w[:tokenizer.VOCAB_SIZE]  # the padding rows: never a target, never an input
        weights[name] = w.contiguous()
    return weights

# -----------------------------------------------------------------------------
# The tokenizer: GPT-2's vocab.json and merges.txt, rebuilt from the BPE ranks we ship
#
# tiktoken stores each token as its bytes and its rank; GPT-2's original files store tokens as text,
# and the merges as pairs. Two things turn one into the other:
# 1. Bytes as printable characters. GPT-2 maps each of the 256 byte values to one visible unicode
#    character (bytes that are printable ASCII or Latin-1 stand for themselves; the others, like space
#    and control bytes, get the characters from U+0100 on, in order), so that a token is a string.
# 2. Merges in rank order. Token rank r (from 256 on) was made by merging two tokens of lower rank. To
#    find which two, run BPE on its bytes allowing only the merges ranked below r: it stops at exactly
#    the two parts that rank r joins.

def bytes_to_unicode():
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table

def split_by_lower_ranks(token, ranks):
    """The two parts BPE merged into token: BPE on its bytes with only the merges ranked below it."""
    parts, limit = [bytes([b]) for b in token], ranks[token]
    while len(parts) > 2:
        pairs = [(ranks.get(parts[i] + parts[i + 1], limit), i) for i in range(len(parts) - 1)]
        rank, i = min(pairs)
        if rank >= limit:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    assert len(parts) == 2, f"token {token!r} is not the merge of two lower-ranked tokens"
    return parts

def tokenizer_files(block_size):
    """{file name: text} of the GPT-2 tokenizer in transformers' layout."""
    ranks = tokenizer.load_ranks()  # sha256-checked
    as_text = bytes_to_unicode()
    def text(token):
        return "".join(as_text[b] for b in token)
    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab[EOT_TEXT] = tokenizer.EOT
    merges = [" ".join(map(text, split_by_lower_ranks(token, ranks)))
              for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]) if rank >= 256]
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}
    # <|endoftext|> registered as the special token it is; no clean-up of spaces around punctuation on
    # decode (transformers 4.x would otherwise change " ." into "."): decoding gives back the text
    eot_token = {"content": EOT_TEXT, "special": True, "normalized": False, "lstrip": False, "rstrip": False,
                 "single_word": False}
    tokenizer_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": block_size, "add_prefix_space": False,
                        "add_bos_token": False, "clean_up_tokenization_spaces": False, "errors": "replace", **special,
                        "added_tokens_decoder": {str(tokenizer.EOT): eot_token}}
    return {"vocab.json": json.dumps(vocab, ensure_ascii=False),
            "merges.txt": "#version: 0.2\n" + "\n".join(merges) + "\n",
            "tokenizer_config.json": json.dumps(tokenizer_config, indent=2),
            "special_tokens_map.json": json.dumps(special, indent=2)}

# -----------------------------------------------------------------------------
# Writing the folder: built under a temporary name, then renamed into place

def check_output_dir(out_dir):
    """An existing folder is replaced only if it holds nothing but an earlier export's files."""
    ours = {*FILES, TASK_FILE, *ADAPTER_FILES}
    if os.path.isdir(out_dir) and set(os.listdir(out_dir)) - ours:
        other = sorted(set(os.listdir(out_dir)) - ours)[0]
        raise SystemExit(f"error: {out_dir} exists and holds other files ({other}, ...): choose another folder")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise SystemExit(f"error: {out_dir} exists and is not a folder")

def export(model, out_dir, task=None):
    """Write the folder (with task.json if task, the dict a fine-tuned checkpoint carries); returns how many
    parameters it holds."""
    weights = hf_weights(model)
    texts = tokenizer_files(model.config.block_size)
    texts["config.json"] = json.dumps(hf_config(model.config), indent=2)
    texts["generation_config.json"] = json.dumps({"bos_token_id": tokenizer.EOT, "eos_token_id": tokenizer.EOT},
                                                 indent=2)
    if task is not None:
        texts[TASK_FILE] = json.dumps(task, indent=2)
    write_folder(out_dir, texts, "model.safetensors", weights)
    return sum(w.numel() for w in weights.values())

def export_adapter(model, out_dir, spec):
    """A LoRA checkpoint's adapters (model: its base with them, unmerged; spec: the checkpoint's 'lora') in peft's
    layout; returns how many parameters they hold."""
    config, tensors = lora.peft_files(model, spec["rank"], spec["alpha"], spec["targets"], spec["base"]["name"])
    write_folder(out_dir, {"adapter_config.json": json.dumps(config, indent=2)}, "adapter_model.safetensors", tensors)
    return sum(t.numel() for t in tensors.values())

def write_folder(out_dir, texts, weights_name, weights):
    """The files ({name: text}, and the tensors as weights_name) in a temporary folder, renamed into place."""
    from safetensors.torch import save_file
    check_output_dir(out_dir)
    out_dir = os.path.abspath(out_dir)
    tmp = f"{out_dir}.tmp{os.getpid()}"
    os.makedirs(tmp)
    try:
        save_file(weights, os.path.join(tmp, weights_name), metadata={"format": "pt"})
        for name, text in texts.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        if os.path.isdir(out_dir):  # an earlier export: out of the way first, removed once the new one is in
            os.replace(out_dir, tmp + ".old")
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp + ".old", ignore_errors=True)

def main(argv=None):
    p = argparse.ArgumentParser(formatter_class=ShowDefaults,  # --help shows every default
                                description="Export a GPT-2 checkpoint of ours to the Hugging Face layout.")
    p.add_argument("checkpoint", help="one of our checkpoints (log/model_XXXXX.pt); also a Hugging Face-layout "
                                      "folder or gpt2..gpt2-xl, which it re-exports")
    p.add_argument("output_dir", help="the folder to write (replaced if it holds only an earlier export)")
    p.add_argument("--adapter", action="store_true", help="a LoRA checkpoint: its adapters alone, in peft's layout "
                   "(default: merged into the base, a plain GPT-2 folder)")
    args = p.parse_args(argv)
    if not os.path.exists(args.checkpoint) and not args.checkpoint.startswith("gpt2"):
        raise SystemExit(f"error: checkpoint {args.checkpoint} not found")
    check_output_dir(args.output_dir)  # before loading anything
    spec = load_checkpoint(args.checkpoint).get("lora") if args.adapter and os.path.exists(args.checkpoint) else None
    if args.adapter and not spec:
        raise SystemExit(f"error: --adapter: {args.checkpoint} is not a LoRA checkpoint (train_gpt2.py --lora R)")
    # checksums verified, one error line if unreadable
    model, task = load_model(args.checkpoint, merge=not args.adapter)
    n = export_adapter(model, args.output_dir, spec) if args.adapter else export(model, args.output_dir, task)
    files = ADAPTER_FILES if args.adapter else FILES + ((TASK_FILE,) if task else ())
    print(f"exported {args.checkpoint} ({n / 1e6:.2f}M parameters, {model.config.n_layer} layers) to "
          f"{args.output_dir}: {', '.join(files)}", file=sys.stderr)

if __name__ == "__main__":
    main()
