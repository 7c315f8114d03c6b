"""
GPT-2 and its trainer, in one file, for CPUs first (and GPUs too).

    python train_gpt2.py                              # FineWeb-Edu shards present: GPT-2 (124M); none: a demo
    torchrun --nproc_per_node=2 train_gpt2.py         # data parallel on one machine (--shard full: FSDP2)
    mpirun -n 3 -ppn 1 python train_gpt2.py           # data parallel on three nodes (see README)

Read it top to bottom: the model, the learning rate schedule, loading a trained model, the stages of a run, then
main(), the training story. Its flags and their defaults are in train_args.py; what it reads is in dataloader.py (the
shards fineweb.py writes, cut into blocks; the task folders finetune.py writes, packed into rows); how the processes
live on the machine (launchers, threads, Intel's libraries, memory, signals, safe files) is in plumbing/. sample.py
and answer.py generate with the model.
"""
import argparse
import itertools
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from plumbing import (attention, checkpoints, clock, cpu, inputs, layouts, node_disks, parts, pipeline, progress, report,
                      sharding, speedups, tensor_parallel, world)
from plumbing.checkpoints import append_log, checkpoint_path, list_checkpoints, load_checkpoint
from plumbing.fused_loss import IGNORE, lm_head_loss
import dataloader
import lora
from tokenizer import VOCAB_SIZE
from train_args import check_args, launch_flags, resolve_args

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
        """cache: generation's KVCache (its keys and values of the tokens so far); attn_mask, lengths: see GPT.hidden."""
        B, T, C = *x.shape[:2], self.n_embd  # C: the width of this module's heads (--tp: this rank's share of them)
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size): heads become a batch dimension
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if lengths is not None:  # packed rows of examples
            return self.c_proj(packed_attention(q, k, v, lengths).reshape(B, T, C))
        if cache is None and attn_mask is None:  # causal from position 0 (training): the kernel measured fastest
            return self.c_proj(attention.causal(q, k, v).transpose(1, 2).reshape(B, T, C))  # (plumbing/attention.py)
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
        """The next T slots' positions, and their queries' mask over every key so far (True: may attend; None: causal)."""
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
# of a step: 824 MB for 4 x 1024 positions): plumbing/fused_loss.py takes a chunk of positions at a time.

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
        """Token ids (B, T) -> hidden states after ln_f (B, T, n_embd); forward adds lm_head or the loss. A method of its own
        so hellaswag.py can run lm_head on only the positions it scores, in rows it packs with its own positions (B, T; default
        0..T-1) and attn_mask (bool, True = may attend, broadcast to (B, n_head, T, keys); default causal); a KVCache gives
        both. lengths: rows packed with examples end to end (1-D, see packed_attention): each attends only within itself."""
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
        """Logits (targets None), or the loss. packed: a Packed batch (dataloader.py's task rows): positions restarting and
        attention staying inside each example, and only the targets' positions (packed.picked) through lm_head. cache: a
        KVCache (generation), which this call fills in; then the logits of the last position only."""
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
        inputs.copy_pretrained_weights(weights_file, params, CONV1D_WEIGHTS)
        return model

    @classmethod
    def from_checkpoint(cls, ckpt, build=None):
        """The model in one of our checkpoints (see load_checkpoint); build(config) as in from_pretrained."""
        model = (build or cls)(GPTConfig(**ckpt["config"]))
        if ckpt["sharded_path"]:  # (a run with --lora on it: its adapters are not in the checkpoint)
            missing = set(model.state_dict()) - parts.load_sharded(ckpt["sharded_path"], model)
            if any(".lora_" not in k for k in missing):
                raise SystemExit(f"error: {ckpt['sharded_path']} holds no {min(missing)}: not a whole model's checkpoint")
        else:
            for k, p in model.named_parameters():
                if ".lora_" not in k:  # (a base for LoRA has no adapters yet; a part reads only its own tensors)
                    sharding.copy_weight(p, checkpoints.checked(ckpt, "model", k))
        return model

    def configure_optimizer(self, weight_decay, learning_rate, device_type):
        # decay the matrices (weights of Linear layers, embeddings); not biases and LayerNorm gains
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        split = lambda p: hasattr(p, "placements")  # noqa: E731  --tp's split weights (DTensors): fused AdamW takes them apart
        if 0 < sum(map(split, params)) < len(params):
            groups = [{**g, "params": [p for p in g["params"] if split(p) == kind]} for g in groups for kind in (False, True)]
        # fused AdamW runs the whole update in one kernel; PyTorch has it for CPU since 2.4
        fused = device_type in ("cpu", "cuda", "xpu")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused), fused

PRETRAINED_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# OpenAI's checkpoints use a 'Conv1D' module: a Linear whose weight is stored transposed, (in, out)
CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
PADDED_VOCAB_SIZE = 50304  # 50257 rounded up to a multiple of 128: friendlier matrix shapes

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
# Loading a trained model (plumbing/checkpoints.py writes checkpoints safely and reads them back)

