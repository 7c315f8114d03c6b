"""Checkpoints written in parts (plumbing/parts.py): a .dcp folder written under each of FSDP (--shard full), a pipeline
(--pp 2), tensor parallel (--tp 2) and both (--pp 2 --tp 2, 4 ranks), every rank writing its own part in the whole model's names, resumes under each
other layout and on one process, continuing the uninterrupted run (losses within 1e-5, the same final weights);
sample.py and export_hf.py read each. And what a part checkpoint holds: each tensor of the whole model once, whole.

The model: 4 blocks of 32 (2 heads: --tp 2 gives each rank one); 384 tokens a step, the same on every layout.
"""
import os
import subprocess
import sys

import pytest
import torch

import train_gpt2
from conftest import (LIMIT, REPO, clean_env, final_weights_diff, make_shards, run_launched, run_train,
                      stopped_after_step_3, tiny_run_args, torchrun)
from test_distributed import assert_same_run

pytestmark = pytest.mark.xdist_group("multiprocess")

TOL = 1e-5
EQUAL = ["--batch_size", "2", "--total_batch_size", "384", "--n_layer", "4"]
# each layout's flags, complete (a resumed run takes the others from its checkpoint's arguments), and its ranks
LAYOUTS = {"one": (1, []), "fsdp": (2, ["--shard", "full", "--pp", "1", "--tp", "1"]),
           "pp2": (2, ["--pp", "2", "--shard", "none", "--tp", "1"]), "tp2": (2, ["--tp", "2", "--shard", "none", "--pp", "1"]),
           "pp2tp2": (4, ["--pp", "2", "--tp", "2", "--shard", "none"])}
WRITERS = ["fsdp", "pp2", "tp2", "pp2tp2"]


def launch(args, layout):
    ranks, flags = LAYOUTS[layout]
    if ranks == 1:
        return run_train([*args, *flags], env=clean_env(), timeout=LIMIT)
    return run_launched([*args, *flags], torchrun(ranks), clean_env())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("parts") / "data")


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """One process's run (the reference), and each writer's: 6 steps, checkpoints at 3 and 6."""
    out = {}
    for layout in ["one", *WRITERS]:
        log_dir = tmp_path_factory.mktemp(layout) / "log"
        launch(tiny_run_args(data, log_dir, *EQUAL), layout)
        out[layout] = log_dir
    return out


@pytest.mark.parametrize("writer", WRITERS)
def test_a_part_checkpoint_holds_the_whole_model_once(runs, writer):
    """Every tensor of the one-process model (the tied weight under both its names), with its AdamW moments, in the
    one-process shapes and values a layout-free reader (DCP on one process, no process group) gets back."""
    path = os.path.join(runs[writer], "model_00006.dcp")
    assert os.path.isdir(path) and not os.path.exists(os.path.join(runs[writer], "model_00006.pt"))
    one = train_gpt2.load_checkpoint(os.path.join(runs["one"], "model_00006.pt"))
    model, _ = train_gpt2.load_model(path)
    state = model.state_dict()
    for name, value in one["model"].items():
        assert state[name].shape == value.shape and (state[name] - value).abs().max() <= TOL, name


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("reader", ["one", *WRITERS])
def test_a_part_checkpoint_resumes_under_every_layout(runs, tmp_path, writer, reader):
    if reader == writer:
        pytest.skip("the same layout resumes its own checkpoints: test_pipeline, test_tensor_parallel, test_distributed")
    resumed = stopped_after_step_3(runs[writer], tmp_path / f"{writer}_to_{reader}")
    proc = launch(["--resume", "--log_dir", resumed], reader)
    assert "model_00003.dcp at step 3" in proc.stdout
    assert ("pipeline: 2 stages" in proc.stdout) == (reader in ("pp2", "pp2tp2"))
    assert ("tensor parallel: 2 ranks" in proc.stdout) == (reader == "tp2")
    assert ("split over 2 tensor-parallel ranks" in proc.stdout) == (reader == "pp2tp2")
    assert_same_run(runs["one"], resumed)
    assert final_weights_diff(runs["one"], resumed) <= TOL


@pytest.mark.parametrize("writer", WRITERS)
def test_sample_and_export_read_a_part_checkpoint(runs, tmp_path, writer):
    path = str(runs[writer] / "model_00006.dcp")
    sample = subprocess.run([sys.executable, "sample.py", "--ckpt_path", path, "--max_new_tokens", "4", "--num_samples",
                             "1"], cwd=REPO, capture_output=True, text=True, env=clean_env())
    assert sample.returncode == 0, sample.stderr
    out = tmp_path / "hf"
    export = subprocess.run([sys.executable, "export_hf.py", path, str(out)], cwd=REPO, capture_output=True, text=True,
                            env=clean_env(HF_HUB_OFFLINE="1"))
    assert export.returncode == 0, export.stderr
    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    ours = train_gpt2.load_model(str(runs["one"] / "model_00006.pt"))[0].eval()
    idx = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(idx).logits - ours(idx)[0][..., :50257]).abs().max().item()
    assert diff <= 1e-4, diff
