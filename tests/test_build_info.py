"""dqn_ops.build_info(): what setup.py built, consistent with the kernels the dispatcher has."""
import re

import dqn_ops


def test_build_info_matches_the_registered_kernels():
    info = dqn_ops.build_info()
    assert set(info) == {"cuda", "reason", "cuda_arch_list"}
    assert info["cuda"] == dqn_ops.cuda_kernels_built()
    if info["cuda"]:
        targets = info["cuda_arch_list"].replace("+PTX", "").split(";")
        assert targets and all(float(re.match(r"\d+\.\d+", t).group()) >= 8.0 for t in targets), info  # BF16 tensor cores: sm_80 and newer
    elif info["reason"].startswith("unknown"):  # built without setup.py
        assert info["cuda_arch_list"] is None
    else:
        assert info["cuda_arch_list"] is None and info["reason"], info
