"""bench/compare_hf_lora.py: its peft side trains the adapters alone, as many as ours, and the script runs end to end
on a tiny base (both sides at ours' hyperparameters; peft alone as users run it). Nothing here is a quality figure."""
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import compare_hf_lora  # noqa: E402
import export_hf  # noqa: E402
import lora  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def base(tmp_path):
    """A random tiny GPT exported as a Hugging Face folder: the base both sides load."""
    torch.manual_seed(0)
    export_hf.export(GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=1, n_head=2, n_embd=32)),
                     str(tmp_path / "base"))
    return str(tmp_path / "base")


def run(tmp_path, *flags):
    cmd = [sys.executable, os.path.join("bench", "compare_hf_lora.py"), "--synthetic", "reverse", "--n_train", "24",
           "--n_val", "4", "--epochs", "1", "--lora", "4", "--lora_alpha", "8",
           "--work_dir", str(tmp_path / "work"), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path)))


def test_peft_trains_the_adapters_alone_as_many_as_ours(base):
    args = compare_hf_lora.parse_args(["--init_from", base, "--synthetic", "reverse", "--lora", "4",
                                       "--lora_alpha", "8"])
    theirs = compare_hf_lora.peft_model(args, 0.0, 0.0)
    trainable = {n: p.numel() for n, p in theirs.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    ours = lora.add_adapters(GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=1, n_head=2, n_embd=32)), 4, 8.0,
                             list(lora.TARGETS))
    assert sum(trainable.values()) == sum(p.numel() for p in lora.adapters(ours).values())
    assert "--init_from " + os.path.abspath(base) + " --lora 4 --lora_alpha 8" in args.our_flags
    assert (args.n_layer, args.n_embd, args.block_size) == (1, 32, 64)   # the base's shape and context


def assert_ran_at_ours_hyperparameters(out):
    """Both sides ran, peft's at ours' hyperparameters and as many steps, and the gap between them was said."""
    ours_steps = re.search(r"fine-tuning: 24 examples x 1 epochs = (\d+) steps", out).group(1)
    assert f"peft, ours' hyperparameters: 24 examples x 1 epochs = {ours_steps} steps of " in out   # as many steps
    assert "betas (0.9, 0.95), weight decay 0.1, clip 1, no dropout" in out and "lr 0.001 -> 0.0001" in out
    assert "cpu: " in out and "the base, before fine-tuning (ours' step 0): val loss " in out
    assert re.search(r"ours - peft: val loss [-+]\d\.\d{4}, accuracy [-+]\d\.\d{3}: (NOT )?within 0.05", out)


def test_runs_tiny_at_ours_hyperparameters_and_same_batches_give_ours_val_loss(base, tmp_path):
    """The script end to end at ours' hyperparameters (as many steps, the same optimizer and schedule). Then
    --same_batches: peft's steps hold ours' examples and its A starts at ours': the two runs differ by their code
    alone, so they end at the same val loss (their own seeds' order and A give another: the first run here)."""
    gaps = []
    for flags in ([], ["--same_batches"]):
        proc = run(tmp_path / str(len(gaps)), "--init_from", base, "--hf_like_ours", "--seed", "3",
                   "--our_flags", "--seed 3", *flags)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert_ran_at_ours_hyperparameters(proc.stdout)
        gaps.append(abs(float(re.search(r"ours - peft: val loss ([-+]\d\.\d{4})", proc.stdout).group(1))))
    assert gaps[1] <= 1e-4 < gaps[0]


def test_runs_peft_alone_as_users_run_it(base, tmp_path):
    proc = run(tmp_path, "--init_from", base, "--only", "hf")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("peft: lora_dropout 0.05; 24 examples x 1 epochs = 3 steps of 8 examples; lr 0.0002 linear to 0"
            in proc.stdout)


def test_bad_input_is_one_error_line(base, tmp_path):
    for flags, message in ((["--init_from", str(tmp_path)], "not a Hugging Face-layout folder"),
                           (["--init_from", base, "--hf_like_ours", "--only", "hf"], "not with --only hf"),
                           (["--init_from", base, "--same_batches"],
                            "--same_batches is a refinement of --hf_like_ours")):
        proc = run(tmp_path, *flags)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
