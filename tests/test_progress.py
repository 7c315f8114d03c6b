"""Every long phase says how long (plumbing/progress.py): the step line's elapsed time and ETA, progress lines
of the val pass and HellaSwag in a log, and the note when a run's plan takes more than a day here."""
import argparse
import os
import re
import subprocess
import sys

from conftest import HELLASWAG_EXAMPLES, REPO, make_shards, run_train, tiny_run_args, write_hellaswag
from plumbing import progress

STEP_LINE = re.compile(r"^step +\d+ \| .* \| elapsed \d+s \| ETA \d+(s|m\d\ds)$", re.M)

# train_gpt2.py as a user runs it, but with the thresholds of a long run: progress lines for a pass of any
# length, and a "day" that any plan exceeds
PATCHED = """
import sys
sys.path.insert(0, {repo!r})
from plumbing import progress
progress.QUIET_S, progress.DAY = 0, {day}
import train_gpt2
from parallel import world
world.run_main(train_gpt2.main)
"""


def run_patched(tmp_path, args, day=86400):
    script = tmp_path / "patched.py"
    script.write_text(PATCHED.format(repo=REPO, day=day))
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_long_passes_print_a_line_every_tenth(tmp_path):
    hs = write_hellaswag(tmp_path / "hs", HELLASWAG_EXAMPLES)
    out = run_patched(tmp_path, tiny_run_args(make_shards(tmp_path / "data"), tmp_path / "log", "--val_tokens", "1280",
                                              "--hellaswag_interval", "3", "--hellaswag_dir", hs))
    assert len(STEP_LINE.findall(out)) == 6  # every step line ends with its elapsed time and ETA
    val = re.findall(r"^validation: (\d+)% \((\d+)/10 batches\), \d+s, ETA \d+s$", out, re.M)
    # 1280 val tokens = 10 batches of 4 x 32: a line each tenth, at evaluations 0, 3 and 6
    assert [int(n) for _, n in val] == list(range(1, 11)) * 3
    hella = re.findall(r"^hellaswag: (\d+)% \((\d+)/6 examples\)", out, re.M)
    assert hella == [("66", "4"), ("100", "6")] * 3  # (scored 4 examples a batch: --batch_size)
    assert "note: " not in out  # 6 steps take less than a day


def test_a_plan_longer_than_a_day_says_so_once(tmp_path):
    out = run_patched(tmp_path, tiny_run_args(make_shards(tmp_path / "data"), tmp_path / "log"), day=1e-6)
    notes = re.findall(r"^note: this run's plan, 6 steps of 256 tokens, takes about \d+s on this machine at the "
                       r"speed of its first steps \(ends [\d-]+ [\d:]+\): more than a day; --hours H trains the best "
                       r"model H hours allow$", out, re.M)
    assert len(notes) == 1  # (and names --hours, the remedy)
    assert out.index("step     1 |") < out.index(notes[0]) < out.index("step     2 |")  # measured from steps 1, 2


def test_short_passes_stay_quiet(tmp_path):
    out = run_train(tiny_run_args(make_shards(tmp_path / "data"), tmp_path / "log")).stdout
    assert len(STEP_LINE.findall(out)) == 6 and "validation: " not in out and "note: " not in out
    # but how long the run will take is said before its first step (and its first val pass)
    forecast = re.search(r"^time: 6 steps of 256 tokens take about \d+s here \(ends [\d-]+ [\d:]+; estimated at 60% "
                         r"of this CPU's fp32 matmul rate, \d+ GFLOP/s\)$", out, re.M)
    assert forecast and forecast.start() < out.index("validation loss") < out.index("step     0")


