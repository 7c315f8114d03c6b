"""
GPT-2 and its trainer, in one file, for CPUs first (and GPUs too).

    python train_gpt2.py                              # FineWeb-Edu shards present: GPT-2 (124M); none: a 5-minute demo
    torchrun --nproc_per_node=2 train_gpt2.py         # data parallel on one machine
    mpirun -n 3 -ppn 1 python train_gpt2.py           # data parallel on three nodes (see README)

Read it top to bottom: the model, the data loader, the distributed setup, the learning
rate schedule, checkpoints, then main() which ties them into the training loop.
Importing this file starts nothing; the other scripts import GPT from it.
"""
import argparse
import ctypes
import glob
import hashlib
import inspect
import math
import os
import re
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

import tokenizer

# -----------------------------------------------------------------------------
# The model: GPT-2 exactly (pre-LayerNorm transformer, tanh GELU, learned positions, tied lm_head)


@dataclass
class GPTConfig:
    block_size: int = 1024  # context length: the number of position embeddings
    vocab_size: int = 50257  # 50,000 BPE merges + 256 byte tokens + <|endoftext|>
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


class KVCache:
    """Keys and values of the tokens seen so far, so generation feeds one new token per forward."""

    def __init__(self, n_layer):
        self.k = [None] * n_layer
        self.v = [None] * n_layer
        self.pos = 0  # how many positions are filled

    def update(self, layer, k, v, max_len):
        if self.k[layer] is None:  # allocate on first use, in the dtype autocast gave us
            B, nh, _, hs = k.shape
            self.k[layer] = k.new_zeros(B, nh, max_len, hs)
            self.v[layer] = v.new_zeros(B, nh, max_len, hs)
        T = k.size(2)
        self.k[layer][:, :, self.pos:self.pos + T] = k
        self.v[layer][:, :, self.pos:self.pos + T] = v
        return self.k[layer][:, :, :self.pos + T], self.v[layer][:, :, :self.pos + T]


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x, kv_cache=None, layer=0):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size): heads become a batch dimension
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if kv_cache is None or kv_cache.pos == 0:
            if kv_cache is not None:
                kv_cache.update(layer, k, v, self.max_len)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # new queries at positions pos..pos+T-1 see every cached key and the new ones up to themselves
            pos = kv_cache.pos
            k, v = kv_cache.update(layer, k, v, self.max_len)
            # (one new query, the usual case, sees them all: no mask needed)
            mask = torch.ones(T, pos + T, dtype=torch.bool, device=x.device).tril(diagonal=pos) if T > 1 else None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        return self.c_proj(y)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None, layer=0):
        # pre-LayerNorm: the residual stream itself is never normalized, which keeps gradients clean
        x = x + self.attn(self.ln_1(x), kv_cache, layer)
        x = x + self.mlp(self.ln_2(x))
        return x


# The loss: lm_head and cross-entropy fused, a chunk of positions at a time.
#
# The output layer is GPT-2's biggest matrix multiply and its logits are the biggest tensor of a
# training step: for B=4, T=1024 they are 4096 x 50304 numbers, 824 MB in fp32. The plain
# F.cross_entropy(lm_head(x), y) writes and reads them many times over (the matmul's bf16 output,
# its fp32 copy, log_softmax, the gradient of each, the gradient's bf16 copy). But the loss is the
# last thing forward computes, so its gradient with respect to the logits is known at once:
#     d mean_loss / d logits = (softmax(logits) - onehot(targets)) / N
# So we take LOSS_CHUNK positions at a time: their logits, their loss, and that gradient, which two
# matmuls turn straight into the gradients of x and of the weight; then the chunk's logits are freed.
# backward() only scales the saved gradients: by 1/N and by its incoming gradient (1/grad_accum_steps).
# The math is F.cross_entropy's; only the rounding differs (tests/test_perf.py measures by how much).
LOSS_CHUNK = 1024  # positions per chunk: their fp32 logits take 1024 x 50304 x 4 bytes = 206 MB


def lm_head_loss(x, weight, targets):
    """F.cross_entropy(x @ weight.T, targets) for x (..., C) and targets (...), chunk by chunk.
    Under autocast the matmuls run in its dtype, as lm_head's would; the softmax is always fp32."""
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    with torch.autocast(device_type, enabled=False):  # the dtypes below are chosen by hand
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return LMHeadLoss.apply(x, weight, targets, dtype)
        return chunked_loss(x, weight, targets, dtype, grads=False)[0] / x.size(0)  # validation: the loss alone


def chunked_loss(x, weight, targets, dtype, grads):
    """Summed cross-entropy and, if grads, its gradients with respect to x (N, C) and weight (V, C)."""
    N = x.size(0)
    w = weight.to(dtype)  # one cast of the (tied) weight per call, not one per chunk
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x) if grads else None
    grad_w = torch.zeros_like(weight) if grads else None
    for i in range(0, N, LOSS_CHUNK):
        xc, yc = x[i:i + LOSS_CHUNK].to(dtype), targets[i:i + LOSS_CHUNK, None]
        logits = (xc @ w.t()).float()
        lse = torch.logsumexp(logits, dim=1, keepdim=True)  # the log of softmax's denominator
        target_logits = logits.gather(1, yc)
        loss += (lse - target_logits).sum()  # -log softmax(logits)[target], summed over the chunk
        if grads:
            # softmax in place of the logits, then in the matmuls' dtype, as autocast's backward would use.
            # torch.compile fuses this with the logsumexp into one pass that writes only the bf16 result.
            g = logits.sub_(lse).exp_().to(dtype)
            # minus one-hot(target): the targets' probabilities are recomputed from their logits and
            # written over g's, so that they are rounded once, like all the others
            g.scatter_(1, yc, (target_logits - lse).exp_().sub_(1.0).to(dtype))
            grad_x[i:i + LOSS_CHUNK] = g @ w
            grad_w += g.t() @ xc
    return loss, grad_x, grad_w


