"""Helpers shared by the tests: tiny token shards, running train_gpt2.py as a user would (alone, or several
processes at once), comparing two runs' final weights, one torch thread for tiny models, a few HellaSwag examples,
tiny models that answer and fine-tuned checkpoints made by hand; and the xdist set-up (pytest.ini, docs/tests.md)."""
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# torch.compile is on by default in train_gpt2.py, but compiling a tiny model costs a test far more
# time than it saves: make it a no-op here and in every subprocess (they inherit the environment).
# tests/test_perf.py turns it back on where compilation is what it tests.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


def pytest_configure(config):
    """Under xdist (pytest.ini: -n 2, one worker per core of a 2-core host) every worker computes on one torch
    thread: two threads each would have the workers' OpenMP threads fight over the cores. (Subprocesses keep
    their own settings: the tests give them --threads and OMP_NUM_THREADS.)

    And Ctrl-C is taken back where it is ignored: a script that starts the tests in the background (`pytest &`,
    without job control) has them ignore SIGINT, and every process they start inherits that, so the tests that
    stop a run with SIGINT, as Ctrl-C does, would see it carry on."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch
        torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Say so when the xdist_group marks are lost: pytest-xdist 3.8 passes a test's group on by appending it to the
    test's node id, which pytest 9.2 no longer lets it change (pytest-dev/pytest-xdist#1386). The tests then run
    side by side, the multi-process ones too, fighting over the cores, and module fixtures are built twice."""
    if getattr(config.option, "loadgroup", False):
        lost = [item.nodeid for item in items if any(item.iter_markers("xdist_group")) and "@" not in item.nodeid]
        if lost:
            import warnings
            warnings.warn(pytest.PytestConfigWarning(
                f"the xdist_group marks are ignored ({lost[0]} has no @group): this pytest-xdist does not work with "
                f"pytest {pytest.__version__}; pip install -r requirements-dev.txt (pytest<9.2)"))


# a model small enough that a CPU trains it in a fraction of a second per step
TINY_MODEL = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64"]


def make_shards(data_dir, train_tokens=(6000, 5000), val_tokens=3000, seed=0, vocab=50257, prefix="tiny"):
    """Random-token shards in build-nanogpt's format: np.save'd 1-D uint16 arrays."""
    rng = np.random.default_rng(seed)
    os.makedirs(data_dir, exist_ok=True)
    np.save(os.path.join(data_dir, f"{prefix}_val_000000.npy"), rng.integers(0, vocab, val_tokens, dtype=np.uint16))
    for i, n in enumerate(train_tokens, start=1):
        np.save(os.path.join(data_dir, f"{prefix}_train_{i:06d}.npy"), rng.integers(0, vocab, n, dtype=np.uint16))
    return str(data_dir)


def save_random_hf_gpt2(path, **sizes):
    """A randomly initialised GPT-2 saved the way the hub stores it (config.json + model.safetensors); `sizes`
    override its GPT2Config (2 layers, 4 heads, 64 wide, context 128 by default)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(**{**dict(n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=50257), **sizes})
    hf = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # HF zero-inits biases; make them random so a bias mix-up cannot hide
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def tiny_run_args(data_dir, log_dir, *extra):
    """Flags for a short fp32 run of the tiny model; later flags override earlier ones."""
    return ["--data_dir", str(data_dir), "--log_dir", str(log_dir), *TINY_MODEL,
            "--seq_len", "32", "--batch_size", "4", "--total_batch_size", "256", "--max_steps", "6",
            "--warmup_steps", "2", "--max_lr", "1e-3", "--min_lr", "1e-4", "--eval_interval", "3",
            "--val_tokens", "512", "--sample_interval", "0", "--hellaswag_interval", "0",
            "--checkpoint_interval", "3", "--keep_checkpoints", "0", "--dtype", "fp32", "--threads", "1",
            *extra]


def run_train(args, launcher=(), check=True, env=None, timeout=600, cwd=None):
    """Run train_gpt2.py in a subprocess, as a user would; returns the CompletedProcess."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    cmd = [*launcher, *([] if launcher else [sys.executable]), os.path.join(REPO, "train_gpt2.py"), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd or REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def stopped_after_step_3(run_dir, copy):
    """A copy of a finished run's folder as if it had stopped after its first checkpoint (step 3): later ones
    removed."""
    from plumbing import checkpoints
    shutil.copytree(run_dir, copy)
    for f in checkpoints.list_checkpoints(str(copy))[1:]:
        shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)  # (a .dcp is a folder)
    return copy