def load_model(name_or_path, build=None, merge=True):
    """(model, task): one of our checkpoints (.pt, or .dcp from a sharded run), or what GPT.from_pretrained reads
    (gpt2..gpt2-xl, a Hugging Face-layout folder). task: the task.json dict of the data a fine-tuned model learned
    (its checkpoint's, or the folder's task.json, which export_hf.py writes); None for a plain language model.
    build(config, init_weights=False) makes the model the weights fill (build_model's: sharded, in bf16, with a new
    run's adapters); default GPT. A LoRA checkpoint holds its adapters, not its base: the base is loaded again (built
    by build), checked to be the one they were trained on, and the adapters merged into it, W + (alpha/R) B A, a
    layer at a time: a plain GPT, as any base is (merge=False: its adapters left beside it, for export_hf.py --adapter)."""
    if os.path.isfile(name_or_path) or os.path.isfile(os.path.join(name_or_path, "meta.pt")):
        ckpt = load_checkpoint(name_or_path)
        if not ckpt.get("lora"):
            return GPT.from_checkpoint(ckpt, build), ckpt.get("task")
        spec, args = ckpt["lora"], argparse.Namespace(**ckpt["args"])
        build = build if merge else lambda config, init_weights=False: lora.add_adapters(
            GPT(config), spec["rank"], spec["alpha"], spec["targets"], init=False)
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
            sharding.copy_weight(p, saved[name])
        return base, ckpt.get("task")
    task = dataloader.read_task(name_or_path) if os.path.isdir(name_or_path) else None
    return GPT.from_pretrained(name_or_path, build), task

# -----------------------------------------------------------------------------
# The stages of a run. main() at the bottom tells the story; each stage is one function here, and they
# share one Run: the run's settings, fixed when it starts, and its training state, which the stages set up.

# a non-finite loss now and then (a bad batch, a bf16 overflow) is skipped; this many in a row is divergence
MAX_SKIPPED_STEPS = 5
# twice the loss of a uniform guess (ln 50304 = 10.8, where scratch training starts): weights that give more
# are broken even if finite (--max_lr 1e6 gets there in one step)
DIVERGED_LOSS = 2 * math.log(PADDED_VOCAB_SIZE)

class Run:
    """What travels from stage to stage. Fixed when the run starts: the arguments (resolved once, by resolve_args, and
    never written after, but for the layout --parallel auto picks and --hours' plan), this rank, the task (a finetune.py folder's), the
    layout (sharded?, pipeline?) and the accumulation steps. Then filled by main() with what each stage returns, in
    its order: the device, dtype and IPEX, the data loader, HellaSwag's examples (None: not measured), the lock on
    --log_dir, the model, the optimizer and the wrapped model."""

    def __init__(self, args, ranks, task):
        self.args, self.ranks, self.task = args, ranks, task
        self.lay_out()
        self.split_model = None  # the model split over ranks: --pp's Pipeline or --tp's TensorParallel, each with its own step
        self.train_loader = self.hellaswag = self.lock = self.device_type = self.dtype = self.autocast = self.ipex = None
        self.raw_model = self.model = self.optimizer = None  # raw_model: the plain GPT; model: what trains
        self.compiled, self.flops_per_token, self.matmul_rate, self.lora, self.budget = False, 0, None, None, None

    def lay_out(self):
        """What follows from the layout, --shard, --pp and --tp (set again if --parallel auto picks another: choose_layout)."""
        args, ranks = self.args, self.ranks
        # FSDP2 over the world: decided here, and only here (--pp shards within each stage: plumbing/pipeline.py)
        self.sharded = args.shard != "none" and ranks.world_size > 1 and args.pp == 1
        self.in_parts = self.sharded or args.pp > 1 or args.tp > 1  # no rank holds the whole model: .dcp checkpoints
        self.replicas = ranks.world_size // (args.pp * args.tp)  # data-parallel replicas: --pp stages x --tp ranks each
        self.grad_accum_steps = args.total_batch_size // (args.batch_size * args.seq_len * self.replicas)
        group = args.pp * args.tp  # the ranks of one replica read the same batches: the loaders see the replicas
        self.data_ranks = pipeline.replica_ranks(ranks, group) if group > 1 else ranks

    def share_of_matmul_rate(self, dt):
        """' | N% of this CPU's fp32 matmul rate': the step's FLOPs (6 per parameter and token, 4 for a frozen one:
        no weight gradient; plus attention) per second on this rank, against what this CPU's matmuls reach at the
        model's shape (cpu.MatmulRate: measured again, and said so, when a step beats it)."""
        if self.device_type != "cpu":
            return ""
        if self.matmul_rate is None:  # after the first step, outside its time
            config, params = self.raw_model.config, list(self.raw_model.parameters())
            self.flops_per_token = cpu.flops_per_token(sum(p.numel() for p in params), config.n_layer, config.n_embd,
                                                       self.args.seq_len) - 2 * sum(p.numel() for p in params if not p.requires_grad)
            if self.args.pp * self.args.tp > 1:  # a replica's ranks share its work: the whole model's FLOPs, over them
                self.flops_per_token = cpu.flops_per_token(layouts.parameters(config)[0], config.n_layer, config.n_embd,
                                                           self.args.seq_len) / (self.args.pp * self.args.tp)
            self.matmul_rate = cpu.MatmulRate(self.dtype, config.n_embd)
        return self.matmul_rate.share(self.args.total_batch_size / self.replicas / dt * self.flops_per_token / 1e9)

