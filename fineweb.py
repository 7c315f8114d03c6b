"""
fineweb.py: text -> the uint16 token shards that train_gpt2.py reads (through dataloader.py).

    python fineweb.py                                   # FineWeb-Edu sample-10BT -> edu_fineweb10B/
    python fineweb.py --input 'my_notes/*.txt' --output_dir my_shards --shard_size 1e6 --val_tokens 1e5

build-nanogpt's shards ({prefix}_val_000000.npy, {prefix}_train_000001.npy, ...: np.save'd uint16 arrays)
of [EOT] + tokens per document, in input order; val holds whole documents only. Each shard is written
atomically and a manifest lets a killed run carry on, byte-identical. Why and how: docs/data.md.
"""
import argparse
import collections
import gc
import glob
import hashlib
import itertools
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow.parquet as pq

from plumbing.common import ShowDefaults, atomic_write
from plumbing.progress import Bar
from tokenizer import EOT, get_encoding

EOT_TEXT = "<|endoftext|>"        # the text that tiktoken turns into the EOT id when allowed
MANIFEST_VERSION = 2
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")

# -----------------------------------------------------------------------------
# 1. Where documents come from
#
# The input is a list of "units": one per local file, or per data file of the Hugging Face dataset. A unit
# yields (row, text): row is the document's index in its unit. A place in the input is (unit, row, token),
# token an offset into a document that a train shard ends inside. That is all resuming needs.

Unit = collections.namedtuple("Unit", "name read")   # read(start_row) -> iterator of (row, text), rows >= start_row

def expand_inputs(patterns):
    """--input values -> the list of files, in a fixed order (sorted within each pattern)."""
    files = []
    for pattern in patterns:
        if os.path.isdir(pattern):     # a folder: the supported files in it
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(pattern) for f in fs
                           if f.lower().endswith(LOCAL_SUFFIXES))
        else:                          # a file, or a glob pattern
            found = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
        if not found:
            raise SystemExit(f"error: --input {pattern}: no such file, or no {'/'.join(LOCAL_SUFFIXES)} files")
        unsupported = [f for f in found if not f.lower().endswith(LOCAL_SUFFIXES)]
        if unsupported:
            raise SystemExit(f"error: {unsupported[0]}: unsupported file type (use {', '.join(LOCAL_SUFFIXES)})")
        files += [f for f in found if f not in files]
    return files

def read_file(path, field, start_row):
    """The documents of a local file, from start_row on, as (row, text):
    .txt      the whole file is one document, decoded as UTF-8, byte for byte
    .jsonl    one JSON object per line; the row is the line number (blank lines are skipped)
    .parquet  the field's column, a record batch at a time; the row is the row"""
    if path.lower().endswith(".parquet"):
        yield from arrow_rows(pq.ParquetFile(path).iter_batches(batch_size=1024, columns=[field]), 0, start_row)
        return
    with open(path, "rb") as f:
        if path.lower().endswith(".txt"):
            try:
                yield from [(0, f.read().decode("utf-8"))][start_row:]
            except UnicodeDecodeError as e:
                raise SystemExit(f"error: {path}: not UTF-8 text (bad byte at offset {e.start})")
            return
        for row, line in enumerate(f):
            if row < start_row or not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise SystemExit(f"error: {path} line {row + 1}: not valid JSON ({e})")
            if not isinstance(obj, dict) or field not in obj:
                found = sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
                raise SystemExit(f"error: {path} line {row + 1}: no '{field}' field (found {found}); see --text_field")
            yield row, obj[field]

def arrow_rows(batches, row, start_row):
    """(row, text) from start_row on, out of Arrow batches of one text column whose first row is `row`.
    Batches wholly before start_row are skipped without turning their text into Python strings."""
    try:
        for batch in batches:
            if row + len(batch) > start_row:
                skip = max(0, start_row - row)
                yield from enumerate(batch.column(0).slice(skip).to_pylist(), row + skip)
            row += len(batch)
    except BaseException:    # closed early (Ctrl-C) or an error: an Arrow reader left half-read can abort the
        # interpreter at exit ("terminate called without an active exception"); free it while Python is alive
        if hasattr(batches, "close"):
            batches.close()
        gc.collect()
        raise