def checkpoint_val(log_dir, step):
    """The full-precision val loss stored in a checkpoint (log.txt rounds it to 4 decimals); a sharded
    run's checkpoint is a folder (model_XXXXX.dcp)."""
    from plumbing import checkpoints
    path = next(f for f in checkpoints.list_checkpoints(str(log_dir)) if checkpoints.checkpoint_step(f) == step)
    return checkpoints.load_checkpoint(path)["val_loss"]


def assert_same_run(ref_dir, dist_dir, tol=1e-5):
    """Two 6-step runs (the REFERENCE flags, checkpoints at 3 and 6) trained alike: their train losses within tol,
    their val lines equal and their checkpoints' val losses within tol. Returns the largest train loss difference."""
    ref, got = read_log(ref_dir, "train"), read_log(dist_dir, "train")
    assert sorted(got) == sorted(ref) == list(range(6))
    worst = max(abs(ref[s] - got[s]) for s in ref)
    assert worst <= tol, f"train losses differ by {worst:.2e}: {ref} vs {got}"
    assert read_log(ref_dir, "val") == read_log(dist_dir, "val")
    for step in (3, 6):
        assert abs(checkpoint_val(ref_dir, step) - checkpoint_val(dist_dir, step)) <= tol
    return worst


def read_log(log_dir, kind):
    """{step: value} of one kind of line ('train', 'val', 'hella') in log_dir/log.txt."""
    out = {}
    with open(os.path.join(log_dir, "log.txt")) as f:
        for line in f:
            step, k, value = line.split()
            if k == kind:
                out[int(step)] = float(value)
    return out


def final_weights(log_dir):
    """A run's final weights, from its last checkpoint (one file, or a sharded folder: load_model reads either)."""
    from model import load_model
    from plumbing import checkpoints
    return load_model(checkpoints.list_checkpoints(str(log_dir))[-1])[0].state_dict()


def assert_trains_as_one_process(single, log_dir, proc, ranks, tol=1e-5):
    """A 6-step run under a layout (proc, on `ranks` ranks, its folder log_dir) trained as one process (single: its
    folder and its CompletedProcess): the losses, val losses and final weights within tol, and clipping's gradient
    norms within 2e-4 (a uniform scale error on the gradient would keep the losses close, AdamW and clipping hide it:
    the norms show it); the run's end check printed the digest of its parts. Returns the largest loss difference."""
    worst = assert_same_run(single[0], log_dir, tol)
    assert final_weights_diff(single[0], log_dir) <= tol
    norms, reference = printed_norms(proc.stdout), printed_norms(single[1].stdout)
    assert len(norms) == 6 and max(abs(a - b) for a, b in zip(norms, reference)) <= 2e-4, (norms, reference)
    assert re.search(rf"parameter sha256 \(all {ranks} rank\(s\), of the parts\): [0-9a-f]{{64}}", proc.stdout)
    return worst