class LMHeadLoss(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, targets, dtype):
        loss, grad_x, grad_w = chunked_loss(x, weight, targets, dtype, grads=True)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.N = x.size(0)
        return loss / ctx.N

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        scale = grad_loss / ctx.N  # the mean's 1/N, applied to these two gradients rather than to all the logits
        return grad_x * scale, grad_w * scale, None, None


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
        for block in self.transformer.h:
            block.attn.max_len = config.block_size
        self.apply(self._init_weights)

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

    def forward(self, idx, targets=None, kv_cache=None):
        B, T = idx.size()
        start = kv_cache.pos if kv_cache is not None else 0
        assert start + T <= self.config.block_size, f"sequence of {start + T} > block_size {self.config.block_size}"
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for layer, block in enumerate(self.transformer.h):
            x = block(x, kv_cache, layer)
        if kv_cache is not None:
            kv_cache.pos += T
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x), None
        # training and validation need only the loss: the logits are never all materialized (see below)
        return None, lm_head_loss(x, self.lm_head.weight, targets)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Yield (B,) tensors of sampled token ids, one per step, continuing idx (B, T).

        The prompt is run once to fill a KV cache, then each step feeds only the new token.
        Once the context is full there is nothing left to cache: every further step recomputes
        the last block_size tokens, so the output always equals a plain recompute."""
        block_size = self.config.block_size
        kv_cache = KVCache(self.config.n_layer)
        logits, _ = self(idx[:, -block_size:], kv_cache=kv_cache)
        for _ in range(max_new_tokens):
            logits = logits[:, -1, :tokenizer.VOCAB_SIZE].float()  # padded vocab ids are never sampled
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
            if kv_cache.pos < block_size:
                logits, _ = self(next_id, kv_cache=kv_cache)
            else:
                logits, _ = self(idx[:, -block_size:])

    @classmethod
    def from_pretrained(cls, name_or_path):
        """OpenAI's GPT-2 weights from the Hugging Face hub (gpt2, gpt2-medium, gpt2-large, gpt2-xl),
        or a local directory in the same layout (config.json + model.safetensors)."""
        import json
        from safetensors.torch import load_file
        if name_or_path in PRETRAINED_NAMES:
            from huggingface_hub import hf_hub_download  # honours HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT
            repo = "openai-community/" + name_or_path
            try:
                config_file = hf_hub_download(repo, "config.json")
                weights_file = hf_hub_download(repo, "model.safetensors")
            except Exception as e:
                raise SystemExit(f"error: could not fetch {repo} from the Hugging Face hub ({one_line(e)}); "
                                 "download config.json and model.safetensors into a directory and pass its path instead")
        elif os.path.isdir(name_or_path):
            config_file = os.path.join(name_or_path, "config.json")
            weights_file = os.path.join(name_or_path, "model.safetensors")
            for f in (config_file, weights_file):
                if not os.path.isfile(f):
                    raise SystemExit(f"error: {f} not found: a pretrained directory needs config.json and model.safetensors")
        else:
            raise SystemExit(f"error: --init_from {name_or_path!r} is neither one of {', '.join(PRETRAINED_NAMES)} "
                             "nor a directory holding config.json and model.safetensors")
        with open(config_file) as f:
            hf = json.load(f)
        config = GPTConfig(block_size=hf["n_positions"], vocab_size=hf["vocab_size"],
                           n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"])
        model = GPT(config)
        ours = model.state_dict()
        try:
            theirs = load_file(weights_file)
        except Exception as e:
            raise SystemExit(f"error: cannot read {weights_file}: {one_line(e)}")
        # save_pretrained() writes 'transformer.h.0...', OpenAI's upload has no prefix; the attention
        # 'bias' buffers are causal masks, and lm_head is tied to wte, so neither is loaded
        theirs = {k.removeprefix("transformer."): v for k, v in theirs.items()
                  if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"}
        # OpenAI's checkpoints use a 'Conv1D' module: a Linear whose weight is stored transposed
        transposed = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
        missing = [k for k in ours if k != "lm_head.weight" and k.removeprefix("transformer.") not in theirs]
        if missing:
            raise SystemExit(f"error: {weights_file} lacks {len(missing)} GPT-2 tensors, e.g. {missing[0]}")
        with torch.no_grad():
            for k in ours:
                if k == "lm_head.weight":
                    continue
                w = theirs[k.removeprefix("transformer.")]
                if k.endswith(transposed):
                    w = w.t()
                if w.shape != ours[k].shape:
                    raise SystemExit(f"error: {weights_file}: {k} has shape {tuple(w.shape)}, expected {tuple(ours[k].shape)}")
                ours[k].copy_(w)
        return model

    def configure_optimizer(self, weight_decay, learning_rate, device_type):
        # decay the matrices (weights of Linear layers, embeddings); not biases and LayerNorm gains
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # fused AdamW runs the whole update in one kernel; PyTorch has it for CPU since 2.4
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cpu", "cuda", "xpu")
        try:
            optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused)
        except RuntimeError:
            fused = False
            optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8)
        return optimizer, fused


def one_line(e):
    """An exception as one line: errors we report must fit on one."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


PRETRAINED_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
PADDED_VOCAB_SIZE = 50304  # 50257 rounded up to a multiple of 128: friendlier matrix shapes

# -----------------------------------------------------------------------------
# Data: uint16 token shards (np.save), memory-mapped, shuffled deterministically


def find_shards(data_dir, split):
    return sorted(f for f in glob.glob(os.path.join(data_dir, "*.npy")) if split in os.path.basename(f))


def open_shard(path):
    """Memory-map a shard: only the pages we read are loaded. Fails with one line on a bad file."""
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:
        raise SystemExit(f"error: cannot read shard {path}: {one_line(e)}")
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise SystemExit(f"error: shard {path} holds {tokens.dtype} of shape {tokens.shape}, expected a 1-D uint16 array")
    if len(tokens) == 0:
        raise SystemExit(f"error: shard {path} is empty")
    return tokens


