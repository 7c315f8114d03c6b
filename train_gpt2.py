"""
GPT-2's trainer, for CPUs first (and GPUs too). The model itself is model.py.

    python train_gpt2.py                              # FineWeb-Edu shards present: GPT-2 (124M); none: a demo
    torchrun --nproc_per_node=2 train_gpt2.py         # data parallel on one machine (--shard full: FSDP2)
    mpirun -n 3 -ppn 1 python train_gpt2.py           # data parallel on three nodes (see README)

Read it top to bottom: the learning rate schedule, the stages of a run, then main(), the training story. Its flags
and their defaults are in train_args.py; what it reads is in dataloader.py (the shards fineweb.py writes, cut into
blocks; the task folders finetune.py writes, packed into rows). Beneath it, three packages: compute/ (how a step runs
fast on this CPU), parallel/ (how ranks share the model: DDP, FSDP, pipeline, tensor parallel, their checkpoints) and
plumbing/ (checkpoint files, progress, the report). sample.py and answer.py generate with the model.
"""
import functools
import itertools
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch

import clock
import dataloader
import lora
from compute import attention, cpu, speedups
from compute.fused_loss import IGNORE
from model import GPT, PRETRAINED_NAMES, Block, GPTConfig, keep_packed_attention_eager, load_model
from parallel import build, layouts, mesh, node_disks, parts, pipeline, sharding, sizes, tensor_parallel, world
from plumbing import checkpoints, inputs, progress, report
from plumbing.checkpoints import append_log, checkpoint_path, list_checkpoints
from tokenizer import PADDED_VOCAB_SIZE
from train_args import check_args, launch_flags, resolve_args

# -----------------------------------------------------------------------------
# Learning rate: linear warmup, then cosine decay to min_lr (build-nanogpt's get_lr)

