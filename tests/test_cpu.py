"""The dtype follows the CPU: bf16 only where it is native and measured faster, fp32 everywhere else,
whichever kind of CPU runs these tests, and ranks agree on it; the matmul rate behind that choice is a
best, not a sample: measured at every start in turns (bf16, fp32, ...), kept as the best ever seen in a
cache that a bad entry or a corrupt file cannot break, and measured again when a step beats it; on a busy
machine (products that lose their cores, as their CPU time shows) the decision measures longer, or takes
the rates kept when a one-thread measurement says they are this CPU's, and its line names its source and
never prints 0; the FLOPs count behind "N% of this CPU's matmul rate" is GPT-2's; every run says which CPU
it ran on. The measurement is fed fake product times and CPU shares (a FakeCPU) wherever the host's speed
or load would decide the result."""
import json
import os
import random
import re
import threading
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import make_shards, run_train, tiny_run_args
from compute import cpu, speedups
from parallel import sizes
from plumbing.common import read_json, write_json
from model import GPT, GPTConfig

BF16, FP32 = torch.bfloat16, torch.float32
# matmul rates in GFLOP/s at GPT-2's width (768) on 2 threads, measured on the two kinds of host this
# project runs on: an AMD EPYC with AVX512-BF16, and an AMD EPYC with AVX2 only (no native bf16, where
# PyTorch's fallback runs bf16 matmuls ~170x slower than fp32)
BF16_HOST = {BF16: 420.0, FP32: 185.0}
AVX2_HOST = {BF16: 1.0, FP32: 170.0}
NOT_FASTER = {BF16: 200.0, FP32: 185.0}  # advertises bf16, runs it barely faster


class FakeCPU:
    """A CPU whose (rows, width) @ (width, 4 width) products run at the given GFLOP/s (with `threads` given: on
    that many of torch's threads, proportionally less on fewer), each slowed by slowdown(i) for the i-th product, and
    whose threads were on a CPU for ran(i, dtype) of the i-th product's time (another job held the cores for the rest,
    so it took 1 / ran as long): measure_in_turns' time_product, without a clock. uses: {dtype: the share of torch's
    threads its products use} (PyTorch's bf16 fallback uses one)."""

    def __init__(self, width, gflops, slowdown=lambda i: 1.0, ran=lambda i, dtype: 1.0, uses=None, threads=None):
        self.width, self.gflops, self.slowdown, self.ran, self.uses = width, dict(gflops), slowdown, ran, uses or {}
        self.threads, self.calls, self.seconds = threads, [], 0.0

    def time_product(self, dtype, rows):
        self.calls.append((dtype, rows))
        i, flops = len(self.calls) - 1, 2 * rows * self.width * 4 * self.width
        ran, threads = self.ran(i, dtype), self.threads or torch.get_num_threads()
        flops_per_second = self.gflops[dtype] * min(1.0, torch.get_num_threads() / threads) * 1e9
        seconds = flops / flops_per_second * self.slowdown(i) / ran
        self.seconds += seconds
        return seconds, ran * self.uses.get(dtype, 1.0)