def local_units(files, field):
    """Check every file cheaply before any work (readable, has the text field), then wrap each."""
    for path in files:
        try:
            if path.lower().endswith(".parquet"):    # the column, from the file's footer
                columns = pq.ParquetFile(path).schema_arrow.names
                if field not in columns:
                    raise SystemExit(f"error: {path}: no '{field}' column (columns: {', '.join(columns)}); "
                                     "see --text_field")
            elif path.lower().endswith(".jsonl"):    # the first document (a missing field fails here)
                next(read_file(path, field, 0), None)
            else:                                    # .txt: read once, later; here only opened
                open(path, "rb").close()
        except Exception as e:                       # no permission, a broken parquet file, ...
            raise SystemExit(f"error: {path}: cannot read it ({type(e).__name__}: {e})")
    return [Unit(path, lambda start, p=path: read_file(p, field, start)) for path in files]

def count_rows(path, opener=open):
    """A file's rows (read_file's), for the progress bar's total and its ETA: a .txt is one, a .parquet's rows are
    in its footer (a small read; on the Hub, opener=xopen: a range request), a .jsonl's lines are counted."""
    if not path.lower().endswith((".parquet", ".jsonl")):
        return 1
    with opener(path, "rb") as f:
        return pq.ParquetFile(f).metadata.num_rows if path.lower().endswith(".parquet") else sum(1 for _ in f)

def hub_units(dataset, name, split, field):
    """A Hugging Face dataset, streamed: rows are downloaded as they are read. One unit per data file, so
    that a resume jumps straight to the file it stopped in instead of re-downloading everything before."""
    import datasets    # here, so that --input works without it
    try:
        ds = datasets.load_dataset(dataset, name=name, split=split, streaming=True)
    except Exception as e:
        raise SystemExit(f"error: cannot open dataset {dataset} (name={name}, split={split}): {type(e).__name__}: {e}")
    if ds.column_names is not None and field not in ds.column_names:
        raise SystemExit(f"error: dataset {dataset}: no '{field}' column (columns: {', '.join(ds.column_names)}); "
                         "see --text_field")
    ds = ds.select_columns([field]).with_format("arrow")    # batches come as Arrow tables
    n = ds.num_shards
    def read(i, start_row):
        part = ds.shard(num_shards=n, index=i, contiguous=True)   # exactly data file i, in order
        return arrow_rows(part.skip(start_row).iter(batch_size=1024), start_row, start_row)
    units = [Unit(f"dataset {dataset} file {i + 1}/{n}", lambda start, i=i: read(i, start)) for i in range(n)]
    # the progress bar's total (a stream does not know its length): each data file's rows, or the card's count
    split_info = (ds.info.splits or {}).get(split)
    return units, parquet_rows(dataset, name, split, n) or getattr(split_info, "num_examples", None) or None

def parquet_rows(dataset, name, split, n):
    """Each of a dataset's n data files' rows, when they are parquet files (FineWeb-Edu's are), from their footers.
    None otherwise, or if anything fails: a total helps, no more."""
    import datasets
    from datasets.utils.file_utils import xopen    # (opens hf:// paths too)
    try:
        files = [str(f) for f in datasets.load_dataset_builder(dataset, name=name).config.data_files[split]]
        parquet = len(files) == n and all(f.endswith(".parquet") for f in files)
        return [count_rows(f, xopen) for f in files] if parquet else None
    except Exception:
        return None

# -----------------------------------------------------------------------------
# 2. Tokenizing
#
# tiktoken's encoder is Rust and releases the GIL, but a call per document costs a Python round trip
# each (ids -> list -> numpy, the GIL back). So a whole batch is ONE call:
#     encode("<|endoftext|>" + doc1 + "<|endoftext|>" + doc2 ..., allowed_special={"<|endoftext|>"})
# tiktoken BPE-encodes the pieces between allowed special tokens separately and puts EOT for each:
# exactly [EOT] + encode(doc1) + [EOT] + ..., our shard format, as one numpy array. A (rare) document
# that itself contains the text "<|endoftext|>" must not get a real EOT, so it is encoded on its own.