def check_enough_tokens(shards, files, T, what):
    # a short shard (the last one fineweb.py writes may be) just yields fewer blocks; none at all is an error
    if sum((len(s) - 1) // T for s in shards) == 0:
        raise SystemExit(f"error: the {what} shards ({', '.join(map(os.path.basename, files))}) hold fewer "
                         f"than the {T + 1} tokens one sequence of --seq_len {T} needs")


class DataLoader:
    """Cuts each shard into blocks of T+1 tokens (inputs and targets overlap by one) and serves
    them in an order shuffled by the seed: shard order per epoch, block order per shard.

    All ranks walk the same stream of blocks; each step the next world*B blocks are taken and
    rank r keeps blocks r*B..(r+1)*B-1. So ranks never share data, and every block is used once
    per epoch whatever the world size (a step may span two shards or two epochs). The position
    in that stream is the loader's whole state: (epoch, shard index, block index)."""

    def __init__(self, data_dir, split, B, T, rank=0, world_size=1, seed=1337):
        self.B, self.T, self.rank, self.world_size, self.seed = B, T, rank, world_size, seed
        self.files = find_shards(data_dir, split)
        if not self.files:
            raise SystemExit(f"error: no shards with '{split}' in their name in --data_dir {data_dir}")
        self.shards = [open_shard(f) for f in self.files]
        check_enough_tokens(self.shards, self.files, T, split)
        self.epoch, self.shard, self.block = 0, 0, 0
        self._load_orders()

    def _load_orders(self):
        # permutations are a pure function of (seed, epoch, shard): nothing else to store or restore
        rng = np.random.default_rng([self.seed, self.epoch])
        self.shard_order = rng.permutation(len(self.shards))
        n_blocks = (len(self.shards[self.shard_order[self.shard]]) - 1) // self.T
        rng = np.random.default_rng([self.seed, self.epoch, int(self.shard_order[self.shard])])
        self.block_order = rng.permutation(n_blocks)

    def state_dict(self):
        return {"epoch": self.epoch, "shard": self.shard, "block": self.block, "seed": self.seed,
                "files": [os.path.basename(f) for f in self.files]}

    def load_state_dict(self, state):
        if state["files"] != [os.path.basename(f) for f in self.files] or state["seed"] != self.seed:
            raise SystemExit("error: the shards in --data_dir or the --seed differ from the checkpoint's; "
                             "resuming would not continue the same data order")
        self.epoch, self.shard, self.block = state["epoch"], state["shard"], state["block"]
        self._load_orders()

    def _next_block(self):
        """Advance the stream by one block; return (shard array, start offset)."""
        while self.block == len(self.block_order):  # while: a short shard may have no block at all
            self.block, self.shard = 0, self.shard + 1
            if self.shard == len(self.shards):
                self.shard, self.epoch = 0, self.epoch + 1
            self._load_orders()
        tokens = self.shards[self.shard_order[self.shard]]
        start = int(self.block_order[self.block]) * self.T
        self.block += 1
        return tokens, start

    def next_batch(self):
        rows = []
        for i in range(self.world_size * self.B):
            tokens, start = self._next_block()
            if i // self.B == self.rank:  # only this rank's blocks are read from disk
                rows.append(np.asarray(tokens[start:start + self.T + 1], dtype=np.int64))
        buf = torch.from_numpy(np.stack(rows))
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # inputs, and targets shifted by one


def val_batches(data_dir, T, val_tokens, B, rank, world_size):
    """The first val_tokens//T blocks of the val shards, in order, this rank's share (block i goes
    to rank i % world_size), in batches of at most B. Which tokens are scored does not depend on
    B or the world size, so val losses compare across runs."""
    shards = [open_shard(f) for f in find_shards(data_dir, "val")]
    blocks = [(s, i * T) for s in shards for i in range((len(s) - 1) // T)][:max(1, val_tokens // T)]
    mine = blocks[rank::world_size]
    for i in range(0, len(mine), B):
        buf = torch.from_numpy(np.stack([np.asarray(s[o:o + T + 1], dtype=np.int64) for s, o in mine[i:i + B]]))
        yield buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


# -----------------------------------------------------------------------------
# Distributed setup: the same script under torchrun, mpirun (MPICH, Intel MPI, Open MPI) or srun


def detect_launch(env=os.environ):
    """(rank, world_size, local_rank, local_world_size, launcher) from the launcher's variables.

    No flags needed: every launcher already tells each process who it is, each under its own
    names. The order matters where they overlap (mpirun inside a Slurm allocation sees both).
    A missing local size is taken as 1, i.e. "this job may span hosts", which only has the
    effect of insisting on an explicit MASTER_ADDR."""
    def read(name, default=None):
        value = env.get(name, default)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise SystemExit(f"error: launcher variable {name}={value!r} is not an integer") from None

    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (or set by hand)
        launcher = "torchrun"
        rank, world = read("RANK"), read("WORLD_SIZE")
        local_rank, local_world = read("LOCAL_RANK", 0), read("LOCAL_WORLD_SIZE", world)
    elif "OMPI_COMM_WORLD_RANK" in env:  # Open MPI's mpirun
        launcher = "openmpi"
        rank, world = read("OMPI_COMM_WORLD_RANK"), read("OMPI_COMM_WORLD_SIZE")
        local_rank, local_world = read("OMPI_COMM_WORLD_LOCAL_RANK", 0), read("OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    elif "PMI_RANK" in env and "PMI_SIZE" in env:  # MPICH and Intel MPI (their hydra launcher)
        launcher = "mpich"
        rank, world = read("PMI_RANK"), read("PMI_SIZE")
        local_rank, local_world = read("MPI_LOCALRANKID", 0), read("MPI_LOCALNRANKS", 1)
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        # Slurm, but only inside a job step (srun): under salloc or sbatch, every process started
        # without srun inherits the allocation's SLURM_PROCID=0 and would believe it is rank 0.
        launcher = "slurm"
        rank, world, local_rank = read("SLURM_PROCID"), read("SLURM_NTASKS", 1), read("SLURM_LOCALID", 0)
        # SLURM_STEP_TASKS_PER_NODE looks like "2(x3),1": the number of tasks on each node, in node order
        per_node = []
        for part in env.get("SLURM_STEP_TASKS_PER_NODE", str(world)).split(","):
            m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if not m:
                raise SystemExit(f"error: cannot parse SLURM_STEP_TASKS_PER_NODE={env['SLURM_STEP_TASKS_PER_NODE']!r}")
            per_node += [int(m.group(1))] * int(m.group(2) or 1)
        node = read("SLURM_NODEID", 0)
        local_world = per_node[node] if node < len(per_node) else 1
    else:
        return 0, 1, 0, 1, "single"
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise SystemExit(f"error: inconsistent {launcher} variables: rank {rank} of {world}, "
                         f"local rank {local_rank} of {local_world}")
    return rank, world, local_rank, local_world, launcher


def physical_cores(cpus=None):
    """Physical cores among the given logical CPUs (default: those this process may run on).
    Hyper-threads of one core share its vector units, so a matmul thread per hyper-thread
    only adds contention."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cpus = set(cpus)
    try:
        cores = set()
        with open("/proc/cpuinfo") as f:
            info = {}
            for line in f.read().splitlines() + [""]:
                if ":" in line:
                    key, value = (s.strip() for s in line.split(":", 1))
                    info[key] = value
                elif info:
                    cpu = int(info.get("processor", -1))
                    if cpu in cpus:
                        cores.add((info.get("physical id"), info.get("core id", cpu)))
                    info = {}
        return max(1, len(cores)) if cores else len(cpus)
    except (OSError, ValueError):
        return max(1, len(cpus))


def ranks_sharing_cpus(mine, host, everyone, local_world):
    """How many ranks of this node (mine among them) run on CPUs that overlap mine.

    everyone: (hostname, CPU list) of every rank. Capped by the launcher's count of ranks on this
    node, since hosts in containers or network namespaces can share a hostname."""
    return max(1, min(local_world, sum(h == host and not mine.isdisjoint(cpus) for h, cpus in everyone)))


def cpu_list(cpus):
    """{0,1,2,3,8} -> '0-3,8', the notation of taskset and /proc/self/status."""
    out, cpus = [], sorted(cpus)
    for i, c in enumerate(cpus):
        if i and c == cpus[i - 1] + 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)


def choose_backend(requested, device_type):
    """The process group backend: oneCCL when Intel's bindings are installed, else PyTorch's own."""
    if requested in ("ccl", "auto") and device_type in ("cpu", "xpu"):
        # importing Intel's oneCCL bindings is what registers the 'ccl' backend with torch.distributed
        try:
            import oneccl_bindings_for_pytorch  # noqa: F401
            return "ccl"
        except ModuleNotFoundError as e:
            if requested == "ccl" or e.name != "oneccl_bindings_for_pytorch":
                raise SystemExit(f"error: --backend ccl needs Intel's oneccl_bindings_for_pytorch ({e}); "
                                 "see requirements-intel.txt, or pass --backend gloo") from None
        except Exception as e:  # installed but broken (a missing libccl.so, a torch version mismatch)
            raise SystemExit(f"error: oneccl_bindings_for_pytorch is installed but fails to import "
                             f"({type(e).__name__}: {e}); fix it, or pass --backend gloo") from None
    if requested == "auto":
        return {"cuda": "nccl", "xpu": "xccl"}.get(device_type, "gloo")
    wants = {"ccl": ("cpu", "xpu"), "nccl": ("cuda",), "xccl": ("xpu",), "gloo": ("cpu", "cuda")}[requested]
    if device_type not in wants:
        raise SystemExit(f"error: --backend {requested} does not work with --device {device_type}")
    return requested


def find_ipex(mode, device_type):
    """Intel Extension for PyTorch when --ipex asks for it (on) or allows it (auto) and it can run, else None.

    Optional: Intel stopped developing IPEX after 2.8, and it runs only with the torch minor version
    it was built for; a mismatch is a clear error with --ipex on and a quiet skip with auto."""
    if mode == "off":
        return None
    if device_type not in ("cpu", "xpu"):
        if mode == "on":
            raise SystemExit(f"error: --ipex on needs --device cpu or xpu, not {device_type}")
        return None
    import importlib.metadata
    import importlib.util
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        if mode == "on":
            raise SystemExit("error: --ipex on, but intel_extension_for_pytorch is not installed "
                             "(pip install -r requirements-intel.txt, or pass --ipex off)")
        return None
    version = importlib.metadata.version("intel_extension_for_pytorch")
    if version.split(".")[:2] != torch.__version__.split(".")[:2]:
        if mode == "on":
            raise SystemExit(f"error: --ipex on, but intel_extension_for_pytorch {version} needs torch "
                             f"{'.'.join(version.split('.')[:2])}.*, not {torch.__version__} (see requirements-intel.txt)")
        return None
    import intel_extension_for_pytorch as ipex
    return ipex


# -----------------------------------------------------------------------------
# Learning rate: linear warmup, then cosine decay to min_lr (build-nanogpt's get_lr)


def get_lr(it, warmup_steps, max_steps, max_lr, min_lr):
    if it < warmup_steps:
        return max_lr * (it + 1) / warmup_steps
    if it > max_steps:
        return min_lr
    decay_ratio = (it - warmup_steps) / (max_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # goes from 1 to 0
    return min_lr + coeff * (max_lr - min_lr)


# -----------------------------------------------------------------------------
# torch.compile: the first step traces the model and compiles C++ kernels for it (~30 s for
# GPT-2 124M on 2 cores); the kernels are cached on disk, so a later run starts in a few seconds


def compile_cache_dir():
    """Where torch.compile keeps its kernels: $TORCHINDUCTOR_CACHE_DIR if set, else ~/.cache/gpt2-cpu/inductor
    (PyTorch's own default, /tmp/torchinductor_$USER, is emptied at every reboot)."""
    default = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "gpt2-cpu", "inductor")
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default)


# -----------------------------------------------------------------------------
# Memory: keep what was freed. A training step allocates and frees the same big tensors every time
# (activations, logits chunks, gradients). glibc's malloc serves every block over 32 MB with its own
# mmap and unmaps it when freed, so each step the kernel hands those pages back one 4 KB page fault
# at a time, zero-filled: ~550,000 faults, about a sixth of a 124M step on a 2-core VM. Telling malloc
# never to use mmap for big blocks, and never to give the top of its heap back, lets the second step
# reuse the first one's memory: no faults after warm-up (bench.py shows faults/step and the A/B).


def keep_freed_memory():
    """mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, -1) where the C library is glibc; True if set.
    Another allocator (LD_PRELOAD of tcmalloc, jemalloc; macOS) keeps its own policy."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it (musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's malloc.h
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))


# What forward keeps for backward: left to itself, torch.compile keeps every tensor backward will read
# (the MLP's input and its GELU output, a bf16 copy of each weight, ...). Given a budget below 1, its
# partitioner recomputes the cheapest of them during backward instead. Measured at GPT-2 124M, B=4,
# T=1024 with bench.py --ab: budget 1 peaks at 4.0 GiB; 0.9 at 3.2 GiB, 1.02x faster than 0.8 and
# 0.97-1.0x as fast as 1; 0.5 also recomputes attention and is 20% slower.
ACTIVATION_MEMORY_BUDGET = 0.9


def compile_model(model, memory_budget=None):
    import torch._functorch.config
    torch._functorch.config.activation_memory_budget = memory_budget or ACTIVATION_MEMORY_BUDGET
    return torch.compile(model)


def can_compile(device_type):
    """On CPU, torch.compile needs a C++ compiler; without one it would fail at the first step."""
    return device_type != "cpu" or any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++"))


# -----------------------------------------------------------------------------
# Checkpoints: written to a temporary file and renamed, so a crash never leaves half a file


def checkpoint_path(log_dir, step):
    return os.path.join(log_dir, f"model_{step:05d}.pt")


def list_checkpoints(log_dir):
    return sorted(glob.glob(os.path.join(log_dir, "model_[0-9]*.pt")))


def atomic_save(obj, path):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never a mix


def load_checkpoint(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise SystemExit(f"error: cannot load checkpoint {path}: {one_line(e)}")


def append_log(log_dir, line):
    with open(os.path.join(log_dir, "log.txt"), "a") as f:
        f.write(line + "\n")


# -----------------------------------------------------------------------------
# Command line


def build_parser(defaults=True):
    p = argparse.ArgumentParser(description="Train or fine-tune GPT-2 on CPUs (and GPUs).",
                                argument_default=None if defaults else argparse.SUPPRESS)
    d = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    a = p.add_argument
    a("--data_dir", default=d("edu_fineweb10B"), help="folder of uint16 .npy shards named *train* / *val*")
    a("--log_dir", default=d("log"), help="checkpoints and log.txt go here")
    a("--init_from", default=d("scratch"), help="scratch | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | "
      "a Hugging Face-layout directory | one of our checkpoints (.pt)")
    a("--n_layer", type=int, default=d(12))
    a("--n_head", type=int, default=d(12))
    a("--n_embd", type=int, default=d(768))
    a("--block_size", type=int, default=d(1024), help="context length of a scratch model")
    a("--batch_size", type=int, default=d(8), help="sequences per micro-step and rank")
    a("--seq_len", type=int, default=d(1024), help="tokens per training sequence (<= block_size)")
    a("--total_batch_size", type=int, default=d(524288), help="tokens per optimizer step (2**19, ~0.5M)")
    a("--max_steps", type=int, default=d(19073), help="10B tokens / 2**19 tokens per step")
    a("--warmup_steps", type=int, default=d(715))
    a("--max_lr", type=float, default=d(6e-4))
    a("--min_lr", type=float, default=d(6e-5))
    a("--weight_decay", type=float, default=d(0.1))
    a("--grad_clip", type=float, default=d(1.0))
    a("--eval_interval", type=int, default=d(250))
    a("--val_tokens", type=int, default=d(10485760), help="val loss is measured on this many tokens")
    a("--hellaswag_interval", type=int, default=d(250), help="0 = off")
    a("--hellaswag_dir", default=d(None), help="HellaSwag cache folder (default: hellaswag.py's)")
    a("--sample_interval", type=int, default=d(250), help="0 = off")
    a("--checkpoint_interval", type=int, default=d(250), help="0 = never save a checkpoint")
    a("--keep_checkpoints", type=int, default=d(5), help="keep the newest N checkpoints (0 = all)")
    a("--resume", nargs="?", const="latest", default=d(None),
      help="continue from the newest checkpoint in --log_dir, or from the given file")
    a("--overwrite", action="store_true", default=d(False), help="start afresh in a --log_dir that holds a run")
    a("--dtype", choices=["bf16", "fp32"], default=d("bf16"), help="autocast dtype of the forward pass")
    a("--compile", action=argparse.BooleanOptionalAction, default=d(True),
      help="torch.compile the training step (--no-compile: run it eagerly)")
    a("--device", default=d("auto"), help="auto | cpu | cuda | cuda:N | xpu")
    a("--backend", choices=["auto", "ccl", "gloo", "nccl", "xccl"], default=d("auto"),
      help="process group backend; auto = ccl if oneccl_bindings_for_pytorch imports, else gloo (CPU), nccl, xccl")
    a("--ipex", choices=["auto", "on", "off"], default=d("auto"),
      help="Intel Extension for PyTorch's ipex.optimize on CPU/XPU; auto = when installed")
    a("--dist_timeout", type=float, default=d(300), help="seconds a collective may wait for the other ranks")
    a("--threads", type=int, default=d(0), help="torch threads per rank (0 = physical cores / ranks per node)")
    a("--seed", type=int, default=d(1337))
    a("--demo", action="store_true", default=d(False), help="train a small GPT on a local demo corpus")
    return p


# The demo: a small GPT on the Python standard library's own source, which every machine with Python has.
DEMO_ARGS = dict(n_layer=4, n_head=4, n_embd=256, block_size=256, seq_len=256, batch_size=16,
                 total_batch_size=4096, max_steps=60, warmup_steps=10, max_lr=3e-3, min_lr=3e-4,
                 eval_interval=30, val_tokens=32768, sample_interval=60, hellaswag_interval=0,
                 checkpoint_interval=60, log_dir="log_demo")


def build_demo_shards(out_dir, max_tokens=8_000_000):
    """Tokenize the standard library's .py files into one val and one train shard (cached)."""
    done = os.path.join(out_dir, "demo_train_000001.npy")
    if os.path.exists(done):
        return
    os.makedirs(out_dir, exist_ok=True)
    stdlib = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True))
    files = [f for f in files if "site-packages" not in f and "test" not in os.path.relpath(f, stdlib)]
    docs = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            docs.append(f.read())
    enc = tokenizer.get_encoding()
    tokens, n = [], 0
    for ids in enc.encode_ordinary_batch(docs, num_threads=os.cpu_count() or 1):
        tokens.append([tokenizer.EOT] + ids)  # every document starts with <|endoftext|>
        n += len(ids) + 1
        if n >= max_tokens:
            break
    # whole documents only: every 20th goes to val, so no document is split between the two
    val = np.concatenate([t for i, t in enumerate(tokens) if i % 20 == 0]).astype(np.uint16)
    train = np.concatenate([t for i, t in enumerate(tokens) if i % 20 != 0]).astype(np.uint16)
    for name, arr in (("demo_val_000000.npy", val), ("demo_train_000001.npy", train)):
        tmp = os.path.join(out_dir, f"{name}.{os.getpid()}.tmp.npy")  # ranks on one host may build at once
        np.save(tmp, arr)
        os.replace(tmp, os.path.join(out_dir, name))


# -----------------------------------------------------------------------------
# Training


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    given = vars(build_parser(defaults=False).parse_args(argv))  # only the flags on the command line
    compile_cache_dir()  # now: building the optimizer already makes torch settle on a cache folder
    keep_freed_memory()  # before the first big tensor

    # --- distributed setup ------------------------------------------------------
    rank, world_size, local_rank, local_world, launcher = detect_launch()
    master = rank == 0

    def print0(*a, **k):
        if master:
            print(*a, **k, flush=True)

    # --- resume: the checkpoint's run arguments, overridden by flags given now ----
    log_dir = args.log_dir
    ckpt, ckpt_file = None, None
    if args.resume:
        ckpt_file = args.resume
        if ckpt_file == "latest":
            found = list_checkpoints(log_dir)
            if not found:
                raise SystemExit(f"error: --resume: no model_*.pt checkpoint in --log_dir {log_dir}")
            ckpt_file = found[-1]
        if not os.path.isfile(ckpt_file):
            raise SystemExit(f"error: --resume: checkpoint {ckpt_file} not found")
        ckpt = load_checkpoint(ckpt_file)  # every rank loads the same file
        saved = {**vars(args), **ckpt["args"]}  # a flag newer than the checkpoint keeps its default
        saved.update({k: v for k, v in given.items() if k in saved})
        saved.update(resume=args.resume, overwrite=False, log_dir=given.get("log_dir", saved["log_dir"]))
        args = argparse.Namespace(**saved)
        log_dir = args.log_dir

    # --- demo mode: no shards in the default data dir ----------------------------
    if not args.resume and (args.demo or (not find_shards(args.data_dir, "train") and "data_dir" not in given)):
        if not args.demo:
            print0(f"no shards in {args.data_dir}/ (run fineweb.py to make them): running the demo instead")
        for k, v in DEMO_ARGS.items():
            if k not in given:
                setattr(args, k, v)
        args.demo = True
        args.data_dir = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "gpt2-cpu", "demo")
        # every rank builds (or finds) the shards: the cache is per host, and a rank that skipped
        # this would race rank 0 to read files not yet written
        build_demo_shards(args.data_dir)
    log_dir = args.log_dir

    # --- validate everything cheap before anything expensive --------------------
    if not os.path.isdir(args.data_dir):
        raise SystemExit(f"error: --data_dir {args.data_dir} does not exist (make shards with fineweb.py)")
    if args.seq_len > args.block_size and args.init_from == "scratch":
        raise SystemExit(f"error: --seq_len {args.seq_len} is longer than --block_size {args.block_size}")
    tokens_per_micro = args.batch_size * args.seq_len * world_size
    if args.total_batch_size % tokens_per_micro:
        raise SystemExit(f"error: --total_batch_size {args.total_batch_size} is not divisible by --batch_size "
                         f"{args.batch_size} x --seq_len {args.seq_len} x world size {world_size} = {tokens_per_micro}")
    grad_accum_steps = args.total_batch_size // tokens_per_micro
    for flag in ("batch_size", "seq_len", "max_steps", "n_layer", "n_head", "n_embd"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"error: --{flag} must be positive")
    if args.n_embd % args.n_head:
        raise SystemExit(f"error: --n_embd {args.n_embd} is not divisible by --n_head {args.n_head}")
    train_loader = DataLoader(args.data_dir, "train", args.batch_size, args.seq_len, rank, world_size, args.seed)
    if args.eval_interval > 0:
        val_files = find_shards(args.data_dir, "val")
        if not val_files:
            raise SystemExit(f"error: no shards with 'val' in their name in --data_dir {args.data_dir} (or pass --eval_interval 0)")
        check_enough_tokens([open_shard(f) for f in val_files], val_files, args.seq_len, "val")
    has_run = os.path.exists(os.path.join(log_dir, "log.txt")) or list_checkpoints(log_dir)
    if has_run and not args.resume and not args.overwrite:
        raise SystemExit(f"error: --log_dir {log_dir} already holds a run; continue it with --resume, "
                         "choose another --log_dir, or pass --overwrite to replace it")

    # --- device, threads, process group -----------------------------------------
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "xpu" if hasattr(torch, "xpu") and torch.xpu.is_available() else "cpu"
    device = args.device
    device_type = device.split(":")[0]
    if device_type not in ("cpu", "cuda", "xpu", "mps"):
        raise SystemExit(f"error: --device {device}: expected auto, cpu, cuda[:N], xpu or mps")
    if device_type != "cpu" and not getattr(torch, device_type).is_available():
        raise SystemExit(f"error: --device {device}: this torch build or machine has no {device_type} device")
    if device_type == "cuda" and world_size > 1:
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if args.threads < 0:
        raise SystemExit(f"error: --threads {args.threads} must be 0 (automatic) or positive")
    ipex = find_ipex(args.ipex, device_type)  # imported now, applied once the model and optimizer exist
    if not args.dist_timeout > 0:
        raise SystemExit(f"error: --dist_timeout {args.dist_timeout} must be a positive number of seconds")
    if world_size > 1:
        import torch.distributed as dist
        # torchrun sets MASTER_ADDR/MASTER_PORT (where rank 0 listens for the others); MPI and Slurm
        # do not. On one host the answer is obvious; across hosts only the user knows rank 0's address,
        # and guessing wrong would leave every rank waiting for --dist_timeout.
        if "MASTER_ADDR" not in os.environ:
            if local_world < world_size:
                hint = {"mpich": "mpirun -genv MASTER_ADDR <rank 0's host> ...",
                        "openmpi": "export MASTER_ADDR=<rank 0's host>, then mpirun -x MASTER_ADDR ...",
                        "slurm": 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'}
                # every rank finds the same; rank 0 says it, the others leave quietly
                raise SystemExit(f"error: this {launcher} job spans several hosts but MASTER_ADDR is not set: export "
                                 f"MASTER_ADDR=<hostname or IP of rank 0's node> (optionally MASTER_PORT, default 29500) "
                                 f"for every rank, e.g. {hint.get(launcher, 'MASTER_ADDR=node0 MASTER_PORT=29500')}"
                                 if master else 1)
            os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ.setdefault("MASTER_PORT", "29500")
        backend = choose_backend(args.backend, device_type)
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:  # the timeout bounds both this rendezvous and every later collective
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=args.dist_timeout))
        except (RuntimeError, ValueError) as e:
            raise SystemExit(f"error: rank {rank} could not join the {world_size} ranks at {where} "
                             f"(backend {backend}, --dist_timeout {args.dist_timeout:g}s): {e}") from None
        print0(f"distributed: {launcher}, world size {world_size}, backend {backend}, master {where}")
    if device_type == "cpu":
        # One matmul thread per physical core, shared among the ranks on this node. A launcher that
        # pins each rank to its own cores (Intel MPI does by default; mpirun -bind-to core) already
        # did the dividing: ranks whose CPU sets don't overlap need not divide again.
        mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        sharing = local_world
        if not args.threads and world_size > 1:  # a collective: every rank takes part, whatever its node
            import socket
            everyone = [None] * world_size
            dist.all_gather_object(everyone, (socket.gethostname(), sorted(mine)))
            sharing = ranks_sharing_cpus(mine, socket.gethostname(), everyone, local_world)
        torch.set_num_threads(args.threads or max(1, physical_cores(mine) // sharing))
        print0(f"threads: {torch.get_num_threads()} torch threads per rank "
               f"({'--threads' if args.threads else f'{physical_cores(mine)} physical cores / {sharing} rank(s)'}), "
               f"{local_world} rank(s) on this node, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
               f"affinity {cpu_list(mine)}")

    # --- model ----------------------------------------------------------------
    torch.manual_seed(args.seed)  # same initial weights on every rank
    if ckpt is not None:
        model = GPT(GPTConfig(**ckpt["config"]))
        model.load_state_dict(ckpt["model"])
    elif args.init_from == "scratch":
        model = GPT(GPTConfig(block_size=args.block_size, vocab_size=PADDED_VOCAB_SIZE,
                              n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    elif os.path.isfile(args.init_from):  # fine-tune from one of our checkpoints
        init = load_checkpoint(args.init_from)
        model = GPT(GPTConfig(**init["config"]))
        model.load_state_dict(init["model"])
    else:
        model = GPT.from_pretrained(args.init_from)
    config = model.config
    if args.seq_len > config.block_size:
        raise SystemExit(f"error: --seq_len {args.seq_len} is longer than the model's context {config.block_size}")
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print0(f"model: {n_params / 1e6:.2f}M parameters, {config}")

    optimizer, fused = model.configure_optimizer(args.weight_decay, args.max_lr, device_type)
    print0(f"optimizer: AdamW, fused={fused}")
    start_step = 0
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        train_loader.load_state_dict(ckpt["loader"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        start_step = ckpt["step"]
        print0(f"resumed from {ckpt_file} at step {start_step}")
    del ckpt

    # Intel Extension for PyTorch: after any checkpoint is loaded (checkpoints hold plain weights and
    # optimizer state), before DDP (which must wrap the parameters IPEX trains). inplace: no second copy.
    if ipex is not None:
        ipex_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        model, optimizer = ipex.optimize(model, optimizer=optimizer, dtype=ipex_dtype, inplace=True)
        print0(f"ipex: intel_extension_for_pytorch {ipex.__version__}, optimize(dtype={ipex_dtype}) "
               f"(--ipex {args.ipex}; --ipex off to train without it)")

    # torch.compile turns the training forward and backward into fused C++ kernels (bench.py measures
    # what that brings). Only training runs compiled: validation, HellaSwag and sampling call raw_model,
    # the same weights run eagerly, because their shapes change (a shorter last batch, a growing KV cache)
    # and every new shape would mean another compilation.
    raw_model = model
    if args.compile and ipex is not None:
        # measured here: torch.compile over an ipex.optimize'd model leaves the blocks' LayerNorm
        # parameters without gradients (tests/test_ipex.py), so the two are not combined
        print0("compile: off, because IPEX optimized the model (--ipex off to compile instead)")
        args.compile = False
    if args.compile and not can_compile(device_type):
        print0("warning: --compile needs a C++ compiler (g++ or clang++, or $CXX) and none was found: "
               "training without it (install one, or pass --no-compile to silence this)")
        args.compile = False
    if args.compile:
        print0(f"compile: torch.compile, kernels cached in {compile_cache_dir()}")
        model = compile_model(model)
    if world_size > 1:
        # every rank must continue from the same checkpoint: DDP copies rank 0's weights to the others
        # when it wraps, but not the optimizer state nor the data position
        starts = [None] * world_size
        torch.distributed.all_gather_object(starts, start_step)
        if len(set(starts)) > 1:
            raise SystemExit(f"error: the ranks resumed from different steps {starts}: give every rank the same "
                             "checkpoint (a --log_dir on a shared file system, or the same --resume file)")
        # DDP averages the gradients across ranks during backward, bucket by bucket, overlapping
        # communication with the rest of the backward pass
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None)
    autocast = (torch.autocast(device_type=device_type, dtype=torch.bfloat16)
                if args.dtype == "bf16" else nullcontext())

    if master:
        os.makedirs(log_dir, exist_ok=True)
        if args.overwrite and not args.resume:
            for f in list_checkpoints(log_dir):
                os.remove(f)
            open(os.path.join(log_dir, "log.txt"), "w").close()
        else:
            open(os.path.join(log_dir, "log.txt"), "a").close()
    print0(f"total batch {args.total_batch_size} tokens = {args.batch_size} x {args.seq_len} x {world_size} rank(s) "
           f"x {grad_accum_steps} accumulation steps")

    def all_reduce_sum(t):
        if world_size > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)  # SUM: AVG is not on every CPU backend
        return t

    hellaswag_failed = False
    for step in range(start_step, args.max_steps + 1):
        last_step = step == args.max_steps
        # a resumed run already did the evals and the checkpoint of its first step before saving it
        periodic = step > start_step or ckpt_file is None

        # --- validation loss ----------------------------------------------------
        val_loss = None
        if periodic and args.eval_interval > 0 and (step % args.eval_interval == 0 or last_step):
            model.eval()
            stats = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, token count
            with torch.no_grad():
                for x, y in val_batches(args.data_dir, args.seq_len, args.val_tokens, args.batch_size, rank, world_size):
                    x, y = x.to(device), y.to(device)
                    with autocast:
                        _, loss = raw_model(x, y)
                    stats += torch.tensor([loss.item() * y.numel(), y.numel()], dtype=torch.float64, device=device)
            all_reduce_sum(stats)
            val_loss = (stats[0] / stats[1]).item()
            print0(f"validation loss: {val_loss:.4f}")
            if master:
                append_log(log_dir, f"{step} val {val_loss:.4f}")

        # --- HellaSwag ------------------------------------------------------------
        if (periodic and args.hellaswag_interval > 0 and not hellaswag_failed
                and (step % args.hellaswag_interval == 0 or last_step)):
            try:
                import hellaswag
                examples = hellaswag.load_examples("val", data_dir=args.hellaswag_dir)
            except (Exception, SystemExit) as e:  # no data is no reason to stop training
                print0(f"warning: HellaSwag disabled: {e}")
                hellaswag_failed = True
            else:
                model.eval()
                result = hellaswag.evaluate(raw_model, examples, device=device, dtype=args.dtype,
                                            batch_size=args.batch_size, rank=rank, world_size=world_size)
                print0(f"HellaSwag accuracy: {result['num_correct_norm']}/{result['num_total']}={result['acc_norm']:.4f}")
                if master:
                    append_log(log_dir, f"{step} hella {result['acc_norm']:.4f}")

        # --- a sample, to see what the model has learned --------------------------
        if (periodic and args.sample_interval > 0 and (step % args.sample_interval == 0 or last_step)
                and (step > 0 or last_step) and master):
            model.eval()
            prompt = torch.tensor([tokenizer.encode("Hello, I'm a language model,")] * 4, device=device)
            gen = torch.Generator(device=device).manual_seed(42 + rank)
            with autocast:
                new = torch.stack(list(raw_model.generate(prompt, 32, top_k=50, generator=gen)), dim=1)
            for i, row in enumerate(torch.cat((prompt, new), dim=1).tolist()):
                print(f"sample {i}: {tokenizer.decode(row)}", flush=True)

        # --- checkpoint -------------------------------------------------------------
        if (periodic and step > 0 and args.checkpoint_interval > 0
                and (step % args.checkpoint_interval == 0 or last_step) and master):
            state = {
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "config": asdict(config),
                "step": step,
                "args": {k: v for k, v in vars(args).items()},
                "loader": train_loader.state_dict(),
                "rng": {"torch": torch.get_rng_state()},
                "val_loss": val_loss,
            }
            atomic_save(state, checkpoint_path(log_dir, step))
            if args.keep_checkpoints > 0:
                for old in list_checkpoints(log_dir)[:-args.keep_checkpoints]:
                    os.remove(old)
        if last_step:
            break

        # --- one optimizer step -----------------------------------------------------
        model.train()
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        loss_accum = torch.zeros((), device=device)
        for micro_step in range(grad_accum_steps):
            x, y = train_loader.next_batch()
            x, y = x.to(device), y.to(device)
            # DDP all-reduces gradients during backward; only the last micro-step needs that
            sync = micro_step == grad_accum_steps - 1 or world_size == 1
            with (nullcontext() if sync else model.no_sync()):
                with autocast:
                    _, loss = model(x, y)
                loss = loss / grad_accum_steps  # the gradient of the mean over all micro-batches
                loss_accum += loss.detach()
                loss.backward()
        all_reduce_sum(loss_accum)
        loss_accum /= world_size
        norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip)
        lr = get_lr(step, args.warmup_steps, args.max_steps, args.max_lr, args.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        if device_type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0
        tokens_per_sec = args.total_batch_size / dt
        print0(f"step {step:5d} | loss {loss_accum.item():.6f} | lr {lr:.4e} | norm {norm.item():.4f} | "
               f"dt {dt * 1000:.0f}ms | tok/sec {tokens_per_sec:.0f}")
        if args.compile and step == start_step:
            first_dt = dt
        if args.compile and step == start_step + 1:  # the first step's extra time went to compiling
            # (with kernels already in the cache the first step is barely slower, or even faster)
            print0(f"compile: took about {max(first_dt - dt, 0):.1f} s, during the first step")
        if master:
            append_log(log_dir, f"{step} train {loss_accum.item():.6f}")
            append_log(log_dir, f"{step} tok/s {tokens_per_sec:.0f}")  # play.ipynb plots it; its loss plots skip it

    # every rank must hold the same weights; a checksum per rank proves it
    # (the state dict: full fp32 weights in plain layout, also under IPEX, whose parameters are bf16 halves)
    weights = raw_model.state_dict()
    checksum = hashlib.sha256()
    for k in sorted(weights):  # one tensor at a time: joining them all first would double the peak memory
        checksum.update(weights[k].detach().cpu().float().contiguous().numpy())
    digest = checksum.hexdigest()
    if world_size > 1:
        digests = [None] * world_size
        torch.distributed.all_gather_object(digests, digest)
        if len(set(digests)) != 1:
            raise SystemExit(f"error: ranks hold different parameters after training: {digests}")
        # DDP's reducer holds the process group: drop it first, so that the group is torn down here,
        # by destroy_process_group, and not by the reducer's destructor, which runs holding Python's
        # lock (GIL) and can deadlock with a gloo thread that needs it (seen with torch 2.8 + IPEX)
        import gc
        del model
        gc.collect()
        torch.distributed.destroy_process_group()
    print0(f"parameter sha256 (all {world_size} rank(s)): {digest}")


def collective_failure(e):
    """A one-line reason when e is a failed collective (a rank died or hung, the network broke), else None."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    text = str(e)
    if not (isinstance(e, dist.DistError) or any(s in text for s in ("gloo", "ccl", "Connection", "Timed out"))):
        return None  # an ordinary bug: keep its traceback
    reason = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return (f"error: rank {dist.get_rank()}: a collective with the other ranks failed, so training stops "
            f"(another rank died or hung past --dist_timeout, or the network failed): {reason}")


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:
        message = collective_failure(e)
        if message is None:
            raise
        # leave at once: the destructors of a broken process group can block on the dead peer
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
