"""
How one training step runs fast on this CPU (one process; parallel/ spreads the work over ranks). Read in this order:

  cpu.py          this CPU: what it computes fast (native bf16 or not, its matmul rates, measured at every start and
                  kept as the best seen), threads and affinity, malloc, the vector-math warm-up
  speedups.py     the precision (the one place a run's dtype is decided, from cpu.py's measurements) and the optional
                  ways to make a step faster: torch.compile and Intel's IPEX
  fused_loss.py   lm_head and the loss, a chunk of positions at a time: the logits are never all in memory
  attention.py    causal attention: our kernel (attention.cpp, on AMX or AVX512-BF16) where it measures faster than
                  PyTorch's, else PyTorch's
"""
