"""
What every layout, the planner of --parallel auto and --hours count alike, written once: a GPT-2's parameters (the
whole model's, a block's, a stage's, a tensor-parallel rank's), a token's training FLOPs, the bytes a rank's training
needs, GiB, the accumulation steps and a micro-batch's weight in the step's mean loss, and a sharded tensor's local
piece and whole. It imports nothing of the project above compute/ (the loss's ignored label): every other module of
parallel/ may use it.
"""
import torch

from compute.fused_loss import IGNORE

GiB = 2**30
STATE_BYTES = 16  # per trained parameter: fp32 weight, gradient, AdamW's two moments

def gib(b):
    return f"{b / GiB:.2f} GiB"

def max_memory_bytes(max_memory_gib):
    """--max_memory (GiB, or None: not given) in bytes, or None."""
    return max_memory_gib * GiB if max_memory_gib else None

# -----------------------------------------------------------------------------
# Parameters: GPT-2's, lm_head tied to wte

def block_parameters(n_embd, tp=1):
    """One block's parameters a rank holds: its four matrices and c_attn's and c_fc's biases (12 C^2 + 7 C), split in
    tp shares under tensor parallel, and c_proj's two biases and the two LayerNorms (6 C), whole on every rank."""
    return (12 * n_embd * n_embd + 7 * n_embd) / tp + 6 * n_embd

def stage_parameters(config, first_block, end_block, first, last, tp=1):
    """The parameters a rank holds of the blocks first_block..end_block-1 (a pipeline's stage, or all of them), with the
    embeddings (V + block_size) C where it is the first stage, and ln_f's 2 C where it is the last; lm_head is wte,
    so a last stage that is not also the first holds its own copy, V C."""
    C, V = config.n_embd, config.vocab_size
    return ((end_block - first_block) * block_parameters(C, tp) + first * (V + config.block_size) * C
            + last * (2 * C + (not first) * V * C))

def parameters(config):
    """(all of them, one block's, the embeddings' (wte, wpe))."""
    return (stage_parameters(config, 0, config.n_layer, True, True), block_parameters(config.n_embd),
            (config.vocab_size + config.block_size) * config.n_embd)

def flops_per_token(n_params, n_layer, n_embd, seq_len):
    """Training FLOPs per token (forward + backward): 6 per parameter (2 forward, 4 backward), plus
    attention's scores and weighted sum, 12 n_layer n_embd T (PaLM, appendix B)."""
    return 6 * n_params + 12 * n_layer * n_embd * seq_len

# -----------------------------------------------------------------------------
# Memory: what a rank needs at its peak, as measured

def beyond_state(params, vocab_matrices, config, bf16):
    """A rank's peak beyond its training state, as measured (peak RSS, AMD EPYC Zen 4, GPT-2 large on 3 stages, fp32
    and bf16): the process 0.3 GiB; 2 bytes a parameter (a backward's temporaries); 4 V C bytes for each vocabulary
    matrix held (the tied weight's gradients, from the embedding and the loss); in bf16, autocast's weight copies."""
    return 0.3 * GiB + (2 + 2 * bf16) * params + vocab_matrices * 4 * config.vocab_size * config.n_embd

def training_memory(params, vocab_matrices, config, bf16):
    """A rank's peak for the weights, gradients and AdamW state of `params`, and what comes with them (beyond_state);
    activations aside."""
    return STATE_BYTES * params + beyond_state(params, vocab_matrices, config, bf16)

def activation_bytes(config, rows, seq_len, layers, bf16):
    """A micro-batch's activations kept for the backward through `layers` blocks. Per token and block about 48 C
    bytes in bf16 (the inputs of the four matmuls and of attention, the LayerNorms' and GELU's inputs, in bf16 or
    fp32 as autocast leaves them) and 80 C in fp32: measured on GPT-2 (124M) as peak memory minus the state. Plus
    the loss's chunk of logits (fp32, 4096 positions x V at most)."""
    per_token = (48 if bf16 else 80) * config.n_embd
    return rows * seq_len * layers * per_token + 4 * min(rows * seq_len, 4096) * config.vocab_size

def refuse_if_over(needed, free, max_memory_gib, what, remedy):
    """One error line where `what` needs more than a rank has ('free', or --max_memory's): held to all of it, not a
    share: the estimate is not exact, and a user's explicit choice is refused only where it cannot fit."""
    if needed > free:
        raise SystemExit(f"error: {what} needs ~{gib(needed)} a rank (training state and activations), and a rank has "
                         f"{gib(free)}" + (" (--max_memory)" if max_memory_gib else " free") + f": {remedy}")

# -----------------------------------------------------------------------------
# A step: its micro-batches, and each one's share of the step's mean loss

def micro_steps(total_batch_size, batch_size, seq_len, replicas):
    """Accumulation steps a replica runs for one optimizer step of total_batch_size tokens."""
    return total_batch_size // max(batch_size * seq_len * replicas, 1)

def loss_weight(y, n_targets, replicas, n_micro):
    """What a micro-batch's mean loss is multiplied by, so that the gradients summed over a step's micro-batches and
    averaged over the replicas are the gradient of the step's mean loss over all its targets. Pretraining (n_targets
    None: every micro-batch holds as many targets): 1 / micro-batches. Task data: the micro-batch's share of the step's
    targets (counted over all replicas), times the replicas, whose gradients are then averaged (not
    transformers#34191)."""
    if n_targets is None:
        return 1 / n_micro
    return int((y != IGNORE).sum()) * replicas / max(n_targets, 1)

# -----------------------------------------------------------------------------
# A sharded tensor (FSDP's, tensor parallel's DTensor): this rank's piece, and the whole

def local(t):
    """A sharded tensor's piece on this rank (a DTensor's local part); any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t

def local_bytes(t):
    """The bytes of this rank's piece(s) of a tensor: a DTensor's local part; a ShardedTensor's pieces (tensor
    parallel's c_attn as its checkpoints write it: its numel() raises, having no whole size to give); else all of it."""
    if hasattr(t, "local_shards"):
        return sum(local_bytes(piece.tensor) for piece in t.local_shards())
    t = local(t)
    return t.numel() * t.element_size()

def whole(t):
    """A sharded tensor gathered whole (every rank of its mesh calls it); any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t

def piece_of(full, like):
    """The piece of a whole tensor that this rank holds of `like`, a sharded tensor (a DTensor: full cut as its
    placements cut it, no collective); for any other `like`, full itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()

@torch.no_grad()
def copy_weight(param, full):
    """param = full; for a sharded parameter (a DTensor), just the piece of full that this rank holds (in the order
    param.from_whole gives, where a layout holds its rows in another order: tensor parallel's c_attn)."""
    if hasattr(param, "from_whole"):
        full = param.from_whole(full)
    local(param).copy_(piece_of(full, param))
