"""
HellaSwag: can the model tell which of four endings finishes a sentence?

    python hellaswag.py -m gpt2                       # OpenAI's GPT-2 (124M) through GPT.from_pretrained
    python hellaswag.py -m gpt2-xl --dtype bf16       # also gpt2-medium, gpt2-large
    python hellaswag.py -m log/model_01000.pt         # one of our checkpoints
    python hellaswag.py -m gpt2 --limit 500           # the first 500 examples only: a quick look

Each example is a context and four endings, one of them right: after "A woman fills a kettle with
water. she", is it "turns it on." or "paints the kettle blue."? A language model answers with the
ending it finds most likely after the context. This is build-nanogpt's "completion style": the context and " " + ending
are tokenized separately and concatenated, and each ending is scored by the model's loss on the
ending's tokens only:
    acc       the ending with the lowest total loss   (favours short endings)
    acc_norm  the ending with the lowest mean loss per token  (what train_gpt2.py logs)
On the 10,042 val examples build-nanogpt reports "10042 acc: 0.2859 acc_norm: 0.2955" for gpt2 and
"acc: 0.3842 acc_norm: 0.4893" for gpt2-xl. Random guessing is 0.25.

The same evaluate() runs inside train_gpt2.py every --hellaswag_interval steps, each rank scoring
every world_size-th example and the counts summed over ranks.

It is several times faster than scoring one example per forward pass the plain way, with the
same scores: see "Scoring" below for how, and bench/bench_hellaswag.py for how much.
"""
import argparse
import json
import os
import sys
import time

import torch
from torch.nn import functional as F

import tokenizer
from compute import cpu, speedups
from model import PRETRAINED_NAMES, load_model
from parallel import world
from plumbing.common import ShowDefaults, atomic_write
from plumbing.progress import Bar

DEFAULT_DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hellaswag")
# the dataset's home; set HELLASWAG_URL to fetch the same files from a mirror
BASE_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/"
SPLITS = ("train", "val", "test")  # test has no labels: its answers are kept secret by the authors


class HellaSwagError(Exception):
    """The data could not be had or is not HellaSwag; the message says what to do."""


# -----------------------------------------------------------------------------
# Data: one JSON object per line, downloaded once into a cache folder


def data_path(split, data_dir=None):
    return os.path.join(data_dir or DEFAULT_DATA_DIR, f"hellaswag_{split}.jsonl")


def parse_examples(lines, source):
    """Parse and check jsonl lines; returns the examples, or raises HellaSwagError naming the bad line."""
    examples = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            ex = json.loads(line)
        except ValueError as e:
            raise HellaSwagError(f"{source} line {n} is not JSON ({e})")
        problem = None
        if not isinstance(ex, dict):
            problem = "is not a JSON object"
        elif not isinstance(ex.get("ctx"), str):
            problem = "has no string 'ctx'"
        elif (not isinstance(ex.get("endings"), list) or len(ex["endings"]) != 4
              or not all(isinstance(e, str) for e in ex["endings"])):
            problem = "has no 'endings' list of 4 strings"
        elif "label" not in ex:
            problem = "has no 'label'" + (" (the test split is unlabeled: evaluate on val)" if "test" in source else "")
        elif type(ex["label"]) is not int or not 0 <= ex["label"] <= 3:
            problem = f"has 'label' {ex['label']!r}, not 0, 1, 2 or 3"
        if problem:
            raise HellaSwagError(f"{source} line {n} {problem}; each line must be a JSON object with "
                                 "'ctx' (string), 'endings' (4 strings) and 'label' (0-3)")
        examples.append(ex)
    if not examples:
        raise HellaSwagError(f"{source} holds no examples")
    return examples


