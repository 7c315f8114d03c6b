"""Training on task data (a finetune.py folder): the loss on the targets only, equal to transformers' with -100
labels; packed rows without crosstalk; the step's mean over its targets whatever the accumulation, world size or
sharding; exact resume in the middle of an epoch."""
import json
import os

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import dataloader
import finetune
from conftest import TINY_MODEL, TORCHRUN, clean_env, final_weights_diff, read_log, run_launched, run_train
from dataloader import IGNORE, Packed, TaskLoader, pack, pick_targets
from compute import fused_loss
from compute.fused_loss import lm_head_loss
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_gpt(seed=0, block_size=64):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=block_size, vocab_size=50304, n_layer=2, n_head=2, n_embd=32))


def example_ids(rng, n_prompt, n_answer):
    """Token ids and their target mask, as finetune.py lays out one example: prompt, answer, EOT."""
    ids = rng.integers(0, 50000, n_prompt + n_answer).tolist() + [50256]
    return ids, [0] * n_prompt + [1] * (n_answer + 1)


def inputs_and_targets(ids, mask):
    x, y = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
    return x, torch.where(torch.tensor(mask[1:]) > 0, y, IGNORE)


# -----------------------------------------------------------------------------
# The loss


def test_loss_and_gradients_equal_transformers_with_minus_100_labels():
    from transformers import GPT2Config, GPT2LMHeadModel
    import export_hf
    model = tiny_gpt()
    hf_cfg = {k: v for k, v in export_hf.hf_config(model.config).items() if k not in ("architectures", "torch_dtype")}
    hf = GPT2LMHeadModel(GPT2Config(**{**hf_cfg, "vocab_size": 50304}))
    weights = export_hf.hf_weights(model)
    weights["transformer.wte.weight"] = model.transformer.wte.weight.detach().clone()  # all 50304 rows
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.endswith((".attn.bias", ".attn.masked_bias", "lm_head.weight")) for k in missing)
    rng = np.random.default_rng(1)
    batch = [example_ids(rng, 9, 6), example_ids(rng, 4, 11)]  # uneven answers, one row each, no padding
    ids = torch.tensor([b[0] for b in batch])
    labels = torch.where(torch.tensor([b[1] for b in batch]) > 0, ids, -100)  # transformers shifts them itself
    hf.eval()
    theirs = hf(input_ids=ids, labels=labels).loss
    theirs.backward()
    x, y = ids[:, :-1], labels[:, 1:]
    _, ours = model(x, y)
    ours.backward()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    grads = export_hf.hf_weights(type("G", (), {"config": model.config, "state_dict": lambda self: {
        k: p.grad for k, p in model.named_parameters()}})())
    hf_grads = dict(hf.named_parameters())
    for k, g in grads.items():
        ref = hf_grads[k].grad[:g.shape[0]] if k == "transformer.wte.weight" else hf_grads[k].grad
        torch.testing.assert_close(g, ref, rtol=0, atol=1e-5, msg=k)


@pytest.mark.parametrize("ignored", ["none", "one chunk", "every other"])
def test_chunked_loss_skips_ignored_targets_as_cross_entropy_does(monkeypatch, ignored):
    monkeypatch.setattr(fused_loss, "LOSS_CHUNK", 8)
    torch.manual_seed(0)
    x = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(100, 16, requires_grad=True)
    y = torch.randint(0, 100, (32,))
    if ignored == "one chunk":
        y[8:16] = IGNORE  # a whole chunk of nothing
    elif ignored == "every other":
        y[::2] = IGNORE
    ref = F.cross_entropy(x @ w.t(), y, ignore_index=IGNORE)
    ref_gx, ref_gw = torch.autograd.grad(ref, (x, w))
    ours = lm_head_loss(x, w, y)
    gx, gw = torch.autograd.grad(ours, (x, w))
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(gx, ref_gx)
    torch.testing.assert_close(gw, ref_gw)
    with torch.no_grad():  # validation's path
        torch.testing.assert_close(lm_head_loss(x, w, y), ref)


def test_a_batch_with_no_target_has_loss_zero_not_nan():
    x = torch.randn(12, 16, requires_grad=True)
    w = torch.randn(100, 16, requires_grad=True)
    y = torch.full((12,), IGNORE)
    assert torch.isnan(F.cross_entropy(x @ w.t(), y, ignore_index=IGNORE))  # what we do better
    loss = lm_head_loss(x, w, y)
    loss.backward()
    assert loss.item() == 0.0 and not x.grad.any() and not w.grad.any()
    model = tiny_gpt()  # and through a packed forward, which drops every position before the loss
    y = torch.full((1, 8), IGNORE)
    _, loss = model(torch.zeros(1, 8, dtype=torch.long), y,
                    packed=Packed(torch.arange(8)[None], torch.tensor([8]), pick_targets(y)))
    loss.backward()
    assert loss.item() == 0.0 and all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


