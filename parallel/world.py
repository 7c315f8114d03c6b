"""
How the processes of a job find each other and agree.

  - launchers: reading rank and world size from torchrun's, MPI's or Slurm's variables
  - the process group: where rank 0 listens (MASTER_ADDR), its backend (oneCCL when Intel's bindings
    are installed), one-line errors when a rank can't join or a collective fails
  - the device each rank computes on
  - stop signals, agreed by all ranks so that they stop at the same step
  - checks that the ranks end with the same weights (they start from one checkpoint: parallel/node_disks.py)
Where each rank sits (its replica, stage and tensor-parallel rank; its node) is parallel/mesh.py.
"""
import gc
import hashlib
import os
import re
import resource
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from parallel import mesh

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
    device: str = "cpu"  # where it computes: set once, when the run picks it (pick_device)
    disks: list = None  # [[the ranks that see one --log_dir folder], ...] (parallel/node_disks.py); None: one folder

    @property
    def master(self):  # rank 0 prints, logs and saves checkpoints; the others stay quiet
        return self.rank == 0

    @property
    def keeper(self):
        """Whether this rank writes, renames and prunes the files of its --log_dir folder: rank 0, and where each node
        has a folder of its own, the first rank of each (checkpoints; rank 0 alone writes log.txt and the report)."""
        return self.master if self.disks is None else any(group[0] == self.rank for group in self.disks)

    def gather(self, obj):
        """[every rank's obj], by rank (one process: [obj])."""
        everyone = [obj] * self.world_size
        if self.world_size > 1:
            torch.distributed.all_gather_object(everyone, obj)
        return everyone

    def broadcast(self, obj):
        """Rank 0's obj, on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def together(self, work):
        """work() on every rank; if it stops one rank (SystemExit), it stops all of them, rank 0 saying why, rather
        than leaving the others waiting for the stopped rank's next collective. Returns what work() returned."""
        if self.world_size == 1:
            return work()
        try:
            result, problem = work(), None
        except SystemExit as e:
            result, problem = None, str(e.code) if isinstance(e.code, str) else f"rank {self.rank} exited {e.code}"
        stopped = [(r, p) for r, p in enumerate(self.gather(problem)) if p]
        if stopped:
            rank, problem = stopped[0]
            prefix = f"rank {rank}: " if rank and problem.startswith("error: ") else ""
            raise SystemExit((problem.replace("error: ", f"error: {prefix}", 1)) if self.master else 1)
        return result

    def print0(self, *a, **k):
        if self.master:
            print(*a, **k, flush=True)

    def all_reduce_sum(self, t):
        if self.world_size > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)  # SUM: AVG is not on every CPU backend
        return t

# -----------------------------------------------------------------------------
# The ranks end alike

def check_same_weights(ranks, model):
    """Every rank must hold the same weights at the end; a checksum per rank proves it.
    (The state dict: full fp32 weights in plain layout, also under IPEX, whose parameters are bf16 halves.)
    A model in pieces (FSDP's, a pipeline's, tensor parallel's) is checked by the digests of its parts instead
    (parallel/parts.py)."""
    digest = state_digest(model.state_dict())
    if ranks.world_size > 1:
        digests = ranks.gather(digest)
        if len(set(digests)) != 1:
            raise SystemExit(f"error: ranks hold different parameters after training: {digests}")
    ranks.print0(f"parameter sha256 (all {ranks.world_size} rank(s)): {digest}")

def state_digest(weights):
    """sha256 of a state_dict's tensors, in fp32, in sorted key order."""
    checksum = hashlib.sha256()
    for k in sorted(weights):  # one tensor at a time: joining them all first would double the peak memory
        checksum.update(weights[k].detach().cpu().float().contiguous().numpy())
    return checksum.hexdigest()

