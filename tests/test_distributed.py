"""Data-parallel Trainer: 2 gloo processes on the CPU give the parameters one process gets on
the combined batch (to float rounding)."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dqn_ops import DQNConfig, Trainer, TrainerConfig

CONFIG = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=11, branches=(2, 3))
B, STEPS = 32, 6


def _batches():
    g = torch.Generator().manual_seed(7)
    return [dict(states=torch.randn(B, 6, generator=g), next_states=torch.randn(B, 6, generator=g),
                 actions=torch.stack([torch.randint(0, n, (B,), generator=g) for n in CONFIG.branches], 1),
                 rewards=torch.randn(B, generator=g), dones=(torch.rand(B, generator=g) < 0.2).float())
            for _ in range(STEPS)]


def _worker(rank, world, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # a different seed per rank: the broadcast from rank 0 must make them identical
        t = Trainer(CONFIG, TrainerConfig(batch_size=B // world, readback_interval=2), device="cpu", seed=rank)
        shard = slice(rank * B // world, (rank + 1) * B // world)
        for b in _batches():
            t.step({k: v[shard] for k, v in b.items()})
        torch.save(dict(online=t.online.flat_params.detach(), target=t.target.flat_params,
                        u=t.spectral.u, world=t.world_size), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_gloo_ranks_equal_one_process_on_the_combined_batch(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["world"] == 2
    for k in ("online", "target", "u"):  # the ranks stay identical, bit for bit
        assert torch.equal(r0[k], r1[k]), k
    single = Trainer(CONFIG, TrainerConfig(batch_size=B, readback_interval=2), device="cpu", seed=0)
    for b in _batches():
        single.step(b)
    # the same mean gradient, summed in another order: Adam's normalised steps agree closely
    torch.testing.assert_close(r0["online"], single.online.flat_params.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(r0["target"], single.target.flat_params, rtol=1e-5, atol=1e-7)


def test_train_script_under_torchrun_with_gloo(tmp_path):
    import json
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           os.path.join(root, "scripts", "train.py"), "--distributed", "--device", "cpu", "--tiny", "--epochs", "1",
           "--steps", "4", "--batch", "16", "--num-envs", "4", "--eval-envs", "8", "--quiet", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and not summary["non_finite"]
