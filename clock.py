"""
--hours: the best model this machine can train in the time given, and a schedule that ends on time. (The flag
itself, and its conflicts with others, are train_args.py's.)

  family        the shapes to choose from: GPT-2's blocks, depth d, width 64 d, d heads of 64 (nanochat's
                depth-scaled recipe), GPT-2's vocabulary with its tied lm_head, context 128 d (at most 1024)
  choose        the shape, tokens and schedule for a budget, from measured step times (a pure function)
  Budget        measures those step times here and returns the plan for the trainer to apply; then, every step,
                re-fits the last step to the clock (max_steps: the clock's, not the flag's) and gives the learning
                rate (warmup, stable, then a decay that starts from the clock)

The rule (choose). A shape trained for D tokens is predicted to reach Chinchilla's fitted loss
(Hoffmann et al. 2022, approach 3)

    L(N, D) = 1.69 + 406.4 / N^0.34 + 410.7 / D^0.28

with N every parameter, as the fit counted them (the blocks' 12 d width^2, and the embeddings: GPT-2's 50304 x
width, most of a small shape's; counting the blocks alone, as Kaplan et al. 2020 did for their own law, sized the
model too large: on 2 Zen 4 cores for 15 minutes it chose depth 6, and depths 3, 4 and 5 reached lower
losses) and D = the tokens/s measured here x the seconds left for training. The shape with the lowest L wins.
For a fixed FLOP count 6 N D this fit is lowest near 20 tokens a parameter at 1e17 FLOPs, Chinchilla's rule
(16 at 6e15, 50 at 1e21: the fit's ratio grows slowly); here D comes from the speed measured on this CPU,
where GPT-2's 50304 x width lm_head makes the small shapes slower than 6 N says, so the rule picks from
measured rates, not from FLOPs. The learning rate is GPT-2's 6e-4 at width 768, scaled as 1 / width (muP's
rule for Adam), at most 3e-3 (the demo's, at width 128); the batch about 1/500 of the tokens (a few hundred
steps), a power of two times a micro-batch of 2048 tokens (halved, down to one row, when that gives under 300
steps).

The step times are measured eagerly (a compiled run is faster: the re-fit below gives it the steps), and
otherwise as the run will train: freed memory kept for the next step (train_gpt2.py's policy but for sharded runs:
without it glibc hands back each step's logits, 0.2-0.4 GB at 2048 tokens, and faults them in again; the small
shapes were timed up to 2x slower than they then trained on 2 Zen 4 cores), and each shape with the attention the
run would choose for it (attention.choose: attention.cpp's kernel or PyTorch's SDPA, whichever is faster there).

Measuring goes from the smallest shape up and stops early: when two shapes in a row predict a higher loss than
the best so far (the curve has turned: a larger shape is slower still), and before a shape that would not fit in
90% of this rank's free memory (--parallel auto's estimate of a rank: its state, the rest, a micro-batch's
activations). Timing every depth up to 20 for --hours 1 on 2 Zen 4 cores took 10.2 GiB and 3.6 of the 60 minutes
to choose depth 3.

The schedule: warmup for 5% of the planned steps, then the peak learning rate until the clock reaches
(1 - DECAY) of the budget, then a linear decay to --min_lr (0 unless given) over the steps left. At
every step the last step is re-fitted: the seconds left (less the final evaluation's, as long as the
longest pause so far) over the mean time a step has taken, evaluations included. So a run that slows
down decays and stops earlier, one that speeds up trains longer, and both end at the budget.
"""
import math
import time
from types import SimpleNamespace

import torch

from compute import attention, cpu
from parallel import layouts, sizes
from parallel.cluster import available_memory
from plumbing.progress import STARTED, duration
from tokenizer import PADDED_VOCAB_SIZE

# the family: depths; the fit's constants (Hoffmann et al. 2022, approach 3)
DEPTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24)
E, A, B, ALPHA, BETA = 1.69, 406.4, 410.7, 0.34, 0.28
MICRO_TOKENS = 2048  # tokens of one micro-batch (rows of the shape's context)
STEPS_FOR_BATCH = 500  # the batch is sized for about this many steps
MIN_STEPS = 200  # a budget must give the smallest shape this many steps of a quarter micro-batch (512 tokens)
FEW_STEPS = 300  # a short budget's micro-batch is halved (to one row) until it gives at least this many steps
DECAY = 0.2  # the last 20% of the budget decays the learning rate (Hagele et al. 2024: as good as cosine)
EVAL_SHARE = 0.03  # a val pass takes this share of the time between evaluations (all of them: ~3% of the run)
EVALS = 10  # evaluations in a run, besides the first
PROBE_SHARE = 0.06  # measuring stops growing the shape (after two) before it would take more of the budget
PROBE_STEPS = 3  # timed steps of each shape, after one that warms up
# after the final evaluation: the report, the same-weights check and the exit, measured for a tiny model's 30-40 s
# runs: 1.0 s on 2 Xeon cores with AMX, 2.4 s on 2 AMD EPYC Zen 3 cores, 2 DDP ranks there 2.0 s, and 4.3 s beside
# another test's ranks; the reserve is the middle (a 40 s run then ends within 4% of its time on both CPUs)
EXIT_S = 3.5
PLANNED = ("n_layer", "n_head", "n_embd", "block_size", "seq_len", "batch_size", "total_batch_size", "max_steps",
           "warmup_steps", "max_lr", "min_lr", "eval_interval", "val_tokens", "checkpoint_interval", "sample_interval",
           "hellaswag_interval", "compile")