def download(split, data_dir=None, base_url=None):
    """Fetch hellaswag_{split}.jsonl into data_dir, atomically: the file appears whole and checked, or not at all."""
    base_url = base_url or os.environ.get("HELLASWAG_URL") or BASE_URL
    url = base_url.rstrip("/") + f"/hellaswag_{split}.jsonl"
    path = data_path(split, data_dir)
    by_hand = f"download {url} by hand (from any machine) and save it as {path}"
    import requests

    def fetch_and_check(f):  # into the temporary file; a cut connection or a bad line leaves no file behind
        try:
            with requests.get(url, stream=True, timeout=(10, 60)) as resp:
                resp.raise_for_status()
                total = int(resp.headers.get("content-length", 0)) or None
                print(f"downloading {url} ({f'{total / 1e6:.1f} MB' if total else 'size not given'}), once, into "
                      f"{path}", flush=True)  # (a bar on a terminal, a line every tenth in a log)
                with Bar(total or 0, f"hellaswag_{split}.jsonl", "bytes") as bar:
                    for chunk in resp.iter_content(chunk_size=1 << 16):
                        f.write(chunk)
                        bar.update(len(chunk))
                if total is not None and bar.n != total:
                    raise OSError(f"got {bar.n} of {total} bytes")
        except (requests.RequestException, OSError) as e:
            raise HellaSwagError(f"could not download {url} ({type(e).__name__}: {e}); {by_hand}") from None
        f.flush()
        with open(f.name, encoding="utf-8") as written:
            try:
                parse_examples(written, url)
            except (HellaSwagError, UnicodeDecodeError) as e:
                raise HellaSwagError(f"{url} is not HellaSwag data: {e}; {by_hand}") from None

    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, fetch_and_check)
    return path


def load_examples(split="val", data_dir=None, base_url=None):
    """The checked examples of one split (list of dicts), downloading the file on first use."""
    if split not in SPLITS:
        raise HellaSwagError(f"unknown HellaSwag split {split!r}: choose one of {', '.join(SPLITS)}")
    path = data_path(split, data_dir)
    if not os.path.exists(path):
        print(f"HellaSwag {split} not in {os.path.dirname(path)}: downloading it", file=sys.stderr)
        download(split, data_dir, base_url)
    try:
        with open(path, encoding="utf-8") as f:
            return parse_examples(f, path)
    except (OSError, UnicodeDecodeError) as e:
        raise HellaSwagError(f"cannot read {path} ({e}); delete it to download it again")
    except HellaSwagError as e:
        raise HellaSwagError(f"{e}; delete {path} to download it again") from None


# -----------------------------------------------------------------------------
# Scoring
#
# The plain way (build-nanogpt's) runs 4 rows through the model per example, context + ending
# each, padded to the longest, and takes the logits at every position. Three things in it are
# wasted work, and we skip all three without changing a single score:
#   1. the context is computed 4 times. We pack an example into ONE row, context then the four
#      endings one after another, and give the attention a mask under which each ending sees
#      the context and itself, never another ending, and the position embeddings restart at the
#      end of the context for every ending. Every token then sees exactly what it would see in
#      its own row context + ending, so its hidden state, and its loss, is the same. GPT.hidden
#      takes such positions and mask, and returns the hidden states before lm_head.
#   2. the output layer (n_embd x 50,257+: a third of GPT-2 124M's compute per token, and most
#      of its memory) runs at every position, though only ending tokens are scored. We apply
#      it only at the positions that predict an ending token.
#   3. one example per forward leaves a CPU's matrix units and a GPU idle much of the time on
#      small matrices. We put batch_size examples in a forward, sorted by length so that the
#      padding which makes their rows equal in length stays small.


def render_example(example, block_size):
    """An example as token lists (context, [4 endings]), cut to fit the model's context.

    Context and ending are encoded separately, the ending with a leading space as it follows the
    context mid-sentence (build-nanogpt's protocol). If context + the longest ending exceed
    block_size, the oldest context tokens go, the same for all four endings so they are still
    compared on equal terms (GPT-2's 1024 tokens never need it; models with a short context do)."""
    ctx = tokenizer.encode(example["ctx"]) or [tokenizer.EOT]  # an empty context starts from <|endoftext|>
    ends = [tokenizer.encode(" " + e) for e in example["endings"]]
    excess = len(ctx) + max(len(e) for e in ends) - block_size
    if excess > 0:
        ctx = ctx[min(excess, len(ctx) - 1):]
        ends = [e[-(block_size - len(ctx)):] for e in ends]  # an ending longer than the context keeps its tail
    return ctx, ends


