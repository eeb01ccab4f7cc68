"""The reinforcement-learning parts around the ops: a synthetic futures-trading environment
(``envs``), a replay buffer on the device (``replay``), the training loop in CUDA graphs
(``loop``), the same training step in plain PyTorch (``baseline``: the comparison of the
benchmarks and the convergence-parity check) and strict JSON for result files (``results``).

Not imported by ``dqn_ops``: a user of the ops, the network, the optimizer or the trainer
never loads it. ``import dqn_ops.rl.envs`` (etc.) when you want them.
"""
