"""
Every run leaves a picture: log_dir/report.png and log_dir/report.md, made from log_dir/log.txt.

train_gpt2.py calls update() at its evaluations and at the end (rank 0 only); plot.py draws several
runs' logs into one figure with the same draw(). What the picture shows, one panel each:

  loss against tokens   train (thin) and val (dots): how much data bought how much loss
  loss against time     the same against hours of training steps (evaluations left out)
  accuracy              HellaSwag (hella) or a task's answers (task), when the log has them
  tokens/s              the speed of every step

Time is not in log.txt: it comes from its `tok/s` lines. A step of N tokens at R tokens/s took N / R
seconds, and the sum of those is the time spent training. N (tokens a step) is in log_dir/args.json.

Headless: matplotlib's Agg renderer draws into a Figure object, without pyplot, so no window and no
display are ever needed (a cloud VM has none). Each file is written whole to a temporary file, then
renamed (common.atomic_write): someone looking at report.png never sees half of one.
"""
import json
import os
import shlex
import sys
import time

from plumbing.common import atomic_write
from plumbing.progress import STARTED, duration

EVERY_S = 60  # at an evaluation, draw only if the last drawing (or the start) is this old: drawing takes ~1 s
_last_drawn = [STARTED]

# -----------------------------------------------------------------------------
# Reading a run's log

def read_log(log_dir):
    """{kind: {step: value}} from log_dir/log.txt ('STEP KIND VALUE' lines; a resumed run's repeated steps: the
    last wins, as in play.ipynb). A missing folder or log, or a log with no such line, is one error line."""
    path = os.path.join(log_dir, "log.txt")
    if not os.path.isdir(log_dir):
        raise SystemExit(f"error: {log_dir}: no such folder (give the --log_dir of a train_gpt2.py run)")
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path} not found: {log_dir} holds no train_gpt2.py run")
    streams = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3:
                try:
                    streams.setdefault(parts[1], {})[int(parts[0])] = float(parts[2])
                except ValueError:
                    continue  # not a measurement: skip it
    if not streams:
        raise SystemExit(f"error: {path} holds no 'STEP KIND VALUE' line yet: nothing to plot")
    return streams

