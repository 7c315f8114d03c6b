"""
bench/bench_fineweb.py: end-to-end tokens/s of fineweb.py against build-nanogpt's approach and against
tiktoken's own all-core ceiling, on the same ~50 MB of local text, measured side by side.

    python bench/bench_fineweb.py                # 5 interleaved rounds on a 50 MB corpus (from the repo root)
    python bench/bench_fineweb.py --rounds 3 --mb 20

The contenders, each timed from "go" to "shards on disk" (reading the input included):
  fineweb          fineweb.main() as `python fineweb.py --input corpus.parquet` runs it
  nanogpt          build-nanogpt's fineweb.py loop: encode_ordinary per document in
                   multiprocessing.Pool(cpu_count() // 2), imap chunksize 16, filling and np.save-ing shards
  ceiling          tiktoken's encode_ordinary_batch on all cores, texts already in memory, nothing
                   written: how fast tokenizing alone can go
The machine's speed may drift while this runs (other jobs, CPU boost), so every round runs all of
them, in a rotating order, and we report per-round ratios and their medians. On Linux we also
count the CPU time that other processes took during each run (from /proc/stat): a round in which
they took more than --quiet of the machine is marked busy, and medians are also given over the
quiet rounds only. (A busy machine favours the contender that uses fewer cores.)

The corpus is built, deterministically, from this Python's standard library sources (sorted .py
files, cut at blank lines into ~4 KB documents, repeated until the size is reached) and stored
as a FineWeb-style parquet file with a `text` column. Python code has more tokens per byte than
web prose, so absolute tokens/s differ from FineWeb's; the ratios are what to compare.
"""
import argparse
import glob
import hashlib
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time

import numpy as np

# this script lives in bench/: import fineweb.py and tokenizer.py from the repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fineweb  # noqa: E402
from tokenizer import EOT, get_encoding  # noqa: E402


def build_corpus(path, target_chars):
    """Standard-library source, cut into ~4 KB documents at blank lines, up to target_chars."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)
                   if "site-packages" not in f)
    pieces = []
    for f in files:
        with open(f, "rb") as fh:
            text = fh.read().decode("utf-8", "replace")
        doc = []
        for para in text.split("\n\n"):
            doc.append(para)
            if sum(map(len, doc)) >= 4000:
                pieces.append("\n\n".join(doc))
                doc = []
        if doc:
            pieces.append("\n\n".join(doc))
    pieces = [d for d in pieces if d]    # (an empty file would be an empty document: skipped by fineweb.py)
    docs, total = [], 0
    while total < target_chars:
        for d in pieces:
            docs.append(d)
            total += len(d)
            if total >= target_chars:
                break
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": docs}), path, row_group_size=4096)
    return len(docs), total


def read_texts(path):
    import pyarrow.parquet as pq
    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


# --- build-nanogpt's approach, re-done here on local input ------------------------------------

def nanogpt_tokenize(doc):
    # as build-nanogpt does it: one document per call, a Python list, then numpy with a range check
    tokens = [EOT]
    tokens.extend(get_encoding().encode_ordinary(doc["text"]))
    tokens_np = np.array(tokens)
    assert (0 <= tokens_np).all() and (tokens_np < 2**16).all()
    return tokens_np.astype(np.uint16)


def nanogpt_prepare(corpus, out_dir, shard_size):
    """build-nanogpt's loop: a pool of half the cores, imap(chunksize=16), shards of exactly
    shard_size tokens (the first one called val), np.save."""
    import pyarrow.parquet as pq
    get_encoding()    # build-nanogpt makes its encoder at import, before the pool forks
    docs = pq.read_table(corpus, columns=["text"]).to_pylist()      # rows as {"text": ...} dicts
    nprocs = max(1, os.cpu_count() // 2)
    n_total = 0
    # This pool needs no common.die_with_parent: should this script die, each worker finds its pipes broken
    # at its next result or task, a chunk of 16 documents later at most, and exits (checked with kill -9).
    with mp.Pool(nprocs) as pool:
        shard_index, token_count = 0, 0
        buf = np.empty((shard_size,), dtype=np.uint16)
        for tokens in pool.imap(nanogpt_tokenize, docs, chunksize=16):
            n_total += len(tokens)
            if token_count + len(tokens) < shard_size:
                buf[token_count:token_count + len(tokens)] = tokens
                token_count += len(tokens)
            else:
                split = "val" if shard_index == 0 else "train"
                remainder = shard_size - token_count
                buf[token_count:token_count + remainder] = tokens[:remainder]
                np.save(os.path.join(out_dir, f"edufineweb_{split}_{shard_index:06d}"), buf)
                shard_index += 1
                buf[0:len(tokens) - remainder] = tokens[remainder:]
                token_count = len(tokens) - remainder
        if token_count:
            split = "val" if shard_index == 0 else "train"
            np.save(os.path.join(out_dir, f"edufineweb_{split}_{shard_index:06d}"), buf[:token_count])
    return n_total


# --- the runs ----------------------------------------------------------------------------------

def run_fineweb(corpus, out_dir, shard_size):
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        manifest = fineweb.main(["--input", corpus, "--output_dir", out_dir, "--overwrite",
                                 "--shard_size", str(shard_size), "--val_tokens", str(shard_size)])
    return manifest["totals"]["tokens"]


def run_ceiling(texts):
    ids = get_encoding().encode_ordinary_batch(texts, num_threads=os.cpu_count())
    return sum(map(len, ids)) + len(ids)     # + one EOT per document, as the others count them


def cpu_clock():
    """(CPU seconds used by the whole machine, by this process and its finished children), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    busy = sum(fields) - fields[3] - fields[4]          # all but idle and iowait
    t = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system + t.children_user + t.children_system


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=50, help="corpus size in MB of text")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shard_size", type=int, default=10_000_000, help="tokens per shard, for both writers")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "bench_fineweb"))
    p.add_argument("--quiet", type=float, default=0.10, help="a round is busy if other processes took more "
                   "than this fraction of all cores during any of its runs")
    return p.parse_args()


