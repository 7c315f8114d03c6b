"""The user docs: README's first commands make a venv with PyTorch's CPU build, then run the main job and the
tests; short lines; no development history (issue numbers, "this session") in README.md and docs/*.md."""
import glob
import os
import re

from conftest import REPO

README = os.path.join(REPO, "README.md")
# user docs: README and docs/*.md, but docs/history.md, where development history may go
USER_DOCS = [README] + [p for p in sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
                        if not p.endswith("history.md")]
# "issue 35", "the issue's", "this session", "#36" (but not an upstream project's reference, "pytorch#118499")
HISTORY = re.compile(r"\bissues? \d+|\b[Tt]he issue\b|\bthis session\b|(?<![\w/-])#\d+")


def test_readme_starts_with_a_venv_the_cpu_wheel_the_main_job_and_the_tests():
    with open(README) as f:
        lines = f.read().splitlines()
    start = lines.index("```bash")
    assert start < 4  # the first lines
    block = "\n".join(lines[start + 1:lines.index("```", start)]).replace("\\\n", " ")
    setup, tests = block.splitlines()  # two commands (a line ending in a backslash goes on)
    assert setup.startswith("python3 -m venv .venv && .venv/bin/pip install -r requirements.txt")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in setup  # PyTorch's CPU build, not CUDA's
    assert "&& .venv/bin/python train_gpt2.py" in setup
    assert ".venv/bin/pip install -r requirements-dev.txt && .venv/bin/python -m pytest -q tests" in tests


def test_readme_lines_are_short_and_few():
    with open(README) as f:
        lines = f.read().splitlines()
    long = [f"README.md:{n}: {len(line)} characters" for n, line in enumerate(lines, 1) if len(line) > 120]
    assert not long and len(lines) <= 220, long or f"{len(lines)} lines"


def test_no_development_history_in_user_docs():
    found = []
    for path in USER_DOCS:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                found += [f"{os.path.relpath(path, REPO)}:{n}: {m.group(0)!r}" for m in HISTORY.finditer(line)]
    assert not found, found
