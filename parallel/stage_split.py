"""
Where pipeline parallel (--pp N, parallel/pipeline.py) cuts the GPT, and what each stage then holds and sends: the
blocks cut so that the stages take equal time (or, with --max_memory, fit it), each stage's parameters, and its
bytes a step, computed (the pipeline's plan line and --parallel auto's plan both read them). Arithmetic only: the
stage as a module is parallel/stage.py.

The model is openly GPT: the first stage holds the embeddings, the last ln_f and lm_head, whose weight is wte's
(tied): each of the two keeps its copy (pipeline.py sums their gradients every step).
"""
from parallel import sizes
from parallel.sharding import bytes_sent
from parallel.tensor_parallel import all_reduce_bytes

# -----------------------------------------------------------------------------
# Cutting the model: contiguous runs of blocks, balanced by their compute

def stage_costs(config, seq_len):
    """Forward FLOPs per token: (a block's, lm_head's with its loss). A block: its four matmuls (24 C^2) and attention
    (4 T C, as if not causal: the kernel's work). The embeddings are lookups: no FLOPs, but they are the first
    stage's."""
    C = config.n_embd
    return 24 * C * C + 4 * seq_len * C, 2 * config.vocab_size * C

def split_blocks(n_layer, n_stages, block_cost, head_cost, fits=None):
    """[(first block, end)] for each stage: contiguous, at least one block each, the largest stage cost (its blocks,
    plus lm_head's for the last) as small as it can be. Exact, by dynamic programming over the cut points. fits(stage,
    first block, end): False rules that stage out (None: no such cut fits)."""
    if n_stages > n_layer:
        raise SystemExit(f"error: --pp {n_stages}: more stages than the model's {n_layer} blocks")
    INF = float("inf")
    best = [[INF] * (n_layer + 1) for _ in range(n_stages + 1)]  # best[s][b]: s stages over blocks 0..b-1
    cut = [[0] * (n_layer + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        extra = head_cost if s == n_stages else 0.0
        for b in range(s, n_layer + 1):
            for a in range(s - 1, b):
                if fits is not None and not fits(s - 1, a, b):
                    continue
                cost = max(best[s - 1][a], (b - a) * block_cost + extra)
                if cost < best[s][b]:
                    best[s][b], cut[s][b] = cost, a
    if best[n_stages][n_layer] == INF:
        return None
    bounds, b = [], n_layer
    for s in range(n_stages, 0, -1):
        bounds.append((cut[s][b], b))
        b = cut[s][b]
    return bounds[::-1]

def stage_bounds(config, n_stages, seq_len, budget=None, bf16=False, tp=1):
    """Each stage's (first block, end), balanced by compute (split_blocks); with a budget (--max_memory, bytes a rank),
    the most balanced cut whose every stage's peak (sizes.training_memory, activations aside; a rank's share of it
    under --tp) fits in it, where one does: the first and last stages, which hold the vocabulary's matrices, then take
    fewer blocks."""
    def fits(s, a, b):
        first, last = s == 0, s == n_stages - 1
        params = sizes.stage_parameters(config, a, b, first, last, tp)
        return sizes.training_memory(params, first + last, config, bf16) <= budget
    costs = stage_costs(config, seq_len)
    fitting = budget and split_blocks(config.n_layer, n_stages, *costs, fits)
    return fitting or split_blocks(config.n_layer, n_stages, *costs)

# -----------------------------------------------------------------------------
# What each stage holds and sends, computed

def stage_plan(config, bounds, batch, seq_len, n_microbatches, dp, shard="none", bf16=False, backend="gloo", tp=1):
    """[(what it holds, its parameters, bytes each of its ranks sends a step)] per stage. Parameters: a rank's share of
    its blocks, the embeddings on the first stage, ln_f and lm_head's copy of wte on the last (sizes.stage_parameters).
    Sent: an fp32 activation (B, T, C) a micro-batch to the next stage, its gradient to the one before; the
    tied gradient to the other end (a 2-rank all-reduce sends it once; sharded, each rank's 1/dp piece of it); and
    among the stage's dp ranks what sharding.bytes_sent computes for the stage's parameters: DDP's ring all-reduce,
    or FSDP's gathers and reduce-scatter. Under the schedule, --shard full gathers a unit's weights M + 1 times a step,
    not 2 M: the pipeline keeps a unit gathered after each backward (torch's PipelineStage), so of the forwards only
    those after another forward gather, and of the backwards only those after a forward: for 1F1B and GPipe alike,
    every forward and then the first backward. Split (--tp), each rank also sends its blocks' tensor-parallel
    all-reduces (tensor_parallel.rank_plan)."""
    C, V, pp = config.n_embd, config.vocab_size, len(bounds)
    activation = batch * seq_len * C * 4 * n_microbatches
    gathers = {"none": None, "full": n_microbatches + 1, "grads": 1}[shard]
    plan = []
    for s, (a, b) in enumerate(bounds):
        first, last = s == 0, s == pp - 1
        params = sizes.stage_parameters(config, a, b, first, last, tp)
        tied = (pp > 1 and (first or last)) * V * C * 4 / (dp if shard != "none" else 1)
        sent = (not last) * activation + (not first) * activation + tied
        sent += all_reduce_bytes(b - a, n_microbatches, tp, batch, seq_len, C, bf16)
        sent += bytes_sent(params, params, dp, shard, n_microbatches, bf16, backend, gathers) if dp > 1 else 0
        what = ("embeddings + " if first else "") + f"blocks {a}-{b - 1}" + (" + ln_f, lm_head" if last else "")
        plan.append((what, params, sent))
    return plan
