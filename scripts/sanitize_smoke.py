"""Runs every CUDA kernel of dqn_ops once or twice on small inputs, checking nothing itself:
the program scripts/verify_gpu.sh runs under compute-sanitizer (memcheck, racecheck, initcheck,
synccheck). Small configs keep the sanitizer's slowdown to minutes."""
import os
import subprocess
import sys

import torch
from bench_common import run_meta, switches_note

import dqn_ops
from dqn_ops import DQNConfig, Trainer, TrainerConfig, dense_kernel

CONFIGS = [DQNConfig(state_dim=37, trunk_hidden=(61, 45), value_hidden=(29,), adv_hidden=(23,), atoms=11,
                     branches=(3, 2)),
           DQNConfig(state_dim=16, trunk_hidden=(32, 32), value_hidden=(16,), adv_hidden=(16,), atoms=1,
                     branches=(4, 2)),
           # other network shapes: three trunk layers and two block-diagonal head layers; no head
           # layer and no dueling (the output heads all read the trunk, two of them as one group);
           # one trunk layer, no head layer, dueling, one atom
           DQNConfig(state_dim=10, trunk_hidden=(32, 24, 16), value_hidden=(12, 6), adv_hidden=(8, 5), atoms=7,
                     branches=(2, 4, 3)),
           DQNConfig(state_dim=8, trunk_hidden=(20, 16), adv_hidden=(), atoms=5, branches=(3, 3, 1), dueling=False),
           DQNConfig(state_dim=8, trunk_hidden=(20,), value_hidden=(), adv_hidden=(), atoms=1, branches=(3, 1, 4)),
           # CleanRL's c51 shape: the fused loss's version with 4 atoms a lane, no value head
           DQNConfig(state_dim=4, trunk_hidden=(120, 84), adv_hidden=(), atoms=101, branches=(2,), dueling=False)]

# The switches of code paths not on by default, each set in a child process that runs the sections
# they change (each switch is read once a process).
SWITCHED_PATHS = dict(DQN_OPS_EPILOGUE_COLUMN_SUMS="on", DQN_OPS_NARROW_LOGITS="1", DQN_OPS_STAGE_HEAD_ROWS="1",
                      DQN_OPS_DENSE_COSINES="1")
SWITCHED_RAN = "sanitize_smoke: the switched paths' sections ran"


def dense_kernel_section(dev):
    """The dense layer kernel (csrc/cuda/dense_layer.cu) on every layer it can run: the hidden
    layers' bias + ReLU, the output layer's heads (one network, and both in the trainer's step),
    the backward's masked input gradients, their stores staged through shared memory; rows that
    take each tile shape on a GPU of 132 SMs (32 x 64, 64 x 64, 128 x 128), with tails in every
    dimension (tests/test_dense_layer.py's SHAPE)."""
    c = DQNConfig(state_dim=40, trunk_hidden=(130, 256), value_hidden=(24,), adv_hidden=(16,), atoms=5,
                  branches=(2, 3))
    previous = dense_kernel.set_mode("on")
    try:
        net = dqn_ops.DuelingBranchQNet(c).to(dev)
        for B in (33, 300, 3000, 9000):
            s = torch.randn(B, c.state_dim, device=dev)
            out = net.forward_full(s)
            dqn_ops.mixed_backward(torch.randn_like(out.q_logits), None, out, net.flat_params.detach(),
                                   net.params_bf16, net._layout_ints, "bf16", True)
        for B in (33, 3000):
            t = Trainer(c, TrainerConfig(batch_size=B, use_cuda_graph=False), device=dev)
            s = torch.randn(B, c.state_dim, device=dev)
            a = torch.stack([torch.randint(0, n, (B,), device=dev) for n in c.branches], 1)
            t.step(dict(states=s, next_states=torch.randn_like(s), actions=a, rewards=torch.randn(B, device=dev),
                        dones=torch.zeros(B, device=dev)))
    finally:
        dense_kernel.set_mode(previous)


def iqn_backward_section(dev):
    """IQN's backward on 9 samples x 5 fractions in bf16 (iqn_backward_kernel, its dP's sums by
    sample under DQN_OPS_EPILOGUE_COLUMN_SUMS=on)."""
    c = DQNConfig(state_dim=16, trunk_hidden=(32, 32), value_hidden=(16,), adv_hidden=(16,), atoms=1,
                  branches=(4, 2), iqn_embedding=8)
    net = dqn_ops.DuelingBranchQNet(c).to(dev)
    out = net.forward_full(torch.randn(9, c.state_dim, device=dev), torch.rand(9, 5, device=dev))
    dqn_ops.mixed_backward(torch.randn_like(out.q_logits), None, out, net.flat_params.detach(), net.params_bf16,
                           net._layout_ints, "bf16", True)


