"""--parallel auto (parallel/layouts.py): what each layout holds and sends, the prediction, the choice, and runs."""
import re

import pytest

from conftest import (RECORDING_RANK, REPO, clean_env, final_weights_diff, make_shards, read_log, run_launched,
                      run_train, tiny_run_args, torchrun)
from parallel import layouts, mesh, sizes, tensor_parallel
from model import GPTConfig
from tokenizer import PADDED_VOCAB_SIZE

GPT2 = GPTConfig(block_size=1024, vocab_size=PADDED_VOCAB_SIZE, n_layer=12, n_head=12, n_embd=768)
EQUAL = ["--batch_size", "2", "--total_batch_size", "384", "--n_layer", "4"]


def micro_steps(layout, world=3, rows=1, seq_len=256, tokens=6144):
    """Each data-parallel replica's micro-steps: a pipeline's replicas are world / pp (one: all the step's rows)."""
    return tokens // (rows * seq_len * (world // (layout.pp * layout.tp)))


def planned(config=GPT2, world=3, rows=1, seq_len=256, tokens=6144, bf16=False):
    """The issue's benchmark: GPT-2 (124M) on 3 ranks, rows of 256, 6,144 tokens a step."""
    return {l.short().replace(" ", ""): layouts.plan(l, config, world, rows, seq_len,
                                                               micro_steps(l, world, rows, seq_len, tokens), bf16)
            for l in layouts.candidates(config, world, lambda pp: True)}


def test_what_each_layout_holds_and_sends():
    p = planned()
    P = sizes.parameters(GPT2)[0]
    assert abs(P - 124.48e6) < 0.1e6  # GPT-2 (124M) with the padded vocabulary, lm_head tied
    # memory: DDP holds everything; ZeRO-2 shards AdamW's state and keeps the weights whole for the step; FSDP shards
    # the weights too, but both keep the gradients whole until the last micro-step (gradient sync off before it):
    # measured, GPT-2 medium's shape on 2 ranks in bf16, FSDP's peak 6.26 GiB above ZeRO-2's 5.63 (docs/parallel.md);
    # a pipeline of 3 holds a stage (the ends hold the embeddings or lm_head's copy of them)
    assert p["dp"].memory > p["fsdp"].memory > p["fsdp_grads"].memory
    assert p["pp3"].memory < 0.7 * p["dp"].memory
    # bytes: DDP's ring all-reduce of fp32 gradients, 2 (W-1)/W x 4P; FSDP gathers every weight twice a micro-step,
    # ZeRO-2 once a step, and both reduce-scatter the gradients once a step (on gloo: an all-reduce, 2 (W-1)/W)
    assert p["dp"].sent == pytest.approx(2 * 2 / 3 * 4 * P)
    assert p["fsdp"].sent == pytest.approx(2 / 3 * (2 * 8 * 4 * P + 2 * 4 * P))
    assert p["fsdp_grads"].sent == pytest.approx(2 / 3 * (4 * P + 2 * 4 * P))
    # the acceptance, on paper: the busiest pipeline rank sends <= 10% of FSDP's, ZeRO-2 <= 25%
    assert p["pp3"].sent <= 0.10 * p["fsdp"].sent and p["fsdp_grads"].sent <= 0.25 * p["fsdp"].sent
    # tensor parallel: 4 all-reduces (2 (n-1)/n of them sent) of a micro-batch's activations per block, forward and
    # backward, in each of the 24 micro-steps (one replica: all the step's rows); every block split 3 ways
    assert p["tp3"].sent == pytest.approx(24 * 12 * 4 * 2 * 2 / 3 * (256 * 768 * 4))
    assert p["tp3"].memory < 0.6 * p["dp"].memory
    # bf16: FSDP gathers bf16 weights (half the bytes of the gathers), the gradients stay fp32
    b = planned(bf16=True)
    assert b["fsdp"].sent == pytest.approx(2 / 3 * (2 * 8 * 2 * P + 2 * 4 * P))
    # bf16 activations are smaller; autocast's bf16 copy of the weights is not (layouts.beyond_state)
    copies = sizes.beyond_state(P, 1, GPT2, True) - sizes.beyond_state(P, 1, GPT2, False)
    assert copies == 2 * P and b["dp"].memory - copies < p["dp"].memory