def encode(enc, text, allowed_special=frozenset()):
    """tiktoken's encode_to_numpy (uint32 ids, no Python list in between), no special-token checks."""
    try:
        return enc.encode_to_numpy(text, allowed_special=allowed_special, disallowed_special=())
    except UnicodeEncodeError:
        # Lone surrogates (e.g. from a "\ud800" escape in JSON) are not valid UTF-8; fix them the way
        # tiktoken's encode_ordinary does, so the ids match tokenizer.encode() exactly.
        return encode(enc, text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"), allowed_special)

def tokenize_batch(texts):
    """A batch of documents -> (tokens, ends): tokens is uint16, [EOT] + encode(doc) for every
    non-empty doc in order; ends[i] is where row i's tokens end (an empty row adds nothing)."""
    enc, pieces = get_encoding(), []
    # runs of non-empty documents, each either free of EOT_TEXT (one call for the run) or not (one call each)
    for has_eot_text, run in itertools.groupby(filter(None, texts), key=lambda t: EOT_TEXT in t):
        if has_eot_text:
            for text in run:
                pieces += [np.array([EOT], np.uint32), encode(enc, text)]    # all of it as ordinary text
        else:
            pieces.append(encode(enc, EOT_TEXT + EOT_TEXT.join(run), allowed_special={EOT_TEXT}))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.uint32)
    # Each non-empty document starts with the only EOT in it: ordinary text never encodes to 50256.
    starts, nonempty = np.flatnonzero(tokens == EOT), [bool(t) for t in texts]
    assert len(starts) == sum(nonempty)
    lengths = np.zeros(len(texts), np.int64)
    lengths[nonempty] = np.diff(starts, append=len(tokens))
    # uint16 holds every id: tokenizer.py builds the encoding with explicit_n_vocab=50257, checked by tiktoken
    return tokens.astype(np.uint16), np.cumsum(lengths)

# -----------------------------------------------------------------------------
# 3. Shards and the manifest on disk

def save_manifest(path, manifest):
    atomic_write(path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))

def open_output_dir(out_dir, prefix, config, overwrite):
    """Start, resume or refuse: the manifest, its "shards" verified on disk (none: a fresh start)."""
    manifest_path = os.path.join(out_dir, f"{prefix}_manifest.json")
    fresh = {"version": MANIFEST_VERSION, "config": config, "complete": False, "shards": []}
    ours = re.compile(rf"{re.escape(prefix)}_((train|val)_\d{{6}}\.npy|manifest\.json)(\.tmp)?$")
    for f in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if ours.match(f) and (overwrite or f.endswith(".tmp")):   # .tmp: left by a killed write, never whole
            os.remove(os.path.join(out_dir, f))
    if not os.path.exists(manifest_path):
        if os.path.isdir(out_dir) and any(ours.match(f) for f in os.listdir(out_dir)):
            raise SystemExit(f"error: {out_dir} already holds {prefix}_*.npy shards this script did not make (no "
                             f"{os.path.basename(manifest_path)}); pass --overwrite, or choose another --output_dir")
        return fresh, manifest_path
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        old, shards = manifest["config"], manifest["shards"]
        assert manifest["version"] == MANIFEST_VERSION and isinstance(old, dict)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise SystemExit(f"error: {manifest_path} is not a manifest this script can read; "
                         "pass --overwrite to start over")
    if not shards:                    # a run that stopped before its first shard: nothing to keep
        return fresh, manifest_path
    if old != config:
        changed = ", ".join(k for k in sorted(set(old) | set(config)) if old.get(k) != config.get(k))
        raise SystemExit(f"error: {out_dir} holds shards made with other settings (differs in: {changed}); "
                         "run the original command to finish them, or pass --overwrite to start over")
    # Trust a shard only if its file is there with the size it was written with; redo from the first
    # one that is not (its place in the input is in the manifest entry before it).
    for i, s in enumerate(shards):
        path = os.path.join(out_dir, s["file"])
        if not (os.path.isfile(path) and os.path.getsize(path) == s["bytes"]):
            manifest["shards"], manifest["complete"] = shards[:i], False
            manifest.pop("totals", None)
            break
    return manifest, manifest_path

