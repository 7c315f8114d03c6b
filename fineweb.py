"""
fineweb.py: text -> the uint16 token shards that train_gpt2.py reads.

    python fineweb.py                                   # FineWeb-Edu sample-10BT -> edu_fineweb10B/
    python fineweb.py --input 'my_notes/*.txt' --output_dir my_shards --shard_size 1e6 --val_tokens 1e5

What comes out is build-nanogpt's layout: {prefix}_val_000000.npy, {prefix}_train_000001.npy, ...,
each an np.save'd 1-D uint16 array (GPT-2's 50,257 ids fit in 16 bits: half the disk of int32).
Every document is written as [EOT] + its GPT-2 tokens (EOT = 50256, <|endoftext|>), in input order,
so the model learns where documents start. Train shards hold exactly --shard_size tokens (the last
one fewer) and a document may run on from one train shard into the next. The val shard is shard 0:
the first documents, whole, until it holds at least --val_tokens tokens, so unlike build-nanogpt
(which cuts val at exactly 1e8 tokens) no document is split between val and train.

Where documents come from:
  * default: the Hugging Face dataset HuggingFaceFW/fineweb-edu, config sample-10BT, split train,
    read with `datasets` in streaming mode: tokenizing starts at once and the disk only ever holds
    shards, never the dataset's parquet files. --dataset may also be a local folder laid out like that
    repository (or any other dataset load_dataset accepts).
  * --input PATH_OR_GLOB (repeatable): .txt (one document per file), .jsonl / .json (one object
    per document, its --text_field), .parquet (its --text_field column). A folder means the
    supported files in it. This mode needs no network and no `datasets`.

How it is fast: tokenizing is the only real work, so everything else runs beside it. A reader
thread pulls documents and groups them into ~1 MB batches; --workers threads (one per core)
tokenize batches; the main thread puts the results, in order, into shards; a writer thread saves
finished shards. Each batch is tokenized in a single tiktoken call (see tokenize_batch), which
runs in Rust without holding Python's GIL, so threads use every core. (--pool process does the
same with worker processes; on the 2-core machine this was developed on, threads measured ~5-10%
faster: no process start-up, nothing to pickle. bench_fineweb.py compares them.)

How it is safe: a shard is written under a temporary name, flushed to disk and then renamed, so a
file with a shard's final name is always complete. After each shard a small manifest
({prefix}_manifest.json, written the same way) records where in the input the shard ends. Run the
same command again after Ctrl-C, kill -9 or a crash and it carries on from the last finished shard;
the shards come out byte-identical to an uninterrupted run. A finished output folder is left alone
unless you pass --overwrite.
"""
import argparse
import collections
import gc
import glob
import hashlib
import json
import multiprocessing
import os
import queue
import re
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np
from tqdm import tqdm

from tokenizer import EOT, get_encoding

EOT_TEXT = "<|endoftext|>"        # the text that tiktoken turns into the EOT id when allowed
MANIFEST_VERSION = 1
LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


# -----------------------------------------------------------------------------
# 1. Where documents come from
#
# The input is a list of "units": one per local file, or one per file of the Hugging Face dataset.
# A unit yields (row, text) pairs: row is the document's index inside its unit. A place in the input
# is then (unit, row), plus a token offset for a train shard that ends in the middle of a document.
# That is all resuming needs: reopen unit `unit`, jump to `row`, drop `token` tokens.

class Unit:
    def __init__(self, name, read):
        self.name = name    # for messages: a file path, or "dataset file i/n"
        self.read = read    # read(start_row) -> iterator of (row, text), rows >= start_row


def expand_inputs(patterns):
    """--input values -> the list of files, in a fixed order (sorted within each pattern)."""
    files = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(pattern) for f in fs
                           if f.lower().endswith(LOCAL_SUFFIXES))
            if not found:
                raise SystemExit(f"error: --input {pattern}: the folder has no {'/'.join(LOCAL_SUFFIXES)} files")
        elif glob.has_magic(pattern):
            found = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
            if not found:
                raise SystemExit(f"error: --input {pattern}: no files match")
        elif os.path.isfile(pattern):
            found = [pattern]
        else:
            raise SystemExit(f"error: --input {pattern}: no such file")
        for f in found:
            if not f.lower().endswith(LOCAL_SUFFIXES):
                raise SystemExit(f"error: {f}: unsupported file type (use {', '.join(LOCAL_SUFFIXES)})")
            if f not in files:
                files.append(f)
    return files


