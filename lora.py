"""
LoRA (Hu et al., 2021): fine-tune a frozen GPT through low-rank adapters. Each target Linear (y = x W^T + b) gains A
(R x in) and B (out x R), and computes

    y = x W^T + b + (alpha / R) (x A^T) B^T

with W and b frozen: only A and B train, about 1% of GPT-2's parameters at R 16. So the base needs no gradients, no
AdamW moments and no fp32 master copy (16 bytes a parameter for full fine-tuning, 2 or 4 here), and backward skips its
weight gradients, a third of a step's work. B starts at zero, so at step 0 the model is exactly the base. For
inference the update merges into W (W + (alpha / R) B A): a plain GPT again, as fast as the base.

A library: train_gpt2.py trains with it (--lora R), every script that loads a checkpoint merges with it
(model.load_model), and export_hf.py writes peft's adapter layout with it.
"""
import hashlib
import math
import os

import torch
import torch.nn as nn
from torch.nn import functional as F

from plumbing.checkpoints import checked
from plumbing.inputs import pretrained_files
from parallel.sizes import copy_weight, local, piece_of

# --lora_targets: the Linear layers of each block that get adapters (GPT-2's module names, which peft uses too)
TARGETS = {"attn": "attn.c_attn", "proj": "attn.c_proj", "fc": "mlp.c_fc", "mlp_proj": "mlp.c_proj"}

class LoRALinear(nn.Linear):
    """A frozen Linear with its adapters. add_adapters turns a model's Linear into one in place (its class changes):
    its weight and bias stay the same tensors, under the same names."""

    def forward(self, x):
        if torch.is_grad_enabled() or x.numel() // x.size(-1) * (self.in_features + self.out_features) >= \
                self.in_features * self.out_features:
            return LoRAProduct.apply(x, self.weight, self.bias, self.lora_A, self.lora_B, self.lora_scale)
        # No gradient, and fewer tokens than the layer's width (generating: one token a forward): making W + s B A
        # costs R times a token's product with W, so the adapters go beside W instead, two thin products (peft's way)
        return F.linear(x, self.weight, self.bias) + self.lora_scale * F.linear(F.linear(x, self.lora_A), self.lora_B)

# How the adapters compute. Written as it reads, x Wᵀ + b + s (x Aᵀ) Bᵀ runs six thin matrix products (one side 16
# wide) besides the base's two, forward and backward, each reading a whole (tokens x width) activation or gradient
# for a few FLOPs: on a CPU, where such products run at a fraction of the matmul rate, they cost as much as the
# weight gradient that LoRA saves (measured at GPT-2's MLP, 4096 tokens: 0.91 s of CPU time against full
# fine-tuning's 0.92). So the forward multiplies by W + s B A (that sum is a 16-rank product, 1% of the layer's), and
# backward takes x's gradient through it too; it leaves four thin products, for A's and B's gradients: 0.79 s.
# W + s B A is made again in backward rather than kept: a layer's worth of memory, not a model's. The same math as
# peft's (tests/test_lora.py), rounded in another order.

