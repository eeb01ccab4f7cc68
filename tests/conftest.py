import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import dqn_ops  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and dqn_ops.cuda_kernels_built()
CUDA_SKIP_REASON = ("no CUDA device here" if not torch.cuda.is_available()
                    else "dqn_ops was built without its CUDA kernels")
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=CUDA_SKIP_REASON)

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running (training parity)")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def loads_strict_json(text: str):
    """json.loads that rejects NaN / Infinity (not JSON), as strict parsers do."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)