def test_the_eta_counts_steps_and_evaluations(monkeypatch):
    """A fake clock: steps of 10 s, evaluations of 50 s, every 250 steps of GPT-2 (124M)'s 19,073."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "time", lambda: now[0])
    monkeypatch.setattr(progress, "STARTED", 0.0)
    printed = []
    args = argparse.Namespace(max_steps=19073, eval_interval=250, total_batch_size=524288)
    clock = progress.StepClock(args, 0, printed.append)
    now[0] += 50 + 30  # the first evaluation, then step 0 (30 s: it compiled too)
    assert clock.tick(0, 30.0) == f" | elapsed 1m20s | ETA {progress.duration(19072 * 30 + 77 * 50)}"
    now[0] += 10
    line = clock.tick(1, 10.0)  # from now on 10 s a step: 19071 steps and 77 evaluations left (76 + the last)
    assert line == f" | elapsed 1m30s | ETA {progress.duration(19071 * 10 + 77 * 50)}" == " | elapsed 1m30s | ETA 2d06h"
    assert not printed
    now[0] += 10
    eta = 19070 * 10 + 77 * 50
    assert clock.tick(2, 10.0) == f" | elapsed 1m40s | ETA {progress.duration(eta)}"
    ends = progress.time.strftime("%Y-%m-%d %H:%M", progress.time.localtime(100 + eta))
    assert printed == [f"note: this run's plan, 19073 steps of 524,288 tokens, takes about 2d06h on this machine at "
                       f"the speed of its first steps (ends {ends}): more than a day"]
    args.hours = None  # a trainer with --hours names it
    assert printed[0] + "; --hours H trains the best model H hours allow" == clock.too_long(eta, 100)


def test_a_run_on_the_clock_says_it_ends_on_the_clock(monkeypatch):
    """--hours: the clock re-fits the steps to its deadline, so a slow spell (a step 5x slower) does not move the
    ETA."""
    now = [100.0]
    monkeypatch.setattr(progress.time, "time", lambda: now[0])
    monkeypatch.setattr(progress, "STARTED", 0.0)
    args = argparse.Namespace(max_steps=1000, eval_interval=100, total_batch_size=2048)
    clock = progress.StepClock(args, 0, print, deadline=900.0)
    for step, dt in enumerate([1.0, 1.0, 5.0, 1.0]):
        now[0] += dt
        assert clock.tick(step, dt).endswith(f" | ETA {progress.duration(900.0 - now[0])}")


def test_a_bar_in_a_log_prints_each_tenth_on_rank_0_only(capsys, monkeypatch):
    monkeypatch.setattr(progress, "QUIET_S", 0)
    for enabled in (True, False):
        with progress.Bar(25, "pass", "items", enabled) as bar:
            for _ in range(25):
                bar.update(1)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"pass: {p}%" for p in (12, 20, 32, 40, 52, 60, 72, 80, 92, 100)]


def test_a_bar_resumed_or_without_a_total(capsys, monkeypatch):
    """A resumed pass (initial) times only this run's share; a pass of unknown length prints a line a minute."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "time", lambda: now[0])
    bar = progress.Bar(100, "tokenizing", "documents", initial=50)
    bar.note = "7 shards"
    now[0] = 20.0
    bar.update(10)  # 10 documents in 20 s: the 40 left take 80 s
    bar = progress.Bar(None, "stream", "documents")
    for _ in range(3):
        now[0] += 35.0
        bar.update(700)
    assert capsys.readouterr().out.splitlines() == [
        "tokenizing: 60% (60/100 documents, 7 shards), 20s, ETA 1m20s",
        "stream: 1,400 documents, 1m10s, 20 documents/s",  # (at 70 s: the first minute passed)
    ]


def test_a_big_checkpoint_says_what_it_writes_and_how_long(tmp_path, monkeypatch, capsys):
    """A .pt and a .dcp at least LOUD_BYTES: a line before (what, about how big) and one after (its size on disk,
    how long); a smaller one says nothing, nor does the .dcp's meta.pt (written quietly inside the folder)."""
    import torch
    from conftest import free_port
    from parallel import parts, world
    from plumbing import checkpoints
    monkeypatch.setattr(checkpoints, "LOUD_BYTES", 4000)
    big, small, dcp = (str(tmp_path / f"model_0000{i}.{ext}") for i, ext in ((1, "pt"), (2, "pt"), (3, "dcp")))
    checkpoints.atomic_save({"w": torch.zeros(1000)}, big)  # 4000 bytes
    checkpoints.atomic_save({"w": torch.zeros(999)}, small)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ranks = world.Ranks(rank=0, world_size=1, local_rank=0, local_world=1, launcher="test")
        parts.save_sharded(dcp, {"model": {"w": torch.zeros(1000)}}, {"step": 3}, ranks)
    finally:
        torch.distributed.destroy_process_group()
    size = checkpoints.folder_bytes(dcp)
    assert size > 4000 and size == sum(os.path.getsize(os.path.join(dcp, f)) for f in os.listdir(dcp))
    gb = re.escape(f"{os.path.getsize(big) / 1e9:.2f}")
    assert re.fullmatch(rf"checkpoint: writing {big} \(about 0.00 GB\)\n"
                        rf"checkpoint: {big} written, {gb} GB in \d+\.\ds \([\d.]+ GB/s\)\n"
                        rf"checkpoint: writing {dcp} \(about 0.00 GB\)\n"
                        rf"checkpoint: {dcp} written, {size / 1e9:.2f} GB in \d+\.\ds \([\d.]+ GB/s\)\n",
                        capsys.readouterr().out)


def test_a_weights_download_says_its_size_once(monkeypatch, capsys):
    """OpenAI's weights not in the hub's cache: one line with their size, then huggingface_hub's own progress."""
    import huggingface_hub
    from plumbing import inputs
    cached = {}
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, f: cached.get((repo, f)))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, f: cached.setdefault((repo, f), f"/hub/{f}"))
    assert inputs.pretrained_files("gpt2-xl", ("gpt2-xl",)) == ("/hub/config.json", "/hub/model.safetensors")
    inputs.pretrained_files("gpt2-xl", ("gpt2-xl",))  # cached now: nothing said
    assert capsys.readouterr().out == ("downloading openai-community/gpt2-xl's weights from the Hugging Face hub "
                                       "(6.43 GB), once: then they are read from its cache\n")
