"""Every run leaves a picture (plumbing/report.py): a tiny training run writes log_dir/report.png and report.md;
the time axis comes from the log's tok/s lines; plot.py overlays runs; bad input is one line naming the path."""
import os
import subprocess
import sys

import pytest

from conftest import REPO, make_shards, read_log, run_train, tiny_run_args
from plumbing import report


def write_run(folder, lines, tokens_per_step=100):
    """A run's folder as train_gpt2.py leaves it: log.txt and args.json."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "log.txt"), "w") as f:
        f.write("".join(line + "\n" for line in lines))
    with open(os.path.join(folder, "args.json"), "w") as f:
        f.write(f'{{"total_batch_size": {tokens_per_step}}}')
    return str(folder)


RUN = ["0 val 10.5", "0 train 10.6", "0 tok/s 100", "1 train 9.0", "1 tok/s 50", "2 train 8.0", "2 tok/s 100",
       "3 val 7.5", "3 hella 0.26"]


def test_a_tiny_run_writes_its_report(tmp_path):
    log = tmp_path / "log"
    proc = run_train(tiny_run_args(make_shards(tmp_path / "data"), log, "--sample_interval", "3"))
    png, md = log / "report.png", log / "report.md"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [f for f in os.listdir(log) if f.endswith(".tmp")]  # written whole, then renamed
    text = md.read_text()
    val = read_log(log, "val")
    assert f"- final val loss: {val[6]:.4f} (step 6)" in text
    assert f"--log_dir {log}" in text and "- cpu: " in text and "- dtype: fp32" in text
    assert "- model: " in text and "2 layers x 32 wide" in text and "- elapsed: " in text
    assert "- steps: 6 of 6, 1,536 tokens" in text
    last_sample = [line for line in proc.stdout.splitlines() if line.startswith("sample 3: ")][-1]
    assert last_sample in text  # the last sample the run printed


def test_the_axes_come_from_the_log(tmp_path):
    curves = report.Curves(write_run(tmp_path / "a", RUN))
    assert curves.points("val", "tokens") == ([0, 300], [10.5, 7.5])
    # steps of 100 tokens at 100, 50, 100 tokens/s: 1 s, 2 s, 1 s; the val after step 2 comes at 4 s
    assert curves.points("val", "hours") == ([0, 4 / 3600], [10.5, 7.5])
    assert curves.points("train", "hours")[0] == [0, 1 / 3600, 3 / 3600]
    fig = report.draw([curves], str(tmp_path / "a.png"))
    assert [ax.get_title() for ax in fig.axes] == ["Loss against tokens", "Loss against time",
                                                    "HellaSwag (acc_norm) / task accuracy", "Throughput"]


def test_plot_overlays_two_runs(tmp_path):
    a = write_run(tmp_path / "run_a", RUN)
    b = write_run(tmp_path / "run_b", [line for line in RUN if "hella" not in line], tokens_per_step=200)
    out = tmp_path / "both.png"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "plot.py"), a, b, "-o", str(out)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:4] == b"\x89PNG" and "2 run(s): run_a (3 steps), run_b (3 steps)" in proc.stdout
    import plot
    fig = plot.main([a, b, "-o", str(out)])
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert labels == ["run_a train", "run_a val", "run_b train", "run_b val"]
    assert list(fig.axes[0].lines[3].get_xdata()) == [0, 600]  # run_b's val at its own 200 tokens a step


@pytest.mark.parametrize("case", ["missing", "no_log", "empty"])
def test_bad_input_is_one_line_naming_the_path(tmp_path, case):
    folder = tmp_path / "run"
    if case != "missing":
        folder.mkdir()
    if case == "empty":
        (folder / "log.txt").write_text("")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "plot.py"), str(folder)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1 and not os.path.exists(tmp_path / "plot.png")
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: ")
    assert str(folder) in proc.stderr


def test_update_draws_on_rank_0_at_most_once_a_minute_and_at_the_end(tmp_path, monkeypatch):
    import argparse
    import torch
    folder = write_run(tmp_path / "run", RUN)
    model = torch.nn.Linear(2, 2)
    model.config = argparse.Namespace(n_layer=1, n_embd=2, n_head=1, block_size=8)
    run = argparse.Namespace(args=argparse.Namespace(log_dir=folder, max_steps=3, total_batch_size=100),
                             ranks=argparse.Namespace(master=False), model=model, dtype="fp32", max_steps=3,
                             cpu_line="cpu: a test's")
    png = os.path.join(folder, "report.png")
    report.update(run, final=True)
    assert not os.path.exists(png)  # rank 0 alone draws
    run.ranks.master = True
    monkeypatch.setattr(report, "_last_drawn", [report.time.time()])
    report.update(run, evaluated=True)
    assert not os.path.exists(png)  # drawn less than a minute ago: not at this evaluation
    report.update(run, final=True)
    assert os.path.exists(png) and "- final val loss: 7.5000 (step 3)" in open(os.path.join(folder, "report.md")).read()
    os.remove(png)
    monkeypatch.setattr(report, "_last_drawn", [report.time.time() - report.EVERY_S])
    report.update(run, evaluated=True)
    assert os.path.exists(png)  # a minute on: this evaluation draws
