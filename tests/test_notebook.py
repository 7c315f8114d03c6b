"""play.ipynb runs headless on the log of a tiny training run (with in-loop HellaSwag) and on a fine-tuning
run's (task accuracy), and draws its figure."""
import ast
import json
import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import HELLASWAG_EXAMPLES, REPO, make_shards, read_log, run_train, tiny_run_args, write_hellaswag

NOTEBOOK = os.path.join(REPO, "play.ipynb")


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].source.splitlines()[-1] == 'log_dir = "log"'  # the path is in the first cell
    assert nb.cells[0] is code[0]
    assert all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    hs_dir = write_hellaswag(root / "hellaswag", HELLASWAG_EXAMPLES)
    log = root / "log"
    run_train(tiny_run_args(make_shards(root / "data"), log, "--hellaswag_interval", "3", "--hellaswag_dir", hs_dir))
    return log


def run_notebook(log_dir, tmp_path, monkeypatch):
    """Execute play.ipynb on log_dir headless; returns (its printed text, the panel titles of its one figure)."""
    # a kernel that is this very Python, whatever other "python3" kernels the machine has installed
    spec = tmp_path / "kernels" / "this-python"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "this Python", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells[0].source = f"log_dir = {str(log_dir)!r}"
    nb.cells.append(nbformat.v4.new_code_cell('print("panels:", [ax.get_title() for ax in fig.axes])'))
    NotebookClient(nb, timeout=300, kernel_name="this-python", resources={"metadata": {"path": str(log_dir)}}).execute()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(figures) == 1
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    panels = next(line for line in text.splitlines() if line.startswith("panels: "))
    return text, ast.literal_eval(panels.removeprefix("panels: "))


def test_notebook_plots_a_tiny_run(log_dir, tmp_path, monkeypatch):
    val, hella = read_log(log_dir, "val"), read_log(log_dir, "hella")
    assert sorted(hella) == [0, 3, 6] and all(0 <= a <= 1 for a in hella.values())  # the in-loop eval ran
    with open(os.path.join(log_dir, "log.txt"), "a") as f:  # a throughput stream, as a trainer may log it
        f.write("5 tok/s 1234\n6 tok/s 1500\n")
    text, panels = run_notebook(log_dir, tmp_path, monkeypatch)
    assert panels == ["Loss", "HellaSwag", "Throughput"]
    assert f"min val loss: {min(val.values()):.4f}" in text
    assert f"max HellaSwag: {max(hella.values()):.4f}" in text
    assert "tok/s: last 1500" in text
    assert "task accuracy" not in text


def test_notebook_plots_task_accuracy(tmp_path, monkeypatch):
    """A fine-tuning run's log: task accuracy beside the val loss, and no empty HellaSwag panel."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    (log_dir / "log.txt").write_text(
        "0 val 3.9000\n0 task 0.0000\n0 train 3.95\n1 train 3.10\n2 train 2.40\n2 val 2.5000\n2 task 0.2500\n"
        "3 train 1.90\n4 train 1.20\n4 val 1.4000\n4 task 0.8750\n"
        "3 train 1.80\n4 train 1.10\n4 val 1.3000\n4 task 0.7500\n")  # resumed from step 3: the last value wins
    text, panels = run_notebook(log_dir, tmp_path / "nb", monkeypatch)
    assert panels == ["Loss", "Task accuracy"]
    assert "min val loss: 1.3000 at step 4" in text
    assert "max task accuracy: 0.7500 at step 4 (last: 0.7500)" in text
    assert "HellaSwag" not in text
