"""
What the benchmarks in this folder share. Each is run from the repository root as
`python bench/bench_X.py`; Python then puts bench/ (the script's folder) on sys.path, so
`import common` finds this file, and this file puts the repository root there too, so that the
scripts can import train_gpt2, hellaswag and tokenizer like any script at the top level.
"""
import ctypes
import os
import signal
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from train_gpt2 import GPT  # noqa: E402


def add_dtype(parser):
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                        help="bf16: under autocast; auto (default): bf16 where this CPU computes it natively and "
                             "faster than fp32, else fp32")


def add_dtype_and_threads(parser):
    """The two flags every benchmark has: the precision it measures in, and the torch threads."""
    add_dtype(parser)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")


def random_model(config, threads=0):
    """A GPT of this shape with random weights, the same ones every run (seed 0), on `threads`
    torch threads (0: torch's default). Speed does not depend on the weights, and random ones need
    no download."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    return GPT(config)


# -----------------------------------------------------------------------------
# Child processes die with the benchmark. A benchmark killed with SIGKILL (a test's timeout, the OOM
# killer, kill -9) gets no chance to stop the processes it started. A worker between steps notices (its
# stdin ends), but one in the middle of a step computes on until the step ends, unaware that nobody
# will read its result: a bf16 step on a CPU without native bf16 kept a core busy 12 minutes after a
# test's timeout. Linux can signal a process when its parent dies: prctl(PR_SET_PDEATHSIG), which the
# child asks for between fork and exec (it survives exec).

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(sig=signal.SIGKILL):
    """preexec_fn for subprocess.Popen and subprocess.run: the child gets `sig` when this process dies.
    Linux only; elsewhere None, which Popen takes as no preexec_fn. It covers that child alone, not the
    processes it starts in turn. Call Popen from the main thread: the signal comes when the thread that
    started the child ends, and only the main thread lasts as long as the process. (A preexec_fn runs
    Python between fork and exec, where a lock held by another thread of the parent would never be
    released; this one takes none: prctl is looked up beforehand, getppid and kill are plain calls.)"""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None).prctl  # looked up now, in the parent
    parent = os.getpid()

    def preexec():
        prctl(PR_SET_PDEATHSIG, int(sig))
        # The parent may have died between fork and prctl: nobody would send the signal then, and the
        # child already has a new parent (init, or a subreaper). So check, and go at once if so.
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec
