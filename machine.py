"""
The machine plumbing of train_gpt2.py: what a student needs to know exists, but not to read first.

train_gpt2.py decides how to run (which launcher started us, how many ranks, which backend,
which device); this file holds the details behind each decision:

  - launchers: reading rank and world size from torchrun's, MPI's or Slurm's variables
  - process group: where rank 0 listens (MASTER_ADDR), and a one-line error when it can't be reached
  - CPU threads: one matmul thread per physical core, shared among the ranks of a node
  - Intel: oneCCL (the 'ccl' backend) and Intel Extension for PyTorch, used when installed
  - memory: keeping freed memory for the next step instead of returning it to the OS
  - torch.compile: where its kernels are cached, how much forward keeps for backward
"""
import ctypes
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

# -----------------------------------------------------------------------------
# Launchers: every launcher already tells each process who it is, each under its own names


def detect_launch(env=os.environ):
    """(rank, world_size, local_rank, local_world_size, launcher) from the launcher's variables.

    The order matters where they overlap (mpirun inside a Slurm allocation sees both).
    A missing local size is taken as 1, i.e. "this job may span hosts", which only has the
    effect of insisting on an explicit MASTER_ADDR."""
    def read(name, default=None):
        value = env.get(name, default)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise SystemExit(f"error: launcher variable {name}={value!r} is not an integer") from None

    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (or set by hand)
        launcher = "torchrun"
        rank, world = read("RANK"), read("WORLD_SIZE")
        local_rank, local_world = read("LOCAL_RANK", 0), read("LOCAL_WORLD_SIZE", world)
    elif "OMPI_COMM_WORLD_RANK" in env:  # Open MPI's mpirun
        launcher = "openmpi"
        rank, world = read("OMPI_COMM_WORLD_RANK"), read("OMPI_COMM_WORLD_SIZE")
        local_rank, local_world = read("OMPI_COMM_WORLD_LOCAL_RANK", 0), read("OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    elif "PMI_RANK" in env and "PMI_SIZE" in env:  # MPICH and Intel MPI (their hydra launcher)
        launcher = "mpich"
        rank, world = read("PMI_RANK"), read("PMI_SIZE")
        local_rank, local_world = read("MPI_LOCALRANKID", 0), read("MPI_LOCALNRANKS", 1)
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        # Slurm, but only inside a job step (srun): under salloc or sbatch, every process started
        # without srun inherits the allocation's SLURM_PROCID=0 and would believe it is rank 0.
        launcher = "slurm"
        rank, world, local_rank = read("SLURM_PROCID"), read("SLURM_NTASKS", 1), read("SLURM_LOCALID", 0)
        local_world = slurm_tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(world)), read("SLURM_NODEID", 0))
    else:
        return 0, 1, 0, 1, "single"
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise SystemExit(f"error: inconsistent {launcher} variables: rank {rank} of {world}, "
                         f"local rank {local_rank} of {local_world}")
    return rank, world, local_rank, local_world, launcher


def slurm_tasks_on_node(tasks_per_node, node):
    """SLURM_STEP_TASKS_PER_NODE looks like "2(x3),1": the number of tasks on each node, in node order."""
    per_node = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise SystemExit(f"error: cannot parse SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
        per_node += [int(m.group(1))] * int(m.group(2) or 1)
    return per_node[node] if node < len(per_node) else 1


@dataclass
class Ranks:
    """Who this process is among the ranks of the job (world_size 1: a single process)."""
    rank: int
    world_size: int
    local_rank: int  # among the ranks on this node
    local_world: int
    launcher: str  # single, torchrun, mpich, openmpi or slurm
    device: str = "cpu"
    lock: object = None  # rank 0's lock on --log_dir (lock_folder), held until the process ends
    sharded: bool = False  # FSDP2: each rank holds only its part of the weights, gradients and AdamW state

    @property
    def master(self):  # rank 0 prints, logs and saves checkpoints; the others stay quiet
        return self.rank == 0

    def print0(self, *a, **k):
        if self.master:
            print(*a, **k, flush=True)

    def all_reduce_sum(self, t):
        if self.world_size > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)  # SUM: AVG is not on every CPU backend
        return t