# -----------------------------------------------------------------------------
# 4. The pipeline: reading (main thread) -> tokenizer threads -> cutting and writing shards (main thread)

Batch = collections.namedtuple("Batch", "texts places")   # one place (unit, row) per text

def read_batches(units, start, batch_chars):
    """Documents from `start` = (unit, row) on, in batches of about batch_chars characters (big enough
    that the per-batch overhead vanishes, small enough to keep every worker busy)."""
    texts, places, chars = [], [], 0
    for u in range(start[0], len(units)):
        for row, text in units[u].read(start[1] if u == start[0] else 0):
            if text is not None and not isinstance(text, str):
                raise SystemExit(f"error: {units[u].name} row {row}: the text is a {type(text).__name__}, not a string")
            texts.append(text)
            places.append((u, row))
            chars += len(text) if text else 0
            if chars >= batch_chars:
                yield Batch(texts, places)
                texts, places, chars = [], [], 0
    if texts:
        yield Batch(texts, places)

class Sharder:
    """Takes tokenized batches in input order, cuts them into shards, saves each and records it in the
    manifest with its end: the place (unit, row, token) of the next token to write (EOT is token 0)."""

    def __init__(self, args, manifest, manifest_path):
        self.args, self.manifest, self.manifest_path = args, manifest, manifest_path
        done = manifest["shards"]
        self.end = tuple(done[-1]["end"]) if done else (0, 0, 0)   # the place after the last batch
        self.skip = self.end[2]               # resuming inside a document: its first tokens are written
        self.tokens = sum(s["tokens"] for s in done)   # all tokens taken in so far, this run and before
        self.docs = sum(s["docs"] for s in done)       # and documents begun (each begins with its EOT)
        self.index = len(done) + (args.val_tokens == 0)   # val is shard 0; with --val_tokens 0 train starts at 1
        self.parts, self.fill = [], 0         # the shard being filled: token arrays, and their total length

    def add(self, batch, tokens, ends):
        """Append one tokenized batch."""
        def place(r, token=0):   # the place at token `token` of the batch's row r (r == len(ends): after the batch)
            return (*batch.places[r], token) if r < len(ends) else (batch.places[-1][0], batch.places[-1][1] + 1, 0)
        p, n, self.skip = self.skip, len(tokens), 0
        self.tokens += n - p
        self.docs += int(np.count_nonzero(tokens[p:] == EOT))
        while p < n:
            if self.index == 0:   # val: whole documents, up to and including the first that reaches val_tokens
                r = int(np.searchsorted(ends, self.args.val_tokens - self.fill, side="left"))
                cut, full, end = (int(ends[r]), True, place(r + 1)) if r < len(ends) else (n, False, None)
            else:                 # train: exactly shard_size tokens; a document may run on into the next
                cut = min(n, p + self.args.shard_size - self.fill)
                full = self.fill + cut - p == self.args.shard_size
                r = int(np.searchsorted(ends, cut, side="right"))   # the row that goes on after the cut
                end = place(r, cut - (int(ends[r - 1]) if r > 0 else 0))
            self.parts.append(tokens[p:cut])
            self.fill += cut - p
            p = cut
            if full:
                self._write(end)
        self.end = place(len(ends))

    def _write(self, end):
        split = "val" if self.index == 0 else "train"
        entry = {"file": f"{self.args.prefix}_{split}_{self.index:06d}.npy", "split": split, "end": list(end)}
        path = os.path.join(self.args.output_dir, entry["file"])
        tokens = np.concatenate(self.parts)
        self.parts, self.fill, self.index = [], 0, self.index + 1
        try:
            atomic_write(path, lambda f: np.save(f, tokens, allow_pickle=False))
            entry.update(tokens=len(tokens), docs=int(np.count_nonzero(tokens == EOT)), bytes=os.path.getsize(path))
            self.manifest["shards"].append(entry)
            save_manifest(self.manifest_path, self.manifest)
        except OSError as e:     # disk full, folder removed, ...: one line, and the run can be resumed
            raise SystemExit(f"error: cannot write {path}: {e}")

    def finish(self):
        """End of input: write what is left (the val shard, if it never filled up, or the last train shard)."""
        if self.fill > 0:
            self._write(self.end)
        self.manifest["complete"] = True
        # (a document that runs on into the next shard is counted once: its EOT is in one shard)
        self.manifest["totals"] = {"tokens": self.tokens, "docs": sum(s["docs"] for s in self.manifest["shards"])}
        save_manifest(self.manifest_path, self.manifest)