@pytest.fixture
def two_threads():
    """torch on 2 threads, as on the hosts whose rates these tests use, whatever the test before left."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of the test's own; returns the rates file's path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gpt2-cpu" / "matmul_rates.json"


def on_cpu(monkeypatch, native, gflops, width=768, **kwargs):
    """From here on this host's CPU is a FakeCPU with these rates (and FakeCPU's other arguments), native bf16
    or not; returns it."""
    fake = FakeCPU(width, gflops, **kwargs)
    monkeypatch.setattr(cpu, "native_bf16", lambda: native)
    monkeypatch.setattr(cpu, "matmul_timer", lambda width: fake.time_product)
    return fake


def test_auto_picks_bf16_only_where_native_and_faster(cache, monkeypatch):
    on_cpu(monkeypatch, True, BF16_HOST)
    dtype, line = speedups.resolve_dtype("auto", "cpu", 768)
    assert (dtype == "bf16" and line.startswith("dtype: bf16 (")
            and "bf16 matmul 420 GFLOP/s vs fp32 185, measured now;" in line)
    on_cpu(monkeypatch, False, AVX2_HOST, width=64)
    dtype, line = speedups.resolve_dtype("auto", "cpu", 64)
    assert dtype == "fp32" and line.startswith("dtype: fp32 (") and "no native bf16" in line
    assert "bf16 matmul 1 GFLOP/s vs fp32 170, measured now;" in line and "--dtype bf16 forces it" in line
    # a CPU that advertises bf16 but does not run it faster than fp32 (the check measures, not trusts)
    on_cpu(monkeypatch, True, NOT_FASTER, width=128)
    dtype, line = speedups.resolve_dtype("auto", "cpu", 128)
    assert dtype == "fp32" and "native bf16, but not faster" in line
    # the measured rates alone do not make bf16 native: the flags must say so too
    on_cpu(monkeypatch, False, BF16_HOST, width=256)
    assert speedups.resolve_dtype("auto", "cpu", 256)[0] == "fp32"


def test_explicit_dtype_is_obeyed_with_a_warning_where_bf16_is_slow(cache, monkeypatch):
    on_cpu(monkeypatch, False, AVX2_HOST)
    dtype, line = speedups.resolve_dtype("bf16", "cpu", 768)
    assert dtype == "bf16" and line.startswith("warning: --dtype bf16 on a CPU without fast bf16")
    assert "170.0x slower than fp32" in line
    on_cpu(monkeypatch, True, BF16_HOST, width=64)
    dtype, line = speedups.resolve_dtype("bf16", "cpu", 64)
    assert dtype == "bf16" and not line.startswith("warning")
    assert speedups.resolve_dtype("fp32", "cpu", 64)[0] == "fp32"


def test_ranks_agree_on_bf16_in_the_same_call(cache, monkeypatch):
    on_cpu(monkeypatch, True, BF16_HOST)
    def ranks(others_bf16, world_size=2):  # a job's ranks; the others' choices arrive through the all-reduce
        calls = []
        def all_reduce_sum(t):
            calls.append(float(t))
            return t + others_bf16
        return SimpleNamespace(world_size=world_size, device="cpu", all_reduce_sum=all_reduce_sum, calls=calls)
    agreeing = ranks(others_bf16=1)
    assert speedups.resolve_dtype("auto", "cpu", 768, agreeing)[0] == "bf16" and agreeing.calls == [1.0]
    one_without = ranks(others_bf16=0)
    assert speedups.resolve_dtype("auto", "cpu", 768, one_without) == (
        "fp32", "dtype: fp32 (some ranks' CPUs have no fast bf16)")
    # an explicit --dtype is the same on every rank: no collective
    explicit = ranks(others_bf16=0)
    assert speedups.resolve_dtype("bf16", "cpu", 768, explicit)[0] == "bf16" and explicit.calls == []
    # a rank that chose fp32 still takes part in the all-reduce, or the others would wait for it forever
    on_cpu(monkeypatch, False, AVX2_HOST, width=64)
    fp32_rank = ranks(others_bf16=1)
    assert speedups.resolve_dtype("auto", "cpu", 64, fp32_rank)[0] == "fp32" and fp32_rank.calls == [0.0]
    alone = ranks(others_bf16=0, world_size=1)
    assert speedups.resolve_dtype("auto", "cpu", 64, alone)[0] == "fp32" and alone.calls == []


def test_autocast_follows_the_dtype():
    x = torch.ones(2, 2)
    with speedups.autocast("bf16", "cpu"):
        assert (x @ x).dtype == torch.bfloat16
    with speedups.autocast("fp32", "cpu"):
        assert (x @ x).dtype == torch.float32
    with pytest.raises(ValueError, match="'bf16' or 'fp32'"):
        speedups.autocast("auto", "cpu")


def test_the_real_rate_is_measured_at_every_start_kept_as_the_best_and_draws_no_random_numbers(cache, monkeypatch,
                                                                                                one_thread):
    rng = torch.get_rng_state()
    rate = cpu.matmul_rate(FP32, 64)
    assert rate > 0 and torch.equal(torch.get_rng_state(), rng)  # a run's random stream is untouched
    assert read_json(cache) == {cpu.rate_key(FP32, 64): rate} and "|1|torch.float32|64" in cpu.rate_key(FP32, 64)
    fresh = []  # the next start measures again, and keeps the better of that and the cache
    def measure(*args, **kwargs):
        fresh.append(real_measure(*args, **kwargs)[FP32])
        return {FP32: fresh[-1]}
    real_measure = cpu.measure_matmul_rates
    monkeypatch.setattr(cpu, "measure_matmul_rates", measure)
    again = cpu.matmul_rate(FP32, 64)
    assert len(fresh) == 1 and again == max(rate, fresh[0]) == read_json(cache)[cpu.rate_key(FP32, 64)]


def test_a_poisoned_rate_is_corrected_by_the_next_start(cache, monkeypatch):
    # a first start in a busy moment cached 10 GFLOP/s where this CPU does 150
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({cpu.rate_key(FP32, 128): 10.0, cpu.rate_key(BF16, 128): 34.0}))
    on_cpu(monkeypatch, True, {FP32: 150.0, BF16: 410.0}, width=128)
    dtype, line = speedups.resolve_dtype("auto", "cpu", 128)
    assert "bf16 matmul 410 GFLOP/s vs fp32 150, measured now;" in line
    assert read_json(cache) == pytest.approx({cpu.rate_key(FP32, 128): 150.0, cpu.rate_key(BF16, 128): 410.0})
    # a later start in a busy moment measures less, and the best stays
    busy = on_cpu(monkeypatch, True, {FP32: 40.0, BF16: 90.0}, width=128)
    assert cpu.matmul_rate(FP32, 128) == pytest.approx(150.0) and busy.calls
    assert read_json(cache)[cpu.rate_key(FP32, 128)] == pytest.approx(150.0)


def test_a_cached_rate_above_the_cpus_does_not_sway_the_decision(cache, monkeypatch):
    """The issue's acceptance on an AVX2 host: 34 GFLOP/s written for bf16 where the fallback does 1. No noise
    makes a rate too high, but an edited or copied file can: the decision and its line use this start's
    interleaved measurement, and the step lines' share the best kept."""
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({cpu.rate_key(FP32, 128): 10.0, cpu.rate_key(BF16, 128): 34.0}))
    on_cpu(monkeypatch, False, {FP32: 150.0, BF16: 1.0}, width=128)
    dtype, line = speedups.resolve_dtype("auto", "cpu", 128)
    assert dtype == "fp32" and "bf16 matmul 1 GFLOP/s vs fp32 150, measured now;" in line
    assert cpu.MatmulRate("fp32", 128).gflops == pytest.approx(150.0)