# -----------------------------------------------------------------------------
# Packed rows


def packed_row(examples, T):
    """examples [(ids, mask)] end to end in one row of T positions, padded as TaskLoader pads."""
    x, y, pos, lengths = [], [], [], []
    for ids, mask in examples:
        xi, yi = inputs_and_targets(ids, mask)
        x.append(xi), y.append(yi), pos.append(torch.arange(len(xi))), lengths.append(len(xi))
    pad = T - sum(lengths)
    x.append(torch.full((pad,), 50256)), y.append(torch.full((pad,), IGNORE)), pos.append(torch.arange(pad))
    lengths.append(pad)
    y = torch.cat(y)[None]
    return torch.cat(x)[None], y, Packed(torch.cat(pos)[None], torch.tensor(lengths), pick_targets(y))


def loss_and_grads(model, x, y, packed=None):
    model.zero_grad()
    _, loss = model(x, y, packed=packed)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_each_packed_example_learns_as_if_alone_and_ignores_its_neighbours():
    model = tiny_gpt()
    rng = np.random.default_rng(2)
    a, b, b2 = example_ids(rng, 7, 5), example_ids(rng, 12, 3), example_ids(rng, 12, 3)

    # only a's targets count
    def ignore(ex):
        return (ex[0], [0] * len(ex[1]))

    alone = loss_and_grads(model, *(t[None] for t in inputs_and_targets(*a)))
    for layout in (lambda n: [a, ignore(n)], lambda n: [ignore(n), a]):  # a first or second in its row
        with_b, with_b2 = (loss_and_grads(model, *packed_row(layout(n), 40)) for n in (b, b2))
        for loss, grads in (with_b, with_b2):  # as if alone (only the order of float sums differs)
            torch.testing.assert_close(loss, alone[0], rtol=1e-6, atol=1e-6)
            for k in grads:
                torch.testing.assert_close(grads[k], alone[1][k], rtol=1e-5, atol=1e-6, msg=k)
        # a different neighbour changes nothing for a
        torch.testing.assert_close(with_b[0], with_b2[0], rtol=0, atol=1e-7)
        for k in with_b[1]:
            torch.testing.assert_close(with_b[1][k], with_b2[1][k], rtol=0, atol=1e-7, msg=k)


def test_packed_attention_equals_a_block_diagonal_mask():
    """An independent path: GPT.hidden with a dense mask that lets each position see its own example's earlier ones."""
    model = tiny_gpt()
    rng = np.random.default_rng(3)
    x, _, packed = packed_row([example_ids(rng, 5, 4), example_ids(rng, 9, 9), example_ids(rng, 3, 2)], 48)
    doc = torch.repeat_interleave(torch.arange(len(packed.lengths)), packed.lengths)
    mask = (doc[:, None] == doc[None, :]) & torch.ones(48, 48, dtype=torch.bool).tril()
    with torch.no_grad():
        dense = model.hidden(x, packed.positions, mask)
        ours = model.hidden(x, packed.positions, lengths=packed.lengths)
    torch.testing.assert_close(ours, dense, rtol=0, atol=1e-5)


def test_compiled_packed_rows_leave_packed_attention_eager(monkeypatch):
    """Compiled as train_gpt2.py compiles (keep_packed_attention_eager first), rows with new example lengths compute
    what the eager model does without compiling a graph for each set of lengths (the split depends on the data)."""
    import torch._dynamo
    import model as gpt2
    monkeypatch.setattr(torch._dynamo.config, "disable", False)  # (conftest.py turns torch.compile off)
    monkeypatch.setattr(gpt2, "packed_attention", gpt2.packed_attention)  # (undone after the test)
    gpt2.keep_packed_attention_eager()
    torch._dynamo.reset()
    model, rng, graphs, counts = tiny_gpt(), np.random.default_rng(4), [], []
    compiled = torch.compile(model, backend=lambda gm, _: graphs.append(gm) or gm)  # (the graphs dynamo makes)
    for shape in ([(5, 4), (9, 9), (3, 2)], [(2, 2), (11, 8)], [(4, 4), (4, 4), (4, 4), (1, 1)], [(7, 7), (6, 3)],
                  [(3, 3)] * 5, [(20, 10)], [(8, 8), (8, 4)]):
        x, y, packed = packed_row([example_ids(rng, *n) for n in shape], 48)
        (got, _), (want, _) = loss_and_grads(compiled, x, y, packed), loss_and_grads(model, x, y, packed)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        counts.append(len(graphs))
    # after two rows (the second marks the changing sizes dynamic) no new graph; seen: 10, 11, 11, 12, 13, 13 without it
    assert len(set(counts[1:])) == 1, counts


