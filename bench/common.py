"""
What the benchmarks in this folder share. Each is run from the repository root as
`python bench/bench_X.py`; Python then puts bench/ (the script's folder) on sys.path, so
`import common` finds this file, and this file puts the repository root there too, so that the
scripts can import train_gpt2, hellaswag and tokenizer like any script at the top level.
"""
import os
import sys
from contextlib import nullcontext

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from train_gpt2 import GPT  # noqa: E402  (it is found through the line above)


def add_dtype_and_threads(parser, dtype="fp32"):
    """The two flags every benchmark has: the precision it measures in, and the torch threads."""
    parser.add_argument("--dtype", default=dtype, choices=["fp32", "bf16"], help="bf16: under autocast")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")


def autocast(dtype):
    """bf16 autocast on the CPU, as train_gpt2.py runs it, or nothing for fp32."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()


def random_model(config, threads=0):
    """A GPT of this shape with random weights, the same ones every run (seed 0), on `threads`
    torch threads (0: torch's default). Speed does not depend on the weights, and random ones need
    no download."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    return GPT(config)