def get_lr(it, warmup_steps, max_steps, max_lr, min_lr):
    if it < warmup_steps:
        return max_lr * (it + 1) / warmup_steps
    if it > max_steps:
        return min_lr
    decay_ratio = (it - warmup_steps) / (max_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # goes from 1 to 0
    return min_lr + coeff * (max_lr - min_lr)

# -----------------------------------------------------------------------------
# The stages of a run. main() at the bottom tells the story; each stage is one function here, and they
# share one Run: the run's settings, fixed when it starts, and its training state, which the stages set up.

# a non-finite loss now and then (a bad batch, a bf16 overflow) is skipped; this many in a row is divergence
MAX_SKIPPED_STEPS = 5
# twice the loss of a uniform guess (ln 50304 = 10.8, where scratch training starts): weights that give more
# are broken even if finite (--max_lr 1e6 gets there in one step)
DIVERGED_LOSS = 2 * math.log(PADDED_VOCAB_SIZE)

class Run:
    """What travels from stage to stage. Fixed when the run starts: the arguments (resolved once, by resolve_args, and
    never written after, but for the layout --parallel auto picks and --hours' plan), this rank, the task (a
    finetune.py folder's), the layout (sharded?, in parts?) and the accumulation steps. Then filled by main() with what
    each stage returns, in its order: the device, dtype and IPEX, the data loader, HellaSwag's examples (None: not
    measured), the lock on --log_dir, the model, the optimizer and the model as it trains."""

    def __init__(self, args, ranks, task):
        self.args, self.ranks, self.task = args, ranks, task
        self.lay_out()
        self.device_type = self.dtype = self.autocast = self.ipex = self.cpu_line = None
        self.train_loader = self.hellaswag_examples = self.lock = None
        self.model = None  # the plain GPT (this rank's part of it, under FSDP, --pp, --tp): evaluation runs it eagerly
        self.train_model = None  # the model as its step runs it: compiled, and in DDP
        self.part = None  # this rank's part under --pp or --tp: a Pipeline (its stage) or a TensorParallel (its share)
        self.optimizer, self.compiled, self.budget = None, False, None
        self.flops_per_token, self.matmul_rate = 0, None
        self.lora_spec = None  # a LoRA run's rank, alpha, targets and base, as its checkpoints record them

    def lay_out(self):
        """What follows from the layout: --shard, --pp and --tp (set again if --parallel auto picks another)."""
        args, ranks = self.args, self.ranks
        # FSDP2 over the world: decided here, and only here (--pp shards within each stage: parallel/pipeline.py)
        self.sharded = args.shard != "none" and ranks.world_size > 1 and args.pp == 1
        self.in_parts = self.sharded or args.pp > 1 or args.tp > 1  # no rank holds the whole model: .dcp checkpoints
        self.replicas = ranks.world_size // (args.pp * args.tp)  # data-parallel replicas: --pp stages x --tp ranks each
        self.grad_accum_steps = sizes.micro_steps(args.total_batch_size, args.batch_size, args.seq_len, self.replicas)
        group = args.pp * args.tp  # the ranks of one replica read the same batches: the loaders see the replicas
        self.data_ranks = mesh.replica_ranks(ranks, group) if group > 1 else ranks

    @property
    def max_steps(self):
        """The last step: --max_steps, or, on the clock (--hours), the clock's, re-fitted after every step."""
        return self.budget.max_steps if self.budget else self.args.max_steps

    def share_of_matmul_rate(self, dt):
        """' | N% of this CPU's fp32 matmul rate': the step's FLOPs (6 per parameter and token, 4 for a frozen one:
        no weight gradient; plus attention) per second on this rank, against what this CPU's matmuls reach at the
        model's shape (cpu.MatmulRate: measured again, and said so, when a step beats it)."""
        if self.device_type != "cpu":
            return ""
        if self.matmul_rate is None:  # after the first step, outside its time
            self.flops_per_token, self.matmul_rate = self.flops(), cpu.MatmulRate(self.dtype, self.model.config.n_embd)
        return self.matmul_rate.share(self.args.total_batch_size / self.replicas / dt * self.flops_per_token / 1e9)

    def flops(self):
        """This rank's FLOPs a token: a replica's ranks share its work (a pipeline's stages, tensor parallel's
        shares: the whole model's FLOPs over them)."""
        config, params, seq_len = self.model.config, list(self.model.parameters()), self.args.seq_len
        if self.args.pp * self.args.tp > 1:
            whole = sizes.parameters(config)[0]
            return sizes.flops_per_token(whole, config.n_layer, config.n_embd, seq_len) / (self.args.pp * self.args.tp)
        frozen = sum(p.numel() for p in params if not p.requires_grad)
        trained_and_frozen = sum(p.numel() for p in params)
        return sizes.flops_per_token(trained_and_frozen, config.n_layer, config.n_embd, seq_len) - 2 * frozen

def open_data_and_lock_log_dir(run):
    """The training data's loader and the val data, checked; HellaSwag's examples if they are to be measured; then
    --log_dir, refused if it holds another run, and locked so that no second run writes there. Returns (the loader,
    HellaSwag's examples or None, the lock)."""
    args, ranks = run.args, run.ranks
    if args.shard != "none" and ranks.world_size == 1:
        ranks.print0(f"--shard {args.shard}: with one rank there is nothing to split; training as usual")
    train_loader = dataloader.open_training_data(args, run.task, run.data_ranks)
    has_run = os.path.exists(os.path.join(args.log_dir, "log.txt")) or list_checkpoints(args.log_dir)
    if any(ranks.gather(bool(has_run))) and not args.resume and not args.overwrite:  # (any node's folder)
        raise SystemExit(f"error: --log_dir {args.log_dir} already holds a run; continue it with --resume, "
                         "choose another --log_dir, or pass --overwrite to replace it" if ranks.master else 1)
    hellaswag_examples = None  # no data (no network, say) is no reason not to train: it is just not measured
    if args.hellaswag_interval > 0 and run.sharded:  # batches differ by rank: no lock-step all-gathers
        ranks.print0("warning: no HellaSwag during sharded training: run hellaswag.py -m on a checkpoint")
    elif args.pp > 1 or args.tp > 1:
        # generation through stages or split blocks is not written; a checkpoint holds the whole model
        layout = "pipeline" if args.pp > 1 else "tensor parallel"
        ranks.print0(f"{layout}: no HellaSwag, task accuracy or samples during training: run hellaswag.py -m, "
                     "answer.py or sample.py --ckpt_path on a checkpoint")
    elif args.hellaswag_interval > 0:
        import hellaswag  # (a step script: imported where its evaluation runs, never at the top of another step)
        hellaswag_examples = hellaswag.examples_for_training(args.hellaswag_dir, ranks)
    def lock():  # one run per folder (on each node's disk, where each has its own); then what a killed run left
        held = checkpoints.lock_folder(args.log_dir) if ranks.keeper else None
        if held:
            checkpoints.remove_unfinished(args.log_dir)
        return held
    return train_loader, hellaswag_examples, ranks.together(lock)

def join_ranks(argv):
    """This process among the ranks the launcher started (its variables: torchrun's, mpirun's, srun's; none: one
    process), its device, the process group that joins the ranks, and which of them share one --log_dir folder (a disk
    per node: parallel/node_disks.py). On the command line's flags: a resumed run's are read once they agree on it."""
    flags = launch_flags(argv)
    ranks = world.Ranks(*world.detect_launch())
    ranks.device = world.pick_device(flags.device, ranks.local_rank, ranks.world_size)
    if ranks.world_size > 1:  # oneCCL when Intel's bindings are installed (fastest across Xeon nodes), else gloo on CPU
        backend = world.choose_backend(flags.backend, ranks.device.split(":")[0])
        where = world.init_process_group(backend, ranks.rank, ranks.world_size, ranks.local_world, ranks.launcher,
                                         flags.dist_timeout)
        ranks.print0(f"distributed: {ranks.launcher}, world size {ranks.world_size}, backend {backend}, master {where}")
        ranks.disks, line = node_disks.find(flags.log_dir, ranks)
        ranks.print0(line)
    return ranks

def set_up_machine(run):
    """This rank's CPU threads, the dtype this machine computes fastest, and IPEX if it can run that dtype. Returns
    (device type, dtype, its autocast, IPEX or None: applied later)."""
    args, ranks = run.args, run.ranks
    device_type = ranks.device.split(":")[0]
    ipex = speedups.find_ipex(args.ipex, device_type, speedups.will_compile(args.compile, device_type), ranks.print0)
    if device_type == "cpu":  # one matmul thread per physical core, shared among the ranks on this node
        ranks.print0(cpu.set_cpu_threads(args.threads, ranks.world_size, ranks.local_world))
        run.cpu_line = cpu.describe_cpu(torch.get_num_threads())  # (report.md says it too)
        ranks.print0(run.cpu_line)
    dtype, why = speedups.resolve_dtype(args.dtype, device_type, args.n_embd, ranks)  # ranks agree on it
    ranks.print0(why)
    ipex = speedups.ipex_for_dtype(ipex, args.ipex, dtype,
                                   device_type != "cpu" or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    ipex = None if args.lora else ipex  # (ipex.optimize would swap out the Linear layers that carry the adapters)
    return device_type, dtype, speedups.autocast(dtype, device_type), ipex

def choose_layout(run, ckpt):
    """--parallel auto on several ranks (the default): DDP where the model fits, else the layout predicted fastest
    from the measured links, memory and compute (parallel/layouts.py); it sets --shard and --pp. A forced layout that
    cannot fit is one error line. (Not for --lora: its frozen base has no gradients or AdamW state to spread, so
    DDP stays; --shard or --pp given still apply.)"""
    args, ranks = run.args, run.ranks
    if ranks.world_size > 1 and not args.lora and run.device_type == "cpu":
        config = model_config(args, ckpt)
        if args.parallel != "auto":  # forced: refused if it cannot fit
            layouts.check_fits(args, config, ranks, run.dtype == "bf16")
        else:
            layout, why = layouts.decide(args, config, ranks, run.dtype == "bf16", run.autocast, (Block, GPT))
            ranks.print0(why)
            args.shard, args.pp, args.tp = layout.shard, layout.pp, layout.tp
            check_args(args, ranks.world_size)
            run.lay_out()
    if not run.sharded:  # (sharded, memory is short: what is freed goes back to the OS)
        cpu.keep_freed_memory()

def model_config(args, ckpt):
    """The GPTConfig this run trains, without reading any weights: the checkpoint's, the flags', or --init_from's
    (load_model builds the model from its config before it reads a weight: the build stops it there)."""
    if ckpt is not None:
        return GPTConfig(**ckpt["config"])
    if args.init_from == "scratch":
        return GPTConfig(block_size=args.block_size, vocab_size=PADDED_VOCAB_SIZE, n_layer=args.n_layer,
                         n_head=args.n_head, n_embd=args.n_embd)
    class Found(Exception):
        pass
    def found(config, init_weights=False):
        raise Found(config)
    try:
        load_model(args.init_from, found)
    except Found as e:
        return e.args[0]

def new_model(args, config):
    """A GPT of this config, with the run's LoRA adapters (--lora) added before any layout cuts or shards it (FSDP
    shards them too); their weights are not drawn here (init=False)."""
    model = GPT(config)
    return lora.add_adapters(model, args.lora, args.lora_alpha, args.lora_targets, init=False) if args.lora else model

def build_model(run, ckpt):
    """The model: the checkpoint's weights when resuming; else a scratch GPT-2, OpenAI's weights, or one of our
    checkpoints. Never whole on a rank that holds a part (parallel/build.py): --shard full shards it as it is built,
    --pp and --tp build just the rank's stage or share. --lora: the base is loaded as for a fresh run (a LoRA checkpoint
    holds only the adapters), frozen, held in the run's dtype (bf16: built a tensor at a time, never whole in fp32),
    with adapters on it (lora.py). The shards' token ids are checked against its vocabulary first, before any weights
    are read."""
    args, ranks, bf16 = run.args, run.ranks, run.dtype == "bf16"
    torch.manual_seed(args.seed)  # same initial weights on every rank
    def make_model(config, init_weights=False):  # sharded: weights given to each rank's pieces, unless init_weights
        inputs.check_token_ids(dataloader.token_files(args.data_dir, run.task), config.vocab_size, ranks.print0)
        def make():
            return new_model(args, config)
        if run.sharded:
            return build.build_sharded(make, ranks, bf16, init_weights, args.shard == "grads")
        if run.in_parts and not (args.lora and bf16):  # a stage, a share: built alone
            return build.build_part(make, args, ranks, init_weights, bf16)
        return build.build_in(torch.bfloat16, make, init_weights) if args.lora and bf16 else make()
    # (a rank that finds a tensor damaged stops all)
    if ckpt is not None and not ckpt["sharded_path"] and not args.lora:
        model = ranks.together(lambda: GPT.from_checkpoint(ckpt, make_model))
    elif (ckpt is None or args.lora) and args.init_from != "scratch":
        model, _ = load_model(args.init_from, make_model)
    else:
        # from scratch; or the shapes for a sharded checkpoint's weights
        # (read with its AdamW state, in prepare_training)
        model = make_model(model_config(args, ckpt), init_weights=ckpt is None or args.lora > 0)
    if args.lora:
        run.lora_spec, line = lora.start(model, args, ckpt, PRETRAINED_NAMES)
        ranks.print0(line)
    model.recompute = args.recompute
    config, n_params = model.config, sum(p.numel() for p in model.parameters())
    if args.seq_len > config.block_size:
        raise SystemExit(f"error: --seq_len {args.seq_len} is longer than the model's context {config.block_size}")
    if args.checkpoint_interval > 0:  # what trains, and AdamW's two moments, in fp32 (on every node's disk)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        ranks.together(lambda: ranks.keeper and checkpoints.check_free_space(args.log_dir, 12 * trained,
                                                                              "a checkpoint"))
    ranks.print0(parts.model_line(config, n_params, args))
    return model.to(ranks.device)  # the plain GPT: evaluation and sampling run it eagerly

