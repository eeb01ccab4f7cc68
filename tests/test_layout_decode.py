"""decode_config (dqn_ops/layout.py), the fake kernels' decoder of the ops' `int[] layout`: it takes
the layout ParamLayout.encode() gives and nothing else, so a tampered offset or buffer length
fails with a clear error on the fake path (torch.compile / FakeTensor tracing) too, not only in
csrc/layout.h on real tensors."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dqn_ops import DQNConfig, DuelingBranchQNet, ParamLayout, ops
from dqn_ops.layout import ALIGN, decode_config
from reference import SHAPES

V_MIN, V_MAX = -10.0, 10.0
PREFIX = r"layout: expected the int\[\] from dqn_ops.ParamLayout.encode\(\) \(format 4\), "


def first_offset(c: DQNConfig) -> int:
    """Index of the first offset entry of the encoded layout (after the sizes)."""
    H = c.head_depth
    return 7 + c.num_branches + 1 + len(c.trunk_hidden) + 1 + (H if c.dueling else 0) + H


@pytest.mark.parametrize("name", list(SHAPES))
def test_decode_config_refuses_every_tampered_offset(name):
    c = SHAPES[name]
    layout = ParamLayout(c).encode()
    # the layout describes the stored network (every hidden width rounded up to ALIGN), which is
    # its own aligned config and so encodes the same
    assert decode_config(layout) == c.aligned()
    assert ParamLayout(c.aligned()).encode() == layout
    start = first_offset(c)
    assert start < len(layout) - 1
    for i in range(start, len(layout)):
        what = "the buffer length" if i == len(layout) - 1 else "an offset"
        for delta in (1, ALIGN, -ALIGN):
            bad = list(layout)
            bad[i] += delta
            with pytest.raises(ValueError, match=PREFIX + rf"entry {i} \({what}\) {layout[i]} for these sizes, "
                                                          rf"got {layout[i] + delta}$"):
                decode_config(bad)


def test_fake_kernels_refuse_a_tampered_offset():
    """On fake tensors the ops' fake kernels decode the layout: a moved offset is the error above
    (before, only the layout's length was checked, so the trace went through and the error came
    at run time, if at all)."""
    c = DQNConfig()
    layout = ParamLayout(c).encode()
    i = first_offset(c) + 2  # trunk layer 2's weight W_s2
    bad = list(layout)
    bad[i] += ALIGN
    n, B = layout[-1], 4
    match = PREFIX + rf"entry {i} \(an offset\) {layout[i]} for these sizes, got {layout[i] + ALIGN}"
    with FakeTensorMode():
        p, p_lp = torch.empty(n), torch.empty(n, dtype=torch.bfloat16)
        s = torch.empty(B, c.state_dim)
        out = ops.bf16_dueling_forward(s, p, p_lp, layout)  # the untouched layout traces
        assert out.head_logits.shape == (B, c.head_out)
        with pytest.raises(ValueError, match=match):
            ops.bf16_dueling_forward(s, p, p_lp, bad)
        with pytest.raises(ValueError, match=match):
            ops.mixed_backward(None, out.head_logits, out, p, p_lp, bad)
        with pytest.raises(ValueError, match=match):
            ops.act(s, p, p_lp, bad, V_MIN, V_MAX, torch.empty(1), torch.empty(2, dtype=torch.long))


def test_a_misaligned_offset_fails_on_the_fake_and_the_real_path_alike():
    """The real CPU kernel (csrc/layout.h) refuses the same layout, with its own clear message."""
    c = DQNConfig()
    net = DuelingBranchQNet(c, generator=torch.Generator().manual_seed(0))
    layout = ParamLayout(c).encode()
    i = first_offset(c)
    bad = list(layout)
    bad[i] += 1
    s = torch.randn(3, c.state_dim)
    with pytest.raises(RuntimeError, match=r"dqn_ops.bf16_dueling_forward: layout: segment offset \d+ is not a "
                                           rf"non-negative multiple of {ALIGN}"):
        ops.bf16_dueling_forward(s, net.flat_params.detach(), net.params_bf16, bad)
    with FakeTensorMode():
        p, p_lp = torch.empty(layout[-1]), torch.empty(layout[-1], dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=PREFIX + rf"entry {i} \(an offset\)"):
            ops.bf16_dueling_forward(torch.empty(3, c.state_dim), p, p_lp, bad)