def one_atom_rows_section(dev):
    """Output layers of one-atom heads at rows past 2048 that fill the SMs (the narrow 128 x 16
    tile under DQN_OPS_NARROW_LOGITS=1, the output bias + dueling kernel's staged rows under
    DQN_OPS_STAGE_HEAD_ROWS=1) and IQN's phi layer with its cosines formed in the dense kernel
    (DQN_OPS_DENSE_COSINES=1): an MSE network at 40,000 rows, IQN at 1000 x 37 fraction rows and
    at 100 x 40 (64 cosines; phi 160 wide: blocks past the first column tile, on the 128 x 128
    and 64 x 64 tiles) and at 37 x 5 (16 cosines: a partial K tile), each with its backward, the
    dense kernel on every layer it can run."""
    previous = dense_kernel.set_mode("on")
    try:
        mse = DQNConfig(state_dim=16, trunk_hidden=(32,), value_hidden=(16,), adv_hidden=(16,), atoms=1,
                        branches=(2, 3, 5))
        iqn = DQNConfig(state_dim=16, trunk_hidden=(64, 160), value_hidden=(16,), adv_hidden=(16,), atoms=1,
                        branches=(3, 2), iqn_embedding=64)
        iqn_16 = DQNConfig(state_dim=12, trunk_hidden=(40,), value_hidden=(16,), adv_hidden=(8,), atoms=1,
                           branches=(3,), iqn_embedding=16)
        for c, B, fractions in ((mse, 40_000, 0), (iqn, 1000, 37), (iqn, 100, 40), (iqn_16, 37, 5)):
            net = dqn_ops.DuelingBranchQNet(c).to(dev)
            tau = torch.rand(B, fractions, device=dev) if fractions else None
            out = net.forward_full(torch.randn(B, c.state_dim, device=dev), tau)
            dqn_ops.mixed_backward(torch.randn_like(out.q_logits), None, out, net.flat_params.detach(),
                                   net.params_bf16, net._layout_ints, "bf16", True)
    finally:
        dense_kernel.set_mode(previous)


