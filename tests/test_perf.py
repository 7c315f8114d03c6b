"""The optimized training step computes what the plain one does; --compile works with everything
the training loop does; bench/bench_train.py runs. Nothing here is timed: speed is bench/'s job,
and timings in tests fail at random on shared machines."""
import glob
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import nullcontext

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
import torch.nn.functional as F

from compute import fused_loss, speedups
from conftest import HELLASWAG_EXAMPLES, REPO, make_shards, read_log, run_train, tiny_run_args, write_hellaswag
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # batches of 4 x 32 = 128 positions, in chunks of 48: two full chunks and a shorter last one
    monkeypatch.setattr(fused_loss, "LOSS_CHUNK", 48)


def plain_loss(model, x, y):
    """build-nanogpt's loss: all the logits, then F.cross_entropy."""
    logits, _ = model(x)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def loss_and_grads(model, x, y, plain, autocast=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast(**autocast) if autocast else nullcontext():
        loss = plain_loss(model, x, y) if plain else model(x, y)[1]
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def batch(seed=1, B=4, T=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50257, (B, T), generator=g), torch.randint(0, 50257, (B, T), generator=g)


def test_chunked_loss_equals_cross_entropy_fp32():
    torch.manual_seed(0)
    model = GPT(SMALL)
    x, y = batch()
    plain = loss_and_grads(model, x, y, plain=True)
    ours = loss_and_grads(model, x, y, plain=False)
    for name in plain:
        assert rel(ours[name], plain[name]) <= 1e-5, name
    with torch.no_grad():  # validation's path: the loss alone, no gradients computed or kept
        logits, loss = model(x, y)
    assert logits is None and not loss.requires_grad
    assert rel(loss, plain["loss"]) <= 1e-6


def test_compiled_gelu_is_gpt2s_tanh_gelu(monkeypatch):
    """Compiled, the MLP's GELU is written x * sigmoid(2z), a faster kernel: it must be F.gelu's tanh approximation,
    values and gradients, in fp64 (to rounding) over the range activations take."""
    from model import tanh_gelu
    monkeypatch.setattr(torch._dynamo.config, "disable", False)  # conftest.py turns torch.compile off
    x = torch.linspace(-12, 12, 10001, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(tanh_gelu, backend="inductor", fullgraph=True)
    for gelu in (compiled, lambda t: F.gelu(t, approximate="tanh")):
        y = gelu(x)
        grad, = torch.autograd.grad(y.sum(), x)
        if gelu is compiled:
            ours = (y.detach(), grad)
    assert torch.allclose(ours[0], y, rtol=0, atol=1e-12) and torch.allclose(ours[1], grad, rtol=0, atol=1e-12)


def test_chunked_loss_bf16_rounds_no_worse_than_plain():
    # In bf16 neither path equals the fp32 result: both round the logits and their gradient to
    # bf16. The chunked path also rounds the lm_head (= wte) weight gradient once per chunk before
    # summing in fp32, where the plain path rounds the whole sum once. So we ask of every tensor
    # that its distance to the fp32 result be no more than twice the plain bf16 path's own.
    torch.manual_seed(0)
    model = GPT(SMALL)
    x, y = batch()
    exact = loss_and_grads(model, x, y, plain=True)
    plain = loss_and_grads(model, x, y, plain=True, autocast=BF16)
    ours = loss_and_grads(model, x, y, plain=False, autocast=BF16)
    for name in exact:
        err_plain, err_ours = rel(plain[name], exact[name]), rel(ours[name], exact[name])
        assert err_plain < 2e-2, name  # the reference itself is sane: bf16 keeps 8 bits of mantissa
        assert err_ours <= 2 * err_plain + 1e-6, (name, err_ours, err_plain)


def test_accumulated_chunked_gradients_equal_big_batch():
    # backward() scales the gradients computed in forward by its incoming gradient (1/k here)
    torch.manual_seed(0)
    model = GPT(SMALL)
    x, y = batch(B=8)
    big = loss_and_grads(model, x, y, plain=True)
    model.zero_grad(set_to_none=True)
    for i in range(4):
        _, loss = model(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2])
        (loss / 4).backward()
    for name, p in model.named_parameters():
        assert rel(p.grad, big[name]) <= 1e-5, name


def train_curve(plain, compile, autocast, steps=20):
    """Losses of `steps` AdamW steps of a small model, 2 micro-steps each, on fixed random data."""
    torch.manual_seed(0)
    raw = GPT(SMALL)
    optimizer, _ = raw.configure_optimizer(weight_decay=0.1, learning_rate=1e-3, device_type="cpu")
    model = speedups.compile_model(raw) if compile else raw  # as train_gpt2.py compiles it
    data = [batch(seed=s, B=2) for s in range(8)]  # a few batches, seen again and again: the loss falls
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(2):
            x, y = data[(2 * step + micro) % len(data)]
            with torch.autocast(**autocast) if autocast else nullcontext():
                loss = (plain_loss(model, x, y) if plain else model(x, y)[1]) / 2
            total += loss.item()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        optimizer.step()
        losses.append(total)
    return torch.tensor(losses, dtype=torch.float64)


def test_training_curves_agree(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "disable", False)  # conftest.py turns torch.compile off
    speedups.compile_cache_dir()
    plain = train_curve(plain=True, compile=False, autocast=None)
    assert plain[-1] < plain[0] - 0.5  # it learns, so the curves compare something
    # fp32: the chunked loss, and torch.compile's fused kernels, change only the rounding
    torch._dynamo.utils.counters.clear()
    for compile in (False, True):
        assert ((train_curve(plain=False, compile=compile, autocast=None) - plain).abs().max()
                <= 1e-5 * plain.abs().max())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    # bf16: the optimized step strays from the fp32 curve no further than twice the plain bf16 step does
    plain_bf16 = train_curve(plain=True, compile=False, autocast=BF16)
    ours_bf16 = train_curve(plain=False, compile=True, autocast=BF16)
    assert (ours_bf16 - plain).abs().max() <= 2 * (plain_bf16 - plain).abs().max() + 1e-3


def test_compiled_kernels_go_to_this_isas_folder_unless_you_chose_one(tmp_path, monkeypatch):
    # PyTorch writes its own default (/tmp/torchinductor_$USER) into TORCHINDUCTOR_CACHE_DIR on first use,
    # building a fused AdamW is enough, and child processes inherit it. Taken for the user's choice, it let a
    # process limited to AVX2 load kernels compiled under AVX-512: NaN losses, and a segfault in a child.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ours = str(tmp_path / "gpt2-cpu" / "inductor" / torch.backends.cpu.get_cpu_capability())
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    for inherited in (default_cache_dir(), None):  # torch's default (set here, or by a parent), or none
        if inherited is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inherited)
        speedups.compile_model(model)  # (torch.compile is lazy: nothing compiles until the model runs)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == ours
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # a folder you chose is kept
    speedups.compile_model(model)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_compile_with_val_hellaswag_and_sampling(tmp_path):
    data = make_shards(tmp_path / "data")
    hella = write_hellaswag(tmp_path / "hellaswag", HELLASWAG_EXAMPLES[:3])
    args = tiny_run_args(data, tmp_path / "log", "--compile", "--dtype", "bf16", "--max_steps", "4",
                         "--eval_interval", "2", "--sample_interval", "2", "--hellaswag_interval", "2",
                         "--hellaswag_dir", hella)
    out = run_train(args, env={"TORCH_COMPILE_DISABLE": "0"}).stdout  # conftest.py turns torch.compile off
    assert "compile: took about" in out and "sample 0: Hello, I'm a language model," in out
    assert sorted(read_log(tmp_path / "log", "val")) == [0, 2, 4]
    assert sorted(read_log(tmp_path / "log", "hella")) == [0, 2, 4]
    assert len(read_log(tmp_path / "log", "train")) == 4