def pack(rendered):
    """Lay out examples as one row each: context, then its 4 endings. Returns, each (B, T):
    tokens, positions (for wpe), group (-1 context, 0-3 ending, -2 padding), and prev (the
    index whose output predicts this token: the last context token for an ending's first)."""
    T = max(len(ctx) + sum(map(len, ends)) for ctx, ends in rendered)
    tokens = torch.full((len(rendered), T), tokenizer.EOT, dtype=torch.long)
    positions = torch.zeros_like(tokens)
    group = torch.full_like(tokens, -2)
    prev = torch.zeros_like(tokens)
    for b, (ctx, ends) in enumerate(rendered):
        L = len(ctx)
        tokens[b, :L], positions[b, :L], group[b, :L] = torch.tensor(ctx), torch.arange(L), -1
        i = L
        for j, end in enumerate(ends):
            n = len(end)
            tokens[b, i:i + n] = torch.tensor(end)
            positions[b, i:i + n] = torch.arange(L, L + n)
            group[b, i:i + n] = j
            prev[b, i:i + n] = torch.arange(i - 1, i + n - 1)
            prev[b, i] = L - 1
            i += n
    return tokens, positions, group, prev


def attention_mask(group):
    """(B, 1, T, T) bool, True where query q may attend to key k: k not after q, and k is context
    or in q's own ending (padding may see padding too, so no row of the mask is empty)."""
    T = group.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=group.device).tril()
    same = group[:, :, None] == group[:, None, :]
    return (causal & (same | (group[:, None, :] == -1))).unsqueeze(1)


@torch.no_grad()
def score_endings(model, rendered, device="cpu", dtype="fp32", batch_size=16, progress=None):
    """Summed loss and token count of every ending: two (N, 4) tensors, in the order of `rendered`."""
    n = len(rendered)
    sums = torch.zeros(n, 4, dtype=torch.float64)
    counts = torch.tensor([[len(e) for e in ends] for _, ends in rendered], dtype=torch.long).view(n, 4)
    # longest first: similar lengths share a batch, and running out of memory would happen at once
    order = sorted(range(n), key=lambda i: -(len(rendered[i][0]) + sum(map(len, rendered[i][1]))))
    for b in range(0, n, batch_size):
        chunk = order[b:b + batch_size]
        tokens, positions, group, prev = (t.to(device) for t in pack([rendered[i] for i in chunk]))
        rows, cols = (group >= 0).nonzero(as_tuple=True)  # every ending token, in row-major order
        with speedups.autocast(dtype, torch.device(device).type):
            h = model.hidden(tokens, positions, attention_mask(group))  # (B, T, n_embd): no lm_head yet
            logits = model.lm_head(h[rows, prev[rows, cols]])  # (ending tokens, vocab)
        # the same cross-entropy as training, over the model's whole (possibly padded) vocabulary
        losses = F.cross_entropy(logits.float(), tokens[rows, cols], reduction="none")
        ending = rows * 4 + group[rows, cols]  # which of the chunk's 4 * len(chunk) endings
        sums[chunk] = (torch.zeros(4 * len(chunk), dtype=torch.float64, device=device)
                       .index_add_(0, ending, losses.double()).view(-1, 4).cpu())
        if progress is not None:
            progress.update(len(chunk))
    return sums, counts


def evaluate(model, examples, device="cpu", dtype="fp32", batch_size=16, rank=0, world_size=1, progress=True):
    """HellaSwag accuracy of model on examples. With world_size > 1 (torch.distributed initialized),
    rank r scores examples r, r + world_size, ... and the counts are summed over ranks, so every
    rank returns the totals. Returns num_total, num_correct, num_correct_norm, acc, acc_norm."""
    mine = examples[rank::world_size]
    rendered = [render_example(ex, model.config.block_size) for ex in mine]
    # a bar on a terminal, a line every ~10% in a log (plumbing/progress.py); rank 0 only
    with Bar(len(mine), "hellaswag", "examples", enabled=rank == 0 and progress) as bar:
        sums, counts = score_endings(model, rendered, device, dtype, max(1, batch_size), bar)
    labels = torch.tensor([ex["label"] for ex in mine], dtype=torch.long)
    pred = sums.argmin(dim=1)  # the lowest total loss: the most likely ending
    pred_norm = (sums / counts).argmin(dim=1)  # the lowest loss per token: length does not count
    stats = torch.tensor([len(mine), (pred == labels).sum(), (pred_norm == labels).sum()],
                         dtype=torch.long, device=device)
    if world_size > 1:
        # SUM, not AVG: ranks may hold one example more or less, and AVG is not on every CPU backend
        torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.SUM)
    num_total, num_correct, num_correct_norm = stats.tolist()
    return {"num_total": num_total, "num_correct": num_correct, "num_correct_norm": num_correct_norm,
            "acc": num_correct / max(1, num_total), "acc_norm": num_correct_norm / max(1, num_total)}