def test_sharded_layouts_plan_whole_gradients_while_they_accumulate():
    # With gradient sync off on the micro-steps before the last, FSDP2 keeps every gradient whole on every rank, in
    # fp32 (the reduce dtype, even when the weights are gathered in bf16), and each rank's backward computes every
    # gradient whole (its temporaries): however many ranks share the state, FSDP and ZeRO-2 each hold 4 + 2 bytes a
    # parameter beyond their shares. (Measured, GPT-2 medium's shape on 2 ranks, bf16: FSDP 6.26 GiB, ZeRO-2 5.63;
    # the plan that had them sharded too was 1.27x and 1.26x under.)
    P = sizes.parameters(GPT2)[0]
    for bf16 in (False, True):
        two, eight = (planned(world=w, tokens=w * 2 * 256, bf16=bf16) for w in (2, 8))  # 2 micro-steps a rank
        one = planned(world=8, tokens=8 * 256, bf16=bf16)  # 1: each gradient reduce-scattered as the backward makes it
        # more ranks shrink only the shares: ZeRO-2's weights and moments (12 bytes), FSDP's whole state (16)
        assert two["fsdp_grads"].memory - eight["fsdp_grads"].memory == pytest.approx(12 * P * (1 / 2 - 1 / 8))
        assert two["fsdp"].memory - eight["fsdp"].memory == pytest.approx(16 * P * (1 / 2 - 1 / 8))
        assert eight["fsdp"].memory - one["fsdp"].memory == pytest.approx(4 * P)  # the whole fp32 gradients


def test_slow_links_choose_the_pipeline_fast_ones_the_least_compute():
    p = planned()
    free = 1.05 * max(l.memory for name, l in p.items() if name != "dp") / layouts.HEADROOM  # all but DDP fit
    assert p["dp"].memory > layouts.HEADROOM * free
    def chosen(bandwidth):
        for layout in p.values():
            layouts.predict(layout, GPT2, 3, 256, micro_steps(layout), 0.05, (bandwidth, 50e-6))
        return layouts.choose(list(p.values()), free, fits_alone=False)
    slow, runner_up = chosen(12.5e6)  # 100 Mbit/s: bytes decide
    assert slow.name == "pp" and runner_up is not None and runner_up.seconds >= slow.seconds
    fast, _ = chosen(1e12)  # links as fast as memory: compute decides, and data parallel has no bubble
    assert fast.name in ("fsdp", "fsdp_grads")
    # the pipeline's prediction is its bubble: (M + N - 1) micro-steps of its slowest stage
    layouts.predict(p["pp3"], GPT2, 3, 256, 24, 0.05, (1e12, 0.0))
    blocks = layouts.stages(GPT2, 3, 256)[1]
    assert p["pp3"].seconds == pytest.approx((24 + 3 - 1) * blocks * 0.05, rel=1e-3)
    # nothing fits: no choice; DDP fits: DDP, unmeasured
    assert layouts.choose(list(p.values()), 1e6, fits_alone=False) == (None, None)
    assert layouts.choose(list(p.values()), 10 * p["dp"].memory, fits_alone=True)[0].name == "dp"