def final_weights_diff(log_a, log_b):
    """The largest difference between two runs' final weights (0.0: bitwise equal)."""
    a, b = final_weights(log_a), final_weights(log_b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


# Several processes at once: launchers, ranks started by hand. Every test that runs more than one process that
# computes (or loads the CPU on purpose) is in the xdist group "multiprocess" or "multiprocess-2", whichever its file
# is in (docs/tests.md).

LIMIT = 300  # seconds any one launched run may take before it counts as hung (a run takes 10-30)

# The start of a rank script (run by torchrun: gloo, one thread) that records the collectives it makes: inside
# `with Record():` each one appends [its op's name, the bytes of its (first) tensor argument] to `seen`.
# tests/test_pipeline.py checks a step's traffic with it, tests/test_layouts.py the blocks --parallel auto times.
RECORDING_RANK = r'''
import json, sys
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
torch.set_num_threads(1)
dist.init_process_group("gloo")
seen = []
class Record(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in str(func):
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            seen.append([str(func), sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))])
        return func(*args, **(kwargs or {}))
'''
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def clean_env(**extra):
    """This environment without any launcher's variables (as if typed in a fresh shell), plus extra."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("OMPI_", "PMI_", "MPI_LOCAL", "SLURM_", "PMIX_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun(n):
    """torchrun's command for n ranks on this machine (the multi-rank layout tests launch with it)."""
    return (sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}")


def printed_norms(stdout):
    """The gradient norms a run's step lines print."""
    return [float(n) for n in re.findall(r"\| norm ([\d.]+) \|", stdout)]


def free_port():
    """A TCP port free on 127.0.0.1 right now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_launched(args, launcher, env, check=True):
    """Like run_train, for launchers that start the ranks as their children (torchrun, mpirun): in a session of
    its own, so that a hung run is killed whole, ranks included, after LIMIT seconds."""
    cmd = [*launcher, os.path.join(REPO, "train_gpt2.py"), *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} still running after {LIMIT}s:\n{out}\n{err}")
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out}\n{err}")
    return done


def start_ranks(args, world_size, outputs=None, disks=None):
    """world_size train_gpt2.py processes started by hand with torchrun's variables, as srun starts Slurm's
    tasks; rank r's stdout and stderr go to the file outputs[r], or to pipes when outputs is None. disks: each rank's
    folder, mounted over --log_dir for that rank alone (on_own_disk; ranks given the same folder share it, as the ranks
    of one node share its disk)."""
    port, procs = free_port(), []
    args = [str(a) for a in args]
    for rank in range(world_size):
        env = clean_env(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world_size,
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        streams = (dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE) if outputs is None
                   else dict(stdout=outputs[rank], stderr=subprocess.STDOUT))
        cmd = [sys.executable, os.path.join(REPO, "train_gpt2.py"), *args]
        if disks:
            cmd = on_own_disk(cmd, disks[rank], args[args.index("--log_dir") + 1])
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, text=True, **streams))
    return procs


def outputs_of(procs):
    """Each process's (stdout, stderr), once every one has ended; those still running after LIMIT seconds are
    killed (and the wait raises TimeoutExpired)."""
    try:
        return [p.communicate(timeout=LIMIT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_ranks(args, world_size, disks=None, check=True):
    """start_ranks, waited for (killed after LIMIT seconds): rank 0's output (rank 0 alone speaks), every rank's
    stderr, and the worst exit code, as a CompletedProcess."""
    procs = start_ranks(args, world_size, disks=disks)
    outputs = outputs_of(procs)
    rc = max((p.returncode for p in procs), key=abs)
    done = subprocess.CompletedProcess(procs[0].args, rc, outputs[0][0], "".join(err for _, err in outputs))
    if check and rc != 0:
        command = " ".join(map(str, args))
        raise AssertionError(f"{world_size} ranks of {command} failed ({rc}):\n{done.stdout}\n{done.stderr}")
    return done


@pytest.fixture
def shards(tmp_path):
    return make_shards(tmp_path / "data")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Tiny token shards, made once a test module."""
    return make_shards(tmp_path_factory.mktemp("data") / "data")


@pytest.fixture(scope="module")
def single(data, tmp_path_factory, request):
    """One process's run of tiny_run_args and the test module's REFERENCE flags: the run the layouts are compared
    with. (its --log_dir, its CompletedProcess)"""
    log_dir = tmp_path_factory.mktemp("single") / "log"
    flags = getattr(request.module, "REFERENCE", [])
    return log_dir, run_train(tiny_run_args(data, log_dir, *flags), env=clean_env(), timeout=LIMIT)


def refused(data, world_size, *flags):
    """The one error line check_args gives these flags on world_size ranks (train_args.py: before any work)."""
    from train_args import build_parser, check_args
    args = build_parser().parse_args(["--data_dir", str(data), *flags])
    with pytest.raises(SystemExit) as e:
        check_args(args, world_size)
    return str(e.value)


def assert_resumes_across(layout_dir, single_dir, tmp_path, flags, says, one_flags=()):
    """A layout's checkpoint (step 3 of layout_dir, a 2-rank run of `flags`) resumes on one process, and one
    process's resumes under the layout (its plan line starts with `says`), each continuing the uninterrupted run
    (single_dir) within 1e-5."""
    to_one = stopped_after_step_3(layout_dir, tmp_path / "to_one")
    proc = run_train(["--resume", "--log_dir", to_one, *one_flags], env=clean_env(), timeout=LIMIT)
    assert "model_00003.dcp at step 3" in proc.stdout and says.split(":")[0] + ":" not in proc.stdout
    assert_same_run(single_dir, to_one)
    assert final_weights_diff(single_dir, to_one) <= 1e-5
    to_layout = stopped_after_step_3(single_dir, tmp_path / "to_layout")
    proc = run_launched(["--resume", "--log_dir", to_layout, *flags], torchrun(2), clean_env())
    assert "model_00003.pt at step 3" in proc.stdout and says in proc.stdout
    assert_same_run(single_dir, to_layout)
    assert final_weights_diff(single_dir, to_layout) <= 1e-5


def run_rank_script(script, world_size):
    """A rank script (RECORDING_RANK's start, say) under torchrun on world_size ranks, its first argument the
    repository; it must succeed. Returns the CompletedProcess."""
    proc = subprocess.run([*torchrun(world_size), str(script), REPO], capture_output=True, text=True, env=clean_env(),
                          cwd=REPO, timeout=LIMIT)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and leave the other cores to other jobs).
    A test module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch  # here, not at the top: the tests that never touch torch need not import it
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def hellaswag_example(ind, activity, ctx_a, ctx_b, label, endings, split_type="indomain"):
    """One HellaSwag example with all the keys of the official jsonl, as in its val split."""
    return {"ind": ind, "activity_label": activity, "ctx_a": ctx_a, "ctx_b": ctx_b,
            "ctx": f"{ctx_a} {ctx_b}".strip(), "split": "val", "split_type": split_type, "label": label,
            "endings": endings, "source_id": f"handmade~{ind}"}