def read_args(log_dir):
    """The run's arguments (args.json, written when it started), or {} if there is none."""
    try:
        with open(os.path.join(log_dir, "args.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}

class Curves:
    """One run's log as x and y lists: steps -> tokens (steps x tokens a step) and -> training hours."""

    def __init__(self, log_dir, label=None):
        self.label = label or os.path.basename(os.path.normpath(log_dir))
        self.streams = read_log(log_dir)
        self.tokens_per_step = read_args(log_dir).get("total_batch_size")
        speed = self.streams.get("tok/s", {}) if self.tokens_per_step else {}
        # hours at the start of each step: the steps before it, each tokens / (tokens/s) seconds long
        self.hours_at, seconds = {}, 0.0
        for step in sorted(speed):
            self.hours_at[step] = seconds / 3600
            seconds += self.tokens_per_step / max(speed[step], 1e-9)
        if speed:
            self.hours_at[max(speed) + 1] = seconds / 3600  # the evaluation after the last step

    def points(self, kind, x="step"):
        """(xs, ys) of one kind, sorted by step; x: 'step', 'tokens' or 'hours' (points with no known x are left
        out)."""
        xs, ys = [], []
        for step, value in sorted(self.streams.get(kind, {}).items()):
            at = {"step": step, "tokens": step * (self.tokens_per_step or 1), "hours": self.hours_at.get(step)}[x]
            if at is not None:
                xs.append(at)
                ys.append(value)
        return xs, ys

# -----------------------------------------------------------------------------
# Drawing

def draw(runs, path):
    """runs (a list of Curves) into one PNG at path, a panel per kind of measurement any of them has. Returns the
    figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    def has(*kinds):
        return any(k in run.streams for run in runs for k in kinds)
    panels = ["tokens", "hours"] * has("train", "val") + ["accuracy"] * has("hella", "task") + ["speed"] * has("tok/s")
    panels = panels or ["tokens"]
    fig = Figure(figsize=(5.5 * len(panels), 4.2))
    FigureCanvasAgg(fig)  # the renderer that turns the figure into pixels
    axes = dict(zip(panels, fig.subplots(1, len(panels), squeeze=False)[0]))
    # time in the unit that suits the longest run: seconds, minutes or hours
    longest = max((max(run.hours_at.values(), default=0) for run in runs), default=0)
    unit, per_hour = ("hours", 1) if longest >= 2 else ("minutes", 60) if longest >= 2 / 60 else ("seconds", 3600)
    def plot(panel, run, kind, x="step", **style):  # one series, if the run has it
        xs, ys = run.points(kind, x)
        if xs:
            axes[panel].plot([v * per_hour for v in xs] if x == "hours" else xs, ys, **style)
    for i, run in enumerate(runs):
        color = f"C{i}"  # one colour per run, in every panel
        for x in ("tokens", "hours"):
            if x in axes:
                plot(x, run, "train", x, color=color, alpha=0.5, lw=1, label=f"{run.label} train")
                plot(x, run, "val", x, marker="o", color=color, ms=3, label=f"{run.label} val")
        if "accuracy" in axes:
            plot("accuracy", run, "hella", marker="o", color=color, ms=3, label=f"{run.label} HellaSwag")
            plot("accuracy", run, "task", marker="s", ls="--", color=color, ms=3, label=f"{run.label} task")
        if "speed" in axes:
            plot("speed", run, "tok/s", color=color, lw=1, label=run.label)
    known = all(run.tokens_per_step for run in runs)
    titles = {"tokens": ("tokens" if known else "step", "loss", "Loss against tokens"),
              "hours": (f"{unit} of training steps", "loss", "Loss against time"),
              "accuracy": ("step", "accuracy", "HellaSwag (acc_norm) / task accuracy"),
              "speed": ("step", "tokens per second", "Throughput")}
    for name, ax in axes.items():
        xlabel, ylabel, title = titles[name]
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=90), f"{path}.{os.getpid()}.tmp")
    return fig

# -----------------------------------------------------------------------------
# The trainer's report: report.png and report.md in its --log_dir

def update(run, evaluated=False, final=False):
    """Draw log_dir/report.png and write report.md: after an evaluation (at most every EVERY_S seconds) and at the
    end (final); by rank 0 alone. A report is not worth a run: a failure to write it is one warning line."""
    if not run.ranks.master or not (final or evaluated and time.time() - _last_drawn[0] >= EVERY_S):
        return
    log_dir = run.args.log_dir
    try:
        curves = Curves(log_dir)
    except SystemExit:
        return  # nothing logged yet
    try:
        draw([curves], os.path.join(log_dir, "report.png"))
        text = summary(run, curves)
        atomic_write(os.path.join(log_dir, "report.md"), lambda f: f.write(text.encode()))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"warning: no report in {log_dir}: {type(e).__name__}: {e}", flush=True)
    _last_drawn[0] = time.time()

def summary(run, curves):
    """report.md's text: what was run, where, on what, how long, and what it reached."""
    args, model, s = run.args, run.model, curves.streams
    n_params = sum(p.numel() for p in model.parameters())
    config = model.config
    def last(kind):  # (step, value) of the last of its lines, or None
        return max(s[kind].items()) if s.get(kind) else None
    lines = [f"# Run report: {args.log_dir}", "", "![loss, accuracy and speed](report.png)", "",
             f"- command: `python train_gpt2.py {shlex.join(sys.argv[1:])}`",
             f"- {run.cpu_line}",
             f"- model: {n_params / 1e6:.2f}M parameters, {config.n_layer} layers x {config.n_embd} wide, "
             f"{config.n_head} heads, context {config.block_size}",
             f"- dtype: {run.dtype}",
             f"- elapsed: {duration(time.time() - STARTED)} (the whole process so far)"]
    if last("train"):
        step = last("train")[0] + 1
        lines.append(f"- steps: {step} of {run.max_steps}, {step * args.total_batch_size:,} tokens")
        lines.append(f"- final train loss: {last('train')[1]:.4f} (step {last('train')[0]})")
    for kind, name in (("val", "val loss"), ("hella", "HellaSwag acc_norm"), ("task", "task accuracy")):
        if last(kind):
            lines.append(f"- final {name}: {last(kind)[1]:.4f} (step {last(kind)[0]})")
    if s.get("tok/s"):
        speeds = sorted(s["tok/s"].values())
        lines.append(f"- tokens/s: {speeds[len(speeds) // 2]:.0f} (the median step)")
    if getattr(run, "samples", None):
        lines += ["", "## Samples, from the last evaluation that drew them", "", "```", *run.samples, "```"]
    return "\n".join(lines) + "\n"

def next_steps(log_dir, checkpoints):
    """The demo's last words: where its results went (checkpoints: the run's, oldest first), and what to try next."""
    ckpt = (checkpoints or ["(none: --checkpoint_interval 0)"])[-1]
    return (f"\ndemo finished: checkpoint {ckpt}, log {os.path.join(log_dir, 'log.txt')}. Next:\n"
            f"  python sample.py --ckpt_path {ckpt} --prompt 'def '   # what it learned to write\n"
            f"  {os.path.join(log_dir, 'report.png')}, report.md    # the loss curves, the run in short\n"
            f"  python fineweb.py, then python train_gpt2.py    # the real thing: GPT-2 (124M) on FineWeb-Edu")