def test_pick_targets_rounds_up_with_ignored_positions(monkeypatch):
    monkeypatch.setattr(dataloader, "PICK_MULTIPLE", 4)
    y = torch.tensor([[IGNORE, 5, 6, IGNORE, 7, IGNORE], [IGNORE] * 6])
    picked = pick_targets(y)
    assert picked.tolist() == [1, 2, 4, 0]  # 3 targets, then an ignored position up to 4
    assert pick_targets(torch.full((2, 3), IGNORE)).numel() == 0
    assert pick_targets(torch.ones(2, 3, dtype=torch.long)).tolist() == list(range(6))  # all targets: capped at B*T


def test_pack_keeps_examples_whole_and_in_order():
    lengths = np.array([5, 3, 8, 2, 2, 7, 1])
    rows = pack(range(7), lengths, 8)
    assert [i for row in rows for i in row] == list(range(7))
    assert all(sum(lengths[row]) <= 8 for row in rows)
    assert rows == [[0, 1], [2], [3, 4], [5, 6]]


# -----------------------------------------------------------------------------
# Task folders, and the trainer on them


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def uneven_task(folder, n_train=48, n_val=8, seed=0):
    """A prompt/completion task whose answers differ in length (1 to 9 words): finetune.py prepares it."""
    rng = np.random.default_rng(seed)
    words = "red green blue cat dog sun moon tree river stone".split()
    rows = [{"prompt": "Say " + " ".join(rng.choice(words, 3)) + ":",
             "completion": " " + " ".join(rng.choice(words, int(rng.integers(1, 10))))} for _ in range(n_train + n_val)]
    train = write_jsonl(folder / "train.jsonl", rows[:n_train])
    val = write_jsonl(folder / "val.jsonl", rows[n_train:])
    out = str(folder / "task")
    finetune.main(["--input", train, "--val_input", val, "--output_dir", out])
    return out


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return uneven_task(tmp_path_factory.mktemp("task"))


def task_run_args(data_dir, log_dir, *extra):
    return ["--data_dir", data_dir, "--log_dir", str(log_dir), *TINY_MODEL, "--seq_len", "64", "--max_steps", "4",
            "--warmup_steps", "1", "--max_lr", "1e-3", "--eval_interval", "2", "--checkpoint_interval", "2",
            "--keep_checkpoints", "0", "--task_examples", "4", "--dtype", "fp32", "--threads", "1", *extra]