def read_txt(path, start_row):
    """A .txt file is one document: the whole file, decoded as UTF-8, byte for byte."""
    if start_row > 0:
        return
    with open(path, "rb") as f:
        data = f.read()
    try:
        yield 0, data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(f"error: {path}: not UTF-8 text (bad byte at offset {e.start})")


def get_text(obj, field, path, where):
    if not isinstance(obj, dict) or field not in obj:
        keys = sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
        raise SystemExit(f"error: {path} {where}: no '{field}' field (found {keys}); see --text_field")
    return obj[field]


def read_jsonl(path, field, start_row):
    """JSON lines: one object per line; the row is the line number (blank lines are skipped)."""
    with open(path, "rb") as f:
        for row, line in enumerate(f):
            if row < start_row or not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise SystemExit(f"error: {path} line {row + 1}: not valid JSON ({e})")
            yield row, get_text(obj, field, path, f"line {row + 1}")


def read_json(path, field, start_row):
    """A .json file is either one JSON array of objects, or JSON lines like .jsonl."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        yield from read_jsonl(path, field, start_row)
        return
    try:
        with open(path, "rb") as f:
            items = json.load(f)
    except ValueError as e:
        raise SystemExit(f"error: {path}: not valid JSON ({e})")
    for row in range(start_row, len(items)):
        yield row, get_text(items[row], field, path, f"item {row}")


def read_parquet(path, field, start_row):
    """Parquet: read only the text column, a record batch at a time. Parquet files are split into
    row groups whose sizes the footer lists, so resuming skips whole groups without reading them."""
    import pyarrow.parquet as pq
    pf = pq.ParquetFile(path)
    groups, first = [], 0           # the row groups to read, and the index of the first row in them
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if first + n <= start_row and not groups:
            first += n
        else:
            groups.append(g)
    if not groups:
        return
    batches = pf.iter_batches(batch_size=1024, row_groups=groups, columns=[field])
    row, finished = first, False
    try:
        for batch in batches:
            for text in batch.column(0).to_pylist():
                if row >= start_row:
                    yield row, text
                row += 1
        finished = True
    finally:
        if not finished:
            close_arrow_iterator(batches)


def close_arrow_iterator(it):
    # An Arrow reader left half-read (after Ctrl-C or an error) can abort the interpreter at exit
    # ("terminate called without an active exception") with the pyarrow versions this was written
    # against; closing it and collecting garbage while Python is still fully alive frees it cleanly.
    # (Not done after a normal end: a full gc.collect() can take a noticeable fraction of a second.)
    if hasattr(it, "close"):
        it.close()
    gc.collect()


def local_units(files, field):
    """Check every file cheaply before any work (readable, has the text field), then wrap each."""
    units = []
    for path in files:
        suffix = os.path.splitext(path)[1].lower()
        if not os.access(path, os.R_OK):
            raise SystemExit(f"error: {path}: cannot read the file")
        if suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise SystemExit(f"error: {path}: reading parquet needs pyarrow (pip install pyarrow)")
            try:
                schema = pq.read_schema(path)
            except Exception as e:
                raise SystemExit(f"error: {path}: not a readable parquet file ({e})")
            if field not in schema.names:
                raise SystemExit(f"error: {path}: no '{field}' column (columns: {', '.join(schema.names)}); "
                                 "see --text_field")
            read = lambda start, p=path: read_parquet(p, field, start)
        elif suffix in (".jsonl", ".json"):
            reader = read_jsonl if suffix == ".jsonl" else read_json
            first = next(reader(path, field, 0), None)   # fails here, naming the file, if the field is missing
            if first is None:
                print(f"warning: {path} holds no documents", file=sys.stderr)
            read = lambda start, p=path, r=reader: r(p, field, start)
        else:
            read = lambda start, p=path: read_txt(p, start)
        units.append(Unit(path, read))
    return units


def hub_units(dataset, name, split, field):
    """A Hugging Face dataset, streamed. load_dataset(..., streaming=True) only lists the data files;
    rows are downloaded as they are read. We read it one data file ("shard") at a time so that a
    resume can jump straight to the file it stopped in instead of re-downloading everything before."""
    try:
        import datasets
    except ImportError:
        raise SystemExit("error: reading --dataset needs the `datasets` package (pip install datasets), "
                         "or pass local files with --input")
    try:
        ds = datasets.load_dataset(dataset, name=name, split=split, streaming=True)
    except Exception as e:
        raise SystemExit(f"error: cannot open dataset {dataset} (name={name}, split={split}): "
                         f"{type(e).__name__}: {e}")
    if ds.column_names is not None and field not in ds.column_names:
        raise SystemExit(f"error: dataset {dataset}: no '{field}' column (columns: {', '.join(ds.column_names)}); "
                         "see --text_field")
    ds = ds.select_columns([field])
    n = ds.num_shards

    def read(i, start_row):
        part = ds.shard(num_shards=n, index=i, contiguous=True)   # exactly data file i, in order
        if start_row:
            part = part.skip(start_row)
        batches = part.iter(batch_size=1024)
        row, finished = start_row, False
        try:
            for batch in batches:
                if field not in batch:
                    raise SystemExit(f"error: dataset {dataset} file {i + 1}/{n}: no '{field}' column")
                for text in batch[field]:
                    yield row, text
                    row += 1
            finished = True
        finally:
            if not finished:
                close_arrow_iterator(batches)

    return [Unit(f"dataset {dataset} file {i + 1}/{n}", lambda start, i=i: read(i, start)) for i in range(n)]


# -----------------------------------------------------------------------------
# 2. Tokenizing
#
# tiktoken's encoder is Rust and releases the GIL, but calling it once per document from Python costs
# a round trip per document: converting the ids to a Python list of ints, then to numpy, and (in
# threads) waiting for the GIL to come back. Instead we tokenize a whole batch in ONE call:
#     encode("<|endoftext|>" + doc1 + "<|endoftext|>" + doc2 ..., allowed_special={"<|endoftext|>"})
# tiktoken cuts the text at each allowed special token, BPE-encodes the pieces between them
# separately and puts EOT where each special token was: exactly [EOT] + encode(doc1) + [EOT] + ...,
# which is our shard format, returned as one numpy array. The one catch: a document that itself
# contains the text "<|endoftext|>" must not get a real EOT inside it, so such (rare) documents
# are encoded on their own, as ordinary text.

class TokenIdTooLarge(Exception):
    """A token id that does not fit in uint16 (impossible with GPT-2's 50,257 ids; a guard)."""


def encode(enc, text, allowed_special=frozenset()):
    """tiktoken's encode_to_numpy (uint32 ids, no Python list in between), no special-token checks."""
    try:
        return enc.encode_to_numpy(text, allowed_special=allowed_special, disallowed_special=())
    except UnicodeEncodeError:
        # Lone surrogates (e.g. from a "\ud800" escape in JSON) are not valid UTF-8; fix them the way
        # tiktoken's encode_ordinary does, so the ids match tokenizer.encode() exactly.
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return enc.encode_to_numpy(text, allowed_special=allowed_special, disallowed_special=())


def encode_run(enc, docs):
    """[EOT] + tokens, for each of docs (none of them containing EOT_TEXT), as one uint32 array."""
    return encode(enc, EOT_TEXT + EOT_TEXT.join(docs), allowed_special={EOT_TEXT})


def tokenize_batch(texts):
    """A batch of documents -> (tokens, ends): tokens is uint16, [EOT] + encode(doc) for every
    non-empty doc in order; ends[i] is where row i's tokens end (an empty row adds nothing)."""
    enc = get_encoding()
    pieces, run = [], []
    for text in texts:
        if not text:
            continue
        if EOT_TEXT in text:
            if run:
                pieces.append(encode_run(enc, run))
                run = []
            pieces.append(np.array([EOT], np.uint32))
            pieces.append(encode(enc, text))    # all of it as ordinary text
        else:
            run.append(text)
    if run:
        pieces.append(encode_run(enc, run))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.uint32)

    # Each non-empty document starts with the only EOT in it: ordinary text never encodes to 50256.
    starts = np.flatnonzero(tokens == EOT)
    nonempty = np.flatnonzero([bool(t) for t in texts])
    assert len(starts) == len(nonempty)
    if len(tokens) and tokens.max() >= 2**16:
        bad = int(np.argmax(tokens >= 2**16))
        row = int(nonempty[np.searchsorted(starts, bad, side="right") - 1])
        raise TokenIdTooLarge(row, int(tokens[bad]))
    lengths = np.zeros(len(texts), np.int64)
    lengths[nonempty] = np.diff(np.append(starts, len(tokens)))
    return tokens.astype(np.uint16), np.cumsum(lengths)


