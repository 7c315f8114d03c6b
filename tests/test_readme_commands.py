"""The README's path, run as written: its commands are read from README.md (each picked by its text, so that a changed
command fails here until this test follows it) and run in order in a fresh folder, each checked to leave what the
next one reads. Only what must be tiny is changed, and each change is listed in PATH: a tiny model's flags appended,
a small random GPT-2 for OpenAI's (no download), the demo's task and model shrunk, fewer tokens a step. About 85 s on
one core (shared with a benchmark), 0.6 GB."""
import json
import os
import re
import shlex
import subprocess
import sys

from conftest import REPO, clean_env, save_random_hf_gpt2

# The README's commands, in its order: each by its start (the rest of the line is what the README says), with what is
# changed to make it tiny, and why: (text replaced, what replaces it), "$" appends
TINY_MODEL = "--n_layer 2 --n_head 2 --n_embd 32 --block_size 64 --dtype fp32 --threads 1"
PATH = [
    ("python fineweb.py --input 'my_docs/*.txt' --output_dir my_shards", []),  # (in the text of step 1)
    ("python train_gpt2.py", [("$", f" {TINY_MODEL} --seq_len 64 --batch_size 4 --total_batch_size 256 "
                                    "--val_tokens 512")]),  # no shards: the demo's 60 steps, on a tiny model
    ('python sample.py --ckpt_path log_demo/model_00060.pt --prompt "def main("', []),
    ("python finetune.py --demo", []),  # (its task and model made small by SMALL_FINETUNE_DEMO)
    ("python finetune.py --input train.jsonl --output_dir my_task", []),
    ("python train_gpt2.py --init_from gpt2 --data_dir my_task", [
        ("--init_from gpt2 ", "--init_from tiny_gpt2 "),  # a small random GPT-2: no download
        ("$", " --max_steps 300 --eval_interval 300 --threads 1 --dtype fp32")]),  # (300: the checkpoint's name)
    ('python sample.py --ckpt_path log_task/model_00300.pt --prompt "Name three primes."', []),
    ("python answer.py --ckpt_path log_task/model_00300.pt --input my_val.jsonl", []),
    ("python plot.py log_a log_b -o both.png", [("log_a log_b", "log_demo log_task")]),  # (two runs made above)
    # continued pretraining (in the text after step 6) on step 1's shards, into log/
    ("python train_gpt2.py --init_from gpt2 --data_dir my_shards --max_steps 200", [
        ("--init_from gpt2 ", "--init_from tiny_gpt2 "),
        ("--total_batch_size 32768", "--total_batch_size 64"),  # (its 200 steps: the checkpoint's name)
        ("$", " --seq_len 32 --batch_size 2 --val_tokens 128 --hellaswag_interval 0 --threads 1 --dtype fp32")]),
    # GPT-2 (124M)'s run (19073 steps) is not made here: the continued pretraining's last checkpoint is exported
    ("python export_hf.py log/model_19073.pt gpt2_ours/", [("log/model_19073.pt", "log/model_00200.pt")]),
]
# finetune.py --demo, with the demo's task and model small (its own settings otherwise)
SMALL_FINETUNE_DEMO = f"""
import sys
sys.path.insert(0, {REPO!r})
import finetune
finetune.DEMO_TRAIN_ARGS.update(n_layer=2, n_head=2, n_embd=32, batch_size=8, eval_interval=50, threads=1, dtype="fp32")
make = finetune.make_demo_task
finetune.make_demo_task = lambda out_dir, **kw: make(out_dir, **{{**kw, "n_train": 400, "n_val": 10}})
finetune.main(sys.argv[1:])
"""


def readme_commands():
    """Every command line in README.md: in ```bash blocks, and in `...` spans of its text (joined where a line
    break cuts one), without their comments."""
    text = open(os.path.join(REPO, "README.md")).read()
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
    lines += re.findall(r"`(python [^`]+)`", text.replace("\n", " "))
    return [re.sub(r"\s+#.*$", "", line).strip() for line in lines]


def as_run(command, changes):
    """The README's command with its changes, as argv."""
    for old, new in changes:
        assert old == "$" or old in command, (old, command)
        command = command + new if old == "$" else command.replace(old, new)
    return shlex.split(command)


def test_the_readmes_path_runs_as_written(tmp_path):
    found = readme_commands()
    path = []
    for start, _ in PATH:
        matches = [c for c in found if c == start] or [c for c in found if c.startswith(start + " ")]
        assert matches, f"README.md no longer says {start!r}: update this test's PATH with it"
        path.append(matches[0])
    # what the user brings: text files to pretrain on, a task's examples, its val examples; and a small GPT-2
    os.makedirs(tmp_path / "my_docs")
    for i in range(5):  # about 7,000 tokens each: val takes 3 (--val_tokens 20000), train the rest
        words = " ".join(f"line {j} of doc {i}: the quick brown fox jumps over the lazy dog" for j in range(400))
        (tmp_path / "my_docs" / f"doc{i}.txt").write_text(words)
    examples = [{"prompt": f"Double {n} ->", "completion": f" {2 * n}"} for n in range(60)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples[:50]))
    (tmp_path / "my_val.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples[50:]))
    save_random_hf_gpt2(tmp_path / "tiny_gpt2")
    (tmp_path / "small_demo.py").write_text(SMALL_FINETUNE_DEMO)
    leaves = {0: "my_shards/data_train_000001.npy", 1: "log_demo/model_00060.pt", 3: "task_demo/task.json",
              4: "my_task/task.json", 5: "log_task/model_00300.pt", 8: "both.png", 9: "log/model_00200.pt",
              10: "gpt2_ours/model.safetensors"}  # what each leaves for the next, or for the user
    for i, ((start, changes), command) in enumerate(zip(PATH, path)):
        argv = as_run(command, changes)
        assert argv[0] == "python"
        script = "small_demo.py" if command == "python finetune.py --demo" else os.path.join(REPO, argv[1])
        proc = subprocess.run([sys.executable, script, *argv[2:]], cwd=tmp_path, capture_output=True, text=True,
                              env=clean_env(), timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        if i in leaves:
            assert (tmp_path / leaves[i]).exists(), f"{command} did not write {leaves[i]}"
        if argv[1] == "sample.py":
            assert re.search(r"\d+ tokens in [\d.]+s", proc.stdout + proc.stderr), proc.stdout
        if argv[1] == "answer.py":  # the share of my_val.jsonl's 10 answers it got right
            accuracy = r"^task accuracy: [\d.]+ \(\d+/10 examples of my_val.jsonl"
            assert re.search(accuracy, proc.stdout, re.M), proc.stdout
    assert json.loads((tmp_path / "gpt2_ours" / "config.json").read_text())["n_layer"] == 2  # (tiny_gpt2's)