def tokenize_all(units, manifest, manifest_path, args, rows=None):
    """The main loop: read, tokenize, cut and write until the input ends. rows, the progress bar's total: each
    unit's (a place's row counts exactly), the input's in all (a card's: documents counted as they come), or None."""
    sharder = Sharder(args, manifest, manifest_path)
    if manifest["shards"]:
        print(f"resuming after {manifest['shards'][-1]['file']} ({len(manifest['shards'])} shards done, "
              f"{sharder.tokens:,} tokens)")
    pool = ThreadPoolExecutor(args.workers)
    batches = read_batches(units, sharder.end[:2], args.batch_chars)
    if isinstance(rows, list):  # the documents before a place (unit, row): the rows of the units before it, and row
        before = np.cumsum([0] + rows).tolist()
        total = before[-1]
        def done():
            return before[sharder.end[0]] + sharder.end[1]
    else:  # a stream's total, or none: documents as they are read (those a resumed run wrote: their EOTs)
        total = rows
        def done():
            return sharder.docs
    bar = Bar(total, "tokenizing", "documents", initial=done())
    def consume(batch, future):
        sharder.add(batch, *future.result())
        bar.note = f"{sharder.tokens:,} tokens, {len(manifest['shards'])} shards"
        bar.update(done() - bar.n)
    # Batches being tokenized, oldest first: results are used in input order. Enough of them are
    # queued that the workers stay busy while this thread reads the next batch or writes a shard
    # (so a writer thread of its own measured no faster).
    pending = collections.deque()
    try:
        for batch in batches:
            pending.append((batch, pool.submit(tokenize_batch, batch.texts)))
            if len(pending) >= 2 * args.workers + 2:
                consume(*pending.popleft())
        while pending:
            consume(*pending.popleft())
        if sharder.tokens == 0:
            raise SystemExit("error: the input holds no text (only empty documents)")
        sharder.finish()
        bar.update((total or bar.n) - bar.n)  # the input's end (after blank lines, empty rows): all of it
    finally:
        # normal end, an error or Ctrl-C: stop reading and drop the queued batches
        bar.close()
        batches.close()
        pool.shutdown(wait=True, cancel_futures=True)

# -----------------------------------------------------------------------------
# 5. The command line

def count(text):
    """A token count on the command line: 100000000, 100_000_000 or 1e8 (argparse reports a ValueError)."""
    value = float(text.replace("_", ""))
    if value < 0 or not value.is_integer():
        raise ValueError(text)
    return int(value)