# Hand-made examples in the official format (our own text). Endings of very different lengths make
# acc (the lowest sum of loss) and acc_norm (the lowest mean) disagree: tests/test_hellaswag.py checks it.
HELLASWAG_EXAMPLES = [
    hellaswag_example(1, "Making tea", "A woman fills a kettle with water.", "she", 2, [
        "puts it on the stove and waits for the water to boil while reading the paper.",
        "throws the kettle out of the window.", "turns it on.",
        "paints the kettle blue and green and then sells it at a market in town."]),
    hellaswag_example(2, "Riding a bike", "A boy rides a bicycle down a hill.", "he", 0, [
        "brakes.", "flies into space on the bicycle, waving to the birds as they pass by.",
        "eats the front wheel.", "reads a long novel about the history of the bicycle while riding."], "zeroshot"),
    hellaswag_example(3, "Cooking", "How to cook rice. Rinse the rice in cold water.", "", 3, [
        "Put the rice in a washing machine and run a full cycle with detergent.",
        "Burn it.", "Plant the rice in the garden and wait a year.",
        "Add two cups of water per cup of rice and bring it to a boil."]),
    hellaswag_example(4, "Gardening", "A man kneels in a garden.", "he", 1, [
        "sings.", "pulls weeds.", "builds a rocket out of the flower pots and launches it to the moon.",
        "digs."], "zeroshot"),
    hellaswag_example(5, "Swimming", "People swim in a pool.", "a lifeguard", 1, [
        "watches them from a tall chair.", "blows.", "is eating a very large sandwich made of bricks.",
        "swims."]),
    hellaswag_example(6, "Snow", "Snow falls on the town. Children run outside.", "", 0, [
        "They build a snowman.", "They swim.", "They sunbathe on the roofs of their houses all afternoon.",
        "They sleep."], "zeroshot"),
]