def main():
    # The log says what it checked: the device, the versions and the code-path switches.
    meta = run_meta()
    print(f"sanitize_smoke: {meta['device']}, torch {meta['torch']}, CUDA {meta['cuda']}, {meta['date']}, "
          f"{switches_note(meta['switches'])}", flush=True)
    torch.manual_seed(0)
    dev = "cuda"
    for c in CONFIGS:
        net = dqn_ops.DuelingBranchQNet(c).to(dev)
        s = torch.randn(33, c.state_dim, device=dev)
        out = net.forward_full(s)
        for precision in dqn_ops.ops.BACKWARD_PRECISIONS:
            dqn_ops.mixed_backward(torch.randn_like(out.q_logits), torch.randn_like(out.head_logits), out,
                                   net.flat_params.detach(), net.params_bf16, net._layout_ints, precision, True)
        B, A = 33, c.total_actions
        q = [torch.randn(B, A, c.atoms, device=dev) for _ in range(3)]
        a = torch.stack([torch.randint(0, n, (B,), device=dev) for n in c.branches], 1)
        r, d, w = torch.randn(B, device=dev) * 20, (torch.rand(B, device=dev) < 0.3).float(), torch.rand(B, device=dev)
        dqn_ops.dqn_loss(*q, a, r, d, c.branches, weights=w, loss_type="c51" if c.atoms > 1 else "huber")
        # the trainer's step (dqn_ops/step.py) with the online and target hidden layers batched
        # and in two passes; the C51 config's loss is the fused kernel, the one-atom config's
        # the composition of the public kernels
        for batch_networks in (True, False):
            t = Trainer(c, TrainerConfig(batch_size=B, use_cuda_graph=False, readback_interval=2), device=dev)
            assert t.uses_fused_path == (c.atoms > 1)
            t.batch_networks = batch_networks
            for _ in range(3):
                t.step(dict(states=s, next_states=torch.randn_like(s), actions=a, rewards=r, dones=d))
            t.readback()
    dense_kernel_section(dev)
    # the same, IQN's backward and one-atom heads at many rows with the paths SWITCHED_PATHS
    # names (the bias gradients' column sums begun where the gradients are formed at any rows, the
    # narrow output tile, the staged head rows, the cosines formed in phi's launch) in a child,
    # which compute-sanitizer follows and reports in this log. Its exit status may be the
    # sanitizer's error code (racecheck's reports inside cuBLAS, which verify_gpu.sh sorts out), so
    # the child's last line, not its status, says whether it ran to the end.
    child = subprocess.run([sys.executable, __file__, "--switched-paths"], capture_output=True, text=True,
                           env=dict(os.environ, **SWITCHED_PATHS))
    print(child.stdout + child.stderr, end="", flush=True)
    if SWITCHED_RAN not in child.stdout:
        raise SystemExit(f"sanitize_smoke: the sections with the switched paths exited {child.returncode} before "
                         f"their end")
    # the backward's weight gradients split over row chunks and reduced (from 32768 rows)
    c = DQNConfig(state_dim=8, trunk_hidden=(16, 16), value_hidden=(8,), adv_hidden=(8,), atoms=3, branches=(2,))
    net = dqn_ops.DuelingBranchQNet(c).to(dev)
    out = net.forward_full(torch.randn(32800, c.state_dim, device=dev))
    dqn_ops.mixed_backward(torch.randn_like(out.q_logits), None, out, net.flat_params.detach(), net.params_bf16,
                           net._layout_ints, "bf16", True)
    # the loss kernel's register version at 65 and 128 atoms (a lane's third and fourth atoms; rows
    # in registers, and read twice with more than 4 actions), and its general version (more atoms
    # than the fused loss takes) at the edges of its shared-memory budget (staged rows just below
    # 48 KiB, global rows at and above it)
    for B, branches, atoms in ((9, (4,), 65), (9, (4,), 128), (9, (6, 2), 100),
                               (9, (3, 2), dqn_ops.ops.FUSED_LOSS_MAX_ATOMS + 6),
                               (9, (3,), 152), (9, (3,), 153), (9, (3, 3, 3), 204), (9, (2, 2), 192)):
        q = [torch.randn(B, sum(branches), atoms, device=dev) for _ in range(3)]
        a = torch.stack([torch.randint(0, n, (B,), device=dev) for n in branches], 1)
        dqn_ops.dqn_loss(*q, a, torch.randn(B, device=dev) * 20, (torch.rand(B, device=dev) < 0.3).float(), branches)
    # the trainer's loss composed from the public kernels on CUDA (outside the fused kernel's
    # limits: more atoms, more branches)
    for c in (DQNConfig(state_dim=8, trunk_hidden=(16, 16), value_hidden=(8,), adv_hidden=(8,),
                        atoms=dqn_ops.ops.FUSED_LOSS_MAX_ATOMS + 1, branches=(3, 2)),
              DQNConfig(state_dim=8, trunk_hidden=(16, 16), value_hidden=(8,), adv_hidden=(8,), atoms=5,
                        branches=(2,) * (dqn_ops.ops.FUSED_LOSS_MAX_BRANCHES + 1))):
        t = Trainer(c, TrainerConfig(batch_size=7, use_cuda_graph=False), device=dev)
        assert not t.uses_fused_path
        s = torch.randn(7, c.state_dim, device=dev)
        a = torch.stack([torch.randint(0, n, (7,), device=dev) for n in c.branches], 1)
        t.step(dict(states=s, next_states=torch.randn_like(s), actions=a, rewards=torch.randn(7, device=dev),
                    dones=torch.zeros(7, device=dev)))
    # QR-DQN: the quantile loss at small and large quantile counts (shared-memory staging up to the
    # 256-quantile limit), a poisoned sample, the trainer's composed path and act's quantile mean
    for B, branches, atoms in ((9, (3, 2), 1), (9, (3, 2), 7), (9, (4,), 33), (9, (3, 3, 3), 200), (5, (2, 2), 256),
                               (9, (2,) * 10, 200)):  # more branches than a block's warps
        q = [torch.randn(B, sum(branches), atoms, device=dev) for _ in range(3)]
        a = torch.stack([torch.randint(0, n, (B,), device=dev) for n in branches], 1)
        r = torch.randn(B, device=dev) * 20
        r[1] = float("nan")
        dqn_ops.dqn_loss(*q, a, r, (torch.rand(B, device=dev) < 0.3).float(), branches, loss_type="qr")
    c = DQNConfig(state_dim=8, trunk_hidden=(16, 16), value_hidden=(8,), adv_hidden=(8,), atoms=40, branches=(3, 2))
    t = Trainer(c, TrainerConfig(batch_size=7, use_cuda_graph=False, loss_type="qr"), device=dev)
    s = torch.randn(7, c.state_dim, device=dev)
    a = torch.stack([torch.randint(0, n, (7,), device=dev) for n in c.branches], 1)
    t.step(dict(states=s, next_states=torch.randn_like(s), actions=a, rewards=torch.randn(7, device=dev),
                dones=torch.zeros(7, device=dev)))
    t.act_explore(s, torch.full((1,), 0.5, device=dev))
    # ensembles: the network ops with a value head per member (dueling and not), the loss with
    # masks on every kernel version (C51 register / staged, QR direct / sorted, Huber), act's ucb
    for c in (DQNConfig(state_dim=8, trunk_hidden=(16, 12), value_hidden=(8,), adv_hidden=(6,), atoms=11,
                        branches=(3, 2), ensemble=3),
              DQNConfig(state_dim=8, trunk_hidden=(16,), adv_hidden=(), atoms=1, branches=(2, 4), dueling=False,
                        ensemble=4)):
        net = dqn_ops.DuelingBranchQNet(c).to(dev)
        s = torch.randn(9, c.state_dim, device=dev)
        out = net.forward_full(s)
        dqn_ops.mixed_backward(torch.randn_like(out.q_logits), torch.randn_like(out.head_logits), out,
                               net.flat_params.detach(), net.params_bf16, net._layout_ints, "bf16", True)
        for ucb in (0.0, 1.0):
            dqn_ops.ops.act(s, net.flat_params.detach(), net.params_bf16, net._layout_ints, -10.0, 10.0,
                            torch.full((1,), 0.5, device=dev), torch.zeros(2, dtype=torch.long, device=dev),
                            "c51" if c.atoms > 1 else "mse", ucb)
    for loss_type, atoms in (("c51", 11), ("c51", 101), ("qr", 7), ("qr", 200), ("huber", 1)):
        B, E, branches = 9, 5, (3, 2)
        q = [torch.randn(B, E * sum(branches), atoms, device=dev) for _ in range(3)]
        a = torch.stack([torch.randint(0, n, (B,), device=dev) for n in branches], 1)
        masks = dqn_ops.bootstrap_masks(torch.randint(0, 1 << 40, (B,), device=dev), 7, E, 0.5)
        dqn_ops.dqn_loss(*q, a, torch.randn(B, device=dev), (torch.rand(B, device=dev) < 0.3).float(), branches,
                         loss_type=loss_type, masks=masks)
    # IQN: the network ops at fractions (the cosines, phi and z; the heads on B * N rows; the
    # backward through phi), the loss at per-sample fractions on both kernel versions (direct,
    # sorted; N, K, N' apart; a poisoned fraction), the fractions op, the trainer's step and act
    for c in (DQNConfig(state_dim=8, trunk_hidden=(16, 12), value_hidden=(8,), adv_hidden=(6,), atoms=1,
                        branches=(3, 2), ensemble=2, iqn_embedding=7),
              DQNConfig(state_dim=8, trunk_hidden=(20,), adv_hidden=(), atoms=1, branches=(2, 4), dueling=False,
                        iqn_embedding=16)):
        net = dqn_ops.DuelingBranchQNet(c).to(dev)
        s = torch.randn(9, c.state_dim, device=dev)
        out = net.forward_full(s, torch.rand(9, 5, device=dev))
        for precision in dqn_ops.ops.BACKWARD_PRECISIONS:
            dqn_ops.mixed_backward(torch.randn_like(out.q_logits), torch.randn_like(out.head_logits), out,
                                   net.flat_params.detach(), net.params_bf16, net._layout_ints, precision, True)
        t = Trainer(c, TrainerConfig(batch_size=9, use_cuda_graph=False, iqn_fractions=6), device=dev)
        a = torch.stack([torch.randint(0, n, (9,), device=dev) for n in c.branches], 1)
        t.step(dict(states=s, next_states=torch.randn_like(s), actions=a, rewards=torch.randn(9, device=dev),
                    dones=torch.zeros(9, device=dev)))
        t.act_explore(s, torch.full((1,), 0.5, device=dev))
    for N, K, N2 in ((8, 5, 11), (40, 32, 33), (256, 7, 256)):
        B, E, branches = 9, 2, (3, 2)
        q = torch.randn(B, E * sum(branches), N, device=dev)
        qo, qt = torch.randn(B, E * sum(branches), K, device=dev), torch.randn(B, E * sum(branches), N2, device=dev)
        a = torch.stack([torch.randint(0, n, (B,), device=dev) for n in branches], 1)
        tau = torch.rand(B, N, device=dev)
        tau[2, 1] = float("nan")
        dqn_ops.dqn_loss(q, qo, qt, a, torch.randn(B, device=dev), torch.zeros(B, device=dev), branches,
                         loss_type="iqn", fractions=tau)
    dqn_ops.iqn_fractions(torch.zeros(2, dtype=torch.long, device=dev), 300, 32, 17, 5)
    # FusedAdamBF16 over several tensors: one global norm (per-tensor norms combined), one skip
    ps = [torch.randn(n, device=dev, requires_grad=True) for n in (5, 300, 33)]
    opt = dqn_ops.FusedAdamBF16(ps, lr=1e-3, max_grad_norm=1.0)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    # spectral norm: small matrices (a thread-block cluster each on sm_90), one too large for a
    # cluster (split over blocks with grid barriers), and the per-matrix path
    shapes = [(3, 5), (64, 48), (300, 257), (700, 600)]
    n = sum(r * c for r, c in shapes)
    params = torch.randn(n, device=dev)
    mirror = params.to(torch.bfloat16)
    mats, off = [], 0
    for r, c in shapes:
        mats += [off, r, c]
        off += r * c
    u = torch.nn.functional.normalize(torch.randn(sum(r for r, _ in shapes), device=dev), dim=0)
    v = torch.nn.functional.normalize(torch.randn(sum(c for _, c in shapes), device=dev), dim=0)
    sigma = torch.empty(len(shapes), device=dev)
    for per_matrix in (False, True):
        dqn_ops.batched_spectral_norm(params, mirror, u, v, sigma, mats, [0.5, 1.0, 2.0, 4.0], 2, 1e-12, per_matrix)
    # the cooperative strategy forced on every matrix (the path of GPUs without thread-block
    # clusters, or where a cluster does not fit)
    previous = dqn_ops._C._set_spectral_strategy("cooperative")
    try:
        dqn_ops.batched_spectral_norm(params, mirror, u, v, sigma, mats, [0.5, 1.0, 2.0, 4.0], 2, 1e-12, False)
    finally:
        dqn_ops._C._set_spectral_strategy(previous)
    # the training loop's ops: act, the environment, replay (n-step windows, prioritized tree),
    # eagerly and as one short loop (the replay wraps its small capacity)
    from dqn_ops.rl.envs import BRANCHES, STATE_DIM, FuturesTradingEnv
    from dqn_ops.rl.loop import LoopConfig, TrainingLoop
    from dqn_ops.rl.replay import ReplayBuffer
    c = DQNConfig(state_dim=STATE_DIM, trunk_hidden=(32, 32), value_hidden=(16,), adv_hidden=(16,), atoms=11,
                  branches=BRANCHES)
    for prioritized, n_step in ((False, 1), (True, 3)):
        t = Trainer(c, TrainerConfig(batch_size=16, gamma=0.9 ** n_step, readback_interval=8), device=dev)
        env = FuturesTradingEnv(37, episode_length=5, device=dev, seed=1)
        rb = ReplayBuffer(150, STATE_DIM, len(BRANCHES), device=dev, seed=2, num_envs=37, prioritized=prioritized,
                          n_step=n_step, gamma=0.9)
        loop = TrainingLoop(t, env, rb, LoopConfig(iterations_per_graph=8, use_cuda_graph=False))
        loop.prefill(3)
        loop.run(12)
        t.act_explore(torch.randn(1000, STATE_DIM, device=dev), torch.full((1,), 0.5, device=dev))
        if prioritized:
            rb.update_priorities(torch.tensor([0, 5, 5, 149], device=dev), torch.tensor([1.0, float("nan"), 2.0, 3.0],
                                                                                      device=dev))
        t.readback()
    torch.cuda.synchronize()
    print("sanitize_smoke: every kernel ran")


if __name__ == "__main__":
    if sys.argv[1:] == ["--switched-paths"]:
        dense_kernel_section("cuda")
        iqn_backward_section("cuda")
        one_atom_rows_section("cuda")
        torch.cuda.synchronize()
        print(SWITCHED_RAN)
    else:
        main()