def init_worker():
    # Ctrl-C goes to the whole process group; let only the main process handle it (it stops the
    # workers itself), instead of every worker printing a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # If the main process is killed outright (kill -9, out of memory), nobody tells the workers:
    # they would wait for work forever. A thread watching the parent ends this worker with it.
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()
    get_encoding()


# -----------------------------------------------------------------------------
# 3. Shards and the manifest on disk

def shard_filename(prefix, split, index):
    return f"{prefix}_{split}_{index:06d}.npy"


def atomic_write(path, write):
    """Write to path.tmp, flush it to the disk, then rename: the rename is atomic, so `path` is
    either the old file or the complete new one, never a half-written one (even after kill -9 or
    a power cut)."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_shard(path, tokens):
    atomic_write(path, lambda f: np.save(f, tokens, allow_pickle=False))


def save_manifest(path, manifest):
    """JSON, one line per shard so that it stays readable with 100 shards."""
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in manifest.items() if k != "shards"]
    shards = ",\n".join(f"  {json.dumps(s)}" for s in manifest["shards"])
    text = "{\n" + "\n".join(lines) + '\n "shards": [\n' + shards + "\n ]\n}\n"
    atomic_write(path, lambda f: f.write(text.encode()))


# -----------------------------------------------------------------------------
# 4. The pipeline: reader thread -> tokenizer pool -> shards (main thread) -> writer thread

Batch = collections.namedtuple("Batch", "texts units rows")   # one (unit, row) per text


def read_batches(units, start, batch_chars):
    """Documents from `start` = (unit, row) on, grouped into batches of about batch_chars characters
    (big enough that the per-batch overhead vanishes, small enough to keep every worker busy)."""
    texts, unit_ids, rows, chars = [], [], [], 0
    for u in range(start[0], len(units)):
        for row, text in units[u].read(start[1] if u == start[0] else 0):
            if text is not None and not isinstance(text, str):
                raise SystemExit(f"error: {units[u].name} row {row}: the text is a {type(text).__name__}, not a string")
            texts.append(text)
            unit_ids.append(u)
            rows.append(row)
            chars += len(text) if text else 0
            if chars >= batch_chars:
                yield Batch(texts, unit_ids, rows)
                texts, unit_ids, rows, chars = [], [], [], 0
    if texts:
        yield Batch(texts, unit_ids, rows)


class Background:
    """Run an iterator in a thread, `depth` items ahead of the consumer, so reading (disk, network,
    JSON parsing) overlaps with tokenizing. Exceptions are passed through to the consumer."""

    DONE = object()

    def __init__(self, make_iterator, depth):
        self.queue = queue.Queue(depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(make_iterator,), daemon=True)
        self.thread.start()

    def _run(self, make_iterator):
        it = None
        try:
            it = make_iterator()
            for item in it:
                if not self._put(item):
                    return
            self._put(self.DONE)
        except BaseException as e:    # SystemExit too: a bad input file found while reading
            self._put(e)
        finally:
            if it is not None:
                it.close()            # stopped early: close the readers (and their files) now, here

    def _put(self, item):
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self):
        while True:
            item = self.queue.get()
            if item is self.DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def stop(self):
        self.stopping.set()
        self.thread.join()


class Sharder:
    """Takes tokenized batches in input order and cuts them into shards; hands each finished shard
    to a writer thread, which saves it and then records it in the manifest.

    A place in the input is (unit, row, token): the next token to write is token `token` of the
    document at `row` of input unit `unit` (counting its leading EOT). Along with it we keep how
    many documents (non-empty, and empty) come before that row, so the counts survive a resume."""

    def __init__(self, out_dir, prefix, shard_size, val_tokens, manifest, manifest_path):
        self.out_dir, self.prefix = out_dir, prefix
        self.shard_size, self.val_tokens = shard_size, val_tokens
        self.manifest, self.manifest_path = manifest, manifest_path
        done = manifest["shards"]
        last = done[-1] if done else {"end": [0, 0, 0], "docs_before_end": 0, "empty_before_end": 0}
        self.start = (tuple(last["end"]), last["docs_before_end"], last["empty_before_end"])  # of the next shard
        self.docs, self.empty_docs = last["docs_before_end"], last["empty_before_end"]  # before the next batch
        self.end = self.start                 # the place after the last batch seen
        self.skip = last["end"][2]            # resuming inside a document: its first tokens are written
        self.tokens = sum(s["tokens"] for s in done)   # all tokens taken in so far, this run and before
        self.index = done[-1]["index"] + 1 if done else (0 if val_tokens > 0 else 1)
        self.val_done = self.index > 0        # the val shard is shard 0; 0 val tokens means no val shard
        self.val_parts, self.val_count = [], 0
        self.buf, self.fill = None, 0         # the train shard being filled
        self.writer = ThreadPoolExecutor(1)   # one thread, so shards and manifest updates land in order
        self.writing = None

    def add(self, batch, tokens, ends):
        """Append one tokenized batch; returns how many tokens it added."""
        n = len(tokens)
        empty = np.diff(ends, prepend=0) == 0
        empty_before = np.concatenate([[0], np.cumsum(empty)])

        def place(r, token=0):
            """The place at token `token` of local row r (r == number of rows: after the batch)."""
            if r < len(batch.rows):
                unit, row = batch.units[r], batch.rows[r]
            else:
                unit, row = batch.units[-1], batch.rows[-1] + 1
            e = int(empty_before[r])
            return (unit, row, token), self.docs + r - e, self.empty_docs + e

        p, self.skip = self.skip, 0
        start = p
        if not self.val_done:
            # val takes whole documents, up to and including the first one that reaches val_tokens
            r = int(np.searchsorted(ends, self.val_tokens - self.val_count, side="left"))
            p = int(ends[r]) if r < len(ends) else n
            self.val_parts.append(tokens[:p])
            self.val_count += p
            if r < len(ends):
                self.val_done = True
                self._submit("val", self.val_parts, place(r + 1))
                self.val_parts = []
        while p < n:
            if self.buf is None:
                self.buf, self.fill = np.empty(self.shard_size, np.uint16), 0
            k = min(self.shard_size - self.fill, n - p)
            self.buf[self.fill:self.fill + k] = tokens[p:p + k]
            self.fill += k
            p += k
            if self.fill == self.shard_size:
                # the shard ends inside the row whose tokens cover position p (or after the batch)
                r = int(np.searchsorted(ends, p, side="right"))
                token = p - (int(ends[r - 1]) if r > 0 else 0) if r < len(ends) else 0
                self._submit("train", self.buf, place(r, token))
                self.buf = None
        self.end = place(len(batch.rows))
        self.docs, self.empty_docs = self.end[1], self.end[2]
        self.tokens += n - start
        return n - start

    def _submit(self, split, tokens, place):
        end, docs, n_empty = place
        start, first_doc, _ = self.start
        entry = {
            "index": self.index, "file": shard_filename(self.prefix, split, self.index), "split": split,
            "start": list(start), "end": list(end),
            # the documents this shard holds tokens of (0-based, counting non-empty documents only)
            "first_doc": first_doc, "last_doc": docs if end[2] > 0 else docs - 1,
            "docs_before_end": docs, "empty_before_end": n_empty,
        }
        self.start = place
        self.index += 1
        if self.writing is not None:
            self.writing.result()    # at most one finished shard waits in memory while another is written
        self.writing = self.writer.submit(self._write, entry, tokens)

    def _write(self, entry, tokens):
        if isinstance(tokens, list):
            tokens = np.concatenate(tokens)
        path = os.path.join(self.out_dir, entry["file"])
        try:
            save_shard(path, tokens)
            entry["tokens"], entry["bytes"] = int(len(tokens)), os.path.getsize(path)
            self.manifest["shards"].append(entry)
            save_manifest(self.manifest_path, self.manifest)
        except OSError as e:     # disk full, folder removed, ...: one line, and the run can be resumed
            raise SystemExit(f"error: cannot write {path}: {e}")

    def finish(self):
        """End of input: write what is left (val, if it never filled up; the last train shard)."""
        if not self.val_done and self.val_count > 0:
            self.val_done = True
            self._submit("val", self.val_parts, self.end)
        if self.buf is not None and self.fill > 0:
            self._submit("train", self.buf[:self.fill], self.end)
            self.buf = None
        self.wait()
        self.manifest["complete"] = True
        self.manifest["totals"] = {"docs": self.end[1], "empty_docs": self.end[2],
                                   "tokens": sum(s["tokens"] for s in self.manifest["shards"])}
        save_manifest(self.manifest_path, self.manifest)

    def wait(self):
        """Wait for the shard being written, if any (re-raising its error)."""
        if self.writing is not None:
            writing, self.writing = self.writing, None
            writing.result()


def tokenize_all(units, manifest, manifest_path, args):
    """The main loop. Returns the number of tokens added by this run."""
    sharder = Sharder(args.output_dir, args.prefix, args.shard_size, args.val_tokens, manifest, manifest_path)
    if manifest["shards"]:
        s = manifest["shards"][-1]
        print(f"resuming after {s['file']} ({len(manifest['shards'])} shards done, "
              f"{sum(x['tokens'] for x in manifest['shards']):,} tokens)")
    if args.pool == "process":
        # "spawn" starts clean interpreters: the same behaviour on Linux, macOS and Windows, and no
        # fork() of a process that already runs threads.
        pool = ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=init_worker)
    else:
        pool = ThreadPoolExecutor(args.workers)
    start = sharder.start[0]
    reader = Background(lambda: read_batches(units, start[:2], args.batch_chars), depth=args.workers + 2)
    bar = tqdm(desc="tokenizing", unit="tok", unit_scale=True, initial=sharder.tokens, smoothing=0.05,
               dynamic_ncols=True)
    added = 0

    def consume(batch, future):
        nonlocal added
        try:
            tokens, ends = future.result()
        except TokenIdTooLarge as e:
            row, token = e.args
            raise SystemExit(f"error: {units[batch.units[row]].name} row {batch.rows[row]}: "
                             f"token id {token} does not fit in uint16")
        except BrokenProcessPool:
            raise SystemExit("error: a tokenizer process died (out of memory?); run the same command "
                             "again to resume, perhaps with fewer --workers")
        n = sharder.add(batch, tokens, ends)
        added += n
        bar.update(n)
        bar.set_postfix(docs=f"{sharder.docs:,}", shards=len(manifest["shards"]), refresh=False)

    pending = collections.deque()   # batches being tokenized, oldest first: results are used in order
    try:
        for batch in reader:
            pending.append((batch, pool.submit(tokenize_batch, batch.texts)))
            if len(pending) >= 2 * args.workers + 2:
                consume(*pending.popleft())
        while pending:
            consume(*pending.popleft())
        if sharder.tokens == 0:
            raise SystemExit(f"error: the input holds no text ({sharder.end[2]:,} empty documents)")
        sharder.finish()
    finally:
        # normal end, an error or Ctrl-C: stop reading, drop queued batches, but let the shard
        # being written finish (it is complete: no reason to lose it)
        bar.close()
        reader.stop()
        pool.shutdown(wait=True, cancel_futures=True)
        sharder.wait()
        sharder.writer.shutdown()
    return added


# -----------------------------------------------------------------------------
# 5. The output folder, the summary, the command line

def local_source(files):
    """What identifies local input: the files and their sizes (so a changed input is noticed)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{os.path.abspath(f)}\t{os.path.getsize(f)}\n".encode())
    return {"files": len(files), "first": os.path.abspath(files[0]), "sha256": h.hexdigest()}


