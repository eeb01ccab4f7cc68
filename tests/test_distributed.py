"""Data-parallel Trainer: 2 gloo processes on the CPU, and 2 NCCL processes on two GPUs with the
all-reduce captured in the step's CUDA graph, give the parameters one process gets on the
combined batch (to float rounding)."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dqn_ops import DQNConfig, Trainer, TrainerConfig, ops
from dqn_ops.trainer import group_mask_seed

CONFIG = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=11, branches=(2, 3))
B, STEPS = 32, 6


def _batches():
    g = torch.Generator().manual_seed(7)
    return [dict(states=torch.randn(B, 6, generator=g), next_states=torch.randn(B, 6, generator=g),
                 actions=torch.stack([torch.randint(0, n, (B,), generator=g) for n in CONFIG.branches], 1),
                 rewards=torch.randn(B, generator=g), dones=(torch.rand(B, generator=g) < 0.2).float())
            for _ in range(STEPS)]


def _worker(rank, world, port, out_dir, backend="gloo"):
    device = "cpu"
    if backend == "nccl":
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # a different seed per rank: the broadcast from rank 0 must make them identical. On
        # CUDA the step (all-reduce included) is captured in a CUDA graph after the warm-up.
        cfg = TrainerConfig(batch_size=B // world, readback_interval=2, warmup_steps=2)
        t = Trainer(CONFIG, cfg, device=device, seed=rank)
        shard = slice(rank * B // world, (rank + 1) * B // world)
        for b in _batches():
            t.step({k: v[shard] for k, v in b.items()})
        torch.save(dict(online=t.online.flat_params.detach().cpu(), target=t.target.flat_params.cpu(),
                        u=t.spectral.u.cpu(), world=t.world_size, graphed=t.graphed),
                   os.path.join(out_dir, f"rank{rank}.pt"))
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


ENSEMBLE = DQNConfig(state_dim=6, trunk_hidden=(16,), value_hidden=8, adv_hidden=8, atoms=11, branches=(2, 3),
                    ensemble=4)
MASK_ROWS = torch.arange(512)


def _mask_worker(rank, world, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:  # the same seed on every rank, as scripts/train.py gives them
        t = Trainer(ENSEMBLE, TrainerConfig(batch_size=8, bootstrap_p=0.5), device="cpu", seed=3)
        torch.save(dict(rank=t.rank, masks=t.bootstrap_masks(MASK_ROWS)), os.path.join(out_dir, f"masks{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_each_rank_draws_bootstrap_masks_of_its_own(tmp_path):
    """The ranks' replays hold different transitions at the same rows, so a row's masks differ by
    rank (the key adds rank * 2^48); rank 0's are a single process's."""
    mp.spawn(_mask_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"masks{r}.pt") for r in (0, 1))
    assert (r0["rank"], r1["rank"]) == (0, 1)
    single = Trainer(ENSEMBLE, TrainerConfig(batch_size=8, bootstrap_p=0.5), device="cpu", seed=3)
    assert torch.equal(r0["masks"], single.bootstrap_masks(MASK_ROWS))
    assert torch.equal(r1["masks"], ops.bootstrap_masks(MASK_ROWS, group_mask_seed(3, 0, rank=1), 4, 0.5))
    agree = (r0["masks"] == r1["masks"]).float().mean().item()
    assert 0.4 < agree < 0.6, f"rank 1's masks agree with rank 0's on {agree:.1%} of 2048 draws (independent: ~50%)"


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


def test_scaling_benchmark_merge(tmp_path):
    """scripts/bench_distributed.py --merge: the table and the efficiency t(1 GPU) / t(N GPUs) from
    the per-world files the ranks write. (The ranks' part needs a multi-GPU machine to mean
    anything; on the CPU it was run by hand under torchrun/gloo: gloo processes that ran a
    Trainer sometimes abort in torch's teardown after the last line, so it is not a CI test.)"""
    import json
    import subprocess
    import sys

    meta = dict(date="2026-01-01", device="Test GPU", torch=torch.__version__)
    for world, rows in ((1, [(4096, 300.0), (65536, 3000.0)]), (2, [(4096, 400.0), (65536, 3300.0)])):
        (tmp_path / f"distributed-world{world}.json").write_text(json.dumps(dict(
            meta=dict(meta, world=world),
            rows=[dict(world=world, batch_per_gpu=b, step_us=us, graphed=True, samples_per_s=round(world * b / us * 1e6))
                  for b, us in rows])))
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_distributed.py")
    subprocess.run([sys.executable, script, "--merge", str(tmp_path)], check=True, capture_output=True, text=True,
                   timeout=120)
    merged = json.loads((tmp_path / "distributed.json").read_text())
    eff = {(r["world"], r["batch_per_gpu"]): r["scaling_efficiency"] for r in merged["rows"]}
    assert eff == {(1, 4096): 1.0, (2, 4096): 0.75, (1, 65536): 1.0, (2, 65536): round(3000 / 3300, 3)}
    assert merged["meta"]["worlds"] == [1, 2]
    assert "| 65536 | 2 | 3300.0 |" in (tmp_path / "distributed.md").read_text()


two_gpus = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
                                   and dist.is_available() and dist.is_nccl_available()),
                              reason="needs two CUDA devices and NCCL")


@two_gpus
def test_two_nccl_ranks_with_a_captured_all_reduce_equal_one_gpu_on_the_combined_batch(tmp_path, monkeypatch):
    # NVLink multicast stays off (the device tool's KINDS.md): the workers inherit this.
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        monkeypatch.setenv(name, value)
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), "nccl"), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["world"] == 2 and r0["graphed"] and r1["graphed"]  # the later steps were graph replays
    for k in ("online", "target", "u"):
        assert torch.equal(r0[k], r1[k]), k
    single = Trainer(CONFIG, TrainerConfig(batch_size=B, readback_interval=2, warmup_steps=2), device="cuda:0", seed=0)
    for b in _batches():
        single.step(b)
    # BF16 GEMMs over 16 + 16 rows vs 32 rows sum the batch in another order; Adam's first
    # steps are near lr * sign(g), so an element with g ~ 0 may move the other way: compare
    # with a tolerance of a few Adam steps on those, and tightly on the bulk.
    got, want = r0["online"], single.online.flat_params.detach().cpu()
    lr = single.config.lr
    assert (got - want).abs().max() <= 2 * STEPS * lr
    assert ((got - want).abs() > 1e-5 + 1e-3 * want.abs()).float().mean() < 0.01
