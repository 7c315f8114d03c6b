"""
The ways to make a step faster: the precision (bf16 where this machine computes it fast, else fp32),
torch.compile (C++ kernels fused for the whole step, cached on disk) and Intel Extension for PyTorch
(ipex.optimize), each used when it can run.
"""
import copy
import importlib.metadata
import importlib.util
import math
import os
import shutil
import time
from contextlib import nullcontext

import torch

from compute import cpu
from plumbing.common import cache_dir

# -----------------------------------------------------------------------------
# The precision: --dtype auto|bf16|fp32. bf16 halves the bytes every matmul reads and, on a CPU with
# AVX512-BF16 or AMX, more than doubles its rate; on one without (AVX2: most laptops, many cloud VMs),
# PyTorch's fallback for bf16 matmuls runs ~150x slower than fp32 (1 vs 170 GFLOP/s, pytorch#118499).
# So on a CPU the flags decide (cpu.native_bf16), and the rates measured at the model's shape confirm:
# one that advertises bf16 but runs it no faster than fp32 gets fp32, also the more precise of the two.
# On a busy machine (another job on these cores) the rates come from a longer measurement, or from the
# best ones kept for this machine (cpu.decision_rates), and the line says which.

BF16_MIN_SPEEDUP = 1.25  # bf16's matmul must beat fp32's by this much to pay for autocast's casts

def describe_rates(bf16, fp32, source, measurement):
    """The dtype line's evidence: the two rates the decision used, and where they come from."""
    rates = f"bf16 matmul {cpu.rate_text(bf16)} GFLOP/s vs fp32 {cpu.rate_text(fp32)}"
    if source == "earlier":
        return f"{rates}, measured earlier (this machine is busy now: decided from the best rates kept for it)"
    if measurement.busy:
        return f"{rates}, measured now (this machine is busy: the best of {measurement.rounds} turns each)"
    return f"{rates}, measured now"

def resolve_dtype(requested, device_type, width, ranks=None):
    """--dtype auto|bf16|fp32 -> ('bf16' or 'fp32', the line that says why): the one place a run's precision
    is decided. On a CPU: bf16 where it is native and measured faster at the model's width (cpu.decision_rates:
    both dtypes now, in turns, so that a busy moment slows both alike, or on a busy machine the best rates kept
    for it); call it once torch's threads are set, as the rates are those of these threads. An explicit bf16
    that will run slowly here gets a line starting 'warning:'. On a GPU: bf16 where the device supports it.
    ranks (world.Ranks, for a job of several): every rank calls this, and --dtype auto keeps bf16 only if every
    rank chose it."""
    if device_type == "cpu":
        rates, source, measurement = cpu.decision_rates((torch.bfloat16, torch.float32), width)
        bf16, fp32, native = rates[torch.bfloat16], rates[torch.float32], cpu.native_bf16()
        fast = native and bf16 >= BF16_MIN_SPEEDUP * fp32
        measured = describe_rates(bf16, fp32, source, measurement)
        if requested == "bf16" and not fast:
            return "bf16", (f"warning: --dtype bf16 on a CPU without fast bf16: {measured}, "
                            f"{fp32 / bf16:.1f}x slower than fp32 would be (--dtype auto picks fp32)")
        if requested != "auto":
            return requested, f"dtype: {requested} (--dtype {requested}; {measured})"
        isa = torch.backends.cpu.get_cpu_capability()
        if fast:
            dtype, line = "bf16", f"dtype: bf16 ({isa}, native bf16: {measured}; --dtype fp32 for full precision)"
        else:
            why = "native bf16, but not faster" if native else "no native bf16"
            dtype, line = "fp32", f"dtype: fp32 ({isa}, {why}: {measured}; --dtype bf16 forces it)"
    elif requested != "auto":
        return requested, f"dtype: {requested} (--dtype {requested})"
    elif device_type == "xpu" or (device_type == "cuda" and torch.cuda.is_bf16_supported()):
        dtype, line = "bf16", f"dtype: bf16 ({device_type})"
    else:
        dtype, line = "fp32", f"dtype: fp32 ({device_type} without bf16)"
    if ranks is not None and ranks.world_size > 1:  # a collective: every rank with --dtype auto gets here
        everyone = ranks.all_reduce_sum(torch.tensor(float(dtype == "bf16"), device=ranks.device))
        if dtype == "bf16" and everyone < ranks.world_size:
            kind = "CPUs" if device_type == "cpu" else "devices"
            dtype, line = "fp32", f"dtype: fp32 (some ranks' {kind} have no fast bf16)"
    return dtype, line