def report_peak_memory(ranks):
    """Each rank's peak resident memory (what the OS counts: weights, optimizer state, activations, buffers)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux counts KiB: GiB
    peaks = ranks.gather(peak)
    ranks.print0(f"peak memory per rank: {', '.join(f'{p:.2f}' for p in peaks)} GiB")

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
    # Imported before the group exists, not first by DDP's constructor: its functions take the group at import
    # (group=group.WORLD as a default argument), and would keep it, and its gloo threads, alive past
    # leave_process_group, still running as the process exits (a 2-rank DDP run of the tests aborted there, 1 in
    # ~60 on busy cores: "terminate called without an active exception"; torch 2.13)
    import torch.distributed.nn  # noqa: F401
    try:  # the timeout bounds both this rendezvous and every later collective
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as e:
        raise SystemExit(f"error: rank {rank} could not join the {world_size} ranks at {where} "
                         f"(backend {backend}, --dist_timeout {timeout_s:g}s): {e}") from None
    return where

def run_main(main):
    """Run a script's main(). A failed collective (a rank died or hung) ends this rank with one line and
    exit code 1, at once: the destructors of a broken process group can block on the dead peer. A run that left
    its group with gloo threads still running (FSDP's and tensor parallel's: torch's DTensor caches keep their
    meshes' groups past destroy_process_group) ends at once too, once all is done: as the interpreter exits, C++
    destroys those threads while they run, and the process aborts ("terminate called without an active
    exception", SIGABRT; a --tp 2 run of the tests, after it had saved and printed everything). So does one that
    stops with its group still joined (an error line after the ranks met: a checkpoint no node holds whole, a layout
    that does not divide the ranks), for the same reason."""
    try:
        main()
    except RuntimeError as e:
        message = collective_failure(e)
        if message is None:
            raise
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    except SystemExit as e:  # (a run stopped by a signal exits 143 or 130 after it saved)
        if not (in_group() or left_group and gloo_threads()):
            raise
        end_now(e.code if isinstance(e.code, int) else 1 if e.code else 0, e.code if isinstance(e.code, str) else None)
    if left_group and gloo_threads():
        end_now(0)

def in_group():
    return torch.distributed.is_available() and torch.distributed.is_initialized()

def gloo_threads():
    """The names of this process's threads that gloo started (Linux's /proc; elsewhere none are seen)."""
    try:
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    except OSError:
        return []
    return [n for n in names if "gloo" in n]

def end_now(code, message=None):
    """Exit with this code now, skipping the interpreter's teardown (what is written is flushed first)."""
    if message:
        print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

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
# The backend: how the ranks exchange tensors

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
            print(f"{signal.Signals(signum).name} again: stopping now, without a checkpoint", file=sys.stderr,
                  flush=True)
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
# The device each rank computes on

def pick_device(requested, local_rank, world_size):
    """--device auto: a GPU when there is one, else the CPU. Several ranks on one GPU machine take one GPU each."""
    if requested == "auto":
        requested = ("cuda" if torch.cuda.is_available() else
                     "xpu" if hasattr(torch, "xpu") and torch.xpu.is_available() else "cpu")
    device_type = requested.split(":")[0]
    if device_type not in ("cpu", "cuda", "xpu", "mps"):
        raise SystemExit(f"error: --device {requested}: expected auto, cpu, cuda[:N], xpu or mps")
    if device_type != "cpu" and not getattr(torch, device_type).is_available():
        raise SystemExit(f"error: --device {requested}: this torch build or machine has no {device_type} device")
    if device_type == "cuda" and world_size > 1:
        requested = f"cuda:{local_rank}"
        torch.cuda.set_device(requested)
    return requested

def leave_process_group():
    """Tear the process group down, with the models already dropped (gc.collect frees them now, reference
    cycles included): DDP's reducer and FSDP's device mesh hold the group, and if their destructors destroyed
    it, they would do so holding Python's lock (GIL), which can deadlock with a gloo thread that needs it
    (seen with torch 2.8 + IPEX). (Once, a sharded 3-rank run whose model outlived the group aborted at exit:
    "terminate called without an active exception"; since then the models go first.) The cached mesh goes too:
    it holds its groups, and with them their gloo threads."""
    global left_group
    mesh.mesh_of.cache_clear()
    gc.collect()
    torch.distributed.destroy_process_group()
    left_group = True

left_group = False  # leave_process_group ran: run_main checks for gloo threads left running
