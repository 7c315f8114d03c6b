"""
GPT-2 itself: the model (pre-LayerNorm transformer, tanh GELU, learned positions, tied lm_head), its KV cache for
generation, and how a trained one is loaded: OpenAI's weights, a Hugging Face-layout folder, or one of our checkpoints
(a LoRA one merged into its base). A library: train_gpt2.py trains it; sample.py, answer.py, hellaswag.py and
export_hf.py run or write it; it knows nothing of ranks (parallel/ wraps or cuts it from outside).
"""
import argparse
import json
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

import dataloader
import lora
from compute import attention
from compute.fused_loss import lm_head_loss
from parallel import parts
from parallel.sizes import copy_weight
from plumbing import checkpoints, inputs
from plumbing.common import one_line
from plumbing.checkpoints import load_checkpoint
from tokenizer import VOCAB_SIZE

# -----------------------------------------------------------------------------
# The model: GPT-2 exactly (pre-LayerNorm transformer, tanh GELU, learned positions, tied lm_head)

@dataclass
class GPTConfig:
    block_size: int = 1024  # context length: the number of position embeddings
    vocab_size: int = 50257  # 50,000 BPE merges + 256 byte tokens + <|endoftext|>
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x, cache=None, layer=0, attn_mask=None, lengths=None):
        """cache: generation's KVCache (its keys and values of the tokens so far); attn_mask, lengths: see
        GPT.hidden."""
        B, T, C = *x.shape[:2], self.n_embd  # C: the width of this module's heads (--tp: this rank's share of them)
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size): heads become a batch dimension
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if lengths is not None:  # packed rows of examples
            return self.c_proj(packed_attention(q, k, v, lengths).reshape(B, T, C))
        if cache is None and attn_mask is None:  # causal from position 0 (training): the kernel measured fastest
            return self.c_proj(attention.causal(q, k, v).transpose(1, 2).reshape(B, T, C))  # (compute/attention.py)
        first = cache is None or cache.pos == 0
        k, v = cache.update(layer, k, v) if cache is not None else (k, v)
        # no mask: causal from position 0 (is_causal: no mask tensor is made), or one new query, which sees every key
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None and first)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        return self.c_proj(y)

# Packed rows (fine-tuning, finetune.py): several examples end to end in one row of T positions, and each must
# see only itself, as if it were alone. A block-diagonal causal mask does that, but PyTorch's CPU attention then
# computes every one of the T x T scores and masks most of them: for four 256-token examples in a row of 1024,
# slower than plain causal attention of the whole row, with a quarter of the work. So each example gets its own
# causal attention call on its own tokens: L x L scores for an example of L tokens, nothing across examples.

def packed_attention(q, k, v, lengths):
    """Causal attention inside each example: q, k, v (B, n_head, T, head_size); lengths (1-D) the examples' (and the
    rows' padding's) lengths in order, row after row, summing to B*T. Returns (B, T, n_head, head_size)."""
    B, nh, T, hs = q.shape
    sizes = lengths.tolist()
    # heads first, then the rows end to end: each example is one slice along dim 2 (split's backward is one cat);
    # 4-D, (1, n_head, L, head_size): PyTorch's CPU flash kernel takes those, 3-D goes the slower, bigger math path
    q, k, v = (t.transpose(0, 1).reshape(1, nh, B * T, hs).split(sizes, dim=2) for t in (q, k, v))
    y = torch.cat([F.scaled_dot_product_attention(*qkv, is_causal=True) for qkv in zip(q, k, v)], dim=2)
    return y.view(nh, B, T, hs).permute(1, 2, 0, 3)

def keep_packed_attention_eager():
    """Before torch.compile: its split depends on the data, so compiled code would recompile for each new set of
    lengths; torch.compile leaves it to run eagerly. (Not a decorator: torch.compiler.disable imports torch._dynamo,
    2 s of every process's start, which uncompiled runs, evaluations and sampling never need.)"""
    global packed_attention
    packed_attention = torch.compiler.disable(packed_attention)

class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x):
        return self.c_proj(tanh_gelu(self.c_fc(x)))

def tanh_gelu(x):
    """GPT-2's GELU, the tanh approximation 0.5 x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3). Compiled, it is
    written x * sigmoid(2z), the same function (tanh(z) = 2 sigmoid(2z) - 1): torch.compile's CPU code computes a
    sigmoid from one exp, twice as fast as its tanh (AMX Xeon: GELU's forward and backward were 7% of a GPT-2 step)."""
    if torch.compiler.is_compiling():
        return x * torch.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    return F.gelu(x, approximate="tanh")