def test_task_loader_serves_every_example_once_per_epoch_with_its_targets(task):
    loader = TaskLoader(task, "train", 2, 64, seed=5)
    tokens, targets, examples = dataloader.open_split(task, "train")
    rows_per_epoch = len(loader.rows)
    seen, n_targets = [], 0
    for _ in range(-(-rows_per_epoch // 2)):
        batches, step_targets = loader.next_step(1)
        (x, y, packed), = batches
        assert step_targets == int((y != IGNORE).sum())
        n_targets += step_targets
        at = 0
        for n in packed.lengths.tolist():  # the spans, row after row: none crosses a row's end
            assert at // 64 == (at + n - 1) // 64
            seen.append(tuple(x.view(-1)[at:at + n].tolist()))
            assert packed.positions.view(-1)[at:at + n].tolist() == list(range(n))
            at += n
        assert at == x.numel()
    whole = {tuple(tokens[s:e - 1].tolist()) for s, _, e in examples.tolist()}
    assert whole <= set(seen)
    assert n_targets >= int(targets.sum())


def test_accumulation_and_batch_size_do_not_change_the_step(task, tmp_path):
    """Uneven answers: 1 micro-step of 4 rows, 4 micro-steps of 1 row: the same mean over the step's targets."""
    one = tmp_path / "one"
    run_train(task_run_args(task, one, "--batch_size", "4", "--total_batch_size", "256"))
    four = tmp_path / "four"
    run_train(task_run_args(task, four, "--batch_size", "1", "--total_batch_size", "256"))
    ref, got = read_log(one, "train"), read_log(four, "train")
    assert max(abs(ref[s] - got[s]) for s in ref) < 1e-5
    assert read_log(one, "val") == read_log(four, "val")  # val: every example, whatever the batch
    assert final_weights_diff(one, four) <= 1e-5
    assert set(read_log(one, "task")) == {0, 2, 4}


def test_resume_in_the_middle_of_an_epoch_is_exact(task, tmp_path):
    args = ["--batch_size", "2", "--total_batch_size", "128", "--max_steps", "6", "--checkpoint_interval", "3"]
    ref = tmp_path / "ref"
    run_train(task_run_args(task, ref, *args))
    state = torch.load(ref / "model_00003.pt", weights_only=True)
    assert state["loader"]["epoch"] == 0 and 0 < state["loader"]["row"] < len(TaskLoader(task, "train", 2, 64).rows)
    assert state["task"] == dataloader.read_task(task)  # the template travels with the weights
    part = tmp_path / "part"
    run_train(task_run_args(task, part, *args, "--resume", ref / "model_00003.pt"))
    assert read_log(part, "train") == {s: v for s, v in read_log(ref, "train").items() if s >= 3}
    a = torch.load(ref / "model_00006.pt", weights_only=True)["model"]
    b = torch.load(part / "model_00006.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.xdist_group("multiprocess-2")
def test_two_ranks_and_sharded_equal_one_process(task, tmp_path):
    """2 rows per step: 2 micro-steps on 1 process, 1 on each of 2 ranks (DDP), and the same sharded (FSDP2)."""
    equal = ["--batch_size", "1", "--total_batch_size", "128"]
    single = tmp_path / "single"
    run_train(task_run_args(task, single, *equal), env=clean_env())
    ddp, sharded = tmp_path / "ddp", tmp_path / "sharded"
    out = run_launched(task_run_args(task, ddp, *equal), TORCHRUN, clean_env()).stdout
    assert "world size 2" in out
    run_launched(task_run_args(task, sharded, *equal, "--shard", "full"), TORCHRUN, clean_env())
    ref = read_log(single, "train")
    for other in (ddp, sharded):
        got = read_log(other, "train")
        assert sorted(got) == sorted(ref) == [0, 1, 2, 3]
        assert max(abs(ref[s] - got[s]) for s in ref) <= 1e-5
        assert all(abs(a - b) <= 1e-4
                   for a, b in zip(read_log(single, "val").values(), read_log(other, "val").values()))
        assert read_log(single, "task") == read_log(other, "task")
        assert final_weights_diff(single, other) <= 1e-5


@pytest.mark.long  # (2-3 minutes of one core; the main lane runs the demo's wiring, small: test_readme_commands.py)
def test_the_offline_demo_learns_its_task(tmp_path):
    """python finetune.py --demo, as a user runs it: the synthetic task (sort 3 to 6 digits) prepared into its folder,
    the demo model trained on it from scratch (130 steps), the accuracy before and after, and what to run next; a second
    demo into the same folder is refused. Measured on an AMD EPYC with AVX2 only: val accuracy 0.00 -> 0.87, in 98 s
    on 2 cores, and on one core (as here) too, in 148 s of CPU time."""
    import subprocess
    import sys
    from conftest import REPO
    out_dir, log_dir = tmp_path / "demo", tmp_path / "log_demo"
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "finetune.py"), "--demo", "--output_dir", out_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    # on one core, as on a 1-core laptop (the trainer takes a thread per core it may use): the other xdist worker
    # has the other core. (Popen returns once the new process runs python, long before torch starts threads.)
    os.sched_setaffinity(proc.pid, {min(os.sched_getaffinity(0))})
    try:
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        proc.kill()  # (only if it ran out of time)
    assert proc.returncode == 0, stdout + stderr
    task = dataloader.read_task(str(out_dir))
    assert task["format"] == "prompt_completion" and task["dropped"] == {} and task["splits"]["val"]["examples"] > 0
    accuracy = read_log(log_dir, "task")
    assert accuracy[0] == 0.0 and accuracy[130] >= 0.6, accuracy
    assert f"training: python train_gpt2.py --data_dir {out_dir} --log_dir {log_dir}" in stdout
    assert f"demo finished: task accuracy 0.00 at step 0 -> {accuracy[130]:.2f} at step 130" in stdout
    assert f"python sample.py --ckpt_path {log_dir / 'model_00130.pt'}" in stdout
    with pytest.raises(SystemExit, match="not empty"):
        finetune.main(["--demo", "--output_dir", str(out_dir)])


def test_a_second_demo_into_the_same_folder_is_refused(tmp_path):
    """Before any work: the demo's folder holds a task already (the long lane's demo run checks this after a real
    one)."""
    out_dir = tmp_path / "demo"
    out_dir.mkdir()
    (out_dir / "train.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match="not empty"):
        finetune.main(["--demo", "--output_dir", str(out_dir)])
    assert os.listdir(out_dir) == ["train.jsonl"]
