"""Checkpoints written in parts (parallel/parts.py): a .dcp folder written under each of FSDP (--shard full), a pipeline
(--pp 2), tensor parallel (--tp 2) and both (--pp 2 --tp 2, 4 ranks), every rank writing its own part in the whole
model's names, resumes under each layout (its own too) and on one process, continuing the uninterrupted run (losses
within 1e-5, the same final weights); sample.py and export_hf.py read each. And what a part checkpoint holds: each
tensor of the whole model once, whole.

Every run here has a disk per node, as three cloud VMs do: 2 nodes, each rank's --log_dir a folder only its node sees (a
private mount: 2 ranks, one a node; 4 ranks, two a node). So each resume under another layout, or on 2 ranks of a
4-rank checkpoint, reads pieces that another node wrote: they are sent over the process group (parallel/node_disks.py).
A one-process resume reads a folder the nodes' files were copied into, as one would copy them to a laptop.

The model: 4 blocks of 32 (2 heads: --tp 2 gives each rank one); 384 tokens a step, the same on every layout.
"""
import glob
import os
import re
import shutil

import pytest
import torch

from plumbing import checkpoints
from model import load_model
from conftest import (LIMIT, assert_same_run, can_mount_privately, clean_env, final_weights_diff, need, run_ranks,
                      run_train, stopped_after_step_3, tiny_run_args)

pytestmark = pytest.mark.xdist_group("multiprocess-2")

TOL = 1e-5
EQUAL = ["--batch_size", "2", "--total_batch_size", "384", "--n_layer", "4"]
# each layout's flags, complete (a resumed run takes the others from its checkpoint's arguments), and its ranks
LAYOUTS = {"one": (1, []), "fsdp": (2, ["--shard", "full", "--pp", "1", "--tp", "1"]),
           "pp2": (2, ["--pp", "2", "--shard", "none", "--tp", "1"]),
           "tp2": (2, ["--tp", "2", "--shard", "none", "--pp", "1"]),
           "pp2tp2": (4, ["--pp", "2", "--tp", "2", "--shard", "none"])}
WRITERS = ["fsdp", "pp2", "tp2", "pp2tp2"]


def launch(args, layout, folder=None, check=True):
    """A run of this layout: one process in --log_dir, or its ranks with their --log_dir on their node's disk,
    folder/node0 and folder/node1."""
    ranks, flags = LAYOUTS[layout]
    if ranks == 1:
        return run_train([*args, *flags], env=clean_env(), timeout=LIMIT, check=check)
    need(can_mount_privately(), "a private mount for each rank (root, unshare)")
    return run_ranks([*args, *flags], ranks, disks=[folder / f"node{r * 2 // ranks}" for r in range(ranks)],
                     check=check)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """One process's run (the reference: its --log_dir), and each writer's (the folder of its nodes' disks, node0 and
    node1, and log, where each rank sees its own): 6 steps, checkpoints at 3 and 6."""
    out = {}
    for layout in ["one", *WRITERS]:
        folder = tmp_path_factory.mktemp(layout)
        proc = launch(tiny_run_args(data, folder / "log", *EQUAL), layout, folder)
        if layout != "one":
            assert f"log_dir: {folder / 'log'} is 2 separate folders, a disk per node" in proc.stdout
        out[layout] = folder / "log" if layout == "one" else folder
    return out


def disks_after_step_3(disks, folder):
    """Copies of the nodes' disks as a run killed after its first checkpoint (step 3) leaves them."""
    for disk in disks:
        stopped_after_step_3(disk, folder / disk.name)
    return folder


@pytest.mark.parametrize("writer", WRITERS)
def test_a_part_checkpoint_holds_the_whole_model_once(runs, writer):
    """Every tensor of the one-process model (the tied weight under both its names), with its AdamW moments, in the
    one-process shapes and values a layout-free reader (DCP on one process, no process group) gets back."""
    path = os.path.join(runs[writer], "node0", "model_00006.dcp")
    assert os.path.isdir(path) and not os.path.exists(os.path.join(runs[writer], "node0", "model_00006.pt"))
    one = checkpoints.load_checkpoint(os.path.join(runs["one"], "model_00006.pt"))
    model, _ = load_model(path)
    state = model.state_dict()
    for name, value in one["model"].items():
        assert state[name].shape == value.shape and (state[name] - value).abs().max() <= TOL, name


@pytest.mark.parametrize("writer", WRITERS)
def test_each_node_keeps_every_file_of_each_checkpoint(runs, writer):
    """2 nodes: each keeps its own pieces and a copy of the other's (the next node's), the metadata and meta.pt, in
    folders renamed once whole; nothing half-written (*.tmp) is left; both folders hold the run (args.json, lock)."""
    node0, node1 = (runs[writer] / f"node{n}" for n in (0, 1))
    for step in (3, 6):
        files = [sorted(os.listdir(node / f"model_0000{step}.dcp")) for node in (node0, node1)]
        assert files[0] == files[1] and {".metadata", "meta.pt"} <= set(files[0]), files
        writers = {f.split("_")[2] for f in files[0] if f.endswith(".distcp")}
        assert writers == {str(r) for r in range(LAYOUTS[writer][0])}, writers  # (__RANK_N.distcp: every rank wrote)
    assert not glob.glob(str(runs[writer] / "**" / "*.tmp"), recursive=True)
    assert all(os.path.exists(node / name) for node in (node0, node1) for name in ("args.json", "lock"))
    assert os.listdir(runs[writer] / "log") == []  # (what the ranks saw there is on their disks)