class LoRAProduct(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias, A, B, scale):  # (under autocast, its matmuls run in autocast's dtype)
        ctx.save_for_backward(x, weight, A, B)
        ctx.scale = scale
        return F.linear(x, merged(weight, A, B, scale), bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight, A, B = ctx.saved_tensors
        g = grad.reshape(-1, grad.size(-1))  # (tokens, out), in the dtype the forward's matmuls ran in: so is the rest
        x, A, B = x.reshape(-1, x.size(-1)).to(g.dtype), A.to(g.dtype), B.to(g.dtype)
        # (x's gradient only where something before needs it: not for the first block's c_attn on a frozen base)
        grad_x = (g @ merged(weight.to(g.dtype), A, B, ctx.scale)).view(grad.shape[:-1] + (-1,)) \
            if ctx.needs_input_grad[0] else None
        grad_A = ctx.scale * (g @ B).t() @ x   # dL/dA = s (g B)ᵀ x
        grad_B = ctx.scale * g.t() @ (x @ A.t())   # dL/dB = s gᵀ (x Aᵀ)
        return grad_x, None, None, grad_A, grad_B, None  # (autograd casts to A's dtype)

def merged(weight, A, B, scale):
    """W + scale B A, in W's dtype."""
    return torch.addmm(weight, B.to(weight.dtype), A.to(weight.dtype), alpha=scale)

def parse_targets(text):
    """--lora_targets 'attn,fc' (or a resumed run's list) -> ['attn', 'fc'], in TARGETS' order; one error line for a
    name it does not know."""
    text = ",".join(text) if isinstance(text, list) else text
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise SystemExit(f"error: --lora_targets {text!r}: {'unknown ' + repr(unknown[0]) if unknown else 'none given'}"
                         f" (choose from {', '.join(TARGETS)})")
    return [t for t in TARGETS if t in names]

def adapted(model):
    """The model's LoRALinear layers, (name, module), in the model's order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]

def add_adapters(model, rank, alpha, targets, init=True):
    """Freeze all of model, then give each target Linear of each block its adapters, in fp32 (they train) on the
    weight's device; init: their first values (init_adapters). (A model built on the meta device, to be sharded, gets
    them once it has memory.) Returns the model."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.transformer.h:
        for target in targets:
            linear = block.get_submodule(TARGETS[target])
            linear.__class__ = LoRALinear
            device = linear.weight.device
            linear.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, device=device))
            linear.lora_B = nn.Parameter(torch.empty(linear.out_features, rank, device=device))
            linear.lora_scale = alpha / rank
    if init:
        init_adapters(model)
    return model

def init_adapters(model, seed=0):
    """A as peft (and nn.Linear) initialize a weight, kaiming-uniform (a = sqrt(5)), and B zeros. A is drawn whole,
    layer after layer, from a generator of its own, seeded: the same values however the base was built (whole,
    sharded, in bf16, or loaded: each draws differently from torch's generator), a sharded model's ranks keeping
    their pieces of them."""
    generator = torch.Generator().manual_seed(seed)
    present = dict(adapted(model))  # (a pipeline's stage holds some blocks: the others' draws are made and dropped)
    kinds = {name.split(".", 3)[3]: linear.lora_A.shape for name, linear in present.items()}  # attn.c_attn: (R, C), ...
    for i in range(model.config.n_layer):
        for kind, shape in kinds.items():
            A = torch.empty(shape)
            nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
            if (linear := present.get(f"transformer.h.{i}.{kind}")) is not None:
                copy_weight(linear.lora_A, A)
                copy_weight(linear.lora_B, torch.zeros(linear.lora_B.shape))

def merge(model):
    """W += (alpha / R) B A in every adapted layer, which becomes a plain Linear again: the model for inference."""
    for _, linear in adapted(model):
        add_to_weight(linear.weight, linear.lora_B, linear.lora_A, linear.lora_scale)
        del linear.lora_A, linear.lora_B, linear.lora_scale
        linear.__class__ = nn.Linear
    return model

def merge_saved(model, saved, scale):
    """A LoRA checkpoint's adapters (saved: {name: tensor}, adapters()' names) merged into the plain model that holds
    their base (sharded or not, in any dtype), layer after layer: W += scale B A. Returns the model."""
    modules = dict(model.named_modules())
    for name in [n for n in saved if n.endswith(".lora_A")]:
        layer = name[:-len(".lora_A")]
        add_to_weight(modules[layer].weight, saved[layer + ".lora_B"], saved[name], scale)
    return model

def add_to_weight(weight, B, A, scale):
    """weight += scale B A, the sum taken in fp32 and rounded once to weight's dtype; a sharded weight (a DTensor)
    adds just its piece."""
    with torch.no_grad():
        delta = piece_of(scale * (B.detach().float() @ A.detach().float()), weight)
        weight = local(weight)
        weight.copy_((weight.float() + delta).to(weight.dtype))

def adapter_shapes(config, rank, targets):
    """{name: shape} of the adapters add_adapters gives a GPT of this config: what a sharded checkpoint is asked for."""
    sizes = {"attn": (config.n_embd, 3 * config.n_embd), "proj": (config.n_embd, config.n_embd),
             "fc": (config.n_embd, 4 * config.n_embd), "mlp_proj": (4 * config.n_embd, config.n_embd)}
    return {f"transformer.h.{i}.{TARGETS[t]}.{part}": (rank, sizes[t][0]) if part == "lora_A" else (sizes[t][1], rank)
            for i in range(config.n_layer) for t in targets for part in ("lora_A", "lora_B")}