def check_same_weights(ranks, model):
    """Every rank must hold the same weights at the end; a checksum per rank proves it.
    (The state dict: full fp32 weights in plain layout, also under IPEX, whose parameters are bf16 halves.)
    Sharded, the ranks hold different pieces: each tensor is gathered whole, one at a time, so every rank
    hashes the same weights (and the digest is the one a DDP run with the same weights prints)."""
    weights = model.state_dict()
    checksum = hashlib.sha256()
    for k in sorted(weights):  # one tensor at a time: joining them all first would double the peak memory
        w = weights[k].full_tensor() if ranks.sharded else weights[k]  # sharded: gathered from every rank
        checksum.update(w.detach().cpu().float().contiguous().numpy())
    digest = checksum.hexdigest()
    if ranks.world_size > 1:
        digests = [None] * ranks.world_size
        torch.distributed.all_gather_object(digests, digest)
        if len(set(digests)) != 1:
            raise SystemExit(f"error: ranks hold different parameters after training: {digests}")
    ranks.print0(f"parameter sha256 (all {ranks.world_size} rank(s)): {digest}")


def report_peak_memory(ranks):
    """Each rank's peak resident memory (what the OS counts: weights, optimizer state, activations, buffers)."""
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux counts KiB: GiB
    peaks = [peak] * ranks.world_size
    if ranks.world_size > 1:
        torch.distributed.all_gather_object(peaks, peak)
    ranks.print0(f"peak memory per rank: {', '.join(f'{p:.2f}' for p in peaks)} GiB")


def check_same_start(ranks, start_step):
    steps = [None] * ranks.world_size
    torch.distributed.all_gather_object(steps, start_step)
    if len(set(steps)) > 1:
        raise SystemExit(f"error: the ranks resumed from different steps {steps}: give every rank the same "
                         "checkpoint (a --log_dir on a shared file system, or the same --resume file)")


# -----------------------------------------------------------------------------
# The process group: the ranks find each other through rank 0's address