def open_data_and_lock_log_dir(run):
    """The training data's loader and the val data, checked; HellaSwag's examples if they are to be measured; then
    --log_dir, refused if it holds another run, and locked so that no second run writes there. Returns (the loader,
    HellaSwag's examples or None, the lock)."""
    args, ranks = run.args, run.ranks
    if args.shard != "none" and ranks.world_size == 1:
        ranks.print0(f"--shard {args.shard}: with one rank there is nothing to split; training as usual")
    train_loader = dataloader.open_training_data(args, run.task, run.data_ranks)
    has_run = os.path.exists(os.path.join(args.log_dir, "log.txt")) or list_checkpoints(args.log_dir)
    if any(ranks.gather(bool(has_run))) and not args.resume and not args.overwrite:  # (any node's folder)
        raise SystemExit(f"error: --log_dir {args.log_dir} already holds a run; continue it with --resume, "
                         "choose another --log_dir, or pass --overwrite to replace it" if ranks.master else 1)
    hellaswag_examples = None  # no data (no network, say) is no reason not to train: it is just not measured
    if args.hellaswag_interval > 0 and run.sharded:  # batches differ by rank: no lock-step all-gathers
        ranks.print0("warning: no HellaSwag during sharded training: run hellaswag.py -m on a checkpoint")
    elif args.pp > 1 or args.tp > 1:  # generation through stages or split blocks is not written yet; a checkpoint
        layout = "pipeline" if args.pp > 1 else "tensor parallel"  # holds the whole model
        ranks.print0(f"{layout}: no HellaSwag, task accuracy or samples during training: run hellaswag.py -m, answer.py "
                     "or sample.py --ckpt_path on a checkpoint")
    elif args.hellaswag_interval > 0:
        import hellaswag
        hellaswag_examples = hellaswag.examples_for_training(args.hellaswag_dir, ranks)
    def lock():  # one run per folder (on each node's disk, where each has its own); then what a killed run left
        held = checkpoints.lock_folder(args.log_dir) if ranks.keeper else None
        if held:
            checkpoints.remove_unfinished(args.log_dir)
        return held
    return train_loader, hellaswag_examples, ranks.together(lock)

def join_ranks(argv):
    """This process among the ranks the launcher started (its variables: torchrun's, mpirun's, srun's; none: one
    process), its device, the process group that joins the ranks, and which of them share one --log_dir folder (a disk
    per node: plumbing/node_disks.py). On the command line's flags: a resumed run's are read once they agree on it."""
    flags = launch_flags(argv)
    ranks = world.Ranks(*world.detect_launch())
    ranks.device = world.pick_device(flags.device, ranks.local_rank, ranks.world_size)
    if ranks.world_size > 1:  # oneCCL when Intel's bindings are installed (fastest across Xeon nodes), else gloo on CPU
        backend = world.choose_backend(flags.backend, ranks.device.split(":")[0])
        where = world.init_process_group(backend, ranks.rank, ranks.world_size, ranks.local_world, ranks.launcher,
                                         flags.dist_timeout)
        ranks.print0(f"distributed: {ranks.launcher}, world size {ranks.world_size}, backend {backend}, master {where}")
        ranks.disks, line = node_disks.find(flags.log_dir, ranks)
        ranks.print0(line)
    return ranks

