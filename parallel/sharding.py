"""
Sharding (FSDP2): the weights, gradients and AdamW state of a GPT split across the ranks; and the bytes data parallel
sends a step, sharded or not. Openly model-aware: it shards GPT's blocks one by one (build.py builds it so, never
whole).
"""
import torch

from parallel import parts

def shard_model(model, ranks, bf16, keep_gathered=False):
    """FSDP2 (fully sharded data parallel): every parameter is split in world_size pieces along its first
    dimension, one per rank, and so are its gradient and AdamW's moments. Each block is its own unit:
    its weights are all-gathered just before its forward (and again for its backward), then freed; its
    gradients are reduce-scattered, each rank keeping the piece it owns. What stays unsharded in memory
    is one block's weights at a time, and the activations. The root unit holds the embeddings, whose
    weight lm_head shares (tied): it stays one parameter, sharded once.
    bf16: the weights are all-gathered in bf16 (half the traffic), and used as such, so autocast keeps no
    bf16 copy of every weight for backward; gradients are reduced in fp32 and AdamW updates fp32 pieces.
    keep_gathered (--shard grads, ZeRO-2): a unit's weights, once gathered, stay whole after its forward, and
    train_step keeps them through the backward of every micro-step but the last (set_reshard_after_backward):
    one all-gather per optimizer step instead of two per micro-step, for the whole model's weights in memory."""
    from torch.distributed.fsdp import fully_shard
    policy = precision(bf16)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy, reshard_after_forward=not keep_gathered)
    fully_shard(model, mp_policy=policy, reshard_after_forward=not keep_gathered)
    ranks.print0(f"shard: FSDP2, each rank holds 1/{ranks.world_size} of the " + (
        "AdamW state; the weights are gathered once a step, the gradients accumulate whole until its last micro-step "
        "and are then reduce-scattered (ZeRO-2)" if keep_gathered else
        "weights, gradients and AdamW state"))

def precision(bf16):
    """FSDP2's policy: under bf16, weights gathered in bf16 and gradients reduced in fp32; else fp32 throughout."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else
            MixedPrecisionPolicy())

def load_full_optimizer_state(model, optimizer, state):
    """A plain checkpoint's AdamW state (as optimizer.state_dict() numbers the parameters) into the
    optimizer of a sharded model: each rank keeps its pieces. The numbering is configure_optimizer's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    by_name = parts.by_name({}, state, parts.trained_names(model))["optimizer"]
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))

def ring(world_size, size):
    """Bytes a rank sends in a ring all-gather or reduce-scatter of `size` bytes (an all-reduce is both)."""
    return (world_size - 1) / world_size * size

def bytes_sent(weights, grads, world_size, shard, micro_steps, bf16, backend="gloo", gathers=None):
    """Bytes each rank sends an optimizer step under DDP (--shard none) or FSDP (full, grads): see plan_line.
    gathers: how many times a step each weight is all-gathered, where not this trainer's (a pipeline's stage)."""
    if shard == "none":
        return 2 * ring(world_size, grads * 4)
    gathers = (gathers or {"full": 2 * micro_steps, "grads": 1}[shard]) * weights
    scatter = 2 if backend == "gloo" else 1
    return ring(world_size, gathers * (2 if bf16 else 4) + scatter * grads * 4)

def plan_line(model, world_size, shard, micro_steps, bf16, backend):
    """DDP's and FSDP's bytes each rank sends an optimizer step, computed (bench/bench_parallel.py measures them).
    The collectives are rings: an all-gather sends (n-1)/n of the whole tensor from each rank, a reduce-scatter as
    much, an all-reduce twice that; but gloo reduce-scatters by all-reducing (each rank then keeps its piece): twice.
    DDP all-reduces the gradients once a step. --shard full all-gathers every weight for each micro-step's forward
    and again for its backward (the root unit too, the embeddings: we reshard it after forward, where FSDP2's default
    would keep it), and reduce-scatters the gradients once; --shard grads gathers every weight once a step.
    Weights travel in bf16 under --dtype bf16 when sharded; gradients always in fp32."""
    weights = sum(p.numel() for p in model.parameters())  # (the tied lm_head counted once)
    grads = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sent = bytes_sent(weights, grads, world_size, shard, micro_steps, bf16, backend)
    if shard == "none":
        how = "a ring all-reduce of the gradients"
    else:
        how = ("every weight all-gathered twice a micro-step" if shard == "full" else
               "the weights all-gathered once") + f", the gradients reduce-scattered once ({backend})"
    return (f"data parallel: {world_size} ranks, --shard {shard}, {micro_steps} micro-steps a step: {how}; "
            f"each rank sends {sent / 1e6:.1f} MB a step (computed)")