def run_rounds(args, contenders):
    """Every contender once a round, in a rotating order. Returns (M tokens/s of each, per round; the tokens each
    counted; the rounds in which other processes stayed under --quiet)."""
    names = list(contenders)
    rates = {k: [] for k in names}
    tokens, quiet_rounds = {}, []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]   # rotate, so no one always goes first
        others = []
        for name in order:
            out_dir = os.path.join(args.workdir, "out_" + name)
            shutil.rmtree(out_dir, ignore_errors=True)
            os.makedirs(out_dir)
            c0, t0 = cpu_clock(), time.perf_counter()
            n = contenders[name](out_dir)
            dt, c1 = time.perf_counter() - t0, cpu_clock()
            if c0 and c1:   # CPU time of other processes, as a fraction of all cores over this run
                others.append(((c1[0] - c0[0]) - (c1[1] - c0[1])) / (dt * os.cpu_count()))
            tokens.setdefault(name, n)
            assert n == tokens[name], f"{name}: token count changed between rounds"
            rates[name].append(n / dt / 1e6)
        busy = max(others, default=0)
        if busy <= args.quiet:
            quiet_rounds.append(r)
        print(f"round {r + 1}: " + "  ".join(f"{k} {rates[k][-1]:.2f}" for k in names) + " M tokens/s  | "
              f"fineweb/nanogpt {rates['fineweb'][-1] / rates['nanogpt'][-1]:.2f}x  "
              f"fineweb/ceiling {rates['fineweb'][-1] / rates['ceiling'][-1]:.2f}  | "
              f"others used up to {busy:.0%} of the CPUs{'' if busy <= args.quiet else ' (busy)'}", flush=True)
    assert len(set(tokens.values())) == 1, f"the contenders disagree on the token count: {tokens}"
    return rates, tokens, quiet_rounds


def shards_tokens(out_dir):
    """Every token a writer wrote, its shards in order (by index, the last 10 characters of a name)."""
    shards = sorted(glob.glob(os.path.join(out_dir, "*.npy")), key=lambda f: f[-10:])
    return np.concatenate([np.load(f) for f in shards])


def main():
    args = parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    corpus = os.path.join(args.workdir, f"stdlib_{args.mb:g}MB_py{sys.version_info[0]}{sys.version_info[1]}.parquet")
    if not os.path.exists(corpus):
        n, chars = build_corpus(corpus + ".tmp", int(args.mb * 1e6))
        os.replace(corpus + ".tmp", corpus)
    texts = read_texts(corpus)
    digest = hashlib.sha256("\x00".join(texts).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    print(f"corpus: {corpus}: {len(texts):,} documents, {sum(map(len, texts)) / 1e6:.1f} M characters, "
          f"sha256 {digest}; {os.cpu_count()} CPUs; python {sys.version.split()[0]}")

    contenders = {
        "fineweb": lambda d: run_fineweb(corpus, d, args.shard_size),
        "nanogpt": lambda d: nanogpt_prepare(corpus, d, args.shard_size),
        "ceiling": lambda d: run_ceiling(texts),
    }
    rates, tokens, quiet_rounds = run_rounds(args, contenders)
    # the two writers must have produced the same token stream
    assert np.array_equal(shards_tokens(os.path.join(args.workdir, "out_fineweb")),
                          shards_tokens(os.path.join(args.workdir, "out_nanogpt"))), \
        "fineweb.py and the build-nanogpt loop wrote different tokens"

    for title, rounds in ((f"all {args.rounds} rounds", range(args.rounds)),
                          (f"the {len(quiet_rounds)} quiet rounds", quiet_rounds)):
        if not rounds:
            continue
        print(f"\n{tokens['ceiling']:,} tokens; medians over {title} (M tokens/s):")
        for k in contenders:
            print(f"  {k:16s} {statistics.median(rates[k][r] for r in rounds):6.2f}")
        for a, b in (("fineweb", "nanogpt"), ("fineweb", "ceiling")):
            ratios = [rates[a][r] / rates[b][r] for r in rounds]
            print(f"  {a} / {b}: median {statistics.median(ratios):.2f}  (per round: "
                  + ", ".join(f"{x:.2f}" for x in ratios) + ")")


if __name__ == "__main__":
    main()
