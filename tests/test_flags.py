"""Every flag of every script has help text, shows its default in --help, and has a row in its docs page's table."""
import argparse
import importlib
import os
import re

import pytest

from conftest import REPO

# each script, and the docs page whose table lists its flags
PAGES = {"train_gpt2": "docs/training.md", "fineweb": "docs/data.md", "finetune": "docs/finetuning.md",
         "hellaswag": "docs/evaluation.md", "sample": "docs/sampling.md", "answer": "docs/finetuning.md",
         "export_hf": "docs/export.md", "plot": "docs/training.md"}


class Parsed(Exception):
    """Raised by parse_args in place of parsing: it carries the script's parser out, before any work."""


def parser_of(script, monkeypatch):
    """The ArgumentParser a script's main() builds (caught at its parse_args)."""
    if script == "train_gpt2":
        import train_args
        return train_args.build_parser()
    def caught(self, *args, **kwargs):
        raise Parsed(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(Parsed) as got:
        importlib.import_module(script).main([])
    return got.value.args[0]


def table_rows(page):
    """The text of every table row ('| ... |' lines) of a docs page."""
    with open(os.path.join(REPO, page)) as f:
        return [line for line in f if line.startswith("|")]


@pytest.mark.parametrize("script", PAGES)
def test_every_flag_has_help_a_default_and_a_docs_row(script, monkeypatch):
    parser = parser_of(script, monkeypatch)
    formatter = parser._get_formatter()  # (the text --help prints for a flag, before %(default)s is filled in)
    rows = table_rows(PAGES[script])
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        if not (action.help or "").strip():
            missing.append(f"{name}: no help text")
        if action.option_strings and "default" not in formatter._get_help_string(action):
            missing.append(f"{name}: --help does not show its default")
        if action.option_strings and not any(re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", row)
                                             for row in rows for flag in action.option_strings):
            missing.append(f"{name}: no row in {PAGES[script]}'s flags table")
    assert not missing, f"{script}.py: " + "; ".join(missing)