def reader_and_writer(reader, writer):
    """The main lane resumes each writer's checkpoint under the layout before it in WRITERS (pieces sent between the
    disks: a pipeline's under FSDP, the 4 ranks' on 2),
    and the 4-rank one on one process (both nodes' files in one folder; the 2-rank layouts' .dcp on one process:
    test_distributed.py, test_pipeline.py, test_tensor_parallel.py); the long lane under every other, its own included
    (each disk reading its own pieces: the kill soak's resumes do that in the main lane)."""
    main = (reader == "one" and writer == "pp2tp2"
            or reader != "one" and WRITERS.index(reader) == (WRITERS.index(writer) - 1) % len(WRITERS))
    return pytest.param(reader, writer, id=f"{reader}-{writer}", marks=() if main else pytest.mark.long)


@pytest.mark.parametrize("reader,writer", [reader_and_writer(r, w) for w in WRITERS for r in ["one", *WRITERS]])
def test_a_part_checkpoint_resumes_under_every_layout(runs, data, tmp_path, writer, reader):
    disks = [runs[writer] / "node0", runs[writer] / "node1"]
    resumed = disks_after_step_3(disks, tmp_path)
    log_dir = tmp_path / "log"
    if reader == "one":  # the nodes' files in one folder
        for disk in disks:
            shutil.copytree(tmp_path / disk.name, log_dir, dirs_exist_ok=True)
    proc = launch(["--resume", "--log_dir", log_dir, "--dist_timeout", 60], reader, resumed)
    assert "model_00003.dcp at step 3" in proc.stdout
    assert ("pipeline: 2 stages" in proc.stdout) == (reader in ("pp2", "pp2tp2"))
    assert ("tensor parallel: 2 ranks" in proc.stdout) == (reader == "tp2")
    assert ("split over 2 tensor-parallel ranks" in proc.stdout) == (reader == "pp2tp2")
    ran = log_dir if reader == "one" else resumed / "node0"  # (rank 0's disk: its log.txt)
    assert_same_run(runs["one"], ran)
    assert final_weights_diff(runs["one"], ran) <= TOL
    assert not glob.glob(str(tmp_path / "**" / "*.tmp"), recursive=True)


def test_a_piece_on_no_disk_is_one_error_line_before_training(runs, tmp_path):
    """A piece of model_00003.dcp lost from both nodes' disks: --resume (the newest whole checkpoint) refuses, naming
    the missing file and how many files each disk holds, before any step, without waiting for --dist_timeout; with
    model_00006.dcp damaged alike, --resume takes model_00003.dcp and says why; --resume of the damaged one refuses
    it."""
    folder = disks_after_step_3([runs["fsdp"] / "node0", runs["fsdp"] / "node1"], tmp_path)
    piece = sorted(f for f in os.listdir(folder / "node0" / "model_00003.dcp") if f.startswith("__1_"))[-1]
    for node in ("node0", "node1"):
        os.remove(folder / node / "model_00003.dcp" / piece)
    args = ["--resume", "--log_dir", tmp_path / "log", "--dist_timeout", 60]
    proc = launch(args, "fsdp", folder, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "step " not in proc.stdout, proc.stderr
    assert last.startswith(f"error: --resume: no checkpoint in --log_dir {tmp_path / 'log'} is whole on the nodes' "
                           f"disks; the newest, model_00003.dcp: {piece} on no disk; of its "), last
    assert re.search(r"files, rank 0's disk \d+, rank 1's disk \d+$", last), last
    proc = launch([*args[:1], tmp_path / "log" / "model_00003.dcp", *args[1:]], "fsdp", folder, check=False)
    assert proc.returncode == 1 and "is not whole on the nodes' disks" in proc.stderr.strip().splitlines()[-1]
    for node in ("node0", "node1"):  # an older, whole one: the run goes on from it
        shutil.copytree(runs["fsdp"] / node / "model_00003.dcp", folder / node / "model_00003.dcp", dirs_exist_ok=True)
        shutil.copytree(runs["fsdp"] / node / "model_00006.dcp", folder / node / "model_00006.dcp")
        os.remove(folder / node / "model_00006.dcp" / piece.replace("__1_", "__0_"))
    proc = launch(args, "fsdp", folder)
    assert f"warning: {tmp_path / 'log' / 'model_00006.dcp'} is not whole on the nodes' disks (" in proc.stdout
    assert "resuming from model_00003.dcp" in proc.stdout and "model_00003.dcp at step 3" in proc.stdout


@pytest.mark.parametrize("writer", WRITERS)
def test_sample_and_export_read_a_part_checkpoint(runs, tmp_path, writer, capsys):
    """sample.py and export_hf.py (their main(), here: as scripts they run in test_sample.py, test_export.py and the
    README's path) read one node's copy of a part checkpoint; the export's logits in transformers are one process's."""
    import export_hf
    import sample
    path = str(runs[writer] / "node0" / "model_00006.dcp")
    sample.main(["--ckpt_path", path, "--max_new_tokens", "4", "--num_samples", "1", "--device", "cpu"])
    assert "Hello, I'm a language model," in capsys.readouterr().out
    out = tmp_path / "hf"
    export_hf.main([path, str(out)])
    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    ours = load_model(str(runs["one"] / "model_00006.pt"))[0].eval()
    idx = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(idx).logits - ours(idx)[0][..., :50257]).abs().max().item()
    assert diff <= 1e-4, diff
