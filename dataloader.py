"""
What train_gpt2.py reads, as batches: the pretraining shards that fineweb.py writes, cut into blocks (and their val
blocks); the task folders that finetune.py writes, their examples packed into rows, and their task.json; and the
demo's corpus, built on first use. A library: the data scripts write, this module reads.

Every loader is a pure function of (seed, epoch) and its position in the stream, so a checkpoint stores the position
alone, and a resumed run reads exactly what the uninterrupted one would have.
"""
import glob
import json
import os
from typing import NamedTuple

import numpy as np
import torch

from plumbing.common import atomic_write, one_line
from compute.fused_loss import IGNORE, LOSS_CHUNK
from plumbing.inputs import check_enough_tokens, find_shards, open_shard
from tokenizer import EOT, get_encoding

# -----------------------------------------------------------------------------
# 1. Pretraining shards: uint16 token ids, memory-mapped (plumbing/inputs.py opens them), shuffled deterministically

class DataLoader:
    """Cuts each shard into blocks of T+1 tokens (inputs and targets overlap by one) and serves
    them in an order shuffled by the seed: shard order per epoch, block order per shard.

    All ranks walk the same stream of blocks; each step the next world*B blocks are taken and
    rank r keeps blocks r*B..(r+1)*B-1. So ranks never share data, and every block is used once
    per epoch whatever the world size (a step may span two shards or two epochs). The position
    in that stream is the loader's whole state: (epoch, shard index, block index)."""

    def __init__(self, data_dir, split, B, T, rank=0, world_size=1, seed=1337):
        self.B, self.T, self.rank, self.world_size, self.seed = B, T, rank, world_size, seed
        self.files = find_shards(data_dir, split)
        if not self.files:
            raise SystemExit(f"error: no shards with '{split}' in their name in --data_dir {data_dir}")
        self.shards = [open_shard(f) for f in self.files]
        check_enough_tokens(self.shards, self.files, T, split)
        self.epoch, self.shard, self.block = 0, 0, 0
        self._load_orders()

    def _load_orders(self):  # permutations are a pure function of (seed, epoch, shard): nothing else to store
        rng = np.random.default_rng([self.seed, self.epoch])
        self.shard_order = rng.permutation(len(self.shards))
        n_blocks = (len(self.shards[self.shard_order[self.shard]]) - 1) // self.T
        rng = np.random.default_rng([self.seed, self.epoch, int(self.shard_order[self.shard])])
        self.block_order = rng.permutation(n_blocks)

    def state_dict(self):
        return {"epoch": self.epoch, "shard": self.shard, "block": self.block, "seed": self.seed,
                "files": [os.path.basename(f) for f in self.files]}

    def load_state_dict(self, state):
        if state["files"] != [os.path.basename(f) for f in self.files] or state["seed"] != self.seed:
            raise SystemExit("error: the shards in --data_dir or the --seed differ from the checkpoint's; "
                             "resuming would not continue the same data order")
        self.epoch, self.shard, self.block = state["epoch"], state["shard"], state["block"]
        self._load_orders()

    def _next_block(self):
        """Advance the stream by one block; return (shard array, start offset)."""
        while self.block == len(self.block_order):  # while: a short shard may have no block at all
            self.block, self.shard = 0, self.shard + 1
            if self.shard == len(self.shards):
                self.shard, self.epoch = 0, self.epoch + 1
            self._load_orders()
        tokens = self.shards[self.shard_order[self.shard]]
        start = int(self.block_order[self.block]) * self.T
        self.block += 1
        return tokens, start

    def next_step(self, micro_steps):
        """This rank's (x, y, None) for each micro-step of one optimizer step (TaskLoader's interface), and None: every
        position is a target here, so the step's mean loss is the mean of its micro-batches' means."""
        return [(*self.next_batch(), None) for _ in range(micro_steps)], None

    def next_batch(self):
        rows = []
        for i in range(self.world_size * self.B):
            tokens, start = self._next_block()
            if i // self.B == self.rank:  # only this rank's blocks are read from disk
                rows.append(np.asarray(tokens[start:start + self.T + 1], dtype=np.int64))
        buf = torch.from_numpy(np.stack(rows))
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # inputs, and targets shifted by one