def test_sharded_stages_and_pp_x_tp_are_candidates_planned_as_they_run():
    """Where a pipeline has replicas, its stages may be sharded over them (--pp N --shard grads|full) or split over
    tensor-parallel ranks inside a node (--pp N --tp T); each is planned with the stage's share of the state and
    predicted with the stage's blocks as they run (a tensor-parallel block: timed, its all-reduces inside)."""
    four = [l.flags() for l in layouts.candidates(GPT2, 4, lambda pp: True, hostnames=["a", "a", "b", "b"])]
    assert {"--pp 2", "--pp 2 --shard grads", "--pp 2 --shard full", "--pp 2 --tp 2", "--pp 4", "--tp 2"} <= set(four)
    assert "--pp 4 --shard grads" not in four and "--pp 2 --tp 4" not in four  # (no replicas; tp 4 crosses nodes)
    XL = GPTConfig(block_size=1024, vocab_size=50304, n_layer=48, n_head=25, n_embd=1600)

    def plan(l, world=8):
        return layouts.plan(l, XL, world, 1, 1024, 64 // (world // (l.pp * l.tp)), True)

    whole, grads, full = (plan(layouts.Layout("pp", shard, 2)) for shard in ("none", "grads", "full"))
    stage = layouts.stage_split.stage_plan(XL, whole.bounds, 1, 1024, 16, 4, "grads", True)
    params = max(p for _, p, _ in stage)  # the busiest stage's (the same stage in every plan: the ends are alike)
    assert whole.memory - grads.memory == pytest.approx((20 - 12 / 4 - 6) * params + 2 * params, rel=0.02)
    assert full.memory - grads.memory == pytest.approx(4 * params / 4, rel=0.02)  # + its share of the gradients
    assert grads.sent > whole.sent  # gathers and reduce-scatters where DDP all-reduces
    # pp 2 x tp 2: each stage's blocks split; its block timed as tp runs it; lm_head whole on each of its ranks
    split = plan(layouts.Layout("pp", "none", 2, 2), 4)
    assert split.memory < plan(layouts.Layout("pp", "none", 2), 4).memory and split.sent_in_blocks > 0
    split.block_seconds = 0.03
    layouts.predict(split, XL, 4, 1024, 64, 0.05, (1e12, 0.0))
    head = layouts.stage_split.stage_costs(XL, 1024)[1] / layouts.stage_split.stage_costs(XL, 1024)[0] * 0.05
    (a, b), (c, d) = split.bounds
    assert split.seconds == pytest.approx((64 + 1) * max((b - a) * 0.03, (d - c) * 0.03 + head), rel=1e-3)


def test_ranks_crowding_a_nodes_cores_lend_a_pipelines_idle_time():
    """3 ranks of a thread each on a 2-core node (the benchmark's namespaces) crowd it 1.5x: a block timed with all
    busy runs 1.5x faster alone, and a pipeline's lighter stages and bubble leave their core time to its busiest
    stage, so the step is bounded by the whole step's work on the node's cores. Measured at 10 Gbit/s there: the
    pipeline 26.4 s, ZeRO-2 31.4 s, where the chain at the all-busy speed predicted 31.8 s and chose ZeRO-2."""
    p = planned()
    free = 1.05 * max(l.memory for name, l in p.items() if name != "dp") / layouts.HEADROOM
    block_cost, head_cost = layouts.stage_split.stage_costs(GPT2, 256)
    whole, slowest_stage = GPT2.n_layer + head_cost / block_cost, layouts.stages(GPT2, 3, 256)[1]
    seconds, chosen = {}, {}
    for crowd in (1.0, 1.5):
        for layout in p.values():
            layouts.predict(layout, GPT2, 3, 256, micro_steps(layout), 0.197, (1.25e9, 50e-6), crowd=crowd)
        seconds[crowd] = {name: l.seconds for name, l in p.items()}
        chosen[crowd] = layouts.choose(list(p.values()), free, fits_alone=False)[0].name
    sending = seconds[1.0]["pp3"] - (24 + 2) * slowest_stage * 0.197
    assert seconds[1.5]["pp3"] == pytest.approx(24 * whole * 0.197 / 3 + sending)  # the node's cores bound it
    assert seconds[1.5]["pp3"] < seconds[1.0]["pp3"] and chosen == {1.0: "fsdp_grads", 1.5: "pp"}
    for name in ("fsdp", "fsdp_grads", "tp3"):  # every rank busy all along: nothing lent
        assert seconds[1.5][name] == seconds[1.0][name]


def test_sharded_layouts_predict_their_timed_embeddings_and_loss():
    """Sharded runs give freed memory back to the OS, so their vocabulary-sized temporaries page-fault in afresh every
    micro-step: measured, GPT-2 medium's shape on 2 ranks, the embeddings and loss took 1.31 s (ZeRO-2) and 2.01 s
    (FSDP) a micro-step against the 0.59 s their FLOPs give, and ZeRO-2, predicted at 17.7 s, ran 23-25 s. The timed
    head replaces the FLOPs' share on every rank that computes it (a sharded pipeline's last stage), and FSDP's gathers
    of the embeddings, inside that time, are not sent over the link again."""
    p, link = planned(world=4, tokens=4 * 2 * 256), (1.25e8, 0.0)
    block_cost, head_cost = layouts.stage_split.stage_costs(GPT2, 256)
    for name in ("fsdp", "fsdp_grads", "pp2grads", "pp2full"):
        layout, micro = p[name], micro_steps(p[name], world=4, tokens=4 * 2 * 256)
        flops = layouts.predict(layout, GPT2, 4, 256, micro, 0.1, link).seconds
        layout.head_seconds = 3.0
        timed = layouts.predict(layout, GPT2, 4, 256, micro, 0.1, link).seconds
        stages = layout.bounds or [(0, GPT2.n_layer)]
        def busiest(head):  # a micro-step on the busiest rank: the whole model's, or the slowest stage's
            return max((b - a) * 0.1 + (s == len(stages) - 1) * head for s, (a, b) in enumerate(stages))
        runs = micro + 1 if layout.pp > 1 else micro  # (a pipeline of 2 stages: M + 1 micro-steps of its slowest stage)
        expected = runs * (busiest(3.0) - busiest(head_cost / block_cost * 0.1)) - layout.sent_in_head / link[0]
        assert timed - flops == pytest.approx(expected) and abs(expected) > 1, name
        assert (layout.sent_in_head > 0) == (name == "fsdp")


def test_auto_times_each_piece_under_the_memory_policy_of_its_run(monkeypatch):
    """train_gpt2.py keeps freed memory (cpu.keep_freed_memory) for DDP, pipelines and TP, not for sharded runs: the
    plain and TP blocks are timed with it kept (a plain block ran 1.11x slower without, GPT-2 medium's shape, AMD EPYC
    Zen 4), then glibc's policy is given back and FSDP's and ZeRO-2's blocks and the sharded heads are timed under
    it."""
    from types import SimpleNamespace
    from contextlib import nullcontext
    kept, timed = [False], []
    monkeypatch.setattr(layouts.cpu, "keep_freed_memory", lambda keep=True: kept.__setitem__(0, keep))
    monkeypatch.setattr(layouts, "crowding", lambda ranks: 1.0)
    monkeypatch.setattr(layouts, "measure_network", lambda ranks, nodes: (1.25e9, 50e-6))
    def block(make_block, *args, layout=None, **kwargs):
        timed.append((layout.short() if layout else "plain", kept[0]))
        return 0.1
    monkeypatch.setattr(layouts, "time_block", block)
    monkeypatch.setattr(layouts, "time_head",
                        lambda make_head, *args: timed.append((args[-3] + " head", kept[0])) or 0.8)
    p = planned(world=2, tokens=2 * 2 * 256)
    free = 1.05 * max(l.memory for name, l in p.items() if name != "dp") / layouts.HEADROOM
    monkeypatch.setattr(layouts, "free_memory", lambda ranks, max_memory: free)
    args = SimpleNamespace(batch_size=1, seq_len=256, total_batch_size=2 * 2 * 256, max_memory=None, tp=1,
                           compile=False)
    ranks = SimpleNamespace(world_size=2, gather=lambda obj: [obj] * 2)  # (two ranks of one node)
    chosen, line = layouts.decide(args, GPT2, ranks, False, nullcontext(), (None, None))
    assert timed == [("plain", True), ("tp 2", True), ("fsdp", False), ("full head", False), ("fsdp_grads", False),
                     ("grads head", False)], timed
    assert "embeddings and loss 800 ms (--shard full); embeddings and loss 800 ms (--shard grads)" in line


def test_crowding_counts_every_rank_on_the_machine_whatever_its_hostname():
    """Ranks on one machine (one kernel boot id) share its cores even under hostnames of their own (containers,
    bench_parallel.py's namespaces as nodes): 4 ranks of a thread each on one core crowd it 4x, not 2x per hostname
    (seen: the 4-rank benchmark's pipeline predicted 1.6x its measured step while each 'node' counted 1x)."""
    from parallel import cluster
    one_core = [0]
    everyone = [("m1", one_core, 1)] * 4 + [("m2", one_core, 8)]
    assert cluster.threads_a_core(everyone, "m1") == 4.0 and cluster.threads_a_core(everyone, "m2") == 8.0
    assert cluster.threads_a_core([("m1", one_core, 1)], "m1") == 1.0


def test_nodes_from_hostnames_keep_tensor_parallel_inside_one():
    """Ranks grouped by hostname; TP only where its groups (consecutive ranks) share a node; TP's bytes over the link
    inside a node, the rest over the one across nodes."""
    assert mesh.nodes_of(["a", "a", "b", "b"]) == [[0, 1], [2, 3]]
    assert mesh.nodes_of(["b", "a", "b"]) == [[0, 2], [1]]
    assert mesh.describe_nodes([[0, 1], [2, 3]]) == "2 nodes x 2 ranks"
    assert mesh.describe_nodes([[0], [1], [2]]) == "3 nodes x 1 rank"
    assert mesh.describe_nodes([[0, 1, 2]]) == "1 node x 3 ranks"
    config = GPTConfig(block_size=64, vocab_size=PADDED_VOCAB_SIZE, n_layer=2, n_head=4, n_embd=32)
    def tp_degrees(hostnames):
        return [l.tp for l in layouts.candidates(config, len(hostnames), lambda pp: True, hostnames=hostnames)
                if l.tp > 1 and l.pp == 1]
    assert tp_degrees(["a"] * 4) == [2, 4]  # one node: any degree that divides the ranks and the heads
    assert tp_degrees(["a", "a", "b", "b"]) == [2]  # tp 4 would cross the network
    assert tp_degrees(["a", "b", "a", "b"]) == []  # (a launcher that deals ranks round-robin: no group inside a node)
    assert tp_degrees(["a", "b", "c"]) == [] and tp_degrees(["a"] * 3) == []  # (3 does not divide the 4 heads)
    assert [l.short() for l in layouts.candidates(config, 4, lambda pp: True, hostnames=["a", "b", "c", "d"])
            if l.pp > 1] == ["pp 2", "pp 2 grads", "pp 2 full", "pp 4"]  # pipelines and data parallel across nodes
    # tp 2 x dp 2: the activations' all-reduces are inside its block's time, timed as it runs; the gradients' over
    # the link
    tp = layouts.plan(layouts.Layout("tp", "none", 1, 2), config, 4, 2, 32, 3, False)
    tp_bytes = tensor_parallel.rank_plan(config, 2, 2, 2, 32, 3, "fp32")[1]
    assert tp.sent_in_blocks == tp_bytes and tp.sent > tp_bytes
    layouts.predict(tp, config, 4, 32, 3, 0.0, (1e8, 0.0))
    assert tp.seconds == pytest.approx(tp.sent / 1e8)  # untimed: every byte over the link
    tp.block_seconds = 0.01
    layouts.predict(tp, config, 4, 32, 3, 0.0, (1e8, 0.0))
    assert tp.seconds == pytest.approx(3 * 2 * 0.01 + (tp.sent - tp_bytes) / 1e8)


TIMED = RECORDING_RANK + r'''
from contextlib import nullcontext
from model import Block, GPTConfig
from parallel import cluster, layouts
config = GPTConfig(block_size=16, vocab_size=128, n_layer=2, n_head=4, n_embd=64)
out = {}
for layout in (layouts.Layout("fsdp", "full", 1), layouts.Layout("fsdp_grads", "grads", 1),
               layouts.Layout("tp", "none", 1, 2)):
    layouts.plan(layout, config, 2, 2, 16, 3, False)
    seen.clear()
    with Record():
        cluster.time_block(lambda: Block(config), 2, 16, 64, nullcontext(), SimpleNamespace(world_size=2), turns=2,
                           layout=layout)
    out[layout.name] = {"seen": list(seen), "a_block": layout.sent_in_blocks / (3 * config.n_layer)}
if dist.get_rank() == 0:
    print(json.dumps(out))
from parallel import world
world.leave_process_group()
'''


@pytest.mark.xdist_group("multiprocess-2")
def test_fsdp_zero2_and_tp_blocks_are_timed_with_their_collectives(tmp_path):
    """The blocks --parallel auto times for FSDP, ZeRO-2 and TP (2 ranks, 2 turns) send what the plan counts inside
    their time: FSDP gathers the block's weights for its forward and again for its backward, and reduce-scatters
    nothing (the gradients' once a step goes over the link: seen failing, a reduce-scatter a turn, with the block's
    gradients synced); TP all-reduces the activations twice forward and twice backward."""
    import json
    import subprocess
    script = tmp_path / "timed.py"
    script.write_text(TIMED)
    proc = subprocess.run([*torchrun(2), str(script), REPO], capture_output=True, text=True, env=clean_env(), cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    fsdp = [(f, b) for f, b in out["fsdp"]["seen"] if "barrier" not in f and b > 8]  # (not the timing's own)
    assert {f for f, _ in fsdp} == {"c10d._allgather_base_.default"}, fsdp  # (a reduce-scatter would show here)
    assert len(fsdp) % 2 == 0 and len(fsdp) >= 8, len(fsdp)  # warm-up, sizing and 2 turns: 2 gathers a pass
    # a pass sends the gathered block's bytes (on 2 ranks, a ring all-gather sends half of it, twice)
    assert (len({b for _, b in fsdp}) == 1
            and fsdp[0][1] == pytest.approx(out["fsdp"]["a_block"])), (fsdp[0], out["fsdp"])
    # ZeRO-2 gathers the block once (its first pass) and keeps it; its gradients accumulate whole: nothing else sent
    grads = [(f, b) for f, b in out["fsdp_grads"]["seen"] if "barrier" not in f and b > 8]
    assert [f for f, _ in grads] == ["c10d._allgather_base_.default"], grads
    tp = [b for f, b in out["tp"]["seen"] if "all_reduce" in f and b > 8]
    assert len(tp) % 4 == 0 and len(tp) >= 16 and len(set(tp)) == 1, tp  # 4 all-reduces a pass, of one size
    assert 4 * tp[0] == pytest.approx(out["tp"]["a_block"]), (tp[0], out["tp"])  # (on 2 ranks each sends its size)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("layouts") / "data")



@pytest.mark.xdist_group("multiprocess-2")
def test_auto_keeps_ddp_where_it_fits_and_picks_and_trains_another_where_not(data, tmp_path):
    # fits: DDP as always (which trains one process's model: test_distributed.py), and the line says why
    single = tmp_path / "auto"
    auto = run_launched(tiny_run_args(data, single, *EQUAL), torchrun(2), clean_env())
    assert re.search(r"parallel: data parallel \(DDP\): .* fit in 90% of the [\d.]+ GiB free", auto.stdout)
    assert "shard:" not in auto.stdout and "pipeline:" not in auto.stdout and "tensor parallel" not in auto.stdout
    # memory for every layout but DDP: another layout, chosen by prediction, trains the one-process model
    config = GPTConfig(block_size=64, vocab_size=PADDED_VOCAB_SIZE, n_layer=4, n_head=2, n_embd=32)
    p = planned(config, world=2, rows=2, seq_len=32, tokens=384)
    free = 1.02 * min(l.memory for l in p.values() if l.memory < p["dp"].memory) / layouts.HEADROOM
    assert p["dp"].memory > layouts.HEADROOM * free
    short = tmp_path / "short"
    proc = run_launched(tiny_run_args(data, short, *EQUAL, "--max_memory", f"{free / 2**30:.6f}"), torchrun(2),
                        clean_env())
    line = re.search(r"parallel: (.*) \(predicted; link (\d+) MB/s, .*runner-up (.*)", proc.stdout)
    assert line and "DDP would need" in proc.stdout, proc.stdout
    runs = {"FSDP (--shard full)": "weights, gradients and AdamW state", "ZeRO-2 (--shard grads)": "(ZeRO-2)",
            "pipeline of 2 stages": "pipeline: 2 stages", "tensor parallel over 2 ranks": "tensor parallel: 2 ranks"}
    # (what the chosen layout prints as it is built)
    assert [runs[k] in proc.stdout for k in runs] == [line.group(1).startswith(k) for k in runs], proc.stdout
    assert read_log(short, "train") == pytest.approx(read_log(single, "train"), abs=1e-5)
    assert final_weights_diff(single, short) < 1e-5


def test_bad_layout_flags_are_one_line(data, tmp_path):
    for flags, message in [(["--parallel", "fsdp", "--shard", "full"],
                            "--parallel fsdp sets --shard, --pp and --tp: give it or --shard"),
                           (["--max_memory", "0"], "--max_memory 0: give a positive number of GiB")]:
        proc = run_train(tiny_run_args(data, tmp_path / "log", *flags), check=False, env=clean_env())
        assert proc.returncode != 0 and f"error: {message}" in proc.stderr + proc.stdout


@pytest.mark.xdist_group("multiprocess-2")
def test_a_forced_layout_that_cannot_fit_is_one_line(data, tmp_path):
    proc = run_launched(tiny_run_args(data, tmp_path / "log", *EQUAL, "--parallel", "fsdp", "--max_memory", "0.001"),
                        torchrun(2), clean_env(), check=False)
    assert proc.returncode != 0
    assert re.search(r"error: FSDP \(--shard full\) needs ~0\.\d\d GiB a rank \(training state and activations\), "
                     r"and a rank has 0\.00 GiB \(--max_memory\)",
                     proc.stdout + proc.stderr), proc.stdout + proc.stderr
    assert "model:" not in proc.stdout  # before the model is built


def test_a_pipeline_counts_the_loss_chunk_once_and_in_flight_activations_per_stage(monkeypatch):
    """1F1B keeps pp - s micro-batches' block activations on stage s, and only the last stage computes the loss: its
    chunk of logits is counted once, not once per micro-batch in flight (GPT-2 XL on 8 stages: it was 2.6 GiB too
    much). A larger chunk raises the planned peak by its growth at most (the last stage's; another stage may be the
    peak before it grows), not by pp times it."""
    config = GPTConfig(block_size=1024, vocab_size=50304, n_layer=48, n_head=25, n_embd=1600)
    def peak(chunk):
        monkeypatch.setattr(layouts, "activation_bytes",
                            lambda config, rows, seq_len, layers, bf16: layers * 2**20 + chunk)
        return layouts.plan(layouts.Layout("pp", "none", 8), config, 8, 1, 1024, 64, True).memory
    assert 0 < peak(2 * 2**30) - peak(2**30) <= 2**30