def init_process_group(backend, rank, world_size, local_world, launcher, timeout_s):
    """Join the other ranks; one error line if MASTER_ADDR is missing where it must be given, or unreachable."""
    import torch.distributed as dist
    # torchrun sets MASTER_ADDR/MASTER_PORT (where rank 0 listens for the others); MPI and Slurm
    # do not. On one host the answer is obvious; across hosts only the user knows rank 0's address,
    # and guessing wrong would leave every rank waiting for --dist_timeout.
    if "MASTER_ADDR" not in os.environ:
        if local_world < world_size:
            hint = {"mpich": "mpirun -genv MASTER_ADDR <rank 0's host> ...",
                    "openmpi": "export MASTER_ADDR=<rank 0's host>, then mpirun -x MASTER_ADDR ...",
                    "slurm": 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'}
            # every rank finds the same; rank 0 says it, the others leave quietly
            raise SystemExit(f"error: this {launcher} job spans several hosts but MASTER_ADDR is not set: export "
                             f"MASTER_ADDR=<hostname or IP of rank 0's node> (optionally MASTER_PORT, default 29500) "
                             f"for every rank, e.g. {hint.get(launcher, 'MASTER_ADDR=node0 MASTER_PORT=29500')}"
                             if rank == 0 else 1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29500")
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:  # the timeout bounds both this rendezvous and every later collective
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as e:
        raise SystemExit(f"error: rank {rank} could not join the {world_size} ranks at {where} "
                         f"(backend {backend}, --dist_timeout {timeout_s:g}s): {e}") from None
    return where


def run_main(main):
    """Run a script's main(). A failed collective (a rank died or hung) ends this rank with one line and
    exit code 1, at once: the destructors of a broken process group can block on the dead peer."""
    try:
        main()
    except RuntimeError as e:
        message = collective_failure(e)
        if message is None:
            raise
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def collective_failure(e):
    """A one-line reason when e is a failed collective (a rank died or hung, the network broke), else None."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    text = str(e)
    if not (isinstance(e, dist.DistError) or any(s in text for s in ("gloo", "ccl", "Connection", "Timed out"))):
        return None  # an ordinary bug: keep its traceback
    reason = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return (f"error: rank {dist.get_rank()}: a collective with the other ranks failed, so training stops "
            f"(another rank died or hung past --dist_timeout, or the network failed): {reason}")


# -----------------------------------------------------------------------------
# CPU threads: one per physical core, divided among the ranks that share those cores


def physical_cores(cpus=None):
    """Physical cores among the given logical CPUs (default: those this process may run on).
    Hyper-threads of one core share its vector units, so a matmul thread per hyper-thread
    only adds contention."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cpus = set(cpus)
    try:
        cores = set()
        with open("/proc/cpuinfo") as f:
            info = {}
            for line in f.read().splitlines() + [""]:
                if ":" in line:
                    key, value = (s.strip() for s in line.split(":", 1))
                    info[key] = value
                elif info:
                    cpu = int(info.get("processor", -1))
                    if cpu in cpus:
                        cores.add((info.get("physical id"), info.get("core id", cpu)))
                    info = {}
        return max(1, len(cores)) if cores else len(cpus)
    except (OSError, ValueError):
        return max(1, len(cpus))


def ranks_sharing_cpus(mine, host, everyone, local_world):
    """How many ranks of this node (mine among them) run on CPUs that overlap mine.

    everyone: (hostname, CPU list) of every rank. Capped by the launcher's count of ranks on this
    node, since hosts in containers or network namespaces can share a hostname."""
    return max(1, min(local_world, sum(h == host and not mine.isdisjoint(cpus) for h, cpus in everyone)))


def cpu_list(cpus):
    """{0,1,2,3,8} -> '0-3,8', the notation of taskset and /proc/self/status."""
    out, cpus = [], sorted(cpus)
    for i, c in enumerate(cpus):
        if i and c == cpus[i - 1] + 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)


def set_cpu_threads(threads, world_size, local_world):
    """torch's thread count for this rank; returns a line saying how it was chosen.

    A launcher that pins each rank to its own cores (Intel MPI does by default; mpirun -bind-to core)
    already did the dividing: ranks whose CPU sets don't overlap need not divide again."""
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    sharing = local_world
    if not threads and world_size > 1:  # a collective: every rank takes part, whatever its node
        everyone = [None] * world_size
        torch.distributed.all_gather_object(everyone, (socket.gethostname(), sorted(mine)))
        sharing = ranks_sharing_cpus(mine, socket.gethostname(), everyone, local_world)
    torch.set_num_threads(threads or max(1, physical_cores(mine) // sharing))
    return (f"threads: {torch.get_num_threads()} torch threads per rank "
            f"({'--threads' if threads else f'{physical_cores(mine)} physical cores / {sharing} rank(s)'}), "
            f"{local_world} rank(s) on this node, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
            f"affinity {cpu_list(mine)}")


# -----------------------------------------------------------------------------
# Intel: oneCCL collectives and Intel Extension for PyTorch, each optional


def choose_backend(requested, device_type):
    """The process group backend: oneCCL when Intel's bindings are installed, else PyTorch's own."""
    if requested in ("ccl", "auto") and device_type in ("cpu", "xpu"):
        # importing Intel's oneCCL bindings is what registers the 'ccl' backend with torch.distributed
        try:
            import oneccl_bindings_for_pytorch  # noqa: F401
            return "ccl"
        except ModuleNotFoundError as e:
            if requested == "ccl" or e.name != "oneccl_bindings_for_pytorch":
                raise SystemExit(f"error: --backend ccl needs Intel's oneccl_bindings_for_pytorch ({e}); "
                                 "see requirements-intel.txt, or pass --backend gloo") from None
        except Exception as e:  # installed but broken (a missing libccl.so, a torch version mismatch)
            raise SystemExit(f"error: oneccl_bindings_for_pytorch is installed but fails to import "
                             f"({type(e).__name__}: {e}); fix it, or pass --backend gloo") from None
    if requested == "auto":
        return {"cuda": "nccl", "xpu": "xccl"}.get(device_type, "gloo")
    wants = {"ccl": ("cpu", "xpu"), "nccl": ("cuda",), "xccl": ("xpu",), "gloo": ("cpu", "cuda")}[requested]
    if device_type not in wants:
        raise SystemExit(f"error: --backend {requested} does not work with --device {device_type}")
    return requested


def find_ipex(mode, device_type):
    """Intel Extension for PyTorch when --ipex asks for it (on) or allows it (auto) and it can run, else None.

    Optional: Intel stopped developing IPEX after 2.8, and it runs only with the torch minor version
    it was built for; a mismatch is a clear error with --ipex on and a quiet skip with auto."""
    if mode == "off":
        return None
    if device_type not in ("cpu", "xpu"):
        if mode == "on":
            raise SystemExit(f"error: --ipex on needs --device cpu or xpu, not {device_type}")
        return None
    import importlib.metadata
    import importlib.util
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        if mode == "on":
            raise SystemExit("error: --ipex on, but intel_extension_for_pytorch is not installed "
                             "(pip install -r requirements-intel.txt, or pass --ipex off)")
        return None
    version = importlib.metadata.version("intel_extension_for_pytorch")
    if version.split(".")[:2] != torch.__version__.split(".")[:2]:
        if mode == "on":
            raise SystemExit(f"error: --ipex on, but intel_extension_for_pytorch {version} needs torch "
                             f"{'.'.join(version.split('.')[:2])}.*, not {torch.__version__} (see requirements-intel.txt)")
        return None
    import intel_extension_for_pytorch as ipex
    return ipex


# -----------------------------------------------------------------------------
# Same numbers in every process. oneMKL 2024.2 (inside torch 2.13's wheels) picks each vector-math
# function's kernel (exp, log, tanh, ...) at its first call; when that first call runs on several threads
# at once, one thread can compute its whole chunk with a low-accuracy kernel (pytorch/pytorch#188792).
# Results then depend on thread timing: the same resume gave 10.572952 in one process and 10.572960 in
# another. One call on one element, made by one thread before any parallel work, settles every kernel.


def warm_up_vector_math():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dtype in (torch.float32, torch.float64):
            x = torch.full((1,), 0.5, dtype=dtype)
            for f in (torch.exp, torch.expm1, torch.log, torch.log1p, torch.log2, torch.log10, torch.tanh,
                      torch.sigmoid, torch.erf, torch.erfc, torch.erfinv, torch.sqrt, torch.rsqrt, torch.reciprocal,
                      torch.sin, torch.cos, torch.tan, torch.asin, torch.acos, torch.atan, torch.sinh, torch.cosh,
                      torch.lgamma, torch.abs, torch.neg, torch.floor, torch.ceil, torch.trunc):
                f(x)
            x.pow(1.5)
    finally:
        torch.set_num_threads(threads)


# -----------------------------------------------------------------------------
# Stopping cleanly: schedulers (Slurm, Kubernetes, PBS) send SIGTERM some time before SIGKILL


class GracefulStop:
    """SIGTERM and SIGINT (Ctrl-C) ask the run to stop at the next step boundary, after a checkpoint;
    a second signal stops at once. Exit codes follow the shell's convention: 128 + the signal's number
    (143 for SIGTERM, 130 for SIGINT)."""

    def __init__(self):
        self.signum, self.when = 0, 0.0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        # within a second it is the same request arriving twice (torchrun forwards what Slurm also sends)
        if self.signum and time.monotonic() - self.when > 1.0:
            print(f"{signal.Signals(signum).name} again: stopping now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum, self.when = self.signum or signum, self.when or time.monotonic()

    def agreed(self, ranks):
        """The signal any rank received (0: none). One tiny all-reduce, so every rank decides alike,
        also when the scheduler signalled only some of them."""
        if ranks.world_size > 1:
            flag = torch.tensor([self.signum], device=ranks.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            return int(flag)
        return self.signum


# -----------------------------------------------------------------------------
# Memory: keep what was freed. A training step allocates and frees the same big tensors every time
# (activations, logits chunks, gradients). glibc's malloc serves every block over 32 MB with its own
# mmap and unmaps it when freed, so each step the kernel hands those pages back one 4 KB page fault
# at a time, zero-filled: ~550,000 faults, about a sixth of a 124M step on a 2-core VM. Telling malloc
# never to use mmap for big blocks, and never to give the top of its heap back, lets the second step
# reuse the first one's memory: no faults after warm-up (bench/bench_train.py shows faults/step and the A/B).


def keep_freed_memory():
    """mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, -1) where the C library is glibc; True if set.
    Another allocator (LD_PRELOAD of tcmalloc, jemalloc; macOS) keeps its own policy."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it (musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's malloc.h
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))


# -----------------------------------------------------------------------------
# torch.compile: the first step traces the model and compiles C++ kernels for it (~30 s for
# GPT-2 124M on 2 cores); the kernels are cached on disk, so a later run starts in a few seconds


def compile_cache_dir():
    """Where torch.compile keeps its kernels: $TORCHINDUCTOR_CACHE_DIR if set, else ~/.cache/gpt2-cpu/inductor
    (PyTorch's own default, /tmp/torchinductor_$USER, is emptied at every reboot)."""
    default = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "gpt2-cpu", "inductor")
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default)


# What forward keeps for backward: left to itself, torch.compile keeps every tensor backward will read
# (the MLP's input and its GELU output, a bf16 copy of each weight, ...). Given a budget below 1, its
# partitioner recomputes the cheapest of them during backward instead. Measured at GPT-2 124M, B=4,
# T=1024 with bench/bench_train.py --ab: budget 1 peaks at 4.0 GiB; 0.9 at 3.2 GiB, 1.02x faster than 0.8
# and 0.97-1.0x as fast as 1; 0.5 also recomputes attention and is 20% slower.
ACTIVATION_MEMORY_BUDGET = 0.9


def compile_model(model, memory_budget=None):
    import torch._functorch.config
    torch._functorch.config.activation_memory_budget = memory_budget or ACTIVATION_MEMORY_BUDGET
    return torch.compile(model)


def can_compile(device_type):
    """On CPU, torch.compile needs a C++ compiler; without one it would fail at the first step."""
    return device_type != "cpu" or any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++"))


# -----------------------------------------------------------------------------
# Devices and the wrappers that make a step faster on them


def pick_device(requested, local_rank, world_size):
    """--device auto: a GPU when there is one, else the CPU. Several ranks on one GPU machine take one GPU each."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "xpu" if hasattr(torch, "xpu") and torch.xpu.is_available() else "cpu"
    device_type = requested.split(":")[0]
    if device_type not in ("cpu", "cuda", "xpu", "mps"):
        raise SystemExit(f"error: --device {requested}: expected auto, cpu, cuda[:N], xpu or mps")
    if device_type != "cpu" and not getattr(torch, device_type).is_available():
        raise SystemExit(f"error: --device {requested}: this torch build or machine has no {device_type} device")
    if device_type == "cuda" and world_size > 1:
        requested = f"cuda:{local_rank}"
        torch.cuda.set_device(requested)
    return requested


def apply_ipex(ipex, model, optimizer, args, print0):
    """Intel Extension for PyTorch's optimize(): after any checkpoint is loaded (checkpoints hold plain
    weights and optimizer state), before DDP (which must wrap the parameters IPEX trains)."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, optimizer = ipex.optimize(model, optimizer=optimizer, dtype=dtype, inplace=True)  # inplace: no second copy
    print0(f"ipex: intel_extension_for_pytorch {ipex.__version__}, optimize(dtype={dtype}) "
           f"(--ipex {args.ipex}; --ipex off to train without it)")
    return model, optimizer


def compile_if_possible(model, args, ipex, device_type, print0):
    """torch.compile the training model unless something rules it out; sets args.compile to what was done."""
    if ipex is not None:
        # measured here: torch.compile over an ipex.optimize'd model leaves the blocks' LayerNorm
        # parameters without gradients (tests/test_ipex.py), so the two are not combined
        print0("compile: off, because IPEX optimized the model (--ipex off to compile instead)")
        args.compile = False
    elif not can_compile(device_type):
        print0("warning: --compile needs a C++ compiler (g++ or clang++, or $CXX) and none was found: "
               "training without it (install one, or pass --no-compile to silence this)")
        args.compile = False
    else:
        print0(f"compile: torch.compile, kernels cached in {compile_cache_dir()}")
        model = compile_model(model)
    return model


def leave_process_group():
    """Tear the process group down, with the DDP model already dropped: DDP's reducer holds the group,
    and if the reducer's destructor destroyed it, it would do so holding Python's lock (GIL), which can
    deadlock with a gloo thread that needs it (seen with torch 2.8 + IPEX)."""
    import gc
    gc.collect()
    torch.distributed.destroy_process_group()


# -----------------------------------------------------------------------------
# Files: nothing written is left half-written, a damaged checkpoint is refused, one run per folder


def atomic_save(obj, path):
    """torch.save to path.tmp, then rename: readers see the old file or the new one, never a mix.
    A failed write (a full disk, say) removes the partial .tmp and ends with one error line."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        # torch reports a failed write as "[enforce fail at inline_container.cc...]"; the OS's reason is more use
        cause = e if isinstance(e, OSError) else e.__cause__ or e.__context__ or e
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        raise SystemExit(f"error: cannot write {path} ({one_line(cause)}; {free / 2**20:.0f} MiB free there)") from None
    os.replace(tmp, path)


def check_free_space(folder, needed, what):
    """One error line before training when a file we will write cannot fit."""
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise SystemExit(f"error: {folder} has {free / 2**20:.0f} MiB free, but {what} needs about "
                         f"{needed / 2**20:.0f} MiB: free some space or choose another --log_dir")


def checkpoint_path(log_dir, step, sharded=False):
    return os.path.join(log_dir, f"model_{step:05d}.{'dcp' if sharded else 'pt'}")


def checkpoint_step(path):
    """model_00500.pt (one file) or model_00500.dcp (a folder, one file per rank: sharded runs) -> 500; else None."""
    m = re.fullmatch(r"model_(\d+)\.(pt|dcp)", os.path.basename(path))
    return int(m.group(1)) if m else None


def list_checkpoints(log_dir):
    """Our checkpoints, oldest first, by step number (as text, model_100000.pt would sort before model_99999.pt).
    A folder being written is named *.tmp until it is whole, so it is never listed."""
    found = [f for f in glob.glob(os.path.join(log_dir, "model_*")) if checkpoint_step(f) is not None]
    return sorted(found, key=checkpoint_step)


def prune_checkpoints(log_dir, keep, newer_than=None):
    """Keep the newest `keep` (0: all); or, given newer_than=S, delete those after step S."""
    found = list_checkpoints(log_dir)
    if newer_than is not None:
        old = [f for f in found if checkpoint_step(f) > newer_than]
    else:
        old = found[:-keep] if keep > 0 else []
    for f in old:
        shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)


def prepare_log_dir(log_dir, run_args, overwrite, fresh):
    """log.txt is appended to (--overwrite: emptied, and the old checkpoints deleted). A fresh run records
    its arguments in args.json, so that a --resume before its first checkpoint starts the same run."""
    for f in list_checkpoints(log_dir) if overwrite else []:
        shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)
    open(os.path.join(log_dir, "log.txt"), "w" if overwrite else "a").close()
    if fresh:
        with open(os.path.join(log_dir, "args.json.tmp"), "w") as f:
            json.dump(run_args, f, indent=1)
        os.replace(os.path.join(log_dir, "args.json.tmp"), os.path.join(log_dir, "args.json"))


def shard_model(model, ranks, bf16):
    """FSDP2 (fully sharded data parallel): every parameter is split in world_size pieces along its first
    dimension, one per rank, and so are its gradient and AdamW's moments. Each block is its own unit:
    its weights are all-gathered just before its forward (and again for its backward), then freed; its
    gradients are reduce-scattered, each rank keeping the piece it owns. What stays unsharded in memory
    is one block's weights at a time, and the activations. The root unit holds the embeddings, whose
    weight lm_head shares (tied): it stays one parameter, sharded once.
    bf16: the weights are all-gathered in bf16 (half the traffic), and used as such, so autocast keeps no
    bf16 copy of every weight for backward; gradients are reduced in fp32 and AdamW updates fp32 pieces."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    ranks.sharded = True


def build_sharded(build, ranks, bf16, init_weights=True):
    """build() -> a model, sharded without any rank ever holding all of it: it is built on the meta device
    (shapes, no storage), sharded, and only then given memory: each rank allocates just its pieces.
    init_weights: fill them with exactly the weights that build() followed by shard_model() would give
    (so a sharded run starts where a DDP run does), one module at a time; else leave them for a checkpoint.
    The replay: every module's constructor draws its own random init (which GPT._init_weights then
    overwrites, but the draws move the random generator), so first each module's constructor init is drawn
    and dropped, in construction order; then, in _init_weights' order, each module is made in full on its
    own, initialized, and each rank keeps its piece of every parameter."""
    import copy
    with torch.device("meta"):
        model = build()
    empty_copy = {n: copy.deepcopy(m) for n, m in model.named_modules()  # still on meta: no memory yet
                  if next(m.parameters(recurse=False), None) is not None}  # (the modules that own parameters)
    shard_model(model, ranks, bf16)
    model.to_empty(device="cpu")
    if not init_weights:
        return model
    for empty in empty_copy.values():  # registration order is construction order for GPT
        copy.deepcopy(empty).to_empty(device="cpu").reset_parameters()
    order = []
    model.apply(order.append)  # the order GPT.__init__'s self.apply(self._init_weights) visits modules
    name_of = {id(m): n for n, m in model.named_modules()}
    with torch.no_grad():
        for module in order:
            name = name_of[id(module)]
            if name not in empty_copy:
                continue
            full = copy.deepcopy(empty_copy[name]).to_empty(device="cpu")
            with torch.random.fork_rng(devices=[]):  # the constructor's values, for what _init_weights leaves (LayerNorm)
                full.reset_parameters()
            model._init_weights(full)
            for key, value in full.named_parameters(recurse=False):
                copy_weight(getattr(module, key), value)
    return model


def copy_weight(param, full):
    """param = full; for a sharded parameter (a DTensor), just the piece of full that this rank holds."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    with torch.no_grad():
        if isinstance(param, DTensor):
            param, full = param.to_local(), distribute_tensor(full, param.device_mesh, param.placements,
                                                              src_data_rank=None).to_local()
        param.copy_(full)


def save_sharded(path, model, optimizer, meta, ranks):
    """A sharded checkpoint: a folder where each rank writes its own pieces (torch.distributed.checkpoint),
    rank 0 adds meta.pt (step, config, data position, RNG...). It is written as path.tmp and renamed
    once every rank has finished, so a folder named model_XXXXX.dcp is always whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    tmp = path + ".tmp"
    if ranks.master and os.path.exists(tmp):  # left by a run killed while saving
        shutil.rmtree(tmp)
    torch.distributed.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)  # returns when all have written
    if ranks.master:
        atomic_save(meta, os.path.join(tmp, "meta.pt"))
        if os.path.exists(path):  # the same step saved again (a resumed run re-saving it): same contents
            shutil.rmtree(path)
        os.replace(tmp, path)
    torch.distributed.barrier()


def load_sharded(path, model, optimizer=None):
    """The weights (and AdamW state) of a sharded checkpoint, into a model sharded over any number of ranks,
    or not sharded at all: each rank reads just the pieces it owns now (DCP reshards on load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    if optimizer is None:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        return model.load_state_dict(state["model"])
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def load_full_optimizer_state(model, optimizer, state):
    """A plain checkpoint's AdamW state (as optimizer.state_dict() numbers the parameters) into the
    optimizer of a sharded model: each rank keeps its pieces. The numbering is configure_optimizer's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    names = [n for decay in (True, False) for n, p in model.named_parameters() if (p.dim() >= 2) == decay]
    by_name = {"state": {names[i]: s for i, s in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def tensor_checksums(obj, prefix=""):
    """{path: CRC-32 of the tensor's bytes} for every tensor in a nested dict/list (a checkpoint).
    CRC-32 catches every single flipped bit and every burst of up to 32, at ~1 GB/s."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return {prefix: zlib.crc32(t.view(-1).view(torch.uint8).numpy()) if t.numel() else 0}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    sums = {}
    for k, v in items:
        sums.update(tensor_checksums(v, f"{prefix}/{k}" if prefix else str(k)))
    return sums


def verify_checksums(obj, expected, path):
    """A damaged tensor (a bit flipped on disk or in transit) is refused, naming the file and the tensor."""
    for name, crc in tensor_checksums(obj).items():
        if expected.get(name, crc) != crc:
            raise SystemExit(f"error: checkpoint {path} is damaged: tensor {name} does not match its checksum")


def lock_folder(folder):
    """One writer per log folder: an advisory lock, held until this process ends (kill -9 included).
    Returns the open lock file, which must stay referenced for as long as the lock is wanted."""
    import fcntl
    lock_path = os.path.join(folder, "lock")
    try:
        os.makedirs(folder, exist_ok=True)
        f = open(lock_path, "a+")
    except OSError as e:
        raise SystemExit(f"error: --log_dir {folder} is not writable ({one_line(e)})") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        raise SystemExit(f"error: --log_dir {folder} is in use by {holder}: one run per folder (if that "
                         "process is a leftover rank of a killed launcher, kill it first)") from None
    f.truncate(0)
    f.write(f"PID {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def check_token_ids(files, vocab_size, print0=None):
    """Every token id must have an embedding row: a larger one would crash training when its block comes up.
    Ids from 50257 to the padded vocabulary's end are never produced by GPT-2's tokenizer: a warning."""
    for f in files:
        top = max_token_id(f, np.load(f, mmap_mode="r"))  # remembered across runs: a 10B-token scan is slow
        if top >= vocab_size:
            raise SystemExit(f"error: shard {f} holds token id {top}, beyond the model's vocabulary of {vocab_size}")
        if top >= 50257 and print0:
            print0(f"warning: shard {f} holds token id {top}: a padding id no GPT-2 tokenizer produces")


def max_token_id(path, tokens):
    """The largest id in a memory-mapped shard, remembered in ~/.cache/gpt2-cpu/max_token_ids.json by the
    file's path, size and modification time: reading 10B tokens from a cold disk takes minutes."""
    st = os.stat(path)
    key = f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"
    cache_file = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "gpt2-cpu", "max_token_ids.json")
    try:
        with open(cache_file) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = int(tokens.max())
        try:  # ranks on one host may write at once: each its own temporary file, the last rename wins
            os.makedirs(os.path.dirname(cache_file), exist_ok=True)
            with open(f"{cache_file}.{os.getpid()}.tmp", "w") as f:
                json.dump(cache, f)
            os.replace(f"{cache_file}.{os.getpid()}.tmp", cache_file)
        except OSError:
            pass  # a read-only cache only makes the next run slower
    return cache[key]


def pretrained_files(name_or_path, hub_names):
    """(config.json, model.safetensors) of OpenAI's GPT-2 on the Hugging Face hub, or in a local folder."""
    names = ("config.json", "model.safetensors")
    if name_or_path in hub_names:
        from huggingface_hub import hf_hub_download  # honours HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT
        try:
            config_file, weights_file = (hf_hub_download("openai-community/" + name_or_path, f) for f in names)
        except Exception as e:
            raise SystemExit(f"error: could not fetch openai-community/{name_or_path} from the Hugging Face hub "
                             f"({one_line(e)}); download {' and '.join(names)} into a folder and pass its path")
    elif os.path.isdir(name_or_path):
        config_file, weights_file = (os.path.join(name_or_path, f) for f in names)
        for f in (config_file, weights_file):
            if not os.path.isfile(f):
                raise SystemExit(f"error: {f} not found: a pretrained directory needs config.json and model.safetensors")
    else:
        raise SystemExit(f"error: --init_from {name_or_path!r} is neither one of {', '.join(hub_names)} "
                         "nor a directory holding config.json and model.safetensors")
    return config_file, weights_file


def one_line(e):
    """An exception as one line: errors we report must fit on one."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"