def prepare_training(run, ckpt, ckpt_file):
    """This rank's part (--pp: its stage; --tp: its share of every block), the optimizer, the resumed state, then the
    wrappers: IPEX, torch.compile, DDP. Returns (the model as it trains, the optimizer, whether it is compiled, the
    first step)."""
    args, ranks, model = run.args, run.ranks, run.model
    if args.pp > 1:  # the model is cut down to this rank's stage
        whole = functools.partial(new_model, args, model.config)  # (its names: what one process's checkpoints hold)
        run.part = pipeline.Pipeline(model, args, ranks, run.grad_accum_steps, ranks.print0, run.dtype, whole)
    elif args.tp > 1:  # every block split across the tensor-parallel ranks
        run.part = tensor_parallel.TensorParallel(model, args, ranks, run.grad_accum_steps, ranks.print0, run.dtype)
    optimizer, fused = model.configure_optimizer(args.weight_decay, args.max_lr, run.device_type)
    ranks.print0(f"optimizer: AdamW, fused={fused}")
    if run.device_type == "cpu":
        head_size = model.config.n_embd // model.config.n_head
        line = attention.choose(run.dtype, args.batch_size, model.config.n_head, args.seq_len, head_size, ranks)
        if line:
            ranks.print0(line)
    start_step = 0 if ckpt is None else resume_state(run, ckpt, ckpt_file, optimizer)
    if run.ipex is not None and (run.sharded or run.part is not None):
        run.ipex = None
    if run.ipex is not None and run.device_type == "cpu":  # right at this run's shapes? faster?
        run.ipex, line = speedups.decide_ipex(run.ipex, args.ipex, run.dtype, model.transformer.h[0], args.batch_size,
                                              args.seq_len, ranks)
        ranks.print0(line)
    if run.ipex is not None:
        model, optimizer = speedups.apply_ipex(run.ipex, model, optimizer, run.dtype, ranks.print0)
    # torch.compile fuses the training forward and backward into C++ kernels (bench/bench_train.py measures it).
    # Evaluation and sampling run the plain model eagerly: their shapes change, and each shape would recompile.
    compiled = False
    if args.compile:  # a pipeline's stage, tensor parallel's split model: compiled in place (their step runs them)
        keep_packed_attention_eager()
        def compile(module):
            return speedups.compile_if_possible(module, run.ipex, run.device_type, ranks.print0)
        model, compiled = (model, run.part.compile(compile)) if run.part else compile(model)
    if ranks.world_size > 1 and not run.sharded and run.part is None:  # DDP averages the gradients during backward
        from torch.nn.parallel import DistributedDataParallel as DDP  # (bucket by bucket)
        model = DDP(model, device_ids=[ranks.local_rank] if run.device_type == "cuda" else None)
    # what each rank will send a step (bench/bench_parallel.py measures it)
    if ranks.world_size > 1 and run.part is None:
        ranks.print0(sharding.plan_line(run.model, ranks.world_size, args.shard, run.grad_accum_steps,
                                        run.dtype == "bf16", torch.distributed.get_backend()))
    return model, optimizer, compiled, start_step