def two_busy_loops(bf16, fp32):
    """ran(i, dtype) of a machine where other jobs hold the cores most of the time, for good: a product on two
    threads gets both cores at once for a share of its time, bf16's `bf16`, fp32's `fp32`; a product on one
    thread gets its core for 0.3 of its time, and waits for no partner meanwhile."""
    return lambda i, dtype: 0.3 if torch.get_num_threads() == 1 else {BF16: bf16, FP32: fp32}[dtype]


busy_for_good = two_busy_loops(0.1, 0.4)  # the rates measured now say fp32 is faster where bf16 is 2.3x faster


@pytest.mark.parametrize("native, gflops, expected", [(True, BF16_HOST, "bf16"), (False, AVX2_HOST, "fp32")])
def test_a_busy_start_with_kept_rates_decides_as_a_quiet_one(cache, monkeypatch, two_threads, native, gflops, expected):
    """The issue's case: a CPU with native bf16 measured 'bf16 0 GFLOP/s vs fp32 0' beside two training jobs,
    and chose fp32. A quiet start keeps its rates; a busy one, whose products lose their cores, decides from them."""
    on_cpu(monkeypatch, native, gflops, width=128)
    quiet = speedups.resolve_dtype("auto", "cpu", 128)
    assert quiet[0] == expected
    busy = on_cpu(monkeypatch, native, gflops, width=128, ran=busy_for_good, threads=2)
    dtype, line = speedups.resolve_dtype("auto", "cpu", 128)
    assert dtype == expected, line
    rates = f"bf16 matmul {gflops[BF16]:.0f} GFLOP/s vs fp32 {gflops[FP32]:.0f}"  # the kept ones, as measured quietly
    assert f"{rates}, measured earlier (this machine is busy now: decided from the best rates kept for it)" in line
    # it measured longer first (in turns, for up to cpu.LONGER seconds), and kept the better rates on record
    assert busy.seconds >= cpu.LONGER
    assert read_json(cache) == pytest.approx({cpu.rate_key(d, 128): r for d, r in gflops.items()})


