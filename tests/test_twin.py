"""Our training step against transformers' (bench/twin_hf.py's two loops): from the same weights and batch, our
train_step's gradients (the chunked loss of compute/fused_loss.py, the tied weight's two parts, clipping) equal those of
GPT2LMHeadModel with F.cross_entropy within rounding in fp32, and round no worse than transformers' in bf16; over a few
steps (fused AdamW, decay groups, get_lr) the losses, norms and weights stay together. 12 rows of 128 positions: 1536
positions, more than LOSS_CHUNK, so the loss takes its chunked path, with a short last chunk. Nothing timed."""
import os
import sys

import pytest
import torch

from conftest import REPO
from compute.fused_loss import LOSS_CHUNK

sys.path.insert(0, os.path.join(REPO, "bench"))
import twin_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, T = 12, 128
SHAPE = ["--n_layer", "2", "--n_head", "4", "--n_embd", "64", "--batch_size", str(ROWS), "--seq_len", str(T)]


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 50257, (ROWS, T), generator=g), torch.randint(0, 50257, (ROWS, T), generator=g))
            for _ in range(n)]


def twins(dtype, steps=3, *flags):
    """(args, our loop, transformers' loop), from the same initial weights."""
    args = twin_hf.parse_args(SHAPE + ["--steps", str(steps), "--warmup_steps", "1", "--dtype", dtype, *flags])
    config = twin_hf.GPTConfig(block_size=T, vocab_size=twin_hf.PADDED_VOCAB_SIZE, n_layer=2, n_head=4, n_embd=64)
    ours, theirs = twin_hf.build_twins(config, seed=0)
    return args, twin_hf.Ours(ours, args, dtype), twin_hf.Theirs(theirs, args, dtype)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def grads(loop):
    """{name: gradient} in our layout, as the last step left them (clipped)."""
    if isinstance(loop, twin_hf.Ours):
        return {n: p.grad.clone() for n, p in loop.model.named_parameters()}
    return {n: p.grad.clone() for n, p in loop.model.named_parameters()} | {
        n: loop.model.get_parameter(n).grad.t().clone() for n, _ in loop.model.named_parameters()
        if n.endswith(twin_hf.CONV1D_WEIGHTS)}


def test_fp32_steps_equal_transformers():
    assert ROWS * T > LOSS_CHUNK and ROWS * T % LOSS_CHUNK  # two chunks, the second short
    args, ours, theirs = twins("fp32", 3, "--grad_clip", "0.3")  # below the norms: clipping acts
    start = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    for step, (x, y) in enumerate(batches(args.steps)):
        ref_lr = theirs.optimizer.param_groups[0]["lr"]  # (the scheduler sets the next step's after each step)
        (loss, norm), (ref_loss, ref_norm) = ours.step(step, x, y), theirs.step(step, x, y)
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss and abs(norm - ref_norm) <= 1e-5 * ref_norm, step
        assert norm > args.grad_clip  # (so clipping is part of what agrees)
        assert ours.run.optimizer.param_groups[0]["lr"] == pytest.approx(ref_lr, rel=1e-12), step
        g, ref = grads(ours), grads(theirs)
        bound = 1e-5 if step == 0 else 1e-4  # (after a step the weights differ by rounding too: 1.5e-5 seen)
        for n in ref:
            assert rel(g[n], ref[n]) <= bound, (step, n, rel(g[n], ref[n]))
    # and where the steps took the weights: the same, to a 1e-4 part of how far they moved
    for n, p, q in twin_hf.pairs(ours.model, theirs.model):
        moved = (p - start[n]).norm()
        assert (p - q).norm() <= 1e-4 * moved, (n, ((p - q).norm() / moved).item())


def test_bf16_gradients_round_like_transformers():
    # In bf16 neither side's gradient is the exact one: both round the matmuls' inputs and outputs, the logits and the
    # softmax's gradient to bf16. The bound: for every tensor, ours is no further from transformers' fp32 gradient (the
    # same weights and batch) than 1.5x transformers' bf16 is, and no further than 2% (bf16 keeps 8 bits). Unclipped:
    # each side's clipping would scale its gradient by its own norm's rounding.
    (x, y), = batches(1)
    _, _, exact = twins("fp32", 1, "--grad_clip", "1e9")  # transformers' in fp32
    exact.step(0, x, y)
    args, ours, theirs = twins("bf16", 1, "--grad_clip", "1e9")
    ours.step(0, x, y)
    theirs.step(0, x, y)
    g32, g16, ref16 = grads(exact), grads(ours), grads(theirs)
    for n in g32:
        err, ref_err = rel(g16[n], g32[n]), rel(ref16[n], g32[n])
        assert ref_err < 2e-2 and err < 2e-2, (n, err, ref_err)
        assert err <= 1.5 * ref_err, (n, err, ref_err)