def resume_state(run, ckpt, ckpt_file, optimizer):
    """The checkpoint's weights where build_model did not read them, its AdamW state, data position and random
    generator. Returns its step."""
    model, ranks = run.model, run.ranks
    if run.part is not None:  # each stage or share reads its part: of a .dcp, or cut from a one-process .pt
        source = parts.source(ckpt, run.part.whole_model())
        # (one rank finding a tensor damaged: all stop)
        ranks.together(lambda: run.part.load_sharded(source, optimizer))
    elif ckpt["sharded_path"]:  # any number of ranks, sharded or not: each reads what it holds
        parts.load_sharded(ckpt["sharded_path"], model, optimizer, ranks)
    elif run.sharded:
        sharding.load_full_optimizer_state(model, optimizer, checkpoints.verify_weights(ckpt, "optimizer"))
    else:
        optimizer.load_state_dict(checkpoints.verify_weights(ckpt, "optimizer"))
    run.train_loader.load_state_dict(ckpt["loader"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    ranks.print0(f"resumed from {ckpt_file} at step {ckpt['step']}")
    return ckpt["step"]

def evaluate(run, step, due):
    """This step's evaluations, each when due (due(interval)): val loss, task accuracy, HellaSwag, samples. Returns the
    val loss (or None)."""
    import answer  # (the evaluation steps are step scripts: each imported where it runs, not at the top)
    import hellaswag
    import sample
    args, ranks, model = run.args, run.ranks, run.model
    model.eval()
    val_loss = validation_loss(run, step) if due(args.eval_interval) else None
    if due(args.eval_interval) and run.task is not None and run.task["splits"]["val"]["examples"] and run.part is None:
        n = min(args.task_examples, run.task["splits"]["val"]["examples"])  # do the answers come out right?
        acc, _ = answer.task_accuracy(model, args.data_dir, run.autocast, n=n, ranks=ranks,
                                      lockstep=run.sharded)  # (sharded: every rank answers every example)
        ranks.print0(f"task accuracy: {acc:.4f} (greedy answers to {n} val examples)")
        append_log(args.log_dir, ranks, f"{step} task {acc:.4f}")
    if run.hellaswag_examples is not None and due(args.hellaswag_interval):
        acc = hellaswag.accuracy_during_training(model, run.hellaswag_examples, ranks, run.dtype, args.batch_size)
        append_log(args.log_dir, ranks, f"{step} hella {acc:.4f}")
    # (sharded, every rank generates alongside rank 0, to join the all-gathers of every forward)
    sampling = (ranks.master or run.sharded) and not run.part
    if due(args.sample_interval) and (step > 0 or step == run.max_steps) and sampling:
        run.samples = sample.print_samples(model, ranks, run.autocast)  # (report.md keeps the last)
    return val_loss

def validation_loss(run, step):
    """The mean loss over every val target, printed and logged (None where a task has no val targets)."""
    args, ranks, model = run.args, run.ranks, run.model
    stats = torch.zeros(2, dtype=torch.float64, device=ranks.device)  # summed loss, target count
    with torch.no_grad():
        batches = dataloader.val_batches(args, run.task, run.data_ranks, lockstep=run.sharded or args.pp > 1)
        for batch in progress.each(batches, "validation", "batches", ranks.master):  # (a bar, or a line a tenth)
            empty = (torch.zeros(1, args.seq_len, dtype=torch.long),) * 2 + (None,)  # (lockstep: this rank has none)
            x, y, packed = batch if batch is not None else empty
            with run.autocast:
                _, loss = (run.part or model)(x.to(ranks.device), y.to(ranks.device),
                                              packed=packed and packed.to(ranks.device))
            counted = int((y != IGNORE).sum()) * (batch is not None)
            stats += torch.tensor([loss.item() * counted, counted], dtype=torch.float64, device=ranks.device)
    total, count = ranks.all_reduce_sum(stats).tolist()
    if not count:
        return None
    ranks.print0(f"validation loss: {total / count:.4f}")
    append_log(args.log_dir, ranks, f"{step} val {total / count:.4f}")
    return total / count

def save_checkpoint(run, step, val_loss, evaluated=True):
    """Everything an exact resume needs: weights, optimizer moments, data position, RNG, run arguments; by
    rank 0, or by every rank for its own part when sharded or in parts. Never a diverged state: non-finite weights or
    val loss are not saved, so they can't push a good checkpoint out. Every rank calls it (they must agree)."""
    args, ranks, model, optimizer = run.args, run.ranks, run.model, run.optimizer
    bad = sum(not sizes.local(p).isfinite().all() for p in model.parameters())
    if ranks.all_reduce_sum(torch.tensor(float(bad), device=ranks.device)) or not (val_loss or 0.0) < DIVERGED_LOSS:
        ranks.print0(f"warning: no checkpoint at step {step}: the weights are not finite, or the val loss is not "
                     f"below {DIVERGED_LOSS:.1f}")
        return
    state = {"config": asdict(model.config), "step": step, "args": dict(vars(args)), "val_loss": val_loss,
             "loader": run.train_loader.state_dict(), "rng": {"torch": torch.get_rng_state()}, "task": run.task,
             "lora": run.lora_spec, "budget": run.budget and run.budget.state(),
             "evaluated": evaluated}  # evaluated False: stopped by a signal before this step's evaluations
    if run.in_parts:  # every rank writes its part, in the whole model's names: any layout reads it (parallel/parts.py)
        part = run.part.state(optimizer) if run.part else parts.state_of(model, optimizer)
        parts.save_sharded(checkpoint_path(args.log_dir, step, sharded=True), part, state, ranks)
        return
    if ranks.disks and len(ranks.disks) > 1:  # a disk per node: the first rank of each writes rank 0's checkpoint there
        state = ranks.broadcast(state)  # (the data position and RNG; DDP's ranks all hold the same weights and AdamW)
    if ranks.keeper:
        state.update(model=lora.adapters(model) if args.lora else model.state_dict(), optimizer=optimizer.state_dict())
        state["checksums"] = checkpoints.tensor_checksums(state)  # verified by load_checkpoint
        checkpoints.atomic_save(state, checkpoint_path(args.log_dir, step), quiet=not ranks.master)

def train_step(run, step):
    """One optimizer step over total_batch_size tokens: grad_accum_steps micro-batches on every rank.
    Returns (mean loss, gradient norm, learning rate, whether the weights were updated)."""
    args, optimizer = run.args, run.optimizer
    run.train_model.train()
    optimizer.zero_grad(set_to_none=True)
    batches, n_targets = run.train_loader.next_step(run.grad_accum_steps)
    if run.part is not None:  # --pp: the schedule runs the micro-batches through the stages; --tp: every share
        loss_accum, norm = run.part.step(batches, n_targets, args.grad_clip)
    else:
        loss_accum, norm = accumulate_gradients(run, batches, n_targets)
    lr = (run.budget.lr if run.budget else get_lr)(step, args.warmup_steps, run.max_steps, args.max_lr, args.min_lr)
    for group in optimizer.param_groups:
        group["lr"] = lr
    # a non-finite loss or gradient would make every weight NaN; a loss above DIVERGED_LOSS means they blew up:
    # skip the update (all ranks see the same all-reduced numbers); main() stops the run if it keeps happening
    sane = bool(loss_accum.isfinite() and norm.isfinite() and loss_accum < DIVERGED_LOSS)
    if sane:
        optimizer.step()
    if run.ranks.device.startswith("cuda"):
        torch.cuda.synchronize()
    return loss_accum.item(), norm.item(), lr, sane

def accumulate_gradients(run, batches, n_targets):
    """The gradient of the step's mean loss, accumulated over its micro-batches on this rank, averaged over the ranks
    (DDP, FSDP) and clipped. Returns (the step's mean loss, the gradient norm before clipping)."""
    args, ranks, model = run.args, run.ranks, run.train_model
    loss_accum = torch.zeros((), device=ranks.device)
    for micro_step, (x, y, packed) in enumerate(batches):
        x, y, packed = x.to(ranks.device), y.to(ranks.device), packed and packed.to(ranks.device)
        # DDP all-reduces gradients during backward (FSDP reduce-scatters them); only the last micro-step needs that
        sync = micro_step == run.grad_accum_steps - 1 or ranks.world_size == 1
        if run.sharded:  # (--shard grads: the gathered weights are kept until the last micro-step's backward)
            getattr(model, "_orig_mod", model).set_requires_gradient_sync(sync)
            getattr(model, "_orig_mod", model).set_reshard_after_backward(sync or args.shard == "full")
        with (nullcontext() if sync or run.sharded else model.no_sync()):
            with run.autocast:
                _, loss = model(x, y, packed=packed)
            # the gradient of the step's mean loss over all its targets: each micro-batch's mean, weighed (sizes.py)
            loss = loss * sizes.loss_weight(y, n_targets, ranks.world_size, run.grad_accum_steps)
            loss_accum += loss.detach()
            loss.backward()
    ranks.all_reduce_sum(loss_accum)
    loss_accum /= ranks.world_size
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    return loss_accum, sizes.whole(norm)  # (sharded, clipping's norm is a DTensor: the global norm, gathered)

def check_same_weights(run):
    """DDP's promise: every rank ends with the same weights (a pipeline's, tensor parallel's: each part's replicas
    do; FSDP's ranks each hold their own pieces: their digests, none gathered whole)."""
    if run.part:
        run.part.check_same_weights(run.ranks)
    elif run.sharded:
        parts.check_same_parts(run.ranks, run.model.state_dict(), 0, run.ranks.rank)
    else:
        world.check_same_weights(run.ranks, run.model)

def save_after_signal(run, signum, step, save):
    """After a SIGTERM or SIGINT: save where the run is, if `save` (its evaluations run when it resumes),
    and wait for every rank. Returns the exit code."""
    ranks, saved = run.ranks, ""
    if save:
        save_checkpoint(run, step, None, evaluated=False)
        saved = (f"saved {checkpoint_path(run.args.log_dir, step, run.in_parts)}; continue with --resume; "
                 if ranks.master else "")
    if ranks.world_size > 1:
        torch.distributed.barrier()  # nobody leaves before the checkpoint is written: launchers kill the rest
    print(f"rank {ranks.rank}: stopped by {signal.Signals(signum).name} before step {step}: {saved}"
          f"exit code {128 + signum}", file=sys.stderr, flush=True)
    return 128 + signum

def prune_or_stop_if_diverged(run, step, updated, skipped):
    """Counts the steps in a row that could not update the weights; returns the new count. A checkpoint
    counts only once a step from it updated them (weights can be finite and still diverge at once): then
    older ones are pruned. MAX_SKIPPED_STEPS in a row stop the run, keeping the newest good checkpoint."""
    args, ranks = run.args, run.ranks
    if updated:
        if ranks.keeper:  # (every node's folder, where each has its own)
            checkpoints.prune_checkpoints(args.log_dir, args.keep_checkpoints)
        return 0
    ranks.print0(f"warning: step {step}: the loss is not finite or above {DIVERGED_LOSS:.1f}, or the gradient norm "
                 "is not finite: update skipped")
    if skipped + 1 == MAX_SKIPPED_STEPS:  # every rank gets here alike
        if ranks.keeper:
            checkpoints.prune_checkpoints(args.log_dir, 0, newer_than=step - MAX_SKIPPED_STEPS)
        found = list_checkpoints(args.log_dir)
        raise SystemExit(f"error: training diverged: {MAX_SKIPPED_STEPS} steps in a row with a diverged loss or "
                         f"gradient (the last at step {step}); the newest checkpoint that trained on, "
                         f"{found[-1] if found else '(none)'}, is kept: lower --max_lr" if ranks.master else 1)
    return skipped + 1

# -----------------------------------------------------------------------------
# Training

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cpu.warm_up_vector_math()  # so that a resumed run computes exactly what the uninterrupted one did
    # How to run is the launcher's decision: torchrun, mpirun and srun each tell every process its rank
    # and the world size in their own variables; without one, we are a single process (world size 1).
    ranks = join_ranks(argv)
    args, task, ckpt, ckpt_file = resolve_args(argv, ranks)
    check_args(args, ranks.world_size)
    run = Run(args, ranks, task)
    run.device_type, run.dtype, run.autocast, run.ipex = set_up_machine(run)
    if args.hours:  # measure this machine, plan the run to end on time (clock.py), then check the plan's flags
        def make(**shape):
            return GPT(GPTConfig(vocab_size=PADDED_VOCAB_SIZE, **shape))
        run.budget, plan = clock.Budget.plan(run, make, ckpt)
        vars(args).update(plan)  # (what the plan chose, where no flag said otherwise)
        check_args(args, ranks.world_size)
        run.lay_out()
    choose_layout(run, ckpt)
    run.train_loader, run.hellaswag_examples, run.lock = open_data_and_lock_log_dir(run)
    run.model = build_model(run, ckpt)
    run.train_model, run.optimizer, run.compiled, start_step = prepare_training(run, ckpt, ckpt_file)
    evaluated = ckpt is not None and ckpt.get("evaluated", True)  # were start_step's evaluations done already?
    del ckpt
    if ranks.keeper:  # log.txt, args.json (how the run started: for a --resume before its first checkpoint)
        checkpoints.prepare_log_dir(args.log_dir, vars(args), overwrite=args.overwrite and not args.resume,
                                    fresh=ckpt_file is None, log=ranks.master)
    accumulation = f"{run.replicas} rank(s) x {run.grad_accum_steps} accumulation steps"
    ranks.print0(f"total batch {args.total_batch_size} tokens = {args.batch_size} x {args.seq_len} x {accumulation}"
                 + f" (x {args.pp} stages)" * (args.pp > 1) + f" (x {args.tp} tensor-parallel ranks)" * (args.tp > 1))
    if run.device_type == "cpu" and not args.hours:  # how long the run will take here, before its first step
        ranks.print0(progress.forecast(run, start_step))
    exit_code = train(run, start_step, evaluated)
    report.update(run, final=True)  # the picture of the whole run
    check_same_weights(run)
    world.report_peak_memory(ranks)
    if ranks.world_size > 1:  # (the models hold the group, DDP's reducer, FSDP's mesh: freed first)
        run.model = run.train_model = run.optimizer = run.part = None
        world.leave_process_group()
    if exit_code:
        raise SystemExit(exit_code)
    if args.demo:
        ranks.print0(report.next_steps(args.log_dir, list_checkpoints(args.log_dir)))

def train(run, start_step, evaluated):
    """The loop: at each step its evaluations and checkpoint when due, then one optimizer step, its line and log;
    to run.max_steps (on the clock, re-fitted at every step), or a stop signal. Returns the exit code."""
    args, ranks = run.args, run.ranks
    # SIGTERM / Ctrl-C from here on: finish the step, save a checkpoint, exit (before, nothing is lost: they stop the
    # process at once, also one waiting for ranks that will never come, as torchrun restarting its workers finds)
    stop = world.GracefulStop()
    skipped, first_dt = 0, 0.0
    eta = progress.StepClock(args, start_step, ranks.print0, run.budget and run.budget.deadline)  # (the step line's)
    for step in itertools.count(start_step):
        last_step = step >= run.max_steps
        # a resumed run already did the evals and the checkpoint of its first step (unless a signal stopped it)
        periodic = step > start_step or not evaluated
        def due(interval):
            return periodic and interval > 0 and (step % interval == 0 or last_step)
        val_loss = evaluate(run, step, due)
        report.update(run, evaluated=due(args.eval_interval))  # log_dir/report.png and .md (plumbing/report.py)
        if due(args.checkpoint_interval) and step > 0 and not skipped:
            save_checkpoint(run, step, val_loss)
        if last_step:
            if ranks.keeper:
                checkpoints.prune_checkpoints(args.log_dir, args.keep_checkpoints)
            return 0
        t0 = time.time()
        loss, norm, lr, updated = train_step(run, step)
        dt = time.time() - t0
        if run.budget:
            run.budget.tick(step, t0, t0 + dt)
        ranks.print0(f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {norm:.4f} | dt {dt * 1000:.0f}ms | "
                     f"tok/sec {args.total_batch_size / dt:.0f}{run.share_of_matmul_rate(dt)}{eta.tick(step, dt)}")
        append_log(args.log_dir, ranks, f"{step} train {loss:.6f}", f"{step} tok/s {args.total_batch_size / dt:.0f}")
        first_dt = dt if step == start_step else first_dt
        if run.compiled and step == start_step + 1:  # the first step's extra time went to compiling (0 if cached)
            ranks.print0(f"compile: took about {max(first_dt - dt, 0):.1f} s, during the first step")
        skipped = prune_or_stop_if_diverged(run, step, updated, skipped)
        if signum := stop.agreed(ranks):
            save = args.checkpoint_interval > 0 and not skipped  # no checkpoint of weights that just diverged
            return save_after_signal(run, signum, step + 1, save)

if __name__ == "__main__":
    world.run_main(main)