def set_up_machine(run):
    """This rank's CPU threads, the dtype this machine computes fastest, and IPEX if it can run that dtype. Returns
    (device type, dtype, its autocast, IPEX or None: applied later)."""
    args, ranks = run.args, run.ranks
    device_type = ranks.device.split(":")[0]
    ipex = speedups.find_ipex(args.ipex, device_type, speedups.will_compile(args.compile, device_type), ranks.print0)
    if device_type == "cpu":  # one matmul thread per physical core, shared among the ranks on this node
        ranks.print0(cpu.set_cpu_threads(args.threads, ranks.world_size, ranks.local_world))
        ranks.print0(cpu.describe_cpu(torch.get_num_threads()))
    dtype, why = speedups.resolve_dtype(args.dtype, device_type, args.n_embd, ranks)  # ranks agree on it
    ranks.print0(why)
    ipex = speedups.ipex_for_dtype(ipex, args.ipex, dtype, device_type != "cpu" or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    ipex = None if args.lora else ipex  # (ipex.optimize would swap out the Linear layers that carry the adapters)
    return device_type, dtype, speedups.autocast(dtype, device_type), ipex

def choose_layout(run, ckpt):
    """--parallel auto on several ranks (the default): DDP where the model fits, else the layout predicted fastest
    from the measured links, memory and compute (plumbing/layouts.py); it sets --shard and --pp. A forced layout that
    cannot fit is one error line. (Not for --lora: its frozen base's gradients and AdamW state cost nothing, and a
    pipeline does not take adapters yet.)"""
    args, ranks = run.args, run.ranks
    if ranks.world_size > 1 and not args.lora and run.device_type == "cpu":
        config = model_config(args, ckpt)
        if args.parallel != "auto":  # forced: refused if it cannot fit
            layouts.check_fits(args, config, ranks, run.dtype == "bf16")
        else:
            layout, why = layouts.decide(args, config, ranks, run.dtype == "bf16", run.autocast, (Block, GPT))
            ranks.print0(why)
            args.shard, args.pp, args.tp = layout.shard, layout.pp, layout.tp
            check_args(args, ranks.world_size)
            run.lay_out()
    if not run.sharded:  # (sharded, memory is short: what is freed goes back to the OS)
        cpu.keep_freed_memory()

def model_config(args, ckpt):
    """The GPTConfig this run trains, without reading any weights: the checkpoint's, the flags', or --init_from's
    (load_model builds the model from its config before it reads a weight: the build stops it there)."""
    if ckpt is not None or args.init_from == "scratch":
        return GPTConfig(**ckpt["config"]) if ckpt is not None else GPTConfig(
            block_size=args.block_size, vocab_size=PADDED_VOCAB_SIZE, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    class Found(Exception):
        pass
    def found(config, init_weights=False):
        raise Found(config)
    try:
        load_model(args.init_from, found)
    except Found as e:
        return e.args[0]

def build_model(run, ckpt):
    """The model: the checkpoint's weights when resuming; else a scratch GPT-2, OpenAI's weights, or one of our checkpoints.
    --shard full: the model is sharded as it is built (see sharding.build_sharded), so no rank holds all of it.
    --lora: the base is loaded as for a fresh run (a LoRA checkpoint holds only the adapters), frozen, held in the run's
    dtype (bf16: built a tensor at a time, never whole in fp32), with adapters on it (lora.py).
    The shards' token ids are checked against its vocabulary first, before any weights are read."""
    args, ranks = run.args, run.ranks
    torch.manual_seed(args.seed)  # same initial weights on every rank
    def build(config, init_weights=False):  # sharded: weights given to each rank's pieces, unless init_weights
        inputs.check_token_ids(dataloader.token_files(args.data_dir, run.task), config.vocab_size, ranks.print0)
        def make():  # (the adapters are added before sharding: FSDP shards them too)
            model = GPT(config)
            return lora.add_adapters(model, args.lora, args.lora_alpha, args.lora_targets, init=False) if args.lora else model
        if run.sharded:
            return sharding.build_sharded(make, ranks, run.dtype == "bf16", init_weights, args.shard == "grads")
        if run.in_parts and not (args.lora and run.dtype == "bf16"):  # a stage, a share: built alone
            return parts.build_part(make, args, ranks, init_weights, run.dtype == "bf16")
        return sharding.build_in(torch.bfloat16, make, init_weights) if args.lora and run.dtype == "bf16" else make()
    if ckpt is not None and not ckpt["sharded_path"] and not args.lora:  # (a rank that finds a tensor damaged stops all)
        model = ranks.together(lambda: GPT.from_checkpoint(ckpt, build))
    elif (ckpt is None or args.lora) and args.init_from != "scratch":
        model, _ = load_model(args.init_from, build)
    else:  # from scratch; or the shapes for a sharded checkpoint's weights (read with its AdamW state, in prepare_training)
        config = GPTConfig(**ckpt["config"]) if ckpt is not None else GPTConfig(
            block_size=args.block_size, vocab_size=PADDED_VOCAB_SIZE, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
        model = build(config, init_weights=ckpt is None or args.lora > 0)
    if args.lora:
        run.lora, line = lora.start(model, args, ckpt, PRETRAINED_NAMES)
        ranks.print0(line)
    model.recompute = args.recompute
    config, n_params = model.config, sum(p.numel() for p in model.parameters())
    if args.seq_len > config.block_size:
        raise SystemExit(f"error: --seq_len {args.seq_len} is longer than the model's context {config.block_size}")
    if args.checkpoint_interval > 0:  # what trains, and AdamW's two moments, in fp32 (on every node's disk)
        ranks.together(lambda: ranks.keeper and checkpoints.check_free_space(
            args.log_dir, 12 * sum(p.numel() for p in model.parameters() if p.requires_grad), "a checkpoint"))
    ranks.print0(parts.model_line(config, n_params, args))
    return model.to(ranks.device)  # the plain GPT: evaluation and sampling run it eagerly

def prepare_training(run, ckpt, ckpt_file):
    """The optimizer, the resumed state, then the wrappers: IPEX, torch.compile, DDP. Returns (the model that trains,
    the optimizer, whether it is compiled, the first step)."""
    args, ranks, model = run.args, run.ranks, run.raw_model
    if args.pp > 1:  # the model is cut down to this rank's stage
        run.split_model = pipeline.Pipeline(model, args, ranks, run.grad_accum_steps, ranks.print0, run.dtype)
    elif args.tp > 1:  # every block split across the tensor-parallel ranks
        run.split_model = tensor_parallel.TensorParallel(model, args, ranks, run.grad_accum_steps, ranks.print0, run.dtype)
    optimizer, fused = model.configure_optimizer(args.weight_decay, args.max_lr, run.device_type)
    ranks.print0(f"optimizer: AdamW, fused={fused}")
    if run.device_type == "cpu" and (line := attention.choose(run.dtype, args.batch_size, model.config.n_head, args.seq_len,
                                                                model.config.n_embd // model.config.n_head, ranks)):
        ranks.print0(line)
    start_step = 0
    if ckpt is not None:
        if run.split_model is not None:  # each stage or share reads its part: of a .dcp, or cut from a one-process .pt
            ranks.together(lambda: run.split_model.load_sharded(parts.source(ckpt, run.split_model.whole_model()),
                                                                optimizer))
        elif ckpt["sharded_path"]:  # any number of ranks, sharded or not: each reads what it holds
            parts.load_sharded(ckpt["sharded_path"], model, optimizer, ranks)
        elif run.sharded:
            sharding.load_full_optimizer_state(model, optimizer, checkpoints.verify_weights(ckpt, "optimizer"))
        else:
            optimizer.load_state_dict(checkpoints.verify_weights(ckpt, "optimizer"))
        run.train_loader.load_state_dict(ckpt["loader"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        start_step = ckpt["step"]
        ranks.print0(f"resumed from {ckpt_file} at step {start_step}")
    if run.ipex is not None and (run.sharded or run.split_model is not None):
        run.ipex = None
    if run.ipex is not None and run.device_type == "cpu":  # right at this run's shapes? faster?
        run.ipex, line = speedups.decide_ipex(run.ipex, args.ipex, run.dtype, model.transformer.h[0], args.batch_size,
                                              args.seq_len, ranks)
        ranks.print0(line)
    if run.ipex is not None:
        model, optimizer = speedups.apply_ipex(run.ipex, model, optimizer, run.dtype, ranks.print0)
    # torch.compile fuses the training forward and backward into C++ kernels (bench/bench_train.py measures it).
    # Evaluation and sampling run the raw model eagerly: their shapes change, and each shape would recompile.
    compiled = False
    if args.compile:  # a pipeline's stage, tensor parallel's split model: compiled in place (their step runs them)
        keep_packed_attention_eager()
        compile = lambda m: speedups.compile_if_possible(m, run.ipex, run.device_type, ranks.print0)  # noqa: E731
        model, compiled = (model, run.split_model.compile(compile)) if run.split_model else compile(model)
    if ranks.world_size > 1 and not run.sharded and run.split_model is None:  # DDP averages the gradients during backward, bucket by bucket
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[ranks.local_rank] if run.device_type == "cuda" else None)
    if ranks.world_size > 1 and run.split_model is None:  # what each rank will send a step (bench/bench_parallel.py measures it)
        ranks.print0(sharding.plan_line(run.raw_model, ranks.world_size, args.shard, run.grad_accum_steps,
                                         run.dtype == "bf16", torch.distributed.get_backend()))
    return model, optimizer, compiled, start_step

def evaluate(run, step, due):
    """This step's evaluations, each when due: val loss, task accuracy, HellaSwag, samples. Returns the val loss (or None)."""
    args, ranks, model = run.args, run.ranks, run.raw_model
    model.eval()
    val_loss = None
    if due(args.eval_interval):  # the mean loss over every val target (a task may have none: then no val line)
        stats = torch.zeros(2, dtype=torch.float64, device=ranks.device)  # summed loss, target count
        with torch.no_grad():
            batches = dataloader.val_batches(args, run.task, run.data_ranks, lockstep=run.sharded or args.pp > 1)
            for batch in progress.each(batches, "validation", "batches", ranks.master):  # (a bar, or a line a tenth)
                x, y, packed = batch if batch is not None else (torch.zeros(1, args.seq_len, dtype=torch.long),) * 2 + (None,)
                with run.autocast:
                    _, loss = (run.split_model or model)(x.to(ranks.device), y.to(ranks.device), packed=packed and packed.to(ranks.device))
                counted = int((y != IGNORE).sum()) * (batch is not None)
                stats += torch.tensor([loss.item() * counted, counted], dtype=torch.float64, device=ranks.device)
        total, count = ranks.all_reduce_sum(stats).tolist()
        if count:
            val_loss = total / count
            ranks.print0(f"validation loss: {val_loss:.4f}")
            append_log(args.log_dir, ranks, f"{step} val {val_loss:.4f}")
        if run.task is not None and run.task["splits"]["val"]["examples"] and run.split_model is None:  # do the answers come out right?
            n = min(args.task_examples, run.task["splits"]["val"]["examples"])
            import answer
            acc, _ = answer.task_accuracy(model, args.data_dir, run.autocast, n=n, ranks=ranks,
                                          lockstep=run.sharded)  # (sharded: every rank answers every example)
            ranks.print0(f"task accuracy: {acc:.4f} (greedy answers to {n} val examples)")
            append_log(args.log_dir, ranks, f"{step} task {acc:.4f}")
    if run.hellaswag is not None and due(args.hellaswag_interval):
        import hellaswag
        acc = hellaswag.accuracy_during_training(model, run.hellaswag, ranks, run.dtype, args.batch_size)
        append_log(args.log_dir, ranks, f"{step} hella {acc:.4f}")
    if due(args.sample_interval) and (step > 0 or step == args.max_steps) and (ranks.master or run.sharded) and not run.split_model:
        import sample  # (sharded, every rank generates alongside rank 0, to join the all-gathers of every forward)
        run.samples = sample.print_samples(model, ranks, run.autocast)  # (report.md keeps the last)
    return val_loss

def save_checkpoint(run, step, val_loss, evaluated=True):
    """Everything an exact resume needs: weights, optimizer moments, data position, RNG, run arguments; by
    rank 0, or by every rank for its own part when sharded or in parts. Never a diverged state: non-finite weights or
    val loss are not saved, so they can't push a good checkpoint out. Every rank calls it (they must agree)."""
    args, ranks, model, optimizer = run.args, run.ranks, run.raw_model, run.optimizer
    bad = sum(not (p.to_local() if hasattr(p, "to_local") else p).isfinite().all() for p in model.parameters())
    if ranks.all_reduce_sum(torch.tensor(float(bad), device=ranks.device)) or not (val_loss or 0.0) < DIVERGED_LOSS:
        ranks.print0(f"warning: no checkpoint at step {step}: the weights are not finite, or the val loss is not below {DIVERGED_LOSS:.1f}")
        return
    state = {"config": asdict(model.config), "step": step, "args": dict(vars(args)), "loader": run.train_loader.state_dict(),
             "rng": {"torch": torch.get_rng_state()}, "val_loss": val_loss, "task": run.task, "lora": run.lora,
             "evaluated": evaluated, "budget": run.budget and run.budget.state()}  # evaluated False: stopped by a signal before this step's evaluations
    if run.in_parts:  # every rank writes its part, in the whole model's names: any layout reads it (plumbing/parts.py)
        part = run.split_model.state(optimizer) if run.split_model else parts.state_of(model, optimizer)
        parts.save_sharded(checkpoint_path(args.log_dir, step, sharded=True), part, state, ranks)
        return
    if ranks.disks and len(ranks.disks) > 1:  # a disk per node: the first rank of each writes rank 0's checkpoint there
        state = ranks.broadcast(state)  # (the data position and RNG; DDP's ranks all hold the same weights and AdamW)
    if ranks.keeper:
        state.update(model=lora.adapters(model) if args.lora else model.state_dict(), optimizer=optimizer.state_dict())
        state["checksums"] = checkpoints.tensor_checksums(state)  # verified by load_checkpoint
        checkpoints.atomic_save(state, checkpoint_path(args.log_dir, step), quiet=not ranks.master)

def train_step(run, step):
    """One optimizer step over total_batch_size tokens: grad_accum_steps micro-batches on every rank.
    Returns (mean loss, gradient norm, learning rate, whether the weights were updated)."""
    args, optimizer = run.args, run.optimizer
    run.model.train()
    optimizer.zero_grad(set_to_none=True)
    batches, n_targets = run.train_loader.next_step(run.grad_accum_steps)
    if run.split_model is not None:  # --pp: the schedule runs the micro-batches through the stages; --tp: every share
        loss_accum, norm = run.split_model.step(batches, n_targets, args.grad_clip)
    else:
        loss_accum, norm = accumulate_gradients(run, batches, n_targets)
    lr = (run.budget.lr if run.budget else get_lr)(step, args.warmup_steps, args.max_steps, args.max_lr, args.min_lr)
    for group in optimizer.param_groups:
        group["lr"] = lr
    # a non-finite loss or gradient would make every weight NaN; a loss above DIVERGED_LOSS means they blew up:
    # skip the update (all ranks see the same all-reduced numbers); main() stops the run if it keeps happening
    sane = bool(loss_accum.isfinite() and norm.isfinite() and loss_accum < DIVERGED_LOSS)
    if sane:
        optimizer.step()
    if run.ranks.device.startswith("cuda"):
        torch.cuda.synchronize()
    return loss_accum.item(), norm.item(), lr, sane

def accumulate_gradients(run, batches, n_targets):
    """The gradient of the step's mean loss, accumulated over its micro-batches on this rank, averaged over the ranks
    (DDP, FSDP) and clipped. Returns (the step's mean loss, the gradient norm before clipping)."""
    args, ranks, model = run.args, run.ranks, run.model
    loss_accum = torch.zeros((), device=ranks.device)
    for micro_step, (x, y, packed) in enumerate(batches):
        x, y, packed = x.to(ranks.device), y.to(ranks.device), packed and packed.to(ranks.device)
        # DDP all-reduces gradients during backward (FSDP reduce-scatters them); only the last micro-step needs that
        sync = micro_step == run.grad_accum_steps - 1 or ranks.world_size == 1
        if run.sharded:  # (--shard grads: the gathered weights are kept until the last micro-step's backward)
            getattr(model, "_orig_mod", model).set_requires_gradient_sync(sync)
            getattr(model, "_orig_mod", model).set_reshard_after_backward(sync or args.shard == "full")
        with (nullcontext() if sync or run.sharded else model.no_sync()):
            with run.autocast:
                _, loss = model(x, y, packed=packed)
            # the gradient of the step's mean loss over all its targets. Pretraining: all micro-batches hold as many,
            # so it is the mean of their means. Task data: each micro-batch's mean weighs by its share of the step's
            # targets, times the world size, as DDP and FSDP average the ranks' gradients (not transformers#34191)
            loss = loss / run.grad_accum_steps if n_targets is None else loss * (
                int((y != IGNORE).sum()) * ranks.world_size / max(n_targets, 1))
            loss_accum += loss.detach()
            loss.backward()
    ranks.all_reduce_sum(loss_accum)
    loss_accum /= ranks.world_size
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    return loss_accum, norm.full_tensor() if run.sharded else norm  # sharded: each rank's part of the global norm

def check_same_weights(run):
    """DDP's promise: every rank ends with the same weights (a pipeline's, tensor parallel's: each part's replicas
    do; FSDP's ranks each hold their own pieces: their digests, none gathered whole)."""
    if run.split_model:
        run.split_model.check_same_weights(run.ranks)
    elif run.sharded:
        parts.check_same_parts(run.ranks, run.raw_model.state_dict(), 0, run.ranks.rank)
    else:
        world.check_same_weights(run.ranks, run.raw_model)

def save_after_signal(run, signum, step, save):
    """After a SIGTERM or SIGINT: save where the run is, if `save` (its evaluations run when it resumes),
    and wait for every rank. Returns the exit code."""
    ranks, saved = run.ranks, ""
    if save:
        save_checkpoint(run, step, None, evaluated=False)
        saved = f"saved {checkpoint_path(run.args.log_dir, step, run.in_parts)}; continue with --resume; " if ranks.master else ""
    if ranks.world_size > 1:
        torch.distributed.barrier()  # nobody leaves before the checkpoint is written: launchers kill the rest
    print(f"rank {ranks.rank}: stopped by {signal.Signals(signum).name} before step {step}: {saved}"
          f"exit code {128 + signum}", file=sys.stderr, flush=True)
    return 128 + signum

def prune_or_stop_if_diverged(run, step, updated, skipped):
    """Counts the steps in a row that could not update the weights; returns the new count. A checkpoint
    counts only once a step from it updated them (weights can be finite and still diverge at once): then
    older ones are pruned. MAX_SKIPPED_STEPS in a row stop the run, keeping the newest good checkpoint."""
    args, ranks = run.args, run.ranks
    if updated:
        if ranks.keeper:  # (every node's folder, where each has its own)
            checkpoints.prune_checkpoints(args.log_dir, args.keep_checkpoints)
        return 0
    ranks.print0(f"warning: step {step}: the loss is not finite or above {DIVERGED_LOSS:.1f}, or the gradient norm "
                 "is not finite: update skipped")
    if skipped + 1 == MAX_SKIPPED_STEPS:  # every rank gets here alike
        if ranks.keeper:
            checkpoints.prune_checkpoints(args.log_dir, 0, newer_than=step - MAX_SKIPPED_STEPS)
        found = list_checkpoints(args.log_dir)
        raise SystemExit(f"error: training diverged: {MAX_SKIPPED_STEPS} steps in a row with a diverged loss or "
                         f"gradient (the last at step {step}); the newest checkpoint that trained on, "
                         f"{found[-1] if found else '(none)'}, is kept: lower --max_lr" if ranks.master else 1)
    return skipped + 1

# -----------------------------------------------------------------------------
# Training

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cpu.warm_up_vector_math()  # so that a resumed run computes exactly what the uninterrupted one did
    # How to run is the launcher's decision: torchrun, mpirun and srun each tell every process its rank
    # and the world size in their own variables; without one, we are a single process (world size 1).
    ranks = join_ranks(argv)
    args, task, ckpt, ckpt_file = resolve_args(argv, ranks)
    check_args(args, ranks.world_size)
    run = Run(args, ranks, task)
    run.device_type, run.dtype, run.autocast, run.ipex = set_up_machine(run)
    if args.hours:  # measure this machine, plan the run to end on time (plumbing/clock.py), check the plan's flags
        run.budget = clock.Budget.plan(run, lambda **c: GPT(GPTConfig(vocab_size=PADDED_VOCAB_SIZE, **c)), ckpt)
        check_args(args, ranks.world_size)
    choose_layout(run, ckpt)
    run.train_loader, run.hellaswag, run.lock = open_data_and_lock_log_dir(run)
    run.raw_model = build_model(run, ckpt)
    run.model, run.optimizer, run.compiled, start_step = prepare_training(run, ckpt, ckpt_file)
    evaluated = ckpt is not None and ckpt.get("evaluated", True)  # were start_step's evaluations done already?
    del ckpt
    if ranks.keeper:  # log.txt, args.json (how the run started: for a --resume before its first checkpoint)
        checkpoints.prepare_log_dir(args.log_dir, vars(args), overwrite=args.overwrite and not args.resume,
                                    fresh=ckpt_file is None, log=ranks.master)
    ranks.print0(f"total batch {args.total_batch_size} tokens = {args.batch_size} x {args.seq_len} x "
                 f"{run.replicas} rank(s) x {run.grad_accum_steps} accumulation steps" + (f" (x {args.pp} stages)" if args.pp > 1 else "")
                 + (f" (x {args.tp} tensor-parallel ranks)" if args.tp > 1 else ""))
    if run.device_type == "cpu" and not args.hours:  # how long the run will take here, before its first step
        ranks.print0(progress.forecast(run, start_step))

    # SIGTERM / Ctrl-C from here on: finish the step, save a checkpoint, exit (before, nothing is lost: they stop the
    # process at once, also one waiting for ranks that will never come, as torchrun restarting its workers finds)
    stop = world.GracefulStop()
    skipped, exit_code, first_dt, eta = 0, 0, 0.0, progress.StepClock(
        args, start_step, ranks.print0, run.budget and run.budget.deadline)  # (the step line's ETA)
    for step in itertools.count(start_step):  # to args.max_steps, which --hours re-fits to the clock at every step
        last_step = step >= args.max_steps
        # a resumed run already did the evals and the checkpoint of its first step (unless a signal stopped it)
        periodic = step > start_step or not evaluated
        due = lambda interval: periodic and interval > 0 and (step % interval == 0 or last_step)  # noqa: E731
        val_loss = evaluate(run, step, due)
        report.update(run, evaluated=due(args.eval_interval))  # log_dir/report.png and .md (plumbing/report.py)
        if due(args.checkpoint_interval) and step > 0 and not skipped:
            save_checkpoint(run, step, val_loss)
        if last_step:
            if ranks.keeper:
                checkpoints.prune_checkpoints(args.log_dir, args.keep_checkpoints)
            break

        t0 = time.time()
        loss, norm, lr, updated = train_step(run, step)
        dt = time.time() - t0
        args.max_steps = run.budget.tick(step, t0, t0 + dt) if run.budget else args.max_steps
        ranks.print0(f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {norm:.4f} | dt {dt * 1000:.0f}ms | "
                     f"tok/sec {args.total_batch_size / dt:.0f}{run.share_of_matmul_rate(dt)}{eta.tick(step, dt)}")
        append_log(args.log_dir, ranks, f"{step} train {loss:.6f}", f"{step} tok/s {args.total_batch_size / dt:.0f}")
        first_dt = dt if step == start_step else first_dt
        if run.compiled and step == start_step + 1:  # the first step's extra time went to compiling (0 if cached)
            ranks.print0(f"compile: took about {max(first_dt - dt, 0):.1f} s, during the first step")
        skipped = prune_or_stop_if_diverged(run, step, updated, skipped)
        if signum := stop.agreed(ranks):
            save = args.checkpoint_interval > 0 and not skipped  # no checkpoint of weights that just diverged
            exit_code = save_after_signal(run, signum, step + 1, save)
            break

    report.update(run, final=True)  # the picture of the whole run
    check_same_weights(run)
    world.report_peak_memory(ranks)
    if ranks.world_size > 1:
        run.model = run.raw_model = run.optimizer = run.split_model = None  # they hold the group (DDP's reducer, FSDP's mesh): freed first
        world.leave_process_group()
    if exit_code:
        raise SystemExit(exit_code)
    if args.demo:
        ranks.print0(report.next_steps(args.log_dir, list_checkpoints(args.log_dir)))

if __name__ == "__main__":
    world.run_main(main)