class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, layer=0, attn_mask=None, lengths=None):
        # pre-LayerNorm: the residual stream itself is never normalized, which keeps gradients clean
        x = x + self.attn(self.ln_1(x), cache, layer, attn_mask, lengths)
        return x + self.mlp(self.ln_2(x))

# Generation (sample.py, answer.py) feeds one new token per forward: a KVCache keeps every layer's keys and values of
# the tokens before it, so they are not computed again. Without it, token t would run all t tokens before it through
# the model again, and a sample would cost the square of its length. The output is the same (tests/test_sample.py).

class KVCache:
    """The keys and values of the tokens seen so far, per layer, in slots 0..pos-1. A batch of prompts of different
    lengths (answer.py) is left-padded to one length: pads (B,) says how many padding slots start each row. Each row's
    positions then start at 0 at its first real token (GPT-2's positions are learned: a prompt at positions 5.. would be
    another input), and no query attends to padding."""

    def __init__(self, n_layer, max_len, pads=None):
        self.k, self.v, self.max_len, self.pads = [None] * n_layer, [None] * n_layer, max_len, pads
        self.pos = 0  # how many slots are filled

    def update(self, layer, k, v):
        if self.k[layer] is None:  # allocated on first use, in the dtype autocast gave us
            B, nh, _, hs = k.shape
            self.k[layer], self.v[layer] = k.new_zeros(B, nh, self.max_len, hs), v.new_zeros(B, nh, self.max_len, hs)
        T = k.size(2)
        self.k[layer][:, :, self.pos:self.pos + T] = k
        self.v[layer][:, :, self.pos:self.pos + T] = v
        return self.k[layer][:, :, :self.pos + T], self.v[layer][:, :, :self.pos + T]

    def keep(self, rows):
        """From now on only these batch rows (a 1-D index tensor): the others are done."""
        self.k, self.v = [k.index_select(0, rows) for k in self.k], [v.index_select(0, rows) for v in self.v]
        self.pads = self.pads[rows]

    def positions_and_mask(self, T, device):
        """The next T slots' positions, and their queries' mask over every key so far (True: may attend; None:
        causal)."""
        assert self.pos + T <= self.max_len, f"{self.pos + T} positions > the cache's {self.max_len}"
        slots = torch.arange(self.pos + T, device=device)
        new, keys = slots[self.pos:, None], slots[None, :]
        if self.pads is None:  # new queries see every cached key, and the new ones up to themselves
            return slots[self.pos:], keys <= new if self.pos > 0 and T > 1 else None
        pads = self.pads[:, None, None]
        # a padding query sees itself: a mask row with no key at all gives 0 in PyTorch's CPU attention but NaN in
        # some other kernels, and a NaN would spread to the real rows (weight 0 x NaN). Nobody reads padding's output
        mask = (keys <= new) & (keys >= pads) | (keys == new)
        return (slots[self.pos:] - pads[:, 0]).clamp(min=0), mask[:, None]

