"""A stand-in for Intel's oneccl_bindings_for_pytorch, for tests only (tests put this folder on PYTHONPATH).

The real package cannot be installed here (it is not on PyPI, and oneCCL wants Intel's own wheel
index). What the trainer relies on is its one visible effect: importing it registers a process group
backend named 'ccl' with torch.distributed. This module does exactly that, and the backend it registers
is gloo underneath, so a run with it must equal a gloo run bit for bit. It tests the trainer's
selection and initialisation path, not oneCCL itself.
"""
import os

import torch.distributed as dist

# the real package exposes its install folder as `cwd` (its env/setvars.sh sets up oneCCL's libraries)
cwd = os.path.dirname(os.path.abspath(__file__))


def _create_ccl_backend(store, rank, world_size, timeout):
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


if "ccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("ccl", _create_ccl_backend, devices=["cpu"])
