"""Poisoning of the CUDA caching allocator: the ops allocate their outputs with at::empty,
so filling freed cache blocks with all-ones bytes first makes any element an op forgets to
write show up as NaN (F32, BF16 and F16 alike: 0xFF... is a NaN in each) or -1 (an integer,
out of range as an index or action) instead of as a stale plausible value. (F32's own NaN,
0x7FC00000, would read as BF16 0x0000 = +0.0 at every even element.)"""
import torch


def poison_cuda_cache(device="cuda"):
    blocks = [torch.full((s // 4,), -1, dtype=torch.int32, device=device)
              for s in [64 << 10] * 32 + [512 << 10] * 16 + [4 << 20] * 8 + [32 << 20] * 4]
    del blocks  # back into the cache, filled with 0xFF bytes