def test_a_busy_start_without_kept_rates_measures_longer(cache, monkeypatch, two_threads):
    """No rates kept yet (a first start), and another job holds the cores for the first 60 products, then lets
    them go now and then: the usual measurement (0.1 s of products, 48 here) says fp32; measuring on until each
    dtype's fastest product had its cores finds bf16's lead."""
    def ran(i, dtype):
        return 1.0 if i >= 60 and i % 10 < 3 else busy_for_good(i, dtype)
    fake = on_cpu(monkeypatch, True, BF16_HOST, width=128, ran=ran)
    dtype, line = speedups.resolve_dtype("auto", "cpu", 128)
    assert dtype == "bf16" and "bf16 matmul 420 GFLOP/s vs fp32 185, measured now;" in line
    assert 60 < len(fake.calls) <= 64  # it stopped once both dtypes' fastest products ran undisturbed
    # a machine busy for good: the measurement stops after cpu.LONGER seconds of products, and says so
    fake = on_cpu(monkeypatch, True, BF16_HOST, width=128, ran=two_busy_loops(0.25, 0.25))
    cache.unlink()
    dtype, line = speedups.resolve_dtype("auto", "cpu", 128)
    rounds = fake.calls.count((FP32, 1024)) - 1  # (one was its size's first)
    assert dtype == "bf16" and cpu.LONGER <= fake.seconds <= cpu.LONGER + 0.1
    assert ("bf16 matmul 105 GFLOP/s vs fp32 46, measured now "
            f"(this machine is busy: the best of {rounds} turns each);" in line)


def test_a_kept_rate_above_the_cpus_does_not_sway_a_busy_start(cache, monkeypatch, two_threads):
    """Issue #23's rule, on a busy start: an edited file says fp32 does 2000 GFLOP/s where this CPU does 185. A
    product on one thread, counted over the time it had its core, does 92 now: two threads can't do 2000, so
    the kept rates are not this CPU's, and the decision rests on the rates measured now."""
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({cpu.rate_key(FP32, 768): 2000.0, cpu.rate_key(BF16, 768): 420.0}))
    fake = on_cpu(monkeypatch, True, BF16_HOST, ran=two_busy_loops(0.25, 0.25), threads=2)
    dtype, line = speedups.resolve_dtype("auto", "cpu", 768)
    assert dtype == "bf16" and "bf16 matmul 105 GFLOP/s vs fp32 46, measured now (this machine is busy" in line
    assert fake.calls[-1] == (FP32, 256) and torch.get_num_threads() == 2  # (measured on one thread last, and put back)
    assert read_json(cache)[cpu.rate_key(FP32, 768)] == 2000.0  # (kept: only a reset removes a rate too high)
    # the genuine rates, kept by a quiet start, pass the same check
    cache.write_text(json.dumps({cpu.rate_key(FP32, 768): 185.0, cpu.rate_key(BF16, 768): 420.0}))
    assert "measured earlier" in speedups.resolve_dtype("auto", "cpu", 768)[1]


def test_the_line_never_prints_a_rate_of_0(cache, monkeypatch):
    # a busy machine's fallback: a few tenths of a GFLOP/s, or less; each printed as measured, with its source
    on_cpu(monkeypatch, False, {BF16: 0.4, FP32: 0.0042}, width=64)
    for requested in ("auto", "bf16", "fp32"):
        dtype, line = speedups.resolve_dtype(requested, "cpu", 64)
        assert "bf16 matmul 0.4 GFLOP/s vs fp32 0.0042, measured now" in line, line
        assert not re.search(r"(?<![.\d])0 GFLOP/s|fp32 0(?![.\d])", line)
    assert cpu.rate_text(0.4) == "0.4" and cpu.rate_text(9.96) == "10" and cpu.rate_text(184.6) == "185"


