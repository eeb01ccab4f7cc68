"""dqn_ops.build_info(): what setup.py built, consistent with the kernels the dispatcher has."""
import re

import dqn_ops


def test_build_info_matches_the_registered_kernels():
    info = dqn_ops.build_info()
    assert set(info) == {"cuda", "reason", "cuda_arch_list"}
    assert info["cuda"] == dqn_ops.cuda_kernels_built()
    if info["reason"].startswith("unknown"):  # built without setup.py, or not by its last plan
        assert info["cuda_arch_list"] is None
    elif info["cuda"]:
        numbers = [m.group() for m in re.finditer(r"\d+\.\d+", info["cuda_arch_list"])]
        assert all(float(n) >= 8.0 for n in numbers), info  # BF16 tensor cores: sm_80 and newer
    else:
        assert info["cuda_arch_list"] is None and info["reason"], info


def test_every_public_name_exists_and_the_ops_are_exported():
    """dqn_ops.__all__ names what the package exports; every op the README's table lists under
    `dqn_ops.` is its Python wrapper in dqn_ops.ops."""
    missing = [name for name in dqn_ops.__all__ if not hasattr(dqn_ops, name)]
    assert not missing, f"in __all__ but not exported: {missing}"
    for name in ("bf16_dueling_forward", "mixed_backward", "fused_adam_bf16", "ema_update", "batched_spectral_norm",
                 "dqn_loss", "act", "epsilon_greedy", "bootstrap_masks", "iqn_fractions"):
        assert name in dqn_ops.__all__ and getattr(dqn_ops, name) is getattr(dqn_ops.ops, name), name