def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=ShowDefaults,  # --help shows every default
                                description="Tokenize FineWeb-Edu (or your own text) into uint16 GPT-2 shards.")
    a = p.add_argument
    a("--dataset", default="HuggingFaceFW/fineweb-edu",
      help="Hugging Face dataset (or a local folder laid out like one) to stream (default: %(default)s)")
    a("--name", default="sample-10BT", help="its config; '' for none (default: %(default)s)")
    a("--split", default="train", help="its split (default: %(default)s)")
    a("--input", action="append", default=[], metavar="PATH_OR_GLOB",
      help="local .txt/.jsonl/.parquet files, globs or folders, instead of --dataset (repeatable)")
    a("--text_field", default="text", help="the JSON field / parquet or dataset column with the text (default: text)")
    a("--output_dir", default="edu_fineweb10B", help="where the shards go (default: %(default)s)")
    a("--prefix", default=None, help="shard file prefix (default: edufineweb for --dataset, data for --input)")
    a("--shard_size", type=count, default=10**8, help="tokens per train shard (default: 1e8)")
    a("--val_tokens", type=count, help="tokens in the val shard, whole documents (default: --shard_size; 0: none)")
    a("--workers", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
      else os.cpu_count() or 1, help="tokenizer threads (default: the %(default)s cores this process may use)")
    a("--batch_chars", type=count, default=1_000_000, help="characters of text per tokenizer task (default: 1e6)")
    a("--overwrite", action="store_true", help="delete this prefix's shards and manifest in --output_dir, start over")
    args = p.parse_args(argv)
    args.prefix = ("data" if args.input else "edufineweb") if args.prefix is None else args.prefix
    args.val_tokens = args.shard_size if args.val_tokens is None else args.val_tokens
    # train_gpt2.py picks shards by "train"/"val" in the file name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]*", args.prefix) or re.search("train|val", args.prefix):
        p.error(f"--prefix {args.prefix!r}: use letters, digits, '.', '-', and not the words train or val")
    if args.shard_size < 1 or args.workers < 1 or args.batch_chars < 1:
        p.error("--shard_size, --workers and --batch_chars must be at least 1")
    return args

def main(argv=None):
    args = parse_args(argv)
    manifest = None
    try:
        # Everything cheap is checked before anything slow: input files, then the output folder.
        if args.input:
            files = expand_inputs(args.input)
            units = local_units(files, args.text_field)
            # the files and their sizes identify local input (so that a changed input is noticed)
            h = hashlib.sha256("".join(f"{os.path.abspath(f)}\t{os.path.getsize(f)}\n" for f in files).encode())
            source = {"files": len(files), "first": os.path.abspath(files[0]), "sha256": h.hexdigest()}
        else:
            units = None    # opened below, only if there is work to do (it contacts the Hub)
            source = {"dataset": args.dataset, "name": args.name or None, "split": args.split}
        config = {"source": source, "text_field": args.text_field, "prefix": args.prefix,
                  "shard_size": args.shard_size, "val_tokens": args.val_tokens}
        manifest, manifest_path = open_output_dir(args.output_dir, args.prefix, config, args.overwrite)
        if manifest["complete"]:
            print(f"{args.output_dir} is already complete; nothing to do (pass --overwrite to redo it)")
        else:
            if units:  # (counted only now that there is work to do)
                rows = [count_rows(f) for f in files]
            else:
                units, rows = hub_units(args.dataset, args.name or None, args.split, args.text_field)
            # places in the manifest index into this list of units: it must not have changed
            if manifest.setdefault("units", len(units)) != len(units):
                raise SystemExit(f"error: the input now has {len(units)} files, the interrupted run had "
                                 f"{manifest['units']}; pass --overwrite to start over")
            if not manifest["shards"]:
                os.makedirs(args.output_dir, exist_ok=True)
                save_manifest(manifest_path, manifest)
            tokenize_all(units, manifest, manifest_path, args, rows)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {len(manifest['shards']) if manifest else 0} shards are complete in "
              f"{args.output_dir}; run the same command again to continue", file=sys.stderr)
        raise SystemExit(130)
    shards, totals = manifest["shards"], manifest["totals"]
    n_val = sum(s["split"] == "val" for s in shards)
    print(f"{args.output_dir}: {len(shards)} shards ({n_val} val + {len(shards) - n_val} train), "
          f"{totals['tokens']:,} tokens from {totals['docs']:,} documents")
    if n_val == len(shards):
        print("warning: no train shard: all the input went to val; pass a smaller --val_tokens", file=sys.stderr)
    return manifest

if __name__ == "__main__":
    main()