def test_a_product_the_library_runs_on_fewer_threads_is_not_taken_for_a_busy_machine(cache, monkeypatch, two_threads):
    # PyTorch's bf16 fallback runs on one of torch's two threads: half the CPU time of a product that uses both,
    # on a quiet machine too. Judged against its own products' highest share, it was not descheduled.
    fake = on_cpu(monkeypatch, False, {BF16: 1.0, FP32: 170.0}, width=128, uses={BF16: 0.5})
    measured = cpu.measure_in_turns((BF16, FP32), 128, time_product=fake.time_product, longer=cpu.LONGER)
    assert not measured.busy and measured.rounds < 20 and fake.seconds < 0.5
    assert measured.rates == pytest.approx({BF16: 1.0, FP32: 170.0})
    # but a dtype whose every product had less than one thread's worth of CPU time lost its cores each time
    # (a longer product is more often descheduled), even where the other dtype's products had theirs
    fake = on_cpu(monkeypatch, True, BF16_HOST, width=128, ran=lambda i, dtype: 0.2 if dtype == BF16 else 1.0)
    measured = cpu.measure_in_turns((BF16, FP32), 128, time_product=fake.time_product, longer=cpu.LONGER)
    assert measured.busy and fake.seconds >= cpu.LONGER


def test_products_too_short_to_lose_their_cores_are_not_taken_for_a_busy_machine(cache, monkeypatch, two_threads):
    # a quiet Xeon with AMX at width 128: products of ~0.1 ms, which oneDNN runs on one thread or on both; the
    # one-thread ones (half the CPU time) are a little faster, having no partner to wake
    def time_product(dtype, rows):
        flops, one_thread = 2 * rows * 128 * 4 * 128, len(calls) % 2 == 0
        calls.append(dtype)
        return flops / ({BF16: 900e9, FP32: 220e9}[dtype] * (1.1 if one_thread else 1.0)), 0.5 if one_thread else 1.0
    calls = []
    measured = cpu.measure_in_turns((BF16, FP32), 128, time_product=time_product, longer=cpu.LONGER)
    assert not measured.busy and measured.rounds < 1000  # (taken for busy, it went on to 1000 turns)


def test_a_size_cut_short_by_a_product_that_lost_its_cores_grows_back(cache, monkeypatch, two_threads):
    # bf16's 64-row product lost its cores for 20 ms, as if 64 rows were too many to grow from: measured at 64
    # rows (a product of 20 microseconds, mostly call overhead on a real CPU), bf16's rate would be too low.
    # The first undisturbed 64-row product shows the next size fits, and the measurement goes on from there.
    fake = on_cpu(monkeypatch, True, BF16_HOST, width=128, ran=lambda i, dtype: 0.001 if i == 1 else 1.0)
    assert speedups.resolve_dtype("auto", "cpu", 128)[0] == "bf16"
    assert fake.calls[:2] == [(BF16, 16), (BF16, 64)] and fake.calls[2][0] == FP32  # cut short at 64 rows
    assert fake.calls[-2:] == [(BF16, 1024), (FP32, 1024)]  # grown back to the size a quiet start measures
    assert fake.calls.count((BF16, 1024)) >= cpu.MEASURE_ROUNDS
    # at GPT-2's width, bf16's first product (16 rows, 0.2 ms of work) lost its cores for 90 ms: timed once and
    # left out of the turns, like PyTorch's slow fallback, it would say bf16 runs at 0.8 GFLOP/s; its CPU time
    # (0.4 ms) says otherwise, so it takes its turns
    fake = on_cpu(monkeypatch, True, BF16_HOST, ran=lambda i, dtype: 0.002 if i == 0 else 1.0)
    dtype, line = speedups.resolve_dtype("auto", "cpu", 768)
    assert dtype == "bf16" and "bf16 matmul 420 GFLOP/s vs fp32 185, measured now;" in line


