"""
How long: every long phase of a run says how far it is and when it will end.

  forecast    before the first step: how long the run's steps will take here, from its FLOPs and this
              CPU's measured matmul rate (naming --hours when that is more than an hour)
  StepClock   the step line's `elapsed` and `ETA`, and a note at the start when the plan takes more
              than a day on this machine
  Bar         a long pass (validation, HellaSwag, fineweb.py's tokenizing) as a progress bar on a terminal,
              and as a line every ~10% in a log (a file or a pipe, where a bar's carriage returns make a mess)

Only rank 0 shows them (the trainer passes ranks.print0, or enabled=ranks.master).
"""
import os
import sys
import time

def process_start():
    """When this process started (Linux's /proc), else now (the trainer imports this module first thing)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return min(time.time(), boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()

STARTED = process_start()  # the step lines' elapsed time and --hours' budget count the whole process
QUIET_S = 10  # a pass shorter than this prints no progress lines: a tiny eval needs none
DAY = 86400

def duration(seconds):
    """A time span as a person says it: 42s, 3m05s, 2h07m, 3d04h."""
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < DAY:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // DAY}d{s % DAY // 3600:02d}h"

# -----------------------------------------------------------------------------
# Before the first step: a forecast

MATMUL_SHARE = 0.6  # a training step reaches 60-90% of this CPU's measured matmul rate (docs/performance.md)

def forecast(run, start_step):
    """'time: ...' how long the run's steps will take here: their FLOPs (sizes.flops_per_token, on each replica) at
    MATMUL_SHARE of the matmul rate measured for the model's width and dtype (run.share_of_matmul_rate measures it,
    once); evaluations not counted. A run longer than an hour names --hours."""
    run.share_of_matmul_rate(float("inf"))  # (a step of no speed: only sets run.flops_per_token, run.matmul_rate)
    a, rate = run.args, run.matmul_rate
    steps = max(a.max_steps - start_step, 0)
    seconds = steps * a.total_batch_size / run.replicas * run.flops_per_token / (rate.gflops * 1e9 * MATMUL_SHARE)
    ends = time.strftime("%Y-%m-%d %H:%M", time.localtime(time.time() + seconds))
    line = (f"time: {steps} steps of {a.total_batch_size:,} tokens take about {duration(seconds)} here (ends {ends}; "
            f"estimated at {MATMUL_SHARE:.0%} of this CPU's {rate.name} matmul rate, {rate.gflops:.0f} GFLOP/s)")
    return line + ("; --hours H trains the best model H hours allow" if seconds > 3600 and hasattr(a, "hours") else "")

# -----------------------------------------------------------------------------
# The step line's clock

def evals_between(first, last, interval):
    """How many evaluation steps (multiples of interval) lie in first..last, both included."""
    return 0 if interval <= 0 or last < first else last // interval - (first - 1) // interval

class StepClock:
    """Time left = the steps left x the time of a recent step + the evaluations left x the time an evaluation
    took so far. An evaluation's time is what passed between steps without a step running (val loss,
    HellaSwag, samples, checkpoints); the first step is left out of a step's time (it also compiles). A --hours
    run (deadline: when its clock ends it, time.time()) ends then, whatever a slow spell does to its recent steps."""

    def __init__(self, args, start_step, print0, deadline=None):
        self.args, self.start_step, self.print0, self.deadline = args, start_step, print0, deadline
        self.started = time.time()  # the loop starts: the first evaluation is about to run
        self.dts = []

    def tick(self, step, dt):
        """After step `step`, which took dt seconds: ' | elapsed 1m02s | ETA 3m10s' for its line."""
        self.dts.append(dt)
        args, now = self.args, time.time()
        recent = self.dts[1:][-20:] or self.dts
        steps_left = args.max_steps - step - 1
        paused = max(now - self.started - sum(self.dts), 0.0)  # time between steps: evaluations, checkpoints
        done = evals_between(self.start_step, step, args.eval_interval)
        left = evals_between(step + 1, args.max_steps, args.eval_interval)
        left += args.eval_interval > 0 and args.max_steps % args.eval_interval != 0  # (the last step evaluates too)
        eta = steps_left * sum(recent) / len(recent) + left * paused / max(done, 1)
        eta = eta if self.deadline is None else max(self.deadline - now, 0.0)  # (the clock re-fits the steps to it)
        if len(self.dts) == 3 and now - STARTED + eta > DAY:  # (printed before the third step's line, measured
            # from the two steps after the first, which compiles too)
            self.print0(self.too_long(eta, now))
        return f" | elapsed {duration(now - STARTED)} | ETA {duration(eta)}"

    def too_long(self, eta, now):
        """The note when the run as planned takes more than a day here."""
        a = self.args
        ends = time.strftime("%Y-%m-%d %H:%M", time.localtime(now + eta))
        remedy = ("; --hours H trains the best model H hours allow" if hasattr(a, "hours") else "")
        return (f"note: this run's plan, {a.max_steps} steps of {a.total_batch_size:,} tokens, takes about "
                f"{duration(now - STARTED + eta)} on this machine at the speed of its first steps (ends {ends}): "
                f"more than a day{remedy}")

# -----------------------------------------------------------------------------
# A long pass's progress

class Bar:
    """tqdm's bar on a terminal; elsewhere a line every ~10% of total, once the pass has run QUIET_S seconds.
    Used like tqdm: bar.update(n), and as a context manager. enabled False: silent (every rank but 0).
    total None: not known (a stream): a bar without an end on a terminal, a line a minute in a log. initial: what
    an earlier run already did (a resumed pass: its ETA counts only this run's speed). bar.note: a few words that
    follow the count (fineweb.py's tokens and shards)."""

    def __init__(self, total, desc, unit="it", enabled=True, initial=0):
        self.total, self.desc, self.unit, self.n, self.initial = total, desc, unit, initial, initial
        self.started, self.tqdm, self.note = time.time(), None, ""
        self.shown = self.n * 10 // total if total else 0  # (the tenths an earlier run showed)
        self.enabled = enabled and total != 0
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.tqdm = tqdm(total=total, desc=desc, unit=unit, leave=False, initial=initial, unit_scale=True)

    def update(self, n=1):
        self.n += n
        if self.tqdm is not None or not self.enabled:  # (a total of 0: nothing to show)
            if self.tqdm is not None:
                self.tqdm.set_postfix_str(self.note, refresh=False)
                self.tqdm.update(n)
            return
        spent = time.time() - self.started
        note = f", {self.note}" if self.note else ""
        if self.total is None:  # not known: a line a minute, with the rate
            if spent >= 60 * (self.shown + 1):
                self.shown = int(spent // 60)
                rate = (self.n - self.initial) / spent
                print(f"{self.desc}: {self.n:,} {self.unit}{note}, {duration(spent)}, {rate:,.0f} {self.unit}/s",
                      flush=True)
            return
        tenth = self.n * 10 // self.total  # how many tenths are done
        if tenth > self.shown and spent >= QUIET_S:
            self.shown = tenth
            eta = spent / max(self.n - self.initial, 1) * max(self.total - self.n, 0)
            print(f"{self.desc}: {self.n * 100 // self.total}% ({self.n}/{self.total} {self.unit}{note}), "
                  f"{duration(spent)}, ETA {duration(eta)}", flush=True)

    def close(self):
        if self.tqdm is not None:
            self.tqdm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

def each(items, desc, unit, enabled):
    """Yield items (a list), showing a Bar's progress over them."""
    with Bar(len(items), desc, unit, enabled) as bar:
        for item in items:
            yield item
            bar.update(1)
