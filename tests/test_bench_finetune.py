"""bench/bench_finetune.py: its transformers side trains on the same examples and targets as our packed rows (the same
loss from the same weights), its FLOP count is bench_train.py's for whole rows, and the script runs. Nothing timed."""
import glob
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import bench_finetune  # noqa: E402
from parallel import sizes  # noqa: E402
import dataloader  # noqa: E402
from dataloader import TaskLoader  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_flops_of_whole_rows_are_bench_train_s():
    n_params, n_layer, n_embd, B, T = 124_475_904, 12, 768, 4, 1024
    ours = bench_finetune.step_flops(n_params, 50304 * n_embd, n_layer, n_embd, B * T, B * T, [T] * B)
    assert ours == sizes.flops_per_token(n_params, n_layer, n_embd, T) * B * T
    # a packed row of two examples: attention only inside each, lm_head only on the picked positions
    packed = bench_finetune.step_flops(n_params, 50304 * n_embd, n_layer, n_embd, T, 100, [600, 424])
    assert packed == (6 * (n_params - 50304 * n_embd) * T + 6 * 50304 * n_embd * 100
                      + 12 * n_layer * n_embd * (600**2 + 424**2))


def test_padded_batch_is_the_packed_rows_examples_with_the_same_loss(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    import export_hf
    bench_finetune.write_examples(tmp_path, 40, 5, 30)
    loader = TaskLoader(tmp_path, "train", 2, 64, seed=bench_finetune.SEED)
    rows = loader.rows[:2]
    order = bench_finetune.example_order(tmp_path, 2, 64)
    assert order[:sum(map(len, rows))] == [i for row in rows for i in row]  # the same examples, in the same order
    x, y, packed = loader.batch(rows)
    ids, mask, labels = bench_finetune.padded_batch(*dataloader.open_split(tmp_path, "train"),
                                                    [i for r in rows for i in r])
    assert mask.sum(1).tolist() == [loader.lengths[i] + 1 for r in rows for i in r]  # each example's tokens, unpadded
    assert labels[:, 1:][labels[:, 1:] != -100].tolist() == y[y != -100].tolist()  # the same targets, in order
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=2, n_embd=32))
    hf_cfg = {k: v for k, v in export_hf.hf_config(model.config).items() if k not in ("architectures", "torch_dtype")}
    hf = GPT2LMHeadModel(GPT2Config(**{**hf_cfg, "vocab_size": 50304})).eval()
    hf.load_state_dict({**export_hf.hf_weights(model), "transformer.wte.weight": model.transformer.wte.weight},
                       strict=False)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
        _, ours = model(x, y, packed=packed)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("a, b", [("packed,eager,threads=1", "hf_padded,threads=1"),
                                  pytest.param("packed,eager,threads=1", "pretrain,eager,threads=1",
                                               marks=pytest.mark.long)])  # (the same script: another kind of B)
def test_bench_finetune_runs_tiny(a, b, tmp_path):
    # eager, fp32, one tiny step of each: that the script runs and reports, not how fast
    cmd = [sys.executable, os.path.join("bench", "bench_finetune.py"), "--ab", "--a", a, "--b", b, "--steps", "1",
           "--warmup", "1", "--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--seq_len", "64", "--batch_size", "2",
           "--example_len", "8", "30", "--dtype", "fp32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path), TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "cpu: " in out and "native bf16: " in out and "examples: " in out
    assert f"A: {a.split(',')[0]}," in out and f"B: {b.split(',')[0]}," in out
    assert "A/B: A is " in out and "x B in example tokens/s" in out and "peak RSS: A " in out and "MFU" in out
    if "hf_padded" in b:
        assert "examples per micro-step" in out and "attention sdpa" in out
    assert not glob.glob(str(tmp_path / "bench_finetune_*"))  # its examples' folder is removed