def test_the_timer_reads_the_share_of_the_product_its_threads_ran(monkeypatch, one_thread):
    # a product that took 4 ms of wall time while the process ran for 1 ms: its thread was off the CPU 3/4 of it
    clock = iter([10.0, 10.004])
    cpu_clock = iter([5.0, 5.001])
    monkeypatch.setattr(cpu, "time", SimpleNamespace(perf_counter=lambda: next(clock),
                                                     process_time=lambda: next(cpu_clock)))
    seconds, share = cpu.matmul_timer(32)(FP32, 16)
    assert seconds == pytest.approx(0.004) and share == pytest.approx(0.25)


@pytest.mark.parametrize("contents", [b'{"', b"", b"[1, 2]", b"null", b'"rates"', b"\xff\xfe{}"])
def test_a_corrupt_cache_file_is_replaced_and_the_run_goes_on(cache, monkeypatch, contents):
    on_cpu(monkeypatch, True, {FP32: 150.0, BF16: 410.0}, width=128)
    cache.parent.mkdir(parents=True)
    cache.write_bytes(contents)
    assert cpu.matmul_rate(FP32, 128) == pytest.approx(150.0)
    assert json.loads(cache.read_text()) == {cpu.rate_key(FP32, 128): pytest.approx(150.0)}  # readable again


@pytest.mark.parametrize("value", ['"fast"', "-3", "0", "NaN", "Infinity", "true", "null", "[150]"])
def test_a_cached_value_that_is_not_a_positive_number_is_replaced(cache, monkeypatch, value):
    on_cpu(monkeypatch, True, {FP32: 150.0, BF16: 410.0}, width=128)
    cache.parent.mkdir(parents=True)
    other_machine = "Some Other CPU|AVX2|2.0.0|8|torch.float32|128"  # another CPU's and torch's rate: kept, unused
    cache.write_text(f'{{"{other_machine}": 5.5, "{cpu.rate_key(FP32, 128)}": {value}}}')
    assert cpu.matmul_rate(FP32, 128) == pytest.approx(150.0)
    assert json.loads(cache.read_text()) == {other_machine: 5.5, cpu.rate_key(FP32, 128): pytest.approx(150.0)}


def test_a_share_above_100_percent_measures_again_once(cache, monkeypatch):
    # the run's start measured in a busy moment: 10 GFLOP/s where this CPU does 150
    machine = FakeCPU(768, {FP32: 10.0})
    rate = cpu.MatmulRate("fp32", 768, machine.time_product)
    assert rate.gflops == pytest.approx(10.0) and rate.share(5.0) == " | 50% of this CPU's fp32 matmul rate"
    measured = len(machine.calls)
    machine.gflops[FP32] = 150.0  # quiet again
    line = rate.share(60.0)  # 600%: impossible, so the rate is measured again
    assert len(machine.calls) > measured and rate.gflops == pytest.approx(150.0)
    assert line == (" | 40% of this CPU's fp32 matmul rate "
                    "(measured again: the step beat the 10 GFLOP/s on record; now 150)")
    assert read_json(cache)[cpu.rate_key(FP32, 768)] == pytest.approx(150.0)  # the next start begins from it
    # a step that still beats the new rate runs faster than the probe (the bf16 fallback): said, not re-measured
    measured = len(machine.calls)
    assert rate.share(300.0) == " | 200% of this CPU's fp32 matmul rate" and len(machine.calls) == measured