def test_bench_runs_tiny(tmp_path):
    # eager A: the compiled step is tested above, and every compilation costs CI half a minute.
    # A takes --dtype auto, so it runs bf16 only where this CPU computes it fast: on a CPU without native
    # bf16 a bf16 step of this model (its 50,304-row lm_head) would take minutes. B says fp32 itself.
    cmd = [sys.executable, os.path.join(REPO, "bench", "bench_train.py"), "--ab", "--steps", "2", "--warmup", "1",
           "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", "32", "--batch_size", "2",
           "--grad_accum", "2", "--a", "eager,loss_chunk=48,threads=1", "--b", "plain,fp32,threads=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    a_dtype = "bf16" if "A: eager,chunked,keep,bf16," in out else "fp32"
    assert f"A: eager,chunked,keep,{a_dtype},loss_chunk=48,threads=1" in out, out
    assert (f"A  eager,chunked,keep,{a_dtype},loss_chunk=48,threads=1" in out
            and "B  eager,full,release,fp32,attention=sdpa,threads=1" in out)
    assert f"; dtype: {a_dtype} (" in out and "; dtype: fp32 (--dtype fp32;" in out  # each worker says why
    assert "cpu: " in out and "native bf16: " in out  # the CPU every figure comes from
    assert f"of this CPU's {a_dtype} matmul rate" in out and "of this CPU's fp32 matmul rate" in out
    assert "per-pair ratios" in out and "GiB" in out and "MFU" in out
    # each MFU also against the rate sustained over 1 s of products (a burst can make the fastest probe's too high)
    for name in "AB":
        share, fastest, sustained_share, sustained = re.search(
            rf"^{name}: ([\d.]+)% of this CPU's \w+ matmul rate, ([\d.]+) GFLOP/s \(the fastest probe\); "
            rf"([\d.]+)% of its sustained rate, ([\d.]+) GFLOP/s", out, re.M).groups()
        assert float(sustained) > 0 and float(sustained_share) == pytest.approx(
            float(share) * float(fastest) / float(sustained), rel=0.05, abs=0.1)


def process_state(pid):
    """A process's state letter from /proc/<pid>/stat (R, S, Z for a zombie, ...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]  # after the command name, which may hold spaces
    except OSError:
        return None


def children(pid):
    """The processes whose parent is pid, from /proc/*/stat (its 4th field)."""
    kids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            pass  # it ended while we read
    return kids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_bench_workers_die_with_their_parent(tmp_path):
    # A benchmark killed with SIGKILL (a test's timeout, kill -9) cannot stop its workers. Killed between
    # steps, a worker notices: its stdin ends. Killed during a step, it would compute to the end of the
    # step, unaware; so the parent dies here during a long one (100,000 micro-steps of a tiny model).
    cmd = [sys.executable, os.path.join("bench", "bench_train.py"), "--a", "eager,threads=1", "--dtype", "fp32",
           "--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--batch_size", "1",
           "--grad_accum", "100000", "--steps", "1000"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", XDG_CACHE_HOME=str(tmp_path))
    parent = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    worker = None
    try:
        for line in parent.stdout:  # A's line comes once its worker is ready; then the parent asks for a step
            if line.startswith("A: "):
                break
        else:
            raise AssertionError(f"bench_train.py exited with {parent.wait()} before its worker was ready")
        (worker,) = children(parent.pid)
        time.sleep(1)  # well into the step
        assert process_state(worker) not in (None, "Z")
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while process_state(worker) not in (None, "Z") and time.monotonic() < deadline:  # a zombie is dead
            time.sleep(0.1)
        assert process_state(worker) in (None, "Z"), "the worker outlived its parent"
    finally:
        parent.kill()
        if worker and process_state(worker) not in (None, "Z"):
            os.kill(worker, signal.SIGKILL)  # the failing case must not leave it computing


@pytest.mark.parametrize("script, args, check", [
    ("bench_generate.py", ["--new_tokens", "3"], "the same tokens both ways"),
    ("bench_hellaswag.py", ["--model", "demo", "--rounds", "1", "--batch_sizes", "2"],
     "all methods picked the same endings"),
])
def test_inference_benchmarks_run(script, args, check, tmp_path):
    # run as the README says, from the repository root; each script checks that its ways agree, which
    # only fp32 promises (bf16 rounds differently in each way and may flip a near tie)
    cmd = [sys.executable, os.path.join("bench", script), *args, "--threads", "1", "--dtype", "fp32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert check in proc.stdout
    assert "cpu: " in proc.stdout and "dtype: fp32 (--dtype fp32;" in proc.stdout


KEEP_FREED = """
import resource, sys, torch
from compute import cpu
if sys.argv[1] in ("keep", "kept, then released"):
    assert cpu.keep_freed_memory()
if sys.argv[1] == "kept, then released":  # (as --parallel auto does once it has timed the layouts that keep it)
    torch.ones(64 * 2**20 // 4)  # kept: its pages stay in the heap
    assert cpu.keep_freed_memory(False)
    torch.ones(64 * 2**20 // 4)  # may still land in those kept pages; freeing it trims the heap, as glibc does
def faults_of_a_big_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(64 * 2**20 // 4)  # 64 MB, written and freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(min(faults_of_a_big_tensor() for _ in range(20)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keep_freed_memory_stops_page_faults():
    # Without keep_freed_memory, glibc unmaps each 64 MB tensor when it is freed, and every next one
    # faults in all its 16,384 pages. With it, the freed blocks stay in the heap and, once a few have
    # merged into one big enough (a training step repeats the same sizes), a tensor lands in memory
    # already mapped: no page faults.
    def faults(mode):
        proc = subprocess.run([sys.executable, "-c", KEEP_FREED, mode], capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout)
    assert faults("keep") < 1000
    assert faults("release") > 16000
    assert faults("kept, then released") > 16000  # glibc's policy back: sharded runs give freed memory to the OS
