"""
The loss of a language model, F.cross_entropy(lm_head(x), targets), with lm_head and the cross-entropy fused, a chunk of
positions at a time: the same numbers (up to rounding), without ever holding all the logits.
"""
import torch

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
# A target of IGNORE (fine-tuning: a prompt token, padding) counts for nothing: N counts the others, and a
# batch with none has loss 0 (not 0/0). GPT.forward drops such positions before they get here, when it can.
IGNORE = -100  # F.cross_entropy's ignore_index, and transformers' label for a position that is no target
LOSS_CHUNK = 1024  # positions per chunk: their fp32 logits take 1024 x 50304 x 4 bytes = 206 MB

def lm_head_loss(x, weight, targets):
    """F.cross_entropy(x @ weight.T, targets, ignore_index=IGNORE) for x (..., C) and targets (...), chunk by chunk, but
    0 where nothing is a target. Under autocast the matmuls run in its dtype, as lm_head's would; softmax in fp32."""
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    with torch.autocast(device_type, enabled=False):  # the dtypes below are chosen by hand
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return LMHeadLoss.apply(x, weight, targets, dtype)
        loss, _, _, n = chunked_loss(x, weight, targets, dtype, grads=())  # validation: the loss alone
        return loss / n.clamp(min=1)

def chunked_loss(x, weight, targets, dtype, grads):
    """Summed cross-entropy over the targets that count, its gradients with respect to x (N, C) and weight (V, C) as
    grads asks ("x", "weight": a frozen weight, LoRA's, needs none, and skipping it saves a third of the work), and
    how many targets counted."""
    N = x.size(0)
    w = weight.to(dtype)  # one cast of the (tied) weight per call, not one per chunk
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x) if "x" in grads else None
    grad_w = torch.zeros_like(weight, dtype=torch.float32) if "weight" in grads else None  # summed over chunks in fp32
    counts = targets != IGNORE
    for i in range(0, N, LOSS_CHUNK):
        counted = counts[i:i + LOSS_CHUNK, None]
        yc = targets[i:i + LOSS_CHUNK, None].clamp(min=0)  # (an ignored target reads row 0, then counts for nothing)
        xc = x[i:i + LOSS_CHUNK].to(dtype)
        logits = (xc @ w.t()).float()
        lse = torch.logsumexp(logits, dim=1, keepdim=True)  # the log of softmax's denominator
        target_logits = logits.gather(1, yc)
        loss += ((lse - target_logits) * counted).sum()  # -log softmax(logits)[target], summed over the chunk
        if grads:
            # softmax in place of the logits, then in the matmuls' dtype, as autocast's backward would use.
            # torch.compile fuses this with the logsumexp into one pass that writes only the bf16 result.
            g = logits.sub_(lse).exp_().to(dtype)
            # minus one-hot(target): the targets' probabilities are recomputed from their logits and
            # written over g's, so that they are rounded once, like all the others
            g.scatter_(1, yc, (target_logits - lse).exp_().sub_(1.0).to(dtype))
            # an ignored position's gradient is zero: its row of grad_x, and its row of xc in grad_w's product
            if grad_x is not None:
                grad_x[i:i + LOSS_CHUNK] = (g @ w) * counted
            if grad_w is not None:
                # (.float() by hand: torch 2.8's compiler fused `fp32 += bf16 product` into one addmm of mixed dtypes,
                # which fails at run time: "self and mat2 must have the same dtype")
                grad_w += (g.t() @ (xc * counted)).float()
    return loss, grad_x, grad_w, counts.sum()

class LMHeadLoss(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, targets, dtype):
        grads = [name for name, t in (("x", x), ("weight", weight)) if t.requires_grad]
        loss, grad_x, grad_w, n = chunked_loss(x, weight, targets, dtype, grads)
        n = n.clamp(min=1)
        ctx.save_for_backward(grad_x, grad_w, n)
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w, n = ctx.saved_tensors
        scale = grad_loss / n  # the mean's 1/N, applied to these two gradients rather than to all the logits
        return (None if grad_x is None else grad_x * scale), (None if grad_w is None else grad_w * scale), None, None
