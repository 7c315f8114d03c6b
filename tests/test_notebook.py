"""play.ipynb runs headless on the log of a tiny training run (with in-loop HellaSwag) and draws its figure."""
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


def test_notebook_plots_a_tiny_run(log_dir, tmp_path, monkeypatch):
    val, hella = read_log(log_dir, "val"), read_log(log_dir, "hella")
    assert sorted(hella) == [0, 3, 6] and all(0 <= a <= 1 for a in hella.values())  # the in-loop eval ran
    with open(os.path.join(log_dir, "log.txt"), "a") as f:  # a throughput stream, as a trainer may log it
        f.write("5 tok/s 1234\n6 tok/s 1500\n")

    # a kernel that is this very Python, whatever other "python3" kernels the machine has installed
    spec = tmp_path / "kernels" / "this-python"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "this Python", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells[0].source = f"log_dir = {str(log_dir)!r}"
    NotebookClient(nb, timeout=300, kernel_name="this-python", resources={"metadata": {"path": str(log_dir)}}).execute()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(figures) == 1
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"min val loss: {min(val.values()):.4f}" in text
    assert f"max HellaSwag: {max(hella.values()):.4f}" in text
    assert "tok/s: last 1500" in text