# The loss, F.cross_entropy(lm_head(x), targets), is computed without ever holding all the logits (the biggest tensor
# of a step: 824 MB for 4 x 1024 positions): compute/fused_loss.py takes a chunk of positions at a time.

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        self.recompute = False  # train_gpt2.py --recompute

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):
                # each block adds two projections to the residual stream; scale them so its
                # variance does not grow with depth (GPT-2 paper, section 2.3)
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def hidden(self, idx, positions=None, attn_mask=None, cache=None, lengths=None):
        """Token ids (B, T) -> hidden states after ln_f (B, T, n_embd); forward adds lm_head or the loss. A method of
        its own so hellaswag.py can run lm_head on only the positions it scores, in rows it packs with its own positions
        (B, T; default 0..T-1) and attn_mask (bool, True = may attend, broadcast to (B, n_head, T, keys); default
        causal); a KVCache gives both. lengths: rows packed with examples end to end (1-D, see packed_attention): each
        attends only within itself."""
        T = idx.size(1)
        if cache is not None:
            positions, attn_mask = cache.positions_and_mask(T, idx.device)
        elif positions is None:  # (given ones may outnumber block_size: a packed row of 4 endings can be longer)
            assert T <= self.config.block_size, f"sequence of {T} > block_size {self.config.block_size}"
            positions = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for layer, block in enumerate(self.transformer.h):
            if self.recompute and torch.is_grad_enabled():  # --recompute: keep only the block's input for backward,
                # which runs the block again to get the rest: one more forward, for a fraction of the activations
                x = torch.utils.checkpoint.checkpoint(block, x, cache, layer, attn_mask, lengths, use_reentrant=False)
            else:
                x = block(x, cache, layer, attn_mask, lengths)
        if cache is not None:
            cache.pos += T
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None, packed=None, cache=None):
        """Logits (targets None), or the loss. packed: a Packed batch (dataloader.py's task rows): positions restarting
        and attention staying inside each example, and only the targets' positions (packed.picked) through lm_head.
        cache: a KVCache (generation), which this call fills in; then the logits of the last position only."""
        if packed is not None:
            x = self.hidden(idx, packed.positions, lengths=packed.lengths).flatten(0, 1)[packed.picked]
            return None, lm_head_loss(x, self.lm_head.weight, targets.flatten()[packed.picked])
        x = self.hidden(idx, cache=cache)
        x = x[:, -1:] if cache is not None else x
        # training and validation need only the loss: the logits are never all materialized (see lm_head_loss)
        return (self.lm_head(x), None) if targets is None else (None, lm_head_loss(x, self.lm_head.weight, targets))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Yield (B,) tensors of sampled token ids, one per step, continuing idx (B, T): temperature 0 or top_k 1 is
        greedy. The prompt fills a KVCache once, then each step feeds only the new token, and only when the caller asks
        for one more (one that stops at <|endoftext|> costs no extra forward). Once the context is full there is nothing
        left to cache: each further step recomputes the last block_size tokens, so the output always equals a plain
        recompute."""
        block_size = self.config.block_size
        cache = KVCache(self.config.n_layer, block_size)
        logits, _ = self(idx[:, -block_size:], cache=cache)
        for step in range(max_new_tokens):
            if step > 0:
                logits, _ = self(next_id, cache=cache) if cache.pos < block_size else self(idx[:, -block_size:])
            logits = logits[:, -1, :VOCAB_SIZE].float()  # padded vocab ids are never sampled
            if temperature == 0 or top_k == 1:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                if top_k is not None:
                    probs, top_ids = torch.topk(probs, min(top_k, probs.size(-1)), dim=-1)
                    next_id = torch.gather(top_ids, -1, torch.multinomial(probs, 1, generator=generator))
                else:
                    next_id = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
            yield next_id.squeeze(1)

    @classmethod
    def from_pretrained(cls, name_or_path, build=None):
        """OpenAI's GPT-2 weights from the Hugging Face hub (gpt2, gpt2-medium, gpt2-large, gpt2-xl),
        or a local directory in the same layout (config.json + model.safetensors). build(config) makes the
        model they fill (--shard full: one built sharded); they are read one tensor at a time."""
        config_file, weights_file = inputs.pretrained_files(name_or_path, PRETRAINED_NAMES)
        with open(config_file) as f:
            hf = json.load(f)
        model = (build or cls)(GPTConfig(block_size=hf["n_positions"], vocab_size=hf["vocab_size"],
                                          n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"]))
        # (lm_head.weight is wte's, so it is named, and filled, once; LoRA's adapters are not OpenAI's)
        params = {k: p for k, p in model.named_parameters() if ".lora_" not in k}
        copy_pretrained_weights(weights_file, params, CONV1D_WEIGHTS)
        return model

    @classmethod
    def from_checkpoint(cls, ckpt, build=None):
        """The model in one of our checkpoints (see load_checkpoint); build(config) as in from_pretrained."""
        model = (build or cls)(GPTConfig(**ckpt["config"]))
        if ckpt["sharded_path"]:  # (a run with --lora on it: its adapters are not in the checkpoint)
            missing = set(model.state_dict()) - parts.load_sharded(ckpt["sharded_path"], model)
            if any(".lora_" not in k for k in missing):
                raise SystemExit(f"error: {ckpt['sharded_path']} holds no {min(missing)}: "
                                 "not a whole model's checkpoint")
        else:
            for k, p in model.named_parameters():
                if ".lora_" not in k:  # (a base for LoRA has no adapters yet; a part reads only its own tensors)
                    copy_weight(p, checkpoints.checked(ckpt, "model", k))
        return model

    def configure_optimizer(self, weight_decay, learning_rate, device_type):
        # decay the matrices (weights of Linear layers, embeddings); not biases and LayerNorm gains
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        def is_split(p):  # --tp's split weights (DTensors): fused AdamW takes them apart
            return hasattr(p, "placements")
        if 0 < sum(map(is_split, params)) < len(params):
            groups = [{**g, "params": [p for p in g["params"] if is_split(p) == kind]}
                      for g in groups for kind in (False, True)]
        # fused AdamW runs the whole update in one kernel; PyTorch has it for CPU since 2.4
        fused = device_type in ("cpu", "cuda", "xpu")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused), fused

PRETRAINED_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# OpenAI's checkpoints use a 'Conv1D' module: a Linear whose weight is stored transposed, (in, out)
CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")

def copy_pretrained_weights(weights_file, params, transposed):
    """Fill params ({name: parameter}, sharded or not) from a safetensors file in the Hugging Face layout,
    one tensor at a time; weights whose names end with one of `transposed` are stored (in, out): OpenAI's
    'Conv1D'. save_pretrained() writes 'transformer.h.0...', OpenAI's upload has no prefix; the attention
    'bias' buffers there are causal masks, not weights, so they are not read. Shapes are checked first."""
    from safetensors import safe_open
    try:
        with safe_open(weights_file, framework="pt") as f:
            theirs = {"transformer." + k.removeprefix("transformer."): k for k in f.keys()}
            # lm_head is wte (tied): a pipeline's last stage holds it as lm_head's
            if "transformer.wte.weight" in theirs:
                theirs.setdefault("lm_head.weight", theirs["transformer.wte.weight"])
            missing = [k for k in params if k not in theirs]
            if missing:
                raise SystemExit(f"error: {weights_file} lacks {len(missing)} GPT-2 tensors, e.g. {missing[0]}")
            for k, p in params.items():
                shape = f.get_slice(theirs[k]).get_shape()[::-1 if k.endswith(transposed) else 1]
                if tuple(shape) != tuple(p.shape):
                    raise SystemExit(f"error: {weights_file}: {k} has shape {tuple(shape)}, expected {tuple(p.shape)}")
            for k, p in params.items():
                w = f.get_tensor(theirs[k])
                copy_weight(p, w.t() if k.endswith(transposed) else w)
    except Exception as e:
        raise SystemExit(f"error: cannot read {weights_file}: {one_line(e)}")

# -----------------------------------------------------------------------------
# Loading a trained model (plumbing/checkpoints.py writes checkpoints safely and reads them back)

def load_model(name_or_path, build=None, merge=True):
    """(model, task): one of our checkpoints (.pt, or .dcp from a sharded run), or what GPT.from_pretrained reads
    (gpt2..gpt2-xl, a Hugging Face-layout folder). task: the task.json dict of the data a fine-tuned model learned
    (its checkpoint's, or the folder's task.json, which export_hf.py writes); None for a plain language model.
    build(config, init_weights=False) makes the model the weights fill (build_model's: sharded, in bf16, with a new
    run's adapters); default GPT. A LoRA checkpoint holds its adapters, not its base: the base is loaded again (built
    by build), checked to be the one they were trained on, and the adapters merged into it, W + (alpha/R) B A, a layer
    at a time: a plain GPT, as any base is (merge=False: its adapters left beside it, for export_hf.py --adapter)."""
    if os.path.isfile(name_or_path) or os.path.isfile(os.path.join(name_or_path, "meta.pt")):
        ckpt = load_checkpoint(name_or_path)
        if not ckpt.get("lora"):
            return GPT.from_checkpoint(ckpt, build), ckpt.get("task")
        spec, args = ckpt["lora"], argparse.Namespace(**ckpt["args"])
        def build_with_adapters(config, init_weights=False):
            return lora.add_adapters(GPT(config), spec["rank"], spec["alpha"], spec["targets"], init=False)
        build = build if merge else build_with_adapters
        torch.manual_seed(args.seed)  # (a random base is drawn again)
        base = (load_model(args.init_from, build)[0] if args.init_from != "scratch" else
                build(GPTConfig(**ckpt["config"]), init_weights=True) if build else GPT(GPTConfig(**ckpt["config"])))
        lora.check_base(lora.base_identity(args.init_from, base.config, args.seed, lora.base_files(
            args.init_from, PRETRAINED_NAMES)), spec["base"], f"{name_or_path}: its base --init_from {args.init_from}")
        saved = ckpt["model"] if not ckpt["sharded_path"] else parts.read_sharded(
            ckpt["sharded_path"], lora.adapter_shapes(base.config, spec["rank"], spec["targets"]))
        if merge:
            return lora.merge_saved(base, saved, spec["alpha"] / spec["rank"]), ckpt.get("task")
        for name, p in lora.adapters(base).items():
            copy_weight(p, saved[name])
        return base, ckpt.get("task")
    task = dataloader.read_task(name_or_path) if os.path.isdir(name_or_path) else None
    return GPT.from_pretrained(name_or_path, build), task