def test_the_decision_measures_in_turns_and_survives_a_busy_moment(cache, monkeypatch):
    """A busy moment (another job) slows up to 10 products in a row, wherever it falls in the measurement, by
    a random 2-10x, and every product has a little jitter: the decision is right on both kinds of CPU. (Timed
    one dtype after the other, bf16's five turns and its sizing's last product fit in one such moment.)"""
    rng = random.Random(0)
    for gflops, expected in ((BF16_HOST, "bf16"), (NOT_FASTER, "fp32")):
        for start in range(22):
            for length in range(1, 11):
                slow, jitter = rng.uniform(2, 10), [rng.uniform(1, 1.1) for _ in range(100)]
                def slowdown(i):
                    return jitter[i] * (slow if start <= i < start + length else 1)
                fake = on_cpu(monkeypatch, True, gflops)
                fake.slowdown = slowdown
                cache.unlink(missing_ok=True)  # a first start: nothing better on record
                dtype, line = speedups.resolve_dtype("auto", "cpu", 768)
                assert dtype == expected, (start, length, slow, line)
                # after each dtype's size is found, the timed products alternate: bf16, fp32, bf16, fp32, ...
                assert [d for d, _ in fake.calls[-2 * cpu.MEASURE_ROUNDS:]] == [BF16, FP32] * cpu.MEASURE_ROUNDS
                # the same machine in the same state measures the same rates
                twice = [cpu.measure_matmul_rates((BF16, FP32), 768,
                                                  time_product=FakeCPU(768, gflops, slowdown).time_product)
                         for _ in range(2)]
                assert twice[0] == twice[1]


def test_a_slow_fallback_is_timed_once(cache, monkeypatch):
    # PyTorch's bf16 fallback at GPT-2 XL's width: 16 rows already take 0.3 s, more turns would cost seconds
    fake = on_cpu(monkeypatch, False, {BF16: 1.0, FP32: 170.0}, width=1600)
    dtype, line = speedups.resolve_dtype("auto", "cpu", 1600)
    assert dtype == "fp32" and fake.calls.count((BF16, 16)) == 1 and (BF16, 64) not in fake.calls
    assert [r for d, r in fake.calls if d == FP32] == [16, 64, 256] + [256] * cpu.MEASURE_ROUNDS  # (1024: 0.12 s each)


def test_cache_writes_at_once_never_leave_the_file_half_written(tmp_path):
    # ranks on one node, or two runs, or threads: each writes through a temporary file of its own
    path = str(tmp_path / "gpt2-cpu" / "rates.json")
    payloads = [{f"key {i} {j}": float(i * 1000 + j) for j in range(2000)} for i in range(6)]
    torn, done = [], threading.Event()
    def reader():
        while not done.is_set():
            if os.path.exists(path):
                with open(path) as f:
                    text = f.read()
                try:
                    if json.loads(text) not in payloads:
                        torn.append(text[:80])
                except ValueError:
                    torn.append(text[-80:])
    def writer(payload):
        for _ in range(15):
            write_json(path, payload)
    threads = [threading.Thread(target=reader)] + [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    done.set()
    threads[0].join()
    assert not torn and read_json(path) in payloads
    assert os.listdir(os.path.dirname(path)) == ["rates.json"]  # no temporary file left behind


def test_flops_per_token_counts_what_the_matmuls_do():
    # an independent count: PyTorch's FLOP counter over one training step's forward and backward, with
    # attention computed by plain matmuls (the counter does not see inside the fused CPU kernel)
    config = GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=64)
    model, T = GPT(config), 64
    x = torch.randint(0, config.vocab_size, (2, T))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        _, loss = model(x, x)
        loss.backward()
    counted = counter.get_total_flops() / x.numel()
    n_params = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()  # a lookup, no matmul
    ours = sizes.flops_per_token(n_params, config.n_layer, config.n_embd, T)
    assert abs(ours - counted) / counted < 0.02, (ours, counted)  # (ours counts biases and LayerNorms too)


def test_a_run_names_its_cpu_dtype_and_share_of_the_matmul_rate(tmp_path, one_thread):
    # and corrects a poisoned cache: rates of a thousandth of a GFLOP/s, as a busy first start might leave
    data, cache = make_shards(tmp_path / "data"), tmp_path / "cache" / "gpt2-cpu" / "matmul_rates.json"
    cache.parent.mkdir(parents=True)
    # --threads 1, width 32
    cache.write_text(json.dumps({cpu.rate_key(FP32, 32): 0.001, cpu.rate_key(BF16, 32): 0.001}))
    out = run_train(tiny_run_args(data, tmp_path / "log", "--max_steps", "2"),
                    env={"XDG_CACHE_HOME": str(tmp_path / "cache")}).stdout
    isa = torch.backends.cpu.get_cpu_capability() + (" + AMX" if cpu.has_amx() else "")  # (named where it has it)
    assert f"cpu: {cpu.cpu_name()}, {isa}, native bf16: " in out
    assert "1 torch thread(s)" in out and "dtype: fp32 (--dtype fp32; bf16 matmul " in out
    assert "vs fp32 0 here" not in out and read_json(cache)[cpu.rate_key(FP32, 32)] > 0.001
    assert set(read_json(cache)) == {cpu.rate_key(FP32, 32), cpu.rate_key(BF16, 32)}  # the run's own keys
    assert len(re.findall(r"\| \d+% of this CPU's fp32 matmul rate", out)) == 2  # on every step line