def shape(depth):
    """The family's shape of this depth, as GPTConfig's fields (less the vocabulary)."""
    return dict(n_layer=depth, n_head=depth, n_embd=64 * depth, block_size=min(1024, 128 * depth))

def config(depth):
    """The family's shape of this depth as a GPTConfig's fields, GPT-2's padded vocabulary too."""
    return SimpleNamespace(vocab_size=PADDED_VOCAB_SIZE, **shape(depth))

def parameters(depth):
    """N of the rule: every parameter, as Chinchilla's fit counted them (lm_head is the token embedding, tied)."""
    return sizes.parameters(config(depth))[0]

def probe_memory(depth, bf16):
    """Bytes the probe of this depth needs at most: the estimate of one rank training the whole model."""
    c = config(depth)
    rows = max(1, MICRO_TOKENS // c.block_size)
    return (sizes.training_memory(parameters(depth), 1, c, bf16)
            + sizes.activation_bytes(c, rows, c.block_size, depth, bf16))

def predicted_loss(n, tokens):
    return E + A / n ** ALPHA + B / max(tokens, 1.0) ** BETA

def choose(step_s, train_s, explicit=None, replicas=1):
    """The plan from measured step times. step_s: {depth: seconds of one training step of MICRO_TOKENS}; train_s:
    the seconds left for training steps (evaluations not included). explicit: {flag: value} the user gave, which
    win, and what follows from them too (a given --n_layer picks that depth). replicas: data-parallel ranks, each
    a micro-batch a micro-step (step_s is already the job's). Returns (depth, the flags planned)."""
    explicit = explicit or {}
    rates = {d: MICRO_TOKENS / s for d, s in step_s.items()}
    if explicit.get("n_layer") in rates:
        depth = explicit["n_layer"]
    else:
        depth = min(rates, key=lambda d: predicted_loss(parameters(d), rates[d] * train_s))
    tokens, plan = rates[depth] * train_s, {}
    def put(**planned):  # (what the user gave wins)
        plan.update({k: explicit.get(k, v) for k, v in planned.items()})
    put(**shape(depth))
    put(seq_len=plan["block_size"])
    rows = max(1, MICRO_TOKENS // plan["seq_len"])
    while rows > 1 and tokens / (rows * plan["seq_len"] * replicas) < FEW_STEPS:
        rows //= 2
    put(batch_size=rows)
    micro = plan["batch_size"] * plan["seq_len"] * replicas
    grow = max(0, int(math.log2(max(tokens / STEPS_FOR_BATCH / micro, 1))))
    put(total_batch_size=min(micro << grow, max(micro, 2 ** 19 // micro * micro)))
    steps = max(1, int(tokens // plan["total_batch_size"]))
    put(max_steps=steps, warmup_steps=max(1, steps // 20), min_lr=0.0, max_lr=min(3e-3, 6e-4 * 768 / plan["n_embd"]))
    put(eval_interval=max(1, plan["max_steps"] // EVALS))
    put(val_tokens=val_tokens(plan["eval_interval"], plan["total_batch_size"], plan["seq_len"], EVAL_SHARE),
        checkpoint_interval=plan["eval_interval"] * 5, sample_interval=plan["eval_interval"] * 5,
        hellaswag_interval=0, compile=train_s >= 3600)  # (a cold torch.compile costs a minute or more)
    return depth, plan

def val_tokens(eval_interval, total_batch_size, seq_len, share=0.1, most=10485760):
    """Val tokens whose pass takes `share` of the time between evaluations: a token's forward is about a third of
    its training step (2 of 6 FLOPs a parameter), so 3 x share x the tokens trained between evaluations; at most
    `most` (build-nanogpt's 8-GPU figure), at least one row."""
    return max(seq_len, min(most, int(3 * share * eval_interval * total_batch_size) // seq_len * seq_len))

def time_step(build, depth, dtype_autocast, device="cpu", steps=None, dtype=None, ranks=None):
    """Seconds of one training step (forward, backward, fused AdamW) of a micro-batch of MICRO_TOKENS, at this
    depth, the best of `steps` (PROBE_STEPS) after one that warms up (oneDNN's kernels, the allocator): the best,
    as a busy machine only ever slows a step down. dtype ('bf16', 'fp32') given: on a CPU, attention is chosen for
    this shape first, as the run will choose it (ranks: every rank takes part, they must agree)."""
    steps = steps or PROBE_STEPS
    s = shape(depth)
    rows = max(1, MICRO_TOKENS // s["block_size"])
    if dtype and device == "cpu":
        attention.choose(dtype, rows, s["n_head"], s["block_size"], s["n_embd"] // s["n_head"], ranks)
    torch.manual_seed(0)
    model = build(**s).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.split(":")[0] in ("cpu", "cuda", "xpu"))
    x = torch.randint(0, 50257, (rows, s["block_size"]), device=device)
    best = float("inf")
    for i in range(steps + 1):
        t0 = time.perf_counter()
        with dtype_autocast:
            _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0) if i else best
    return best

class Budget:
    """A --hours run's clock. plan() measures and chooses (a fresh run) or takes the saved plan (a resumed one);
    tick() after each step re-fits the last step, max_steps; lr() is the schedule. All ranks agree: the step times
    measured and the re-fitted end are averaged over them (one small all-reduce each)."""

    def __init__(self, hours, ranks, used_s=0.0, decay_from=None, max_steps=None):
        self.seconds, self.ranks, self.max_steps = hours * 3600, ranks, max_steps
        self.start = self.agree([STARTED])[0]  # (ranks start a moment apart: they agree on one start)
        self.deadline = self.start + self.seconds - used_s  # (resumed: the time the earlier processes used is gone)
        self.used_before, self.decay_from = used_s, decay_from
        self.loop_start = self.last_end = None
        self.steps_done, self.pause_s = 0, 0.0

    def agree(self, values):
        """The mean of each value over the ranks (every rank calls this at the same point)."""
        if self.ranks.world_size == 1:
            return values
        t = self.ranks.all_reduce_sum(torch.tensor(values, dtype=torch.float64, device=self.ranks.device))
        return (t / self.ranks.world_size).tolist()

    def state(self):
        """What a checkpoint keeps: the seconds used so far, and the step the decay started at."""
        return {"used_s": self.used_before + time.time() - self.start, "decay_from": self.decay_from}

    def lr(self, step, warmup_steps, max_steps, max_lr, min_lr):
        """Warmup-stable-decay, in get_lr's arguments: linear warmup, max_lr until tick() starts the decay from the
        clock, then linear to min_lr at max_steps (re-fitted as the run goes)."""
        if self.decay_from is None:
            return max_lr * min(1.0, (step + 1) / max(warmup_steps, 1))
        left = max(max_steps - self.decay_from, 1)
        return min_lr + (max_lr - min_lr) * max(0.0, 1 - (step + 1 - self.decay_from) / left)

    def tick(self, step, started_s, ended_s):
        """After step `step` ran from started_s to ended_s (time.time()): re-fits max_steps, the last step (the run
        ends after it, with the final evaluation and checkpoint); the decay starts here once the clock says so."""
        if self.loop_start is None:
            self.loop_start = started_s
        elif self.last_end is not None:
            self.pause_s = max(self.pause_s, started_s - self.last_end)  # an evaluation, a checkpoint
        self.last_end, self.steps_done = ended_s, self.steps_done + 1
        per_step = (ended_s - self.loop_start) / self.steps_done  # evaluations included
        left = self.deadline - ended_s - self.pause_s - EXIT_S
        end, decaying = self.agree([step + 1 + max(0.0, left) / per_step, float(
            ended_s - self.start + self.used_before >= (1 - DECAY) * self.seconds)])
        if decaying and self.decay_from is None:
            self.decay_from = step + 1
        self.max_steps = max(step + 1, int(end))

    @classmethod
    def plan(cls, run, build, ckpt=None):
        """(the clock, the plan: {flag: value} for what was not given, for the trainer to apply). A fresh run: measure
        the family here (build(**shape) makes a GPT), choose, and print the plan as one line. Resumed (ckpt: its
        checkpoint): its plan stands (its flags are its arguments already), its clock goes on."""
        args, ranks = run.args, run.ranks
        if ckpt is not None and ckpt.get("budget"):
            return cls(args.hours, ranks, ckpt["budget"]["used_s"], ckpt["budget"]["decay_from"], args.max_steps), {}
        budget, explicit, step_s = cls(args.hours, ranks), args.explicit, {}
        max_memory = getattr(args, "max_memory", None)
        free, too_big = min(ranks.gather(available_memory(ranks, max_memory))), ""
        if explicit.get("n_layer") and ranks.device == "cpu":  # one error line, before any measuring
            sizes.refuse_if_over(probe_memory(explicit["n_layer"], run.dtype == "bf16"), free, max_memory,
                                 f"--n_layer {explicit['n_layer']}",
                                 "a smaller --n_layer, or none (--hours chooses one that fits)")
        # attention.cpp's kernel, compiled once per machine: not the probe's, the run needs it too
        built_s = time.time()
        if ranks.device == "cpu" and run.dtype == "bf16":
            attention.kernel()
        built_s = time.time() - built_s
        cpu.keep_freed_memory()  # (as the run will; choose_layout sets the run's own policy after)
        def timed(depth):  # (seconds of a step, spent so far, spent building the kernel): the ranks' mean
            step = time_step(build, depth, run.autocast, ranks.device, dtype=run.dtype, ranks=ranks)
            return budget.agree([step, time.time() - budget.start, built_s])
        for depth in DEPTHS:
            if explicit.get("n_layer", depth) != depth and depth > min(DEPTHS):
                continue  # (the smallest is always timed: it says whether the budget is long enough)
            need = probe_memory(depth, run.dtype == "bf16") if ranks.device == "cpu" else 0
            if depth > min(DEPTHS) and need > layouts.HEADROOM * free:  # (free: the least of any rank's)
                too_big = f" (depth {depth} would need ~{sizes.gib(need)} of {sizes.gib(free)} free: not timed)"
                break
            step, spent, built = timed(depth)
            step_s[depth] = step / run.replicas  # (every rank decides from the same numbers: they stay in step)
            if depth == min(DEPTHS):
                check_long_enough(budget.seconds, spent, step_s[depth], args.hours)
            next_probe = (PROBE_STEPS + 1) * step_s[depth] * 2  # (about: the next shape's steps are slower)
            if (len(step_s) > 1 and spent - built + next_probe > PROBE_SHARE * budget.seconds
                    or step_s[depth] * FEW_STEPS > budget.seconds - spent
                    or turned(step_s, train_seconds(budget.seconds, spent))):
                break  # (the next probe would take measuring past its share, this shape could not train enough, or
                # the predicted loss has turned)
        if explicit.get("n_layer", min(DEPTHS)) not in step_s:
            step, spent, _ = timed(explicit["n_layer"])
            step_s[explicit["n_layer"]] = step / run.replicas
        cpu.keep_freed_memory(False)
        train_s = train_seconds(budget.seconds, spent)
        depth, plan = choose(step_s, train_s, explicit, run.replicas)
        budget.max_steps = plan["max_steps"]
        ends = time.strftime("%H:%M:%S", time.localtime(budget.deadline))
        given = " ".join(f"--{k}" for k in sorted(explicit)) or "none"
        rates = ", ".join(f"{d} layers {MICRO_TOKENS / s:.0f}" for d, s in step_s.items())
        blocks = plan["n_layer"] * sizes.block_parameters(plan["n_embd"])
        ranks.print0(f"plan: {plan['n_layer']} layers x {plan['n_embd']} wide ({plan['n_head']} heads, context "
                     f"{plan['block_size']}), {parameters(depth) / 1e6:.1f}M parameters ({blocks / 1e6:.2f}M in "
                     f"blocks), {plan['max_steps'] * plan['total_batch_size'] / 1e6:.2f}M tokens in "
                     f"~{plan['max_steps']} steps of {plan['total_batch_size']}, lr {plan['max_lr']:.2g}, "
                     f"ends by {ends} ({duration(budget.seconds)} in all); measured tokens/s: {rates}{too_big}; "
                     f"flags given that override it: {given}")
        return budget, plan

def train_seconds(seconds, spent):
    """The seconds left for training steps: the budget less what is spent, the exit and the evaluations."""
    return (seconds - spent - EXIT_S) * (1 - EVAL_SHARE * 1.5)

def turned(step_s, seconds_left):
    """Whether the last two shapes measured both predict a higher loss than the best so far, given the seconds
    left (the larger shapes, slower still, would not win)."""
    loss = {d: predicted_loss(parameters(d), MICRO_TOKENS / s * seconds_left) for d, s in step_s.items()}
    last = list(loss)[-2:]
    return len(last) == 2 and all(loss[d] > min(loss.values()) for d in last)

def check_long_enough(seconds, spent, step_s, hours):
    """One error line when the budget cannot give the smallest shape MIN_STEPS steps (with the time already spent
    starting up and measuring, and the evaluations); it names the shortest budget that can, here."""
    need = (spent + MIN_STEPS * step_s / 4 + EXIT_S) / (1 - EVAL_SHARE * 1.5 - PROBE_SHARE)
    if seconds < need:
        raise SystemExit(f"error: --hours {hours:g} ({duration(seconds)}) is too short: the smallest model of the "
                         f"family needs about {duration(need)} here for {MIN_STEPS} steps; give at least --time "
                         f"{math.ceil(need / 60)}m")