def open_output_dir(out_dir, prefix, config, overwrite):
    """Start, resume or refuse. Returns the manifest (its "shards" are the ones verified on disk);
    one without shards is a fresh start, saved by the caller once the input is open."""
    manifest_path = os.path.join(out_dir, f"{prefix}_manifest.json")
    manifest = {"version": MANIFEST_VERSION, "config": config, "complete": False, "shards": []}
    if not os.path.isdir(out_dir):
        return manifest, manifest_path
    p = re.escape(prefix)
    ours = re.compile(rf"{p}_(train|val)_\d{{6}}\.npy(\.tmp)?$|{p}_manifest\.json\.tmp$")
    files = [f for f in os.listdir(out_dir) if ours.match(f)]
    if overwrite:
        for f in files + ([os.path.basename(manifest_path)] if os.path.exists(manifest_path) else []):
            os.remove(os.path.join(out_dir, f))
        files = []
    for f in files:
        if f.endswith(".tmp"):                 # left by a write that was killed: never a finished file
            os.remove(os.path.join(out_dir, f))
    if not os.path.exists(manifest_path):
        if any(f.endswith(".npy") for f in files):
            raise SystemExit(f"error: {out_dir} already holds {prefix}_*.npy shards this script did not make "
                             f"(there is no {os.path.basename(manifest_path)}); pass --overwrite to replace "
                             "them, or choose another --output_dir")
        return manifest, manifest_path
    try:
        with open(manifest_path) as f:
            old_manifest = json.load(f)
        old = old_manifest["config"]
        assert old_manifest["version"] == MANIFEST_VERSION
    except (ValueError, KeyError, TypeError, AssertionError):
        raise SystemExit(f"error: {manifest_path} is not a manifest this script can read; "
                         "pass --overwrite to start over")
    if not old_manifest["shards"]:        # a run that stopped before its first shard: nothing to keep
        return manifest, manifest_path
    manifest = old_manifest
    if old != config:
        changed = ", ".join(k for k in sorted(set(old) | set(config)) if old.get(k) != config.get(k))
        raise SystemExit(f"error: {out_dir} holds shards made with other settings (differs in: {changed}); "
                         "run the original command to finish them, or pass --overwrite to start over")
    # Trust a shard only if its file is there with the size it was written with; redo from the first
    # one that is not (its place in the input is in the manifest entry before it).
    good = []
    for s in manifest["shards"]:
        path = os.path.join(out_dir, s["file"])
        if not (os.path.isfile(path) and os.path.getsize(path) == s["bytes"]):
            break
        good.append(s)
    if len(good) < len(manifest["shards"]):
        manifest["shards"], manifest["complete"] = good, False
        manifest.pop("totals", None)
    return manifest, manifest_path