def examples_for_training(data_dir, ranks):
    """train_gpt2.py's HellaSwag examples, read once when the run starts; None when the data cannot be had
    (no network, say): that is no reason not to train."""
    try:
        return load_examples("val", data_dir=data_dir)
    except (Exception, SystemExit) as e:
        ranks.print0(f"warning: HellaSwag disabled: {e}")
        return None


def accuracy_during_training(model, examples, ranks, dtype, batch_size):
    """train_gpt2.py's HellaSwag: acc_norm over the val split on all ranks, printed by rank 0."""
    model.eval()
    result = evaluate(model, examples, device=ranks.device, dtype=dtype, batch_size=batch_size,
                      rank=ranks.rank, world_size=ranks.world_size)
    ranks.print0(f"HellaSwag accuracy: {result['num_correct_norm']}/{result['num_total']}={result['acc_norm']:.4f}")
    return result["acc_norm"]


# -----------------------------------------------------------------------------
# Command line


def main(argv=None):
    p = argparse.ArgumentParser(formatter_class=ShowDefaults,  # --help shows every default
                                description="Evaluate a GPT-2 on HellaSwag (build-nanogpt's completion style).")
    p.add_argument("-m", "--model", default="gpt2", help="gpt2 | gpt2-medium | gpt2-large | gpt2-xl | "
                   "a Hugging Face-layout folder | one of our checkpoints (log/model_XXXXX.pt)")
    p.add_argument("--split", default="val", choices=["train", "val"], help="(test has no labels)")
    p.add_argument("--data_dir", default=None, help=f"HellaSwag cache folder (default {DEFAULT_DATA_DIR})")
    p.add_argument("--limit", type=int, default=0, help="score only the first N examples (0 = all)")
    p.add_argument("--batch_size", type=int, default=16, help="examples per forward pass")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | xpu | mps")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "auto"], help="precision of the forward pass: "
                   "fp32 (the protocol behind published scores), bf16 (autocast), auto (bf16 where it is fast here)")
    args = p.parse_args(argv)
    cpu.warm_up_vector_math()  # results independent of thread timing (see compute/cpu.py)

    # cheap checks first, so a typo fails in a second, not after loading a model
    if args.limit < 0 or args.batch_size < 1:
        raise SystemExit("error: --limit must be >= 0 and --batch_size >= 1")
    if not (args.model in PRETRAINED_NAMES or os.path.exists(args.model)):
        raise SystemExit(f"error: -m {args.model}: no such checkpoint file or folder, "
                         f"and not one of {', '.join(PRETRAINED_NAMES)}")
    args.device = world.pick_device(args.device, 0, 1)
    try:
        examples = load_examples(args.split, args.data_dir)
    except HellaSwagError as e:
        raise SystemExit(f"error: {e}")
    if args.limit:
        examples = examples[:args.limit]

    model, _ = load_model(args.model)
    model.to(args.device).eval()
    if torch.device(args.device).type == "cpu":
        print(cpu.describe_cpu(torch.get_num_threads()))
    args.dtype, why = speedups.resolve_dtype(args.dtype, torch.device(args.device).type, model.config.n_embd)
    print(why)
    print(f"{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; "
          f"{len(examples)} HellaSwag {args.split} examples on {args.device}, {args.dtype}, "
          f"{args.batch_size} examples per forward")
    t0 = time.time()
    r = evaluate(model, examples, device=args.device, dtype=args.dtype, batch_size=args.batch_size)
    dt = time.time() - t0
    print(f"{r['num_total']} acc: {r['acc']:.4f} acc_norm: {r['acc_norm']:.4f}")
    print(f"correct: {r['num_correct']}/{r['num_total']} (sum of loss), "
          f"{r['num_correct_norm']}/{r['num_total']} (mean loss per token); "
          f"{dt:.1f}s, {r['num_total'] / dt:.2f} examples/s")
    return r


if __name__ == "__main__":
    main()