def write_hellaswag(folder, examples):
    """folder/hellaswag_val.jsonl, one example per line, as hellaswag.py caches the download."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "hellaswag_val.jsonl"), "w") as f:
        f.writelines(json.dumps(ex) + "\n" for ex in examples)
    return str(folder)


# Tiny models that answer: greedy continuations to compare KV-cached and batched generation with

def varied_model(block_size=48):
    """A random tiny GPT whose greedy continuations do not just repeat one token: embeddings and
    weights larger than the training init (which makes near-uniform logits and loops)."""
    import torch
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 1.0 if "wte" in name or "wpe" in name else 0.3 if p.dim() == 2 else 0.1)
    return model


def greedy_reference(model, ids, max_new_tokens):
    """A greedy answer the plain way: the whole sequence through the model for every token, no cache; it stops at
    <|endoftext|> (not included), after max_new_tokens, or where the context ends."""
    import torch
    from tokenizer import EOT, VOCAB_SIZE
    ids, new = list(ids), []
    with torch.no_grad():
        while len(new) < max_new_tokens and len(ids) < model.config.block_size:
            next_id = int(model(torch.tensor([ids]))[0][0, -1, :VOCAB_SIZE].argmax())
            if next_id == EOT:
                break
            new.append(next_id)
            ids.append(next_id)
    return new


def say_eot_at(model, ids, k):
    """Make <|endoftext|> the greedy pick at step k of the answer to ids; returns the k tokens before it. Its
    (tied) embedding row becomes the row of the token greedy picks there, nudged towards that step's hidden
    state, so it wins there by a hair; where that token was picked before, it may win earlier (callers check)."""
    import torch
    from tokenizer import EOT
    free = greedy_reference(model, ids, k + 1)
    assert len(free) == k + 1
    with torch.no_grad():
        h = model.hidden(torch.tensor([ids + free[:k]]))[0, -1]  # the state that picks free[k]
        model.lm_head.weight[EOT] = model.lm_head.weight[free[k]] + 1e-3 * h / h.norm()
    return free[:k]


# Fine-tuned checkpoints made by hand: a task.json dict, and the checkpoint that carries it

def task_of(fmt, templates=None, block_size=64):
    """A task.json dict as finetune.py writes it (the fields answer.py and sample.py read, and the counts around
    them)."""
    import tasks
    return {"kind": "task", "version": 1, "format": fmt, "formats": {fmt: 20},
            "templates": templates or tasks.TEMPLATES, "train_on": "completion", "max_len": block_size,
            "answer_regex": None}


def save_task_checkpoint(path, model, task):
    """A checkpoint as train_gpt2.py writes it for a task run: its config, weights and task."""
    import torch
    from dataclasses import asdict
    torch.save({"config": asdict(model.config), "model": model.state_dict(), "step": 5, "task": task}, path)
    return str(path)


def checkpoints_of_each_kind(folder, model):
    """model's weights saved as a plain language model's checkpoint and as checkpoints fine-tuned on prompt/completion
    and on chat data: (plain, completion, chat) paths, for the error lines each kind gets."""
    import torch
    from dataclasses import asdict
    plain = os.path.join(folder, "plain.pt")
    torch.save({"config": asdict(model.config), "model": model.state_dict()}, plain)
    return (plain, save_task_checkpoint(os.path.join(folder, "qa.pt"), model, task_of("prompt_completion")),
            save_task_checkpoint(os.path.join(folder, "chat.pt"), model, task_of("chat")))


def record_prompts(monkeypatch, module, name):
    """The token ids of every prompt that module.name (model, ids, ...) answers, in order; it still does the work."""
    seen, real = [], getattr(module, name)
    def recording(model, ids, *args, **kwargs):
        seen.append(list(ids))
        return real(model, ids, *args, **kwargs)
    monkeypatch.setattr(module, name, recording)
    return seen


# -----------------------------------------------------------------------------
# Hosts of their own on one machine: network namespaces (an address and a link each), and a disk of their own (a
# private mount over --log_dir). Tools a test needs (mpirun, ip, unshare) are skipped where missing, except under
# CI=true, where .ci/install-system has installed them and a skip would hide a failure.


def need(available, what):
    """Skip a test whose tool is missing, but fail under CI, where .ci/install-system provides it."""
    if not available:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{what} is missing in CI: .ci/install-system should have installed it")
        pytest.skip(f"{what} is not available here")


def can_create_namespaces(tc=False):
    """Whether this process may make network namespaces (root, iproute2's ip; tc too, to limit a link's rate)."""
    if os.geteuid() != 0 or not shutil.which("ip") or (tc and not shutil.which("tc")):
        return False
    name = f"gpt2probe{os.getpid() % 100000}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


@contextlib.contextmanager
def namespace_hosts(n, rate=None):
    """n network namespaces ('hosts') on one bridge, which itself sits in a namespace of its own,
    so nothing is added to this machine's own network. Addresses come from 198.18.0.0/15, the
    range set aside for network benchmarks (RFC 2544); the namespaces have no other route. rate (tc's words: 1gbit):
    what each host sends is limited to it (a token bucket, as bench/bench_parallel.py limits its links)."""
    tag = f"gpt2t{os.getpid() % 100000}"
    switch, hosts = f"{tag}sw", [f"{tag}h{i}" for i in range(n)]
    created = []

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        for ns in (switch, *hosts):
            ip("netns", "add", ns)
            created.append(ns)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for i, ns in enumerate(hosts):
            ip("-n", switch, "link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", switch, "link", "set", f"port{i}", "master", "br0")
            ip("-n", switch, "link", "set", f"port{i}", "up")
            ip("-n", ns, "addr", "add", f"198.18.0.{i + 1}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            if rate:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                                rate, "burst", "256kb", "latency", "200ms"], check=True, capture_output=True)
        yield hosts, [f"198.18.0.{i + 1}" for i in range(n)]
    finally:
        for ns in reversed(created):  # deleting a namespace deletes its ends of the veth pairs
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def can_mount_privately():
    return os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("mount") is not None


def on_own_disk(cmd, disk, folder):
    """cmd, run where the folder `disk` is mounted over `folder` for it alone (a mount namespace of its own): a node
    whose --log_dir is on a disk no other node sees. Both folders are made if missing."""
    os.makedirs(disk, exist_ok=True)
    os.makedirs(folder, exist_ok=True)
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"',
            "sh", str(disk), str(folder), *map(str, cmd)]
