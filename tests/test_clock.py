"""--hours (clock.py): the planner's choice against its rule on given step times, the schedule's decay
starting from a fake clock and the last step re-fitted to it, the error lines, the default val pass sized to the
run, the forecast before the first step, and a real --hours run on the demo's text that ends on time."""
import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, make_shards
from parallel import world
from plumbing import progress
import clock
import train_args


class OneRank(world.Ranks):
    """One process, quiet."""

    def __init__(self):
        super().__init__(0, 1, 0, 1, "single")

    def print0(self, *a):
        pass


def lm_head_bound_step_s(gflops=100.0):
    """Step times of a CPU whose speed is its FLOPs: the lm_head (50304 x width) and the blocks."""
    return {d: clock.MICRO_TOKENS * 6 * (50304 * 64 * d + 12 * d * (64 * d) ** 2) / (gflops * 1e9)
            for d in clock.DEPTHS}


# -----------------------------------------------------------------------------
# The rule

@pytest.mark.parametrize("train_s", [180, 900, 3600, 36000, 360000])
def test_the_plan_minimises_the_predicted_loss_of_the_measured_speeds(train_s):
    step_s = lm_head_bound_step_s()
    depth, plan = clock.choose(step_s, train_s)
    loss = {d: clock.predicted_loss(clock.parameters(d), clock.MICRO_TOKENS / s * train_s) for d, s in step_s.items()}
    assert depth == min(loss, key=loss.get)  # the lowest predicted loss wins ...
    assert loss[depth] < min(loss[depth - 1] if depth - 1 in loss else 99, loss.get(depth + 1, 99))
    assert plan["n_layer"] == plan["n_head"] == depth and plan["n_embd"] == 64 * depth
    tokens = clock.MICRO_TOKENS / step_s[depth] * train_s
    assert plan["max_steps"] == int(tokens // plan["total_batch_size"])  # ... trained on what the time allows
    assert plan["total_batch_size"] % (plan["batch_size"] * plan["seq_len"]) == 0
    assert plan["max_steps"] >= min(clock.FEW_STEPS, tokens // plan["seq_len"]) or plan["batch_size"] == 1
    assert plan["max_lr"] == pytest.approx(min(3e-3, 6e-4 * 768 / plan["n_embd"]))
    assert plan["warmup_steps"] == max(1, plan["max_steps"] // 20) and plan["min_lr"] == 0.0
    # a val pass is EVAL_SHARE of the time between evaluations: a forward token is a third of a training one
    val_share = plan["val_tokens"] / 3 / (plan["eval_interval"] * plan["total_batch_size"])
    assert val_share <= clock.EVAL_SHARE + 1e-9 and (plan["val_tokens"] == plan["seq_len"] or val_share > 0.02)
    assert plan["compile"] == (train_s >= 3600) and plan["hellaswag_interval"] == 0


@pytest.mark.parametrize("depth", [2, 4, 12])
def test_the_rule_counts_every_parameter_as_chinchillas_fit_did(depth):
    """Chinchilla's constants were fitted with N counting every parameter; a small shape's are mostly its
    embedding (depth 4: 13M of 16M), and counting the blocks alone sized the model too large for the time (2 Zen 4
    cores, 15 minutes: depth 6 chosen, depth 4 trained to a lower loss)."""
    import torch
    from model import GPTConfig, GPT
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50304, **clock.shape(depth)))
    counted = sum(p.numel() for p in model.parameters())  # (tied: lm_head's weight is wte's, counted once)
    assert clock.parameters(depth) == pytest.approx(counted, rel=0.01)  # (less the biases and LayerNorms)


def test_longer_budgets_choose_bigger_shapes_near_chinchillas_ratio_at_scale():
    step_s = lm_head_bound_step_s()
    depths = [clock.choose(step_s, t)[0] for t in (600, 6000, 60000, 600000, 6e6, 6e7)]
    assert depths == sorted(depths) and depths[0] < depths[-1]
    # with a rate that follows 6 N (no lm_head), the law's optimum is near Chinchilla's 20 tokens a parameter at
    # 1e17 FLOPs (the fit's ratio grows slowly with compute: ~16 at 6e15 FLOPs, ~50 at 1e21)
    flops_only = {d: clock.MICRO_TOKENS * 6 * clock.parameters(d) / 1e15 for d in range(1, 200)}
    depth, _ = clock.choose(flops_only, 100)
    ratio = clock.MICRO_TOKENS / flops_only[depth] * 100 / clock.parameters(depth)
    assert 12 < ratio < 30, ratio


def test_flags_given_win_and_what_follows_from_them_too():
    depth, plan = clock.choose(lm_head_bound_step_s(), 900, {"n_layer": 2, "batch_size": 3, "max_lr": 1e-3})
    assert depth == 2 and plan["n_layer"] == 2 and plan["max_lr"] == 1e-3 and plan["batch_size"] == 3
    assert plan["total_batch_size"] % (3 * plan["seq_len"]) == 0  # the batch is built on the given rows


# -----------------------------------------------------------------------------
# The schedule, on a fake clock

def test_the_decay_starts_from_the_clock_and_the_last_step_follows_it(monkeypatch):
    monkeypatch.setattr(clock, "STARTED", 0.0)
    now = [0.0]
    monkeypatch.setattr(clock.time, "time", lambda: now[0])
    budget = clock.Budget(100 / 3600, OneRank())  # 100 s in all
    t, end, lrs, decay_t = 10.0, None, [], None  # the loop starts 10 s in; steps of 1 s, then of 2 s from 50 s on
    for step in range(1000):
        dt = 1.0 if t < 50 else 2.0
        lrs.append(budget.lr(step, 10, end or 10**6, 1e-3, 0.0))
        budget.tick(step, t, t + dt)
        end = budget.max_steps  # (the clock's, re-fitted)
        t += dt
        decay_t = t if budget.decay_from is not None and decay_t is None else decay_t
        if step + 1 >= end:
            break
    decay_from = budget.decay_from
    assert 80 <= decay_t < 82 and decay_from == step + 1 - (t - decay_t) / 2  # from the first step that ends past 80%
    assert lrs[9:decay_from] == [1e-3] * (decay_from - 9)  # warmup, then stable until the clock says decay
    assert all(a > b for a, b in zip(lrs[decay_from:], lrs[decay_from + 1:]))  # then down, step by step
    assert lrs[-1] <= 0.125e-3 + 1e-12  # (the last of ~8 decay steps: an eighth of the peak)
    assert 100 - clock.EXIT_S - 3 <= t <= 100 - clock.EXIT_S + 0.5  # the last step ends in time for the exit


def test_a_resumed_budget_keeps_its_clock(monkeypatch):
    monkeypatch.setattr(clock, "STARTED", 1000.0)
    budget = clock.Budget(1.0, OneRank(), used_s=600.0, decay_from=None)
    assert budget.deadline == 1000.0 + 3600 - 600


class TinyStep(torch.nn.Module):
    """Any shape's stand-in: one weight, a loss of the batch (time_step's steps take no time)."""

    def __init__(self, **shape):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x, y):
        return None, (self.w * x.float()).mean()


