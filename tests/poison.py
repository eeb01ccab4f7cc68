"""Poisoning of the CUDA caching allocator: the ops allocate their outputs with at::empty,
so filling freed cache blocks with NaN first makes any element an op forgets to write show
up as NaN instead of as a stale plausible value."""
import torch


def poison_cuda_cache(device="cuda"):
    blocks = [torch.full((s // 4,), float("nan"), device=device)
              for s in [64 << 10] * 32 + [512 << 10] * 16 + [4 << 20] * 8 + [32 << 20] * 4]
    del blocks  # back into the cache, NaN-filled
