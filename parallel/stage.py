"""
One stage of pipeline parallel (--pp N) as a module: the GPT with what the other stages hold removed, whose forward
runs this stage's part of a micro-batch (and, on the last stage, its loss). parallel/pipeline.py's schedule calls it;
parallel/stage_split.py says where the stages are cut.
"""

import torch
import torch.nn as nn

from compute import speedups
from compute.fused_loss import lm_head_loss

def cut_to_stage(gpt, index, n_stages, blocks):
    """gpt, in place, with what other stages hold removed: their blocks become Identity, so the parameters keep the
    whole model's names, as checkpoints have them; the embeddings stay on the first stage, ln_f and lm_head on the
    last. On the meta device (before any storage: a rank builds only its stage), or again on a cut one (no change)."""
    for i in range(len(gpt.transformer.h)):
        if i not in range(*blocks):
            gpt.transformer.h[i] = nn.Identity()
    if index > 0 and "wte" in gpt.transformer:
        del gpt.transformer["wte"], gpt.transformer["wpe"]
    if index < n_stages - 1 and "ln_f" in gpt.transformer:
        del gpt.transformer["ln_f"]
        gpt.lm_head = None
    return gpt

class Stage(nn.Module):
    """One stage of a GPT: the GPT itself with what other stages hold removed (their blocks become Identity, so the
    parameters keep the whole model's names, as checkpoints have them). Inputs: token ids (first stage) or the
    residual stream (B, T, C); output: the residual stream, or on the last stage the micro-batch's loss when its side
    carries a Target. The loss is inside forward so that lm_head's weight is used where FSDP has gathered it."""

    def __init__(self, gpt, index, n_stages, blocks, dtype="fp32", device_type="cpu"):
        super().__init__()
        self.dtype, self.device_type = dtype, device_type
        self.first, self.last, self.blocks = index == 0, index == n_stages - 1, range(*blocks)
        self.gpt = cut_to_stage(gpt, index, n_stages, blocks)
        self.compiled = None  # run(), compiled (pipeline.Pipeline.compile): for training; evaluation runs it eagerly

    def autocast(self):
        """The run's autocast, made afresh for each forward (the schedule runs them)."""
        return speedups.autocast(self.dtype, self.device_type)

    def forward(self, x, side=None):
        if self.compiled is not None and torch.is_grad_enabled():
            return self.compiled(x, side)
        return self.run(x, side)

    def run(self, x, side=None):
        with self.autocast():
            h = self.layers(x, side.packed if side is not None else None)
            return self.loss(h, side.target) if self.last and side is not None and side.target else h

    def loss(self, h, target):
        """The last stage's loss of one micro-batch, as GPT.forward computes it, times its weight in the step."""
        y, packed = target.y, target.packed
        if packed is not None:  # only the targets' positions through lm_head
            h, y = h.flatten(0, 1)[packed.picked], y.flatten()[packed.picked]
        return (lm_head_loss(h, self.gpt.lm_head.weight, y) * target.weight).float()

    def layers(self, x, packed):
        t = self.gpt.transformer
        if self.first:
            T = x.size(1)
            positions = packed.positions if packed is not None else torch.arange(T, device=x.device)
            x = t.wte(x) + t.wpe(positions)
        lengths = packed.lengths if packed is not None else None
        for layer in self.blocks:
            if self.gpt.recompute:  # as GPT.hidden does: keep only the block's input for backward
                x = torch.utils.checkpoint.checkpoint(t.h[layer], x, None, layer, None, lengths, use_reentrant=False)
            else:
                x = t.h[layer](x, None, layer, None, lengths)
        return t.ln_f(x) if self.last else x

class Side:
    """A micro-batch's packing (dataloader.Packed, or None) and, for the last stage, its Target, handed to every stage
    beside its input. Wrapped so that the pipeline's schedules pass it through untouched, not as tensors to send or
    to differentiate."""

    def __init__(self, packed, target=None):
        self.packed, self.target = packed, target

class Target:
    """What the last stage's loss needs of a micro-batch: its targets, its packing, and its weight in the step's
    mean."""

    def __init__(self, y, packed, weight):
        self.y, self.packed, self.weight = y, packed, weight
