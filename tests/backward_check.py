"""mixed_backward against the hand-written float64 backward of the same forward
(tests/reference.py), within each precision's bar: the check the network tests of every shape,
device and batch size make."""
import torch

import dqn_ops
from poison import poison_cuda_cache
from reference import dueling_head_grad, padding_mask, reference_backward, rel_err

# Precision bars (docs/design.md): relative Frobenius error of the backward against float64.
BACKWARD_BARS = {"fp32": 1e-5, "tf32": 3e-3, "bf16": 2e-2}


def backward_bar(precision: str, device: torch.device) -> float:
    """The bar of `precision` on `device`: the CPU computes tf32 in full F32, only the GPU takes
    the TF32 shortcut."""
    return BACKWARD_BARS[precision if device.type == "cuda" or precision == "bf16" else "fp32"]


def check_backward_within_bars(net, name: str, precision: str, B: int):
    """mixed_backward of `net` (on its device) at batch B within its precision's bar of the float64
    backward, every layer and the states' gradient; the layout's padding zero (on a poisoned
    cache, on CUDA)."""
    c = net.config
    device = net.flat_params.device
    out = net.forward_full(torch.randn(B, c.state_dim, device=device))
    gq = torch.randn(B, c.q_rows, c.atoms, device=device)
    gh = torch.randn(B, c.head_out, device=device) * 0.1
    if device.type == "cuda":
        poison_cuda_cache()
    grad, gs = dqn_ops.mixed_backward(gq, gh, out, net.flat_params.detach(), net.params_bf16, net._layout_ints,
                                      precision, need_grad_states=True)
    d_head = dueling_head_grad(c, gq) + gh.double().cpu()
    ref_grad, ref_gs = reference_backward(net, out.activations, d_head, "mirror" if precision == "bf16" else "master")
    bar = backward_bar(precision, device)
    g, r = net.layer_views(grad), net.layer_views(ref_grad)
    for pname in r:
        e = rel_err(g[pname], r[pname])
        assert e <= bar, f"{name}/{precision}/{device.type}: {pname} error {e:.2e} > {bar:.0e}"
    assert rel_err(gs, ref_gs) <= bar
    assert torch.isfinite(grad).all()
    assert (grad[padding_mask(net.layout, device)] == 0).all()
