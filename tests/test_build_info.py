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