def autocast(dtype, device_type):
    """The forward pass in `dtype`: 'bf16' runs it under autocast (matmuls in bf16, softmax and norms in
    fp32, weights kept in fp32); 'fp32' is plain PyTorch."""
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype must be 'bf16' or 'fp32', not {dtype!r}")
    return torch.autocast(device_type, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()

def find_ipex(mode, device_type, compiles, print0):
    """Intel Extension for PyTorch when --ipex asks for it (on) or allows it (auto) and it can run, else None.

    Optional: Intel stopped developing IPEX after 2.8, and it runs only with the torch minor version
    it was built for; a mismatch is a clear error with --ipex on and a quiet skip with auto.
    compiles: whether the run will torch.compile its step. Importing IPEX 2.8 breaks torch 2.8's compiled attention
    backward (the compiled graph expects one tensor where the op returns several: "TypeError: expected Tensor() for
    op: ..._scaled_dot_product_flash_attention_for_cpu_backward" at the first step, fp32 and bf16, measured on an AMD
    EPYC Zen 4), even when IPEX then trains nothing; and the compiled step beat IPEX's wherever both were timed (a
    GPT-2 block, bf16 on Zen 4: 606 vs 729 ms; fp32 on an AMX Xeon: 888 vs 1144 ms). So --ipex auto leaves IPEX
    unimported in a compiled run, and considers it with --no-compile."""
    if mode == "off":
        return None
    if device_type not in ("cpu", "xpu"):
        if mode == "on":
            raise SystemExit(f"error: --ipex on needs --device cpu or xpu, not {device_type}")
        return None
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        if mode == "on":
            raise SystemExit("error: --ipex on, but intel_extension_for_pytorch is not installed "
                             "(pip install -r requirements-intel.txt, or pass --ipex off)")
        return None
    if mode == "auto" and compiles:
        print0("ipex: not used: the compiled step is faster, and importing IPEX breaks it (--no-compile to time "
               "the two, --ipex on to force it)")
        return None
    version = importlib.metadata.version("intel_extension_for_pytorch")
    if version.split(".")[:2] != torch.__version__.split(".")[:2]:
        if mode == "on":
            raise SystemExit(f"error: --ipex on, but intel_extension_for_pytorch {version} needs torch "
                             f"{'.'.join(version.split('.')[:2])}.*, not {torch.__version__} "
                             "(see requirements-intel.txt)")
        return None
    import intel_extension_for_pytorch as ipex
    return ipex

# -----------------------------------------------------------------------------
# torch.compile: the first step traces the model and compiles C++ kernels for it (~30 s for
# GPT-2 124M on 2 cores); the kernels are cached on disk, so a later run starts in a few seconds

def compile_cache_dir():
    """Where torch.compile keeps its kernels: $TORCHINDUCTOR_CACHE_DIR if you set it, else
    ~/.cache/gpt2-cpu/inductor/ISA (PyTorch's own default, /tmp/torchinductor_$USER, is emptied at every reboot). One
    folder per vector ISA (AVX512, AVX2, ...): a home folder can be shared by CPUs of different kinds, and kernels
    compiled under AVX512 and then loaded in a process limited to AVX2 (ATEN_CPU_CAPABILITY=avx2) trained to NaN here.
    PyTorch writes its default into the variable itself on first use (building a fused AdamW does), and child processes
    inherit it: that value is PyTorch's choice, not yours, so it is replaced too."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir("inductor", torch.backends.cpu.get_cpu_capability())
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]

# What forward keeps for backward: left to itself, torch.compile keeps every tensor backward will read
# (the MLP's input and its GELU output, a bf16 copy of each weight, ...). Given a budget below 1, its
# partitioner recomputes the cheapest of them during backward instead. Measured at GPT-2 124M, B=4,
# T=1024 with bench/bench_train.py --ab on an AMD EPYC, 2 cores: in bf16 (AVX512-BF16), budget 1 peaks at
# 4.0 GiB, 0.9 at 3.2 GiB, 1.02x faster than 0.8 and 0.97-1.0x as fast as 1 (0.5 also recomputes attention,
# 20% slower); in fp32 (AVX2 only), 0.9 peaks at 4.5 GiB against 1's 5.3, at 1.00x its speed.
ACTIVATION_MEMORY_BUDGET = 0.9

def compile_model(model, memory_budget=None):
    compile_cache_dir()
    import torch._functorch.config
    torch._functorch.config.activation_memory_budget = memory_budget or ACTIVATION_MEMORY_BUDGET
    # a tensor-parallel graph holds its process group (a script object, for DTensor's collectives), which the
    # partitioner that picks what backward recomputes cannot size: it holds no activations, so zero is its size
    # (a setting torch 2.8, the IPEX lane's, does not have yet)
    if hasattr(torch._functorch.config, "unsafe_treat_script_objects_as_zero_size"):
        torch._functorch.config.unsafe_treat_script_objects_as_zero_size = True
    return torch.compile(model)

def will_compile(flag, device_type):
    """Whether a run given --compile (flag) will compile: TORCH_COMPILE_DISABLE=1 and a missing C++ compiler say no."""
    return flag and os.environ.get("TORCH_COMPILE_DISABLE", "0") != "1" and can_compile(device_type)

def can_compile(device_type):
    """On CPU, torch.compile needs a C++ compiler; without one it would fail at the first step."""
    return device_type != "cpu" or any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++"))

def ipex_for_dtype(ipex, mode, dtype, bf16_weights):
    """IPEX as find_ipex found it, unless the run is bf16 on a CPU without what ipex.optimize's bf16 weights
    need (bf16_weights: AVX-512 BW, VL and DQ, or AVX-NE-CONVERT, as torch.ops.mkldnn._is_mkldnn_bf16_supported()
    says; an AVX2 CPU has neither, and IPEX fails with an assertion there): then None with --ipex auto, and
    a one-line error with --ipex on."""
    if ipex is None or dtype != "bf16" or bf16_weights:
        return ipex
    if mode == "on":
        raise SystemExit("error: --ipex on with bf16: IPEX's bf16 weights need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, "
                         "which this CPU lacks; pass --dtype auto (fp32 here), or --ipex off")
    return None

# IPEX 2.8's bf16 gradients, measured on an Intel Xeon with AMX (2 cores) against PyTorch's under the same autocast:
# - its Linear weight gradients go wrong at GPT-2's width once a micro-step holds more than about 2,500 rows (B x T):
#   the norm of Linear(768, 3072)'s is right at 2,048 and 2,049 rows, 5.7-5.9x too large at 3,000, 4,095, 4,096 and
#   8,192; Linear(768, 768)'s 2.9x at 4,096; Linear(64, 64)'s and (128, 512)'s right at 4,096 (a tiny test model never
#   shows it). GPT-2 (124M) at B 4 x T 1024: the loss right, the gradient norm 38.1 against 7.2.
# - at 2,048 rows, where those are right, the first LayerNorm of each block gets a bias gradient 23-25% smaller than
#   PyTorch's (its weight's 0.2-6%); the second LayerNorm's and every other parameter's agree to 0.2%.
# Both are in IPEX's AMX kernels: on AMD EPYC Zen 4 and Zen 5 (AVX512-BF16, no AMX) every gradient agrees within
# 0.02% at 4 x 1024 rows (GPT-2 124M's gradient norm 7.1869 with IPEX, 7.1835 without, on Zen 5).
# So before IPEX trains, a block of the model is run both ways at the run's shapes and every parameter's gradient
# compared; and since that block check does not see the LayerNorm bias (it shows only in the whole model's step),
# --ipex auto does not use IPEX for bf16 on a CPU with AMX.
IPEX_GRAD_TOLERANCE = 0.02  # bf16 rounding moves a gradient's norm by well under this here (measured: 0.002)

def ipex_gradient_error(ipex, block, batch_size, seq_len, dtype):
    """(the largest relative difference between the norms of a parameter's gradient with ipex.optimize and without,
    that parameter's name) for one forward and backward of a copy of `block` at (batch_size, seq_len) in `dtype`
    ('bf16' or 'fp32'). Its random numbers come from a generator of its own: the run's stay as they were."""
    generator, width = torch.Generator().manual_seed(0), block.ln_1.normalized_shape[0]
    x = torch.randn(batch_size, seq_len, width, generator=generator)
    grad = torch.randn(batch_size, seq_len, width, generator=generator)
    norms = []
    for use_ipex in (False, True):
        model = copy.deepcopy(block)
        optimizer = torch.optim.AdamW(model.parameters())
        if use_ipex:
            model, optimizer = ipex.optimize(model, optimizer=optimizer, inplace=True,
                                             dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        with autocast(dtype, "cpu"):
            out = model(x)
        out.float().backward(grad)
        norms.append({name: p.grad.float().norm().item() for name, p in model.named_parameters() if p.grad is not None})
    return max((abs(norms[1][name] / norm - 1), name) for name, norm in norms[0].items() if norm > 0)

def time_block(block, batch_size, seq_len, dtype, turns=3):
    """block(x) forward and backward, its best of `turns` after a first (which compiles, where it is compiled)."""
    x = torch.randn(batch_size, seq_len, block.ln_1.normalized_shape[0], generator=torch.Generator().manual_seed(0))
    best = math.inf
    for turn in range(turns + 1):
        start = time.perf_counter()
        with autocast(dtype, "cpu"):
            out = block(x)
        out.float().sum().backward()
        best = min(best, time.perf_counter() - start) if turn else best
    return best

def decide_ipex(ipex, mode, dtype, block, batch_size, seq_len, ranks):
    """IPEX (as found) if it trains right at this run's shapes and faster than the plain step, else None; with --ipex
    on, right is enough, and wrong is one error line. block: one of the model's blocks (copied, not changed), timed with
    ipex.optimize against as the trainer would run it without (eagerly: find_ipex leaves IPEX out of a compiled run).
    Every rank must agree: IPEX only if all choose it. Returns (IPEX or None, the line that says why)."""
    error, name = ipex_gradient_error(ipex, block, batch_size, seq_len, dtype)
    if error > IPEX_GRAD_TOLERANCE:
        why = (f"IPEX {ipex.__version__}'s {dtype} gradients are wrong at this run's {batch_size} x {seq_len} rows a "
               f"micro-step: a block's {name} off by {100 * error:.0f}% against PyTorch's")
        if mode == "on":
            raise SystemExit(f"error: --ipex on: {why}; pass a smaller --batch_size, or --ipex off")
        use, line = False, f"ipex: not used: {why}"
    elif mode == "on":
        use, line = True, "ipex: used (--ipex on; a block's gradients checked at this run's shapes)"
        if dtype == "bf16" and cpu.has_amx():
            line = (f"warning: {line}, but on a CPU with AMX IPEX's bf16 LayerNorm gradients were measured wrong in "
                    "GPT-2 (docs/distributed.md)")
    elif dtype == "bf16" and cpu.has_amx():
        use, line = False, ("ipex: not used: on a CPU with AMX its bf16 gradients were measured wrong in "
                            "GPT-2 (the first LayerNorm's bias 25% off at any batch, docs/distributed.md); "
                            "--ipex on forces it")
    else:
        plain = copy.deepcopy(block)
        ipex_block = copy.deepcopy(block)  # (training mode: IPEX wants the optimizer too, for its master weights)
        ipex_block, _ = ipex.optimize(ipex_block, optimizer=torch.optim.AdamW(ipex_block.parameters()), inplace=True,
                                      dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        with torch.random.fork_rng():
            plain_s, ipex_s = (time_block(plain, batch_size, seq_len, dtype),
                               time_block(ipex_block, batch_size, seq_len, dtype))
        use = ipex_s < plain_s
        line = (f"ipex: {'used' if use else 'not used'}: a block's forward and backward took {1000 * ipex_s:.0f} ms "
                f"with IPEX vs {1000 * plain_s:.0f} ms plain (--ipex on|off forces it)")
    if ranks is not None and ranks.world_size > 1:
        use = ranks.all_reduce_sum(torch.tensor(float(use), device=ranks.device)).item() == ranks.world_size
    return (ipex if use else None), line

def apply_ipex(ipex, model, optimizer, dtype, print0):
    """Intel Extension for PyTorch's optimize(), for the run's dtype ('bf16' or 'fp32'): after any checkpoint
    is loaded (checkpoints hold plain weights and optimizer state), before DDP (which must wrap the
    parameters IPEX trains)."""
    dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    model, optimizer = ipex.optimize(model, optimizer=optimizer, dtype=dtype, inplace=True)  # inplace: no second copy
    print0(f"ipex: intel_extension_for_pytorch {ipex.__version__}, optimize(dtype={dtype}) "
           f"(--ipex off to train without it)")
    return model, optimizer

def compile_if_possible(model, ipex, device_type, print0):
    """torch.compile the training model unless something rules it out. Returns (model, whether compiled)."""
    if ipex is not None:
        # measured here: torch.compile over an ipex.optimize'd model leaves the blocks' LayerNorm
        # parameters without gradients (tests/test_ipex.py), so the two are not combined
        print0("compile: off, because IPEX optimized the model (--ipex off to compile instead)")
        return model, False
    import torch._dynamo  # (the optimizer's constructor imported it already)
    # TORCH_COMPILE_DISABLE=1: torch.compile would return a wrapper that compiles nothing
    if torch._dynamo.config.disable:
        print0("compile: off (TORCH_COMPILE_DISABLE=1)")
        return model, False
    if not can_compile(device_type):
        print0("warning: --compile needs a C++ compiler (g++ or clang++, or $CXX) and none was found: "
               "training without it (install one, or pass --no-compile to silence this)")
        return model, False
    print0(f"compile: torch.compile, kernels cached in {compile_cache_dir()}")
    return compile_model(model), True