def adapters(model):
    """{name: tensor} of the adapters alone: what a LoRA checkpoint holds of the model."""
    return {name: p.detach() for name, p in model.named_parameters() if ".lora_" in name}

def describe(model, rank, alpha, targets):
    """The line a run prints: 'lora: r 16, alpha 32, 4 targets, 2.36M trainable parameters (1.9%)'."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    count = f"{trainable / 1e6:.2f}M" if trainable >= 10_000 else f"{trainable:,}"
    return (f"lora: r {rank}, alpha {alpha:g}, {len(targets)} targets ({', '.join(targets)}), {count} trainable "
            f"parameters ({100 * trainable / total:.1f}%), the base frozen")

# -----------------------------------------------------------------------------
# The base. A LoRA checkpoint holds the adapters, not the base, so it records which base they belong to: its name (or
# path), and the sha256 of the weights as loaded: the file they were read from (a Hugging Face-layout folder's
# model.safetensors, one of our checkpoints), or, for a random base, the shapes and seed it was drawn with. A resumed
# run, or a script that merges the adapters, loads the base again and refuses another one.

def base_identity(name, config, seed, files):
    """{'name', 'sha256'} of a base: files, the ones its weights were read from (none: a random base)."""
    digest = hashlib.sha256()
    if not files:
        digest.update(repr((sorted(vars(config).items()), seed, torch.__version__)).encode())
    for path in files:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return {"name": name, "sha256": digest.hexdigest()}

def base_files(name, hub_names):
    """The files a base's weights are read from: OpenAI's (hub_names) or a folder's model.safetensors, one of our
    checkpoints; none for a random base ('scratch')."""
    if name == "scratch":
        return []
    if os.path.isfile(name) or os.path.isfile(os.path.join(name, "meta.pt")):
        return weight_files(name)
    return [pretrained_files(name, hub_names)[1]]

def start(model, args, ckpt, hub_names):
    """A LoRA run's adapters on the base that model holds: drawn afresh, or a resumed run's (checked to belong to
    this base; a sharded checkpoint's are read with its AdamW state). Returns (what its checkpoints record: rank,
    alpha, targets, the base's identity; the line to print)."""
    base = base_identity(args.init_from, model.config, args.seed, base_files(args.init_from, hub_names))
    if ckpt is None:
        init_adapters(model, args.seed)
    else:
        check_base(base, ckpt["lora"]["base"], f"--resume with --init_from {args.init_from}")
        for name, p in model.named_parameters():
            if ".lora_" in name and not ckpt["sharded_path"]:
                copy_weight(p, checked(ckpt, "model", name))
    line = (describe(model, args.lora, args.lora_alpha, args.lora_targets)
            + f" ({args.init_from}, sha256 {base['sha256'][:12]})")
    return {"rank": args.lora, "alpha": args.lora_alpha, "targets": args.lora_targets, "base": base}, line

def check_base(found, expected, what):
    if found["sha256"] != expected["sha256"]:
        raise SystemExit(f"error: {what}: its adapters belong to the base {expected['name']} (sha256 "
                         f"{expected['sha256'][:16]}…), but {found['name']} is another one (sha256 "
                         f"{found['sha256'][:16]}…)")

def weight_files(path):
    """The files one of our checkpoints keeps its weights in: the .pt file, or every file of a .dcp folder."""
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path))
    return [path]

# -----------------------------------------------------------------------------
# peft's layout (export_hf.py --adapter): what peft.PeftModel.from_pretrained(base, folder) loads onto a transformers
# GPT2LMHeadModel. GPT-2's Linear layers are transformers' Conv1D there, which stores W as (in, out): fan_in_fan_out.
# A and B keep their shapes, (R, in) and (out, R), as peft's lora_A and lora_B Linear layers store them.

def peft_files(model, rank, alpha, targets, base_name):
    """(adapter_config.json's dict, {name: tensor} for adapter_model.safetensors)."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name, "r": rank,
              "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": True,
              "target_modules": [TARGETS[t] for t in targets], "init_lora_weights": True, "inference_mode": True,
              "use_rslora": False, "use_dora": False, "modules_to_save": None}
    return config, {f"base_model.model.{name}.weight": tensor.float().contiguous()   # ...c_attn.lora_A.weight
                    for name, tensor in adapters(model).items()}