def print_summary(manifest, out_dir, added=None, seconds=None):
    shards = manifest["shards"]
    val = [s for s in shards if s["split"] == "val"]
    train = [s for s in shards if s["split"] == "train"]
    t = manifest["totals"]
    print(f"{out_dir}: {len(shards)} shards ({len(val)} val + {len(train)} train), {t['tokens']:,} tokens "
          f"from {t['docs']:,} documents ({t['empty_docs']:,} empty ones skipped)")
    if val:
        print(f"  val tokens:  {val[0]['tokens']:,} in {val[0]['file']} (whole documents)")
    print(f"  last shard:  {shards[-1]['file']} with {shards[-1]['tokens']:,} tokens")
    if added is not None and seconds:
        print(f"  this run:    {added:,} tokens in {seconds:.1f} s, {added / seconds / 1e6:.2f}M tokens/s")
    if not train:
        print("warning: no train shard: all the input went to val; pass a smaller --val_tokens "
              "(with --overwrite)", file=sys.stderr)


def count(text):
    """A token count on the command line: 100000000, 100_000_000 or 1e8."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        value = -1
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number >= 0: {text}")
    return int(value)


def default_workers():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Tokenize FineWeb-Edu (or your own text) into uint16 GPT-2 shards.")
    a = p.add_argument
    a("--dataset", default="HuggingFaceFW/fineweb-edu",
      help="Hugging Face dataset (or a local folder laid out like one) to stream (default: %(default)s)")
    a("--name", default="sample-10BT", help="its config; '' for none (default: %(default)s)")
    a("--split", default="train", help="its split (default: %(default)s)")
    a("--input", action="append", default=[], metavar="PATH_OR_GLOB",
      help="local .txt/.jsonl/.json/.parquet files, globs or folders, instead of --dataset (repeatable)")
    a("--text_field", default="text", help="the JSON field / parquet or dataset column with the text (default: text)")
    a("--output_dir", default="edu_fineweb10B", help="where the shards go (default: %(default)s)")
    a("--prefix", default=None, help="shard file prefix (default: edufineweb for --dataset, data for --input)")
    a("--shard_size", type=count, default=10**8, help="tokens per train shard (default: 1e8)")
    a("--val_tokens", type=count, default=None, help="tokens in the val shard, whole documents so a little "
      "more (default: --shard_size; 0: no val shard)")
    a("--workers", type=int, default=default_workers(),
      help="tokenizer threads or processes (default: the %(default)s cores this process may use)")
    a("--pool", choices=("thread", "process"), default="thread", help="tokenize in threads or processes "
      "(default: %(default)s)")
    a("--batch_chars", type=count, default=1_000_000, help="characters of text per tokenizer task (default: 1e6)")
    a("--overwrite", action="store_true", help="delete this prefix's shards and manifest in --output_dir, start over")
    args = p.parse_args(argv)
    if args.prefix is None:
        args.prefix = "data" if args.input else "edufineweb"
    if args.val_tokens is None:
        args.val_tokens = args.shard_size
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]*", args.prefix) or re.search("train|val", args.prefix):
        # train_gpt2.py picks shards by "train"/"val" in the file name
        p.error(f"--prefix {args.prefix!r}: use letters, digits, '.', '-', and not the words train or val")
    if args.shard_size < 1 or args.workers < 1 or args.batch_chars < 1:
        p.error("--shard_size, --workers and --batch_chars must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not hasattr(get_encoding(), "encode_to_numpy"):
        raise SystemExit("error: fineweb.py needs tiktoken >= 0.9 (pip install -U tiktoken)")
    t0 = time.time()
    manifest = None
    try:
        # Everything cheap is checked before anything slow: input files, then the output folder.
        if args.input:
            files = expand_inputs(args.input)
            units = local_units(files, args.text_field)
            source = local_source(files)
        else:
            units = None    # opened below, only if there is work to do (it contacts the Hub)
            source = {"dataset": args.dataset, "name": args.name or None, "split": args.split}
        config = {"source": source, "text_field": args.text_field, "prefix": args.prefix,
                  "shard_size": args.shard_size, "val_tokens": args.val_tokens}
        manifest, manifest_path = open_output_dir(args.output_dir, args.prefix, config, args.overwrite)
        if manifest["complete"]:
            print(f"{args.output_dir} is already complete; nothing to do (pass --overwrite to redo it)")
            print_summary(manifest, args.output_dir)
            return manifest
        if units is None:
            units = hub_units(args.dataset, args.name or None, args.split, args.text_field)
        # places in the manifest index into this list of units: it must not have changed
        if manifest.setdefault("units", len(units)) != len(units):
            raise SystemExit(f"error: the input now has {len(units)} files, the interrupted run had "
                             f"{manifest['units']}; pass --overwrite to start over")
        if not manifest["shards"]:
            os.makedirs(args.output_dir, exist_ok=True)
            save_manifest(manifest_path, manifest)
        added = tokenize_all(units, manifest, manifest_path, args)
    except KeyboardInterrupt:
        done = len(manifest["shards"]) if manifest else 0
        print(f"\ninterrupted: {done} shards are complete in {args.output_dir}; "
              "run the same command again to continue", file=sys.stderr)
        raise SystemExit(130)
    print_summary(manifest, args.output_dir, added, time.time() - t0)
    return manifest


def build_demo_shards(out_dir, max_tokens=8_000_000):
    """train_gpt2.py's demo corpus: the Python standard library's own source, which every machine with
    Python has, tokenized into one val and one train shard (kept as a cache in out_dir)."""
    done = os.path.join(out_dir, "demo_train_000001.npy")
    if os.path.exists(done):
        return
    os.makedirs(out_dir, exist_ok=True)
    stdlib = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True))
    files = [f for f in files if "site-packages" not in f and "test" not in os.path.relpath(f, stdlib)]
    docs = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            docs.append(f.read())
    enc = get_encoding()
    tokens, n = [], 0
    for ids in enc.encode_ordinary_batch(docs, num_threads=os.cpu_count() or 1):
        tokens.append([EOT] + ids)  # every document starts with <|endoftext|>
        n += len(ids) + 1
        if n >= max_tokens:
            break
    # whole documents only: every 20th goes to val, so no document is split between the two
    val = np.concatenate([t for i, t in enumerate(tokens) if i % 20 == 0]).astype(np.uint16)
    train = np.concatenate([t for i, t in enumerate(tokens) if i % 20 != 0]).astype(np.uint16)
    for name, arr in (("demo_val_000000.npy", val), ("demo_train_000001.npy", train)):
        tmp = os.path.join(out_dir, f"{name}.{os.getpid()}.tmp.npy")  # ranks on one host may build at once
        np.save(tmp, arr)
        os.replace(tmp, os.path.join(out_dir, name))


if __name__ == "__main__":
    main()