def test_the_probe_times_each_shape_as_the_run_will_train_it(monkeypatch):
    """The step times the plan is made of are measured as the run trains: with freed memory kept (without it glibc
    faulted each step's logits in again, and the probe timed the small shapes 2x slower than they trained, Zen 4) and
    with the attention the run would choose at that shape. Afterwards the policy is handed back to choose_layout."""
    kept, chosen, timed = [False], [], []
    monkeypatch.setattr(clock.cpu, "keep_freed_memory", lambda keep=True: kept.__setitem__(0, keep))
    monkeypatch.setattr(clock.attention, "kernel", lambda: False)
    monkeypatch.setattr(clock.attention, "choose", lambda *a: chosen.append(a[:5]))
    monkeypatch.setattr(clock, "STARTED", time.time())

    def build(**shape):
        timed.append((shape["n_layer"], kept[0]))
        return TinyStep()
    args = argparse.Namespace(hours=10.0, explicit={}, max_memory=1e3)  # (every shape fits, and each is as fast)
    run = argparse.Namespace(args=args, ranks=OneRank(), replicas=1, autocast=contextlib.nullcontext(), dtype="bf16",
                             lay_out=lambda: None)
    clock.Budget.plan(run, build)
    assert [d for d, _ in timed] == list(clock.DEPTHS) and all(k for _, k in timed), timed
    assert not kept[0]  # (choose_layout sets the run's own policy)
    assert chosen == [("bf16", max(1, 2048 // min(1024, 128 * d)), d, min(1024, 128 * d), 64) for d in clock.DEPTHS]


class Printed(OneRank):
    def __init__(self):
        super().__init__()
        self.lines = []

    def print0(self, *a):
        self.lines.append(" ".join(map(str, a)))


@pytest.mark.parametrize("max_memory_gib, timed_depths", [
    (1e3, [1, 2, 3, 4]),  # depth 2 predicts the lowest loss, 3 and 4 higher: the curve has turned
    ((clock.probe_memory(2, True) + clock.probe_memory(3, True)) / 2 / 0.9 / 2**30, [1, 2]),  # 3 would need more
])
def test_measuring_stops_once_the_loss_turns_and_before_a_shape_that_would_not_fit(monkeypatch, max_memory_gib,
                                                                                   timed_depths):
    """Timing every depth up to 20 for --hours 1 took 10.2 GiB and 3.6 of the 60 minutes on 2 Zen 4 cores, to choose
    depth 3: the probe stops once two shapes in a row predict a higher loss than the best, and before a shape whose
    estimated memory is over 90% of what this rank may use; the choice is the one all the shapes would give."""
    step_s, timed = lm_head_bound_step_s(), []
    monkeypatch.setattr(clock, "time_step", lambda build, depth, *a, **k: timed.append(depth) or step_s[depth])
    monkeypatch.setattr(clock.attention, "kernel", lambda: False)
    monkeypatch.setattr(clock, "STARTED", time.time())
    args = argparse.Namespace(hours=10.0, explicit={}, max_memory=max_memory_gib)
    run = argparse.Namespace(args=args, ranks=Printed(), replicas=1, autocast=contextlib.nullcontext(), dtype="bf16",
                             lay_out=lambda: None)
    _, plan = clock.Budget.plan(run, None)
    assert timed == timed_depths
    everything = clock.choose(step_s, clock.train_seconds(36000, 0))[0]
    assert plan["n_layer"] == (everything if everything in timed else max(timed))
    assert ("depth 3 would need" in run.ranks.lines[-1]) == (timed == [1, 2]), run.ranks.lines


def test_a_given_depth_that_would_not_fit_is_one_error_line_before_any_measuring(monkeypatch):
    timed = []
    monkeypatch.setattr(clock, "time_step", lambda build, depth, *a, **k: timed.append(depth) or 1.0)
    monkeypatch.setattr(clock.attention, "kernel", lambda: False)
    between = (clock.probe_memory(5, True) + clock.probe_memory(6, True)) / 2 / 2**30
    for depth, fits in [(5, True), (6, False)]:
        args = argparse.Namespace(hours=10.0, explicit={"n_layer": depth}, max_memory=between)
        run = argparse.Namespace(args=args, ranks=Printed(), replicas=1, autocast=contextlib.nullcontext(),
                                 dtype="bf16", lay_out=lambda: None)
        if fits:
            _, plan = clock.Budget.plan(run, None)
            assert plan["n_layer"] == 5 and 5 in timed
            continue
        timed.clear()
        with pytest.raises(SystemExit) as e:
            clock.Budget.plan(run, None)
        assert (str(e.value).startswith("error: --n_layer 6 needs ~")
                and "(--max_memory): a smaller --n_layer" in str(e.value))
        assert "\n" not in str(e.value) and timed == []


# -----------------------------------------------------------------------------
# Bad input: one error line before any work

@pytest.mark.parametrize("text, hours", [("0.25", 0.25), ("90m", 1.5), ("2h", 2.0), ("45s", 0.0125), (" 1.5 ", 1.5)])
def test_times_parse(text, hours):
    assert train_args.parse_hours(text) == pytest.approx(hours)


@pytest.mark.parametrize("text", ["0", "-1", "0m", "abc", "1d"])
def test_a_time_not_above_zero_is_one_error_line(text):
    with pytest.raises(SystemExit) as e:
        train_args.parse_hours(text)
    assert str(e.value).startswith(f"error: --hours {text}:") and "\n" not in str(e.value)


def run_cli(*argv):
    return subprocess.run([sys.executable, os.path.join(REPO, "train_gpt2.py"), *argv], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120, cwd=REPO)


def test_errors_come_before_any_work(tmp_path):
    for argv, said in [(["--hours", "0"], "error: --hours 0: the time must be above zero"),
                       (["--time=-5m"], "error: --hours -5m: give hours"),
                       (["--hours", "1", "--max_steps", "10"],
                        "error: --hours and --max_steps both set the run's length: drop --max_steps")]:
        proc = run_cli(*argv, "--log_dir", str(tmp_path / "log"))
        assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
        assert proc.stderr.startswith(said) and "cpu:" not in proc.stdout  # nothing measured, nothing built
        assert not (tmp_path / "log").exists()


def test_resuming_with_another_plan_is_refused(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    (log / "args.json").write_text(json.dumps({"hours": 0.5, "n_layer": 3}))  # a --hours run stopped early
    for given, said in [(["--hours", "1"], "planned for --hours 0.5, not --hours 1"), ([], None)]:
        argv = ["--resume", "--log_dir", str(log), "--data_dir", make_shards(tmp_path / "data"), *given]
        if said is None:
            assert train_args.resolve_args(argv, OneRank())[0].hours == 0.5  # the same plan goes on
            continue
        with pytest.raises(SystemExit, match=re.escape(said)):
            train_args.resolve_args(argv, OneRank())
    (log / "args.json").write_text(json.dumps({"hours": None}))
    with pytest.raises(SystemExit, match="planned for no --hours"):
        train_args.resolve_args(["--resume", "--log_dir", str(log), "--hours", "1"], OneRank())


def test_a_budget_too_short_names_the_shortest_that_works():
    clock.check_long_enough(3600, 20.0, 0.5, 1.0)  # an hour is plenty
    with pytest.raises(SystemExit) as e:
        clock.check_long_enough(60, 20.0, 2.0, 1 / 60)  # 20 s spent, 200 steps of 0.5 s: 125 s and more
    need = (20 + clock.MIN_STEPS * 2.0 / 4 + clock.EXIT_S) / (1 - clock.EVAL_SHARE * 1.5 - clock.PROBE_SHARE)
    assert str(e.value) == (f"error: --hours 0.0166667 (1m00s) is too short: the smallest model of the family needs "
                            f"about {progress.duration(need)} here for 200 steps; give at least --time 3m")


# -----------------------------------------------------------------------------
# Without --hours: the val pass sized to the run, and how long the run takes, said before its first step

def test_the_default_val_pass_is_a_tenth_of_an_interval(tmp_path):
    assert clock.val_tokens(250, 524288, 1024) == 10485760  # GPT-2 (124M)'s recipe: 2.5% of an interval, as before
    assert clock.val_tokens(30, 2048, 256) == 18432  # 0.3 x 30 steps x 2048 tokens, in rows of 256
    args = train_args.resolve_args(["--data_dir", make_shards(tmp_path / "data"), "--eval_interval", "10",
                                    "--total_batch_size", "8192", "--seq_len", "64"], OneRank())[0]
    assert args.val_tokens == 3 * 0.1 * 10 * 8192 // 64 * 64
    given = train_args.resolve_args(["--data_dir", str(tmp_path / "data"), "--val_tokens", "640"], OneRank())[0]
    assert given.val_tokens == 640


def test_the_forecast_says_how_long_and_names_hours_past_an_hour():
    class Run:
        replicas, flops_per_token = 1, 6 * 124e6 + 12 * 12 * 768 * 1024
        matmul_rate = argparse.Namespace(gflops=400.0, name="bf16")
        args = argparse.Namespace(max_steps=19073, total_batch_size=524288, hours=None)

        def share_of_matmul_rate(self, dt):
            return ""
    line = progress.forecast(Run(), 0)
    seconds = 19073 * 524288 * Run.flops_per_token / (400e9 * 0.6)
    assert line.startswith(f"time: 19073 steps of 524,288 tokens take about {progress.duration(seconds)} here (ends ")
    assert line.endswith("; --hours H trains the best model H hours allow")
    Run.args.max_steps = 1
    assert "--hours" not in progress.forecast(Run(), 0)


# -----------------------------------------------------------------------------
# A real run: train_gpt2.py --hours on the demo's text, with a tiny family, ends within 10% of its time

PATCHED = """
import sys
sys.path.insert(0, {repo!r})
import clock
clock.DEPTHS, clock.MIN_STEPS, clock.MICRO_TOKENS = (1, 2, 3), 20, 256  # a tiny family: 16 wide a layer
clock.shape = lambda d: dict(n_layer=d, n_head=1, n_embd=16 * d, block_size=64)
import train_gpt2
from parallel import world
world.run_main(train_gpt2.main)
"""


def run_patched(tmp_path, budget, launcher=(sys.executable,)):
    script = tmp_path / "patched.py"
    script.write_text(PATCHED.format(repo=REPO))
    started = time.time()
    proc = subprocess.run([*launcher, str(script), "--time", f"{budget:.0f}s", "--log_dir", str(tmp_path / "log"),
                           "--threads", "1"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, time.time() - started


def test_a_run_of_hours_ends_on_time_with_its_plan_a_final_eval_and_a_report(tmp_path):
    budget = 40.0
    out, wall = run_patched(tmp_path, budget)
    assert 0.9 * budget <= wall <= 1.1 * budget, f"{wall:.1f} s for a budget of {budget:.0f} s\n{out}"
    plan = re.findall(r"^plan: (\d) layers x \d+ wide .* tokens in ~\d+ steps of \d+, lr [\d.e-]+, ends by [\d:]+ "
                      r"\(40s in all\); measured tokens/s: 1 layers \d+.*; flags given that override it: "
                      r"none$", out, re.M)
    assert len(plan) == 1, out
    steps = re.findall(r"^step +(\d+) \| .* \| lr ([\d.e+-]+) \|", out, re.M)
    last = int(steps[-1][0]) + 1
    log = open(tmp_path / "log" / "log.txt").read()
    assert f"\n{last} val " in log  # the final evaluation, after the last step ...
    assert os.path.exists(tmp_path / "log" / f"model_{last:05d}.pt")  # ... and the final checkpoint
    lrs = [float(lr) for _, lr in steps]
    assert lrs[-1] < 0.1 * max(lrs)  # the decay ran to its end
    assert os.path.exists(tmp_path / "log" / "report.png") and os.path.exists(tmp_path / "log" / "report.md")


@pytest.mark.xdist_group("multiprocess-2")
def test_ranks_plan_alike_and_end_together(tmp_path):
    """Two DDP ranks: one plan (from the step times averaged over them), the same last step, the same weights."""
    budget = 30.0  # (the one-process run above checks the timing closer, over 40 s)
    out, wall = run_patched(tmp_path, budget, (sys.executable, "-m", "torch.distributed.run", "--standalone",
                                               "--nproc_per_node=2"))
    assert 0.9 * budget <= wall <= 1.15 * budget, f"{wall:.1f} s for a budget of {budget:.0f} s\n{out}"
    assert len(re.findall(r"^plan: ", out, re.M)) == 1 and "parameter sha256 (all 2 rank(s))" in out