def test_one_bf16_training_step_runs_on_any_cpu(tmp_path):
    # where bf16 is not native this step is slow (the tiny model's 50,304-row lm_head), but it must work,
    # after a warning; --dtype auto would have chosen fp32 there
    data = make_shards(tmp_path / "data")
    args = tiny_run_args(data, tmp_path / "log", "--dtype", "bf16", "--max_steps", "1", "--eval_interval", "0",
                         "--checkpoint_interval", "1", "--total_batch_size", "128")
    cache = tmp_path / "cache" / "gpt2-cpu" / "matmul_rates.json"
    cache.parent.mkdir(parents=True)
    cache.write_text('{"AMD EPYC|AVX512|2.13.0|2|torch.bfloat16|32": 41')  # cut short: a corrupt cache stops no run
    out = run_train(args, env={"XDG_CACHE_HOME": str(tmp_path / "cache")}).stdout
    native = cpu.native_bf16()
    warned = "warning: --dtype bf16 on a CPU without fast bf16" in out
    # without native bf16, always the warning; with it, the warning only where measured no faster than fp32 (an AMX
    # Xeon at this width, one thread: bf16 ~1.3x fp32, near the 1.25 line)
    assert ("dtype: bf16 (--dtype bf16;" in out) != warned and (native or warned)
    assert "of this CPU's bf16 matmul rate" in out
    ckpt = torch.load(tmp_path / "log" / "model_00001.pt", weights_only=True)
    assert ckpt["args"]["dtype"] == "bf16" and all(torch.isfinite(w).all() for w in ckpt["model"].values())


def test_auto_resolves_the_same_way_in_a_run_as_here(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # at width 128, where each CPU kind's choice is clear (at 32 an AMX Xeon's bf16 is ~1.3x fp32, near the 1.25
    # line, and two measurements could fall on either side of it)
    expected, _ = speedups.resolve_dtype("auto", "cpu", 128)  # on one thread, as the run below (--threads 1)
    data = make_shards(tmp_path / "data")
    out = run_train(tiny_run_args(data, tmp_path / "log", "--dtype", "auto", "--max_steps", "1", "--n_embd", "128",
                                  "--n_head", "8", "--eval_interval", "0"),
                    env={"XDG_CACHE_HOME": str(tmp_path / "cache")}).stdout
    assert f"dtype: {expected} (" in out and f"of this CPU's {expected} matmul rate" in out
    assert expected == "fp32" or cpu.native_bf16()  # never bf16 without native support


def test_ipex_is_dropped_or_refused_where_it_cannot_run_bf16():
    # ipex.optimize's bf16 weights need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2 CPU it asserts
    ipex = object()  # stands for the module find_ipex returned: only whether it is kept matters here
    assert speedups.ipex_for_dtype(ipex, "auto", "bf16", bf16_weights=True) is ipex
    assert speedups.ipex_for_dtype(ipex, "auto", "fp32", bf16_weights=False) is ipex
    assert speedups.ipex_for_dtype(None, "auto", "bf16", bf16_weights=False) is None
    assert speedups.ipex_for_dtype(ipex, "auto", "bf16", bf16_weights=False) is None  # auto: train without it
    with pytest.raises(SystemExit, match="--ipex on with bf16: IPEX's bf16 weights need AVX-512"):
        speedups.ipex_for_dtype(ipex, "on", "bf16", bf16_weights=False)