class ValLoader:
    """The first val_tokens//T blocks of the val shards, in order, this rank's share (block i goes
    to rank i % world_size), in batches of at most B. Which tokens are scored does not depend on
    B or the world size, so val losses compare across runs."""

    def __init__(self, data_dir, T, val_tokens, B, rank=0, world_size=1):
        shards = [open_shard(f) for f in find_shards(data_dir, "val")]
        blocks = [(s, i * T) for s in shards for i in range((len(s) - 1) // T)][:max(1, val_tokens // T)]
        self.mine, self.T, self.B = blocks[rank::world_size], T, B

    def __iter__(self):
        for i in range(0, len(self.mine), self.B):
            rows = [np.asarray(s[o:o + self.T + 1], dtype=np.int64) for s, o in self.mine[i:i + self.B]]
            buf = torch.from_numpy(np.stack(rows))
            yield buf[:, :-1].contiguous(), buf[:, 1:].contiguous()

# -----------------------------------------------------------------------------
# 2. Task folders (finetune.py): per split, every example's tokens end to end, a target mask, and where each example
#    and its answer start; task.json last, whose presence means the folder is complete.

TASK_VERSION = 1

def read_task(data_dir):
    """The folder's task.json as a dict, or None when it is no task folder (pretraining shards, say)."""
    path = os.path.join(data_dir, "task.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            task = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path}: cannot read it ({one_line(e)})")
    if not isinstance(task, dict) or task.get("kind") != "task" or task.get("version") != TASK_VERSION:
        raise SystemExit(f"error: {path}: not a version {TASK_VERSION} task file; run finetune.py again")
    return task

def open_split(data_dir, split):
    """(tokens, targets, examples) of a split, memory-mapped: read from disk as they are used."""
    return tuple(np.load(os.path.join(data_dir, f"task_{split}_{part}.npy"), mmap_mode="r", allow_pickle=False)
                 for part in ("tokens", "targets", "examples"))

# Examples, each a prompt and its answer whose tokens alone are targets, are packed whole into rows of T positions,
# several to a row and never split across rows; positions restart at 0 for each example (GPT-2's are learned: the model
# must see an example as if it were alone) and attention stays inside each (model.packed_attention). A row's
# unused tail is padding: attended by nothing, no target. DataLoader does the same with blocks instead of examples.

PICK_MULTIPLE = LOSS_CHUNK  # pick_targets rounds up to whole chunks of the fused loss

class Packed(NamedTuple):  # how a batch of rows is packed, for GPT.forward(..., packed=)
    positions: torch.Tensor  # (B, T): each example's positions, from 0
    lengths: torch.Tensor  # (k,): the lengths of the examples and padding, in order, row after row (they sum to B*T)
    picked: torch.Tensor  # (K,): where the targets are in the flattened rows (pick_targets)

    def to(self, device):  # (lengths stay on the CPU, where packed_attention reads them)
        return Packed(self.positions.to(device), self.lengths, self.picked.to(device))

def pick_targets(y):
    """The flat positions of y's targets, padded with one of its ignored positions to a multiple of PICK_MULTIPLE: only
    these go through lm_head and the loss. (Their count changes every batch; rounded up, torch.compile sees a few
    shapes, each compiled once, not a new one every step.)"""
    flat = y.reshape(-1)
    counted = (flat != IGNORE).nonzero().squeeze(1)
    size = min(flat.numel(), -(-counted.numel() // PICK_MULTIPLE) * PICK_MULTIPLE)
    filler = (flat == IGNORE).nonzero()[:1, 0].expand(size - counted.numel())
    return torch.cat((counted, filler))

def pack(order, lengths, T):
    """Example indices, in the given order, cut into rows of at most T positions: the next example starts a new row
    when it does not fit in this one (a greedy pass keeps the order, so a row holds examples adjacent in it)."""
    rows, row, used = [], [], 0
    for i in order:
        if used + lengths[i] > T:
            rows.append(row)
            row, used = [], 0
        row.append(int(i))
        used += int(lengths[i])
    return rows + [row] if row else rows

class TaskLoader:
    """Packed rows of a task folder's split, for training (shuffle: example order shuffled by the seed each epoch,
    then packed) or validation (the examples in order: val_batches). Like DataLoader, all ranks walk the same stream of
    rows and a micro-step takes the next world*B, rank r keeping rows r*B..(r+1)*B-1; the state is (epoch, row)."""

    def __init__(self, data_dir, split, B, T, rank=0, world_size=1, seed=1337):
        self.B, self.T, self.rank, self.world_size, self.seed = B, T, rank, world_size, seed
        self.tokens, self.targets, examples = open_split(data_dir, split)
        examples = examples.astype(np.int64).reshape(-1, 3)  # (an empty split's were float64 before finetune.py said)
        lengths = examples[:, 2] - examples[:, 0] - 1  # positions: inputs are an example's tokens but its last
        if split == "train" and len(examples) and lengths.max() > T:
            raise SystemExit(f"error: --data_dir {data_dir}: a {split} example fills {lengths.max()} positions, "
                             f"more than --seq_len {T}: raise --seq_len, or prepare the data with "
                             f"finetune.py --max_len {T}")
        # a val example that does not fit a row is left out of the val loss, not a reason to stop a run (too_long says)
        self.too_long = int((lengths > T).sum())
        self.examples, self.lengths = examples[lengths <= T], lengths[lengths <= T]
        summed = np.concatenate(([0], np.cumsum(self.targets, dtype=np.int64)))
        self.n_targets = summed[self.examples[:, 2]] - summed[self.examples[:, 0]]  # per example
        self.epoch, self.row = 0, 0
        self._pack()

    def _pack(self):  # a pure function of (seed, epoch), like DataLoader's orders
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.examples))
        self.rows = pack(order, self.lengths, self.T)

    def rows_in_epochs(self, epochs):
        return sum(len(pack(np.random.default_rng([self.seed, e]).permutation(len(self.examples)),
                            self.lengths, self.T))
                   for e in range(epochs))

    def state_dict(self):
        return {"epoch": self.epoch, "row": self.row, "seed": self.seed, "examples": len(self.examples),
                "tokens": len(self.tokens)}

    def load_state_dict(self, state):
        if [state.get(k) for k in ("seed", "examples", "tokens")] != [self.seed, len(self.examples), len(self.tokens)]:
            raise SystemExit("error: the task data in --data_dir or the --seed differ from the checkpoint's; "
                             "resuming would not continue the same data order")
        self.epoch, self.row = state["epoch"], state["row"]
        self._pack()

    def _next_row(self):
        while self.row == len(self.rows):
            self.epoch, self.row = self.epoch + 1, 0
            self._pack()
        self.row += 1
        return self.rows[self.row - 1]

    def next_step(self, micro_steps):
        """This rank's (x, y, Packed) for each micro-step of one optimizer step, and the number of targets in the whole
        step, on all ranks: the loss is their mean, so every micro-batch's share is weighed by its own targets."""
        rows = [self._next_row() for _ in range(micro_steps * self.world_size * self.B)]
        n_targets = int(sum(self.n_targets[i] for row in rows for i in row))
        mine = [rows[(m * self.world_size + self.rank) * self.B:][:self.B] for m in range(micro_steps)]
        return [self.batch(r) for r in mine], n_targets

    def val_batches(self):
        """Every example of the split once, in order, this rank's rows (row i goes to rank i % world_size), B at a
        time."""
        mine = pack(range(len(self.examples)), self.lengths, self.T)[self.rank::self.world_size]
        return [self.batch(mine[i:i + self.B]) for i in range(0, len(mine), self.B)]

    def batch(self, rows):
        """x, y (B, T) and their Packed layout; y is IGNORE where a token is not a target, and on the padding."""
        x = np.full((len(rows), self.T), EOT, dtype=np.int64)
        y = np.full((len(rows), self.T), IGNORE, dtype=np.int64)
        positions, lengths = np.zeros((len(rows), self.T), dtype=np.int64), []
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                start, _, end = self.examples[i]
                n = end - start - 1
                x[r, at:at + n] = self.tokens[start:end - 1]
                y[r, at:at + n] = np.where(self.targets[start + 1:end] > 0,
                                           self.tokens[start + 1:end].astype(np.int64), IGNORE)
                positions[r, at:at + n] = np.arange(n)
                lengths.append(n)
                at += n
            if at < self.T:  # the padding: one more "example" that nothing else sees
                positions[r, at:] = np.arange(self.T - at)
                lengths.append(self.T - at)
        y = torch.from_numpy(y)
        return torch.from_numpy(x), y, Packed(torch.from_numpy(positions), torch.tensor(lengths), pick_targets(y))

# -----------------------------------------------------------------------------
# 3. What train_gpt2.py opens (args: its flags)

def open_training_data(args, task, ranks):
    """This rank's loader of the training data (pretraining shards, or a task folder's examples); and the val data
    checked when it will be evaluated, so that a missing or short val split is one error line before any training."""
    # every rank builds (or finds) the shards: the cache is per host, and one that skipped this could read half a file
    if args.demo:
        build_demo_shards(args.data_dir)
    loader = (TaskLoader if task is not None else DataLoader)(args.data_dir, "train", args.batch_size, args.seq_len,
                                                              ranks.rank, ranks.world_size, args.seed)
    if args.eval_interval > 0 and task is not None:
        too_long = TaskLoader(args.data_dir, "val", 1, args.seq_len).too_long
        if too_long:
            ranks.print0(f"note: {too_long} val example{'s' * (too_long > 1)} longer than --seq_len {args.seq_len} "
                         "positions left out of the val loss")
    elif args.eval_interval > 0:
        val_files = find_shards(args.data_dir, "val")
        if not val_files:
            raise SystemExit(f"error: no shards with 'val' in their name in --data_dir {args.data_dir} (or pass "
                             "--eval_interval 0)")
        check_enough_tokens([open_shard(f) for f in val_files], val_files, args.seq_len, "val")
    return loader

def val_batches(args, task, ranks, lockstep=False):
    """This rank's val batches, (x, y, Packed or None): the same val tokens (pretraining) or every val example (task
    data) whatever the batch size or world size. lockstep (a sharded model): padded with None to the most any rank has,
    as every rank must join every forward's all-gathers."""
    if task is not None:
        val_loader = TaskLoader(args.data_dir, "val", args.batch_size, args.seq_len, ranks.rank, ranks.world_size)
        batches = val_loader.val_batches()
    else:
        batches = [(x, y, None) for x, y in ValLoader(args.data_dir, args.seq_len, args.val_tokens, args.batch_size,
                                                       ranks.rank, ranks.world_size)]
    if lockstep:
        most = torch.tensor(len(batches))
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        batches += [None] * (int(most) - len(batches))
    return batches

def token_files(data_dir, task):
    """Every file of token ids a run reads (their ids are checked against the model's vocabulary)."""
    if task is not None:
        return sorted(glob.glob(os.path.join(data_dir, "task_*_tokens.npy")))
    return find_shards(data_dir, "train") + find_shards(data_dir, "val")

# -----------------------------------------------------------------------------
# 4. The demo's corpus: the Python standard library's own source, which every machine with Python has, tokenized into
#    one val and one train shard on first use (kept as a cache: train_gpt2.py's demo runs with no data of yours)

def build_demo_shards(out_dir, max_tokens=8_000_000):
    if os.path.exists(os.path.join(out_dir, "demo_train_000001.npy")):
        return
    os.makedirs(out_dir, exist_ok=True)
    stdlib = os.path.dirname(os.__file__)
    docs = []
    for path in sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)):
        if "site-packages" not in path and "test" not in os.path.relpath(path, stdlib):
            with open(path, encoding="utf-8", errors="replace") as f:
                docs.append(f.read())
    tokens, n = [], 0
    for ids in get_encoding().encode_ordinary_batch(docs, num_threads=os.cpu_count() or 1):
        tokens.append([EOT] + ids)  # every document starts with <|endoftext|>
        n += len(ids) + 1
        if n >= max_tokens:
            break
    # whole documents only: every 20th goes to val, so no document is split between the two
    val, train = tokens[::20], [t for i, t in enumerate(tokens) if i % 20 != 0]
    for name, docs in (("demo_val_000000.npy", val), ("demo_train_000001.npy", train)):
        path = os.path.join(out_dir, name)  # (ranks on one host may build at once: a temporary file each)
        atomic_write(path, lambda f, a=np.concatenate(docs).astype(np.uint16): np.save(f, a),
                     f"{path}.{os.getpid()}.tmp")
