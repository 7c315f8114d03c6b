"""Intel Extension for PyTorch (--ipex): trains like the plain trainer, and checkpoints cross over both ways.

These need intel_extension_for_pytorch, which needs torch 2.8: .ci/intel-lane runs them in a second
environment built from requirements-intel.txt. In the main environment they skip, except the one
that checks the error for --ipex on without IPEX.

bf16 tolerance: IPEX keeps bf16 weights plus the low 16 bits of each fp32 master weight, and its
kernels sum in other orders than PyTorch's, so losses agree to a few parts in a thousand, not exactly.
"""
import importlib.util
import os
import sys

import pytest
import torch

from conftest import LIMIT, REPO, TORCHRUN, clean_env, make_shards, read_log, run_launched, run_train, tiny_run_args

HAVE_IPEX = importlib.util.find_spec("intel_extension_for_pytorch") is not None
# a learnable task: tokens drawn from 64 ids, so the loss falls from ln(50304) = 10.8 towards ln(64) = 4.2
# bf16 where IPEX can run it (its bf16 weights need AVX-512 or AVX-NE-CONVERT), else fp32
BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
LEARN = ["--dtype", "bf16" if BF16 else "fp32", "--max_steps", "6", "--max_lr", "1e-2", "--min_lr", "1e-3", "--warmup_steps", "1"]
REL_TOL = 1e-2


def close(a, b, rel=REL_TOL):
    return abs(a - b) <= rel * abs(b)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("ipex") / "data", vocab=64)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """The same 6 steps with and without IPEX (checkpoints at steps 3 and 6)."""
    pytest.importorskip("intel_extension_for_pytorch")
    out = {}
    for mode in ("off", "on"):
        log_dir = tmp_path_factory.mktemp(f"ipex_{mode}") / "log"
        out[mode] = log_dir, run_train(tiny_run_args(data, log_dir, *LEARN, "--ipex", mode), timeout=LIMIT)
    return out


def test_ipex_on_without_ipex_fails_clearly(data, tmp_path):
    if HAVE_IPEX:
        pytest.skip("intel_extension_for_pytorch is installed here")
    proc = run_train(tiny_run_args(data, tmp_path / "log", "--ipex", "on"), check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --ipex on, but intel_extension_for_pytorch is not installed "
        "(pip install -r requirements-intel.txt, or pass --ipex off)")
    # auto quietly trains without it
    proc = run_train(tiny_run_args(data, tmp_path / "log2", "--ipex", "auto", "--max_steps", "1"))
    assert "ipex:" not in proc.stdout


def test_ipex_trains_like_the_plain_trainer(runs):
    (off_dir, off), (on_dir, on) = runs["off"], runs["on"]
    assert "ipex: intel_extension_for_pytorch 2.8" in on.stdout and f"optimize(dtype=torch.{'bfloat16' if BF16 else 'float32'})" in on.stdout
    assert "ipex:" not in off.stdout
    plain, ipex = read_log(off_dir, "train"), read_log(on_dir, "train")
    assert sorted(ipex) == list(range(6))
    assert ipex[5] < ipex[0] - 1.0, f"IPEX run did not learn: {ipex}"
    worst = max(abs(ipex[s] - plain[s]) / plain[s] for s in plain)
    print(f"IPEX vs plain bf16: largest relative train loss difference {worst:.1e}")
    assert worst <= REL_TOL, (plain, ipex)
    for step, loss in read_log(off_dir, "val").items():
        assert close(read_log(on_dir, "val")[step], loss)


def test_ipex_checkpoint_holds_plain_fp32_weights(runs):
    plain = torch.load(os.path.join(runs["off"][0], "model_00006.pt"), weights_only=True)
    ipex = torch.load(os.path.join(runs["on"][0], "model_00006.pt"), weights_only=True)
    assert list(ipex["model"]) == list(plain["model"])
    for k, v in ipex["model"].items():
        assert v.dtype == torch.float32 and v.shape == plain["model"][k].shape, k
    assert ipex["optimizer"]["state"].keys() == plain["optimizer"]["state"].keys()


@pytest.mark.parametrize("saved,resumed", [("on", "off"), ("off", "on")])
def test_checkpoint_crosses_between_ipex_and_plain(runs, tmp_path, saved, resumed):
    """Resume a run's step-3 checkpoint with IPEX switched the other way: steps 3..5 continue the same
    trajectory (to bf16 tolerance) and the final val loss matches."""
    src_dir, _ = runs[saved]
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    os.link(os.path.join(src_dir, "model_00003.pt"), log_dir / "model_00003.pt")
    proc = run_train(["--resume", "--log_dir", log_dir, "--ipex", resumed], timeout=LIMIT)
    assert ("ipex: intel_extension_for_pytorch" in proc.stdout) == (resumed == "on")
    before, after = read_log(src_dir, "train"), read_log(log_dir, "train")
    assert sorted(after) == [3, 4, 5]
    for step in after:
        assert close(after[step], before[step]), (step, before, after)
    assert close(read_log(log_dir, "val")[6], read_log(src_dir, "val")[6])


@pytest.mark.filterwarnings("ignore:aten.*layer_norm.*autograd kernel was not registered")  # IPEX's own LayerNorm
def test_state_dict_round_trip(data):
    """In one process: a plain model's state loads into an IPEX-optimized one and back, unchanged."""
    ipex = pytest.importorskip("intel_extension_for_pytorch")
    sys.path.insert(0, REPO)
    from train_gpt2 import GPT, GPTConfig
    config = GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    plain = GPT(config)
    opt, _ = plain.configure_optimizer(0.1, 1e-2, "cpu")
    x, y = torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32))
    _, loss = plain(x, y)
    loss.backward()
    opt.step()
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    opt_state = opt.state_dict()

    model = GPT(config)
    model.load_state_dict(state)
    optimizer, _ = model.configure_optimizer(0.1, 1e-2, "cpu")
    optimizer.load_state_dict(opt_state)
    model, optimizer = ipex.optimize(model, optimizer=optimizer, dtype=torch.bfloat16 if BF16 else torch.float32, inplace=True)
    # the IPEX model reports the exact fp32 weights it was given, in the plain layout
    back = model.state_dict()
    assert list(back) == list(state)
    for k in state:
        assert torch.equal(back[k], state[k]), k
    # train a step with IPEX, then carry weights and optimizer state into a fresh plain model
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=BF16):
        _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    fresh = GPT(config)
    fresh.load_state_dict(model.state_dict())
    fresh_opt, _ = fresh.configure_optimizer(0.1, 1e-2, "cpu")
    fresh_opt.load_state_dict(optimizer.state_dict())
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
        assert not torch.equal(v, state[k]), f"{k} did not change in the IPEX step"
    assert fresh_opt.state_dict()["state"][0]["step"].item() == 2


@pytest.mark.xdist_group("multiprocess")
def test_ipex_with_two_ranks(data, runs, tmp_path):
    """IPEX under DDP (ipex.optimize before the DDP wrap): the ranks end identical, close to one process."""
    log_dir = tmp_path / "log"
    proc = run_launched(tiny_run_args(data, log_dir, *LEARN, "--ipex", "on"), TORCHRUN, clean_env())
    assert "world size 2" in proc.stdout and "parameter sha256 (all 2 rank(s)): " in proc.stdout
    one, two = read_log(runs["on"][0], "train"), read_log(log_dir, "train")
    for step in one:
        assert close(two[step], one[step]), (one, two)
