"""IQN networks on the ops (docs/iqn-design.md): the layout's format 4 (the embedding size after
E, W_phi / b_phi after the trunk's), bf16_dueling_forward with fractions and mixed_backward through
the phi layer, on the CPU reference kernel against the float64 references of tests/reference.py
(reference_iqn_forward, and autograd through it for the backward), gradcheck, opcheck, the fake
kernels, torch.compile; the CUDA kernels against the CPU kernel; the errors.

Tolerances: the float64 path rounds nothing and runs the reference's formulas in another order
(1e-10). The BF16 mirror path rounds where the kernels round (weights, states, cosines, phi, z and
every hidden activation to BF16) and sums in F32 where the reference sums in float64: an
activation may differ by one BF16 ulp where the two sums straddle a rounding boundary (rarely),
q by ~1e-4 relative. Backward with a BF16 mirror: the reference passes gradients straight through
the roundings (the kernels' backward reads the rounded activations, not their rounding); with the
master made equal to the mirror, 'fp32' then differs only by F32 sums (1e-5), and 'bf16', which
rounds every dY to BF16, within 2e-2 (tests/test_network_shapes.py's bars).
"""
import dataclasses

import pytest
import torch

import dqn_ops
from backward_check import BACKWARD_BARS
from conftest import DEVICES, requires_cuda
from dqn_ops import DuelingBranchQNet, ParamLayout, ops
from dqn_ops.layout import LAYOUT_FORMAT, decode_config
from poison import poison_cuda_cache
from reference import logical_activations, mirror_layers, padding_mask, reference_iqn_forward, rel_err
from step_check import snapshot
from test_iqn_reference import NETS


def make_net(c, device="cpu", seed=0):
    return DuelingBranchQNet(c, generator=torch.Generator().manual_seed(seed)).to(device)


def random_fractions(B, N, seed, dtype=torch.float32, device="cpu"):
    return torch.rand(B, N, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype).to(device)


def reference_q_head_acts_and_grads(net, s, tau, grad_q, grad_head, round_to=None):
    """reference_iqn_forward on `net`'s mirror weights in float64 and, by autograd through it,
    d(states) and every layer's gradient for the given d(q), d(head) (as the flat buffer's
    layer views' names: '<layer>.weight', '<layer>.bias')."""
    c = net.config
    layers = {name: tuple(t.clone().requires_grad_() for t in wb) for name, wb in mirror_layers(net).items()}
    x = s.detach().double().cpu().requires_grad_()
    q, head, acts = reference_iqn_forward(c, layers, x, tau.double().cpu(), round_to, straight_through=True)
    (q * grad_q.double().cpu()).sum().add((head * grad_head.double().cpu()).sum()).backward()
    grads = {}
    for name, (w, b) in layers.items():
        grads[f"{name}.weight"], grads[f"{name}.bias"] = w.grad, b.grad
    return q.detach(), head.detach(), [a.detach() for a in acts], grads, x.grad


# ----------------------------------------------------------------------------------------
# The layout: format 4

@pytest.mark.parametrize("name", list(NETS))
def test_format_4_carries_the_embedding_and_decodes(name):
    c = NETS[name]
    layout = ParamLayout(c).encode()
    assert LAYOUT_FORMAT == 4 and layout[0] == 4 and layout[5] == c.iqn_embedding
    assert decode_config(layout) == c.aligned()  # the stored network: widths rounded up to multiples of 8
    seg, L, H = ParamLayout(c).segments, len(c.trunk_hidden), c.head_depth
    first = 7 + c.num_branches + 1 + L + 1 + (H if c.dueling else 0) + H  # the first offset
    trunk = [o for j in range(L) for o in (seg[f"W_s{j + 1}"][0], seg[f"b_s{j + 1}"][0])]
    assert layout[first:first + 2 * L + 2] == trunk + [seg["W_phi"][0], seg["b_phi"][0]]
    plain = dataclasses.replace(c, iqn_embedding=0)
    assert ParamLayout(plain).encode()[5] == 0


def test_the_kernels_refuse_bad_embedding_entries():
    c = NETS["trunk1_head1"]
    net = make_net(c)
    p, p_lp, layout = net.flat_params.detach(), net.params_bf16, net._layout_ints
    s, tau = torch.randn(3, c.state_dim), random_fractions(3, 4, 0)
    op = "dqn_ops.bf16_dueling_forward: layout: "
    with pytest.raises(RuntimeError, match=op + "the IQN embedding size must be >= 0, got -1"):
        ops.bf16_dueling_forward(s, p, p_lp, [*layout[:5], -1, *layout[6:]], fractions=tau)
    with pytest.raises(RuntimeError, match=op + r"an IQN network \(embedding size 5\) has 1 atom, got 3"):
        ops.bf16_dueling_forward(s, p, p_lp, [layout[0], layout[1], 3, *layout[3:]], fractions=tau)
    with pytest.raises(ValueError, match=r"got dueling=1, 1 members, IQN embedding -1"):
        decode_config([*layout[:5], -1, *layout[6:]])


# ----------------------------------------------------------------------------------------
# The CPU kernels against the float64 reference

@pytest.mark.parametrize("name", list(NETS))
def test_float64_path_is_the_float64_reference(name):
    """Mirror in float64: forward (q, head, every activation) and every backward precision are
    the formulas to double precision; N differs from the batch and from every width."""
    c = NETS[name]
    net = make_net(c).double()
    B, N = 7, 5
    s, tau = torch.randn(B, c.state_dim, dtype=torch.float64), random_fractions(B, N, 1, torch.float64)
    out = net.forward_full(s, tau)
    gq = torch.randn(B, c.q_rows, N, dtype=torch.float64)
    gh = torch.randn(B * N, c.head_out, dtype=torch.float64)
    q, head, acts, grads, gs_ref = reference_q_head_acts_and_grads(net, s, tau, gq, gh)
    assert out.q_logits.shape == (B, c.q_rows, N) and out.head_logits.shape == (B * N, c.head_out)
    torch.testing.assert_close(out.q_logits, q, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.head_logits, head, rtol=1e-10, atol=1e-12)
    assert len(out.activations) == len(acts) == 1 + len(c.hidden_widths) + 3
    # the ops save the stored network's activations: c's columns of them (the extra ones zero)
    for i, (a, b) in enumerate(zip(logical_activations(c, out.activations), acts)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"activations[{i}]: {m}")
    for precision in ops.BACKWARD_PRECISIONS:
        grad, gs = dqn_ops.mixed_backward(gq, gh, out, net.flat_params.detach(), net.params_bf16, net._layout_ints,
                                          precision, True)
        views = net.layer_views(grad)
        for pname, want in grads.items():
            torch.testing.assert_close(views[pname], want, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"{precision} {pname}: {m}")
        torch.testing.assert_close(gs, gs_ref, rtol=1e-10, atol=1e-12)
        assert (grad[padding_mask(net.layout, "cpu")] == 0).all()


@pytest.mark.parametrize("name", list(NETS))
def test_bf16_mirror_path_is_the_emulated_rounding(name):
    c = NETS[name]
    net = make_net(c)
    B, N = 64, 9
    s, tau = torch.randn(B, c.state_dim), random_fractions(B, N, 2)
    out = net.forward_full(s, tau)
    with torch.no_grad():
        q, head, acts = reference_iqn_forward(c, mirror_layers(net), s.double(), tau.double(), torch.bfloat16)
    assert len(out.activations) == len(acts)
    mine = logical_activations(c, out.activations)  # c's columns of the stored network's (the extra ones zero)
    L = len(c.trunk_hidden)
    assert torch.equal(mine[L + 1].double(), acts[L + 1]), "the cosines"
    for i, (a, b) in enumerate(zip(mine, acts)):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape, i
        torch.testing.assert_close(a.double(), b, rtol=2 ** -7, atol=1e-6, msg=lambda m: f"activations[{i}]: {m}")
        assert (a.double() != b).float().mean() < 2e-3, f"activations[{i}]"
    assert rel_err(out.q_logits, q) < 1e-4 and rel_err(out.head_logits, head) < 1e-4


@pytest.mark.parametrize("name", list(NETS))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_backward_with_a_bf16_mirror_within_bars(name, precision):
    c = NETS[name]
    net = make_net(c)
    with torch.no_grad():  # master = mirror: dX reads either, so the reference's weights are both
        net.flat_params.copy_(net.params_bf16.float())
    B, N = 48, 6
    s, tau = torch.randn(B, c.state_dim), random_fractions(B, N, 3)
    out = net.forward_full(s, tau)
    gq = torch.randn(B, c.q_rows, N)
    gh = torch.randn(B * N, c.head_out) * 0.1
    *_, grads, gs_ref = reference_q_head_acts_and_grads(net, s, tau, gq, gh, round_to=torch.bfloat16)
    grad, gs = dqn_ops.mixed_backward(gq, gh, out, net.flat_params.detach(), net.params_bf16, net._layout_ints,
                                      precision, True)
    views = net.layer_views(grad)
    bar = BACKWARD_BARS[precision]
    for pname, want in grads.items():
        assert rel_err(views[pname], want) <= bar, f"{pname}: {rel_err(views[pname], want):.2e}"
    assert rel_err(gs, gs_ref) <= bar


@pytest.mark.parametrize("name", ["trunk1_head1", "head0_no_dueling", "ensemble2_q_h2"])
def test_gradcheck_float64(name):
    c = NETS[name]
    layout = ParamLayout(c).encode()
    net = make_net(c).double()
    p = net.flat_params.detach().clone().requires_grad_()
    s = torch.randn(3, c.state_dim, dtype=torch.float64, requires_grad=True)
    tau = random_fractions(3, 4, 5, torch.float64)

    def f(states, params):
        out = dqn_ops.bf16_dueling_forward(states, params, params.detach().clone(), layout, "fp32", tau)
        return out.q_logits, out.head_logits

    assert torch.autograd.gradcheck(f, (s, p), eps=1e-6, atol=1e-7, rtol=1e-6, fast_mode=c.num_parameters > 3000)


# ----------------------------------------------------------------------------------------
# Registration: opcheck, fake kernels, torch.compile

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["cleanrl", "ensemble3_dueling_h1"])
def test_opcheck(device, name):
    c = NETS[name]
    net = make_net(c, device)
    p, p_lp, layout = net.flat_params.detach(), net.params_bf16, net._layout_ints
    B, N = 5, 3
    s, tau = torch.randn(B, c.state_dim, device=device), random_fractions(B, N, 6, device=device)
    torch.library.opcheck(torch.ops.dqn_ops.bf16_dueling_forward.default,
                          (s, p.clone().requires_grad_(), p_lp, layout, "bf16", tau))
    fwd = torch.ops.dqn_ops.bf16_dueling_forward.default(s, p, p_lp, layout, "bf16", tau)
    gq = torch.randn(B, c.q_rows, N, device=device)
    for need in (False, True):
        torch.library.opcheck(torch.ops.dqn_ops.mixed_backward.default,
                              (gq, fwd[1].clone(), fwd[2], p, p_lp, layout, "tf32", need))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.backends.cuda.is_built(), reason="a CPU-only torch build makes no fake CUDA tensors"))])
@pytest.mark.parametrize("name", ["cleanrl", "trunk3_head2"])
def test_fake_kernels_give_the_iqn_shapes(device, name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = NETS[name]
    layout = ParamLayout(c).encode()
    st = c.aligned()  # the activations are the stored network's: its hidden widths rounded up to multiples of 8
    n, B, N, L, T = layout[-1], 4, 7, len(c.trunk_hidden), st.trunk_hidden[-1]
    widths = [c.state_dim, *st.trunk_hidden, c.iqn_embedding, T, T, *st.hidden_widths[L:]]
    rows = [B] * (L + 1) + [B * N] * (len(widths) - L - 1)
    with FakeTensorMode():
        p, p_lp = torch.empty(n, device=device), torch.empty(n, device=device, dtype=torch.bfloat16)
        tau = torch.empty(B, N, device=device)
        out = ops.bf16_dueling_forward(torch.empty(B, c.state_dim, device=device), p, p_lp, layout, "bf16", tau)
        assert out.q_logits.shape == (B, c.q_rows, N) and out.head_logits.shape == (B * N, c.head_out)
        assert [tuple(t.shape) for t in out.activations] == list(zip(rows, widths))
        grad, gs = ops.mixed_backward(torch.empty(B, c.q_rows, N, device=device), None, out, p, p_lp, layout,
                                      "bf16", True)
        assert grad.shape == (n,) and gs.shape == (B, c.state_dim)
        with pytest.raises(RuntimeError, match="fractions: an IQN network .* needs the quantile fractions"):
            ops.bf16_dueling_forward(torch.empty(B, c.state_dim, device=device), p, p_lp, layout)
        with pytest.raises(RuntimeError, match=f"activations: expected {len(widths)} tensors"):
            ops.mixed_backward(None, out.head_logits, out.activations[:-1], p, p_lp, layout)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_forward_backward_matches_eager(device):
    c = NETS["ensemble3_dueling_h1"]
    net = make_net(c, device)
    B, N = 6, 4
    s, tau = torch.randn(B, c.state_dim, device=device), random_fractions(B, N, 7, device=device)
    w = torch.randn(B, c.q_rows, N, device=device)

    def f(states, fractions):
        return (net(states, fractions) * w).sum()

    torch._dynamo.reset()
    results = []
    for fn in (torch.compile(f, fullgraph=True, backend="aot_eager"), f):
        net.zero_grad()
        loss = fn(s, tau)
        loss.backward()
        results.append((loss.detach(), net.flat_params.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (results[0][1] != 0).any()


# ----------------------------------------------------------------------------------------
# Errors

@pytest.mark.parametrize("device", DEVICES)
def test_fraction_errors_name_op_and_argument(device):
    c = NETS["trunk1_head1"]
    net = make_net(c, device)
    p, p_lp, layout = net.flat_params.detach(), net.params_bf16, net._layout_ints
    s = torch.randn(4, c.state_dim, device=device)
    op = "dqn_ops.bf16_dueling_forward: fractions: "
    with pytest.raises(RuntimeError, match=op + r"an IQN network \(iqn_embedding 5\) needs the quantile fractions"):
        ops.bf16_dueling_forward(s, p, p_lp, layout)
    with pytest.raises(RuntimeError, match=op + r"expected shape \[4, \*\], got \[3, 2\]"):
        ops.bf16_dueling_forward(s, p, p_lp, layout, fractions=torch.rand(3, 2, device=device))
    with pytest.raises(RuntimeError, match=op + "expected dtype Float, got Double"):
        ops.bf16_dueling_forward(s, p, p_lp, layout, fractions=torch.rand(4, 2, device=device, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=op + "expected at least 1 fraction per row, got 0"):
        ops.bf16_dueling_forward(s, p, p_lp, layout, fractions=torch.rand(4, 0, device=device))
    with pytest.raises(RuntimeError, match=op + "expected a contiguous tensor"):
        ops.bf16_dueling_forward(s, p, p_lp, layout, fractions=torch.rand(2, 4, device=device).t())
    plain = make_net(dataclasses.replace(c, iqn_embedding=0), device)
    with pytest.raises(RuntimeError, match=op + "only an IQN network"):
        plain(s, torch.rand(4, 2, device=device))
    # activations of another fraction count than grad_q's
    out = net.forward_full(s, torch.rand(4, 3, device=device))
    with pytest.raises(RuntimeError,
                       match=r"dqn_ops.mixed_backward: grad_q: expected shape \[4, 5, 3\], got \[4, 5, 2\]"):
        ops.mixed_backward(torch.randn(4, c.q_rows, 2, device=device), None, out, p, p_lp, layout)
    with pytest.raises(RuntimeError, match=r"dqn_ops.mixed_backward: activations\[2\]: expected the IQN cosines"):
        acts = list(out.activations)
        acts[2] = acts[2][:5]
        ops.mixed_backward(None, out.head_logits, acts, p, p_lp, layout)
    # the trainer-step ops take no IQN network
    with pytest.raises(RuntimeError, match="dqn_ops._online_and_target_logits: IQN networks run the composed step"):
        ops._online_and_target_logits(torch.cat([s, s]), p, p_lp, p, p_lp, layout, False)


# ----------------------------------------------------------------------------------------
# CUDA against the CPU kernel

@requires_cuda
@pytest.mark.parametrize("name", list(NETS))
def test_cuda_forward_and_backward_match_the_cpu_kernel(name):
    """The CPU kernel rounds where the GPU does; only F32 summation orders (and cospif against the
    double cosine, both within an F32 ulp before the BF16 rounding) differ."""
    c = NETS[name]
    net = make_net(c, "cuda")
    B, N = 300, 32
    s, tau = torch.randn(B, c.state_dim, device="cuda"), random_fractions(B, N, 8, device="cuda")
    poison_cuda_cache()
    gpu = net.forward_full(s, tau)
    cpu_net = snapshot(net).to("cpu")
    cpu = cpu_net.forward_full(s.cpu(), tau.cpu())
    named = [("q_logits", gpu.q_logits, cpu.q_logits), ("head_logits", gpu.head_logits, cpu.head_logits)]
    named += [(f"activations[{i}]", a, b) for i, (a, b) in enumerate(zip(gpu.activations, cpu.activations))]
    assert len(gpu.activations) == len(cpu.activations) == 1 + len(c.hidden_widths) + 3
    logical_activations(c, gpu.activations)  # the stored network's widths, its extra columns zero
    for what, a, b in named:
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert rel_err(a, b) < 2e-3, f"{what}: {rel_err(a, b):.2e}"
    gq = torch.randn(B, c.q_rows, N, device="cuda")
    gh = torch.randn(B * N, c.head_out, device="cuda") * 0.1
    for precision in ops.BACKWARD_PRECISIONS:
        poison_cuda_cache()
        grad, gs = dqn_ops.mixed_backward(gq, gh, gpu, net.flat_params.detach(), net.params_bf16, net._layout_ints,
                                          precision, True)
        # the CPU kernel on the GPU's own activations: the same operands, other summation orders
        cpu_acts = [a.cpu() for a in gpu.activations]
        want, want_gs = dqn_ops.mixed_backward(gq.cpu(), gh.cpu(), cpu_acts, cpu_net.flat_params.detach(),
                                               cpu_net.params_bf16, net._layout_ints,
                                               "fp32" if precision == "tf32" else precision, True)
        g, w = net.layer_views(grad), cpu_net.layer_views(want)
        bar = 3e-3 if precision == "tf32" else 1e-4
        for pname in w:
            assert rel_err(g[pname], w[pname]) <= bar, f"{precision} {pname}: {rel_err(g[pname], w[pname]):.2e}"
        assert rel_err(gs, want_gs) <= bar
        assert torch.isfinite(grad).all()


# ----------------------------------------------------------------------------------------
# From and to plain PyTorch

@pytest.mark.parametrize("name", ["cleanrl", "ensemble3_dueling_h1"])
def test_to_torch_and_back_keep_the_iqn_network(name):
    """to_torch gives TorchQNet with phi (the same outputs at the same fractions, float64);
    from_torch reads it back by the order of its nn.Linear layers, phi after the trunk."""
    c = NETS[name]
    net = make_net(c).double()
    plain = dqn_ops.to_torch(net)
    s, tau = torch.randn(5, c.state_dim, dtype=torch.float64), random_fractions(5, 6, 9, torch.float64)
    torch.testing.assert_close(plain(s, tau)[0], net(s, tau), rtol=1e-12, atol=1e-12)
    back = dqn_ops.from_torch(plain, c).double()
    assert torch.equal(back.flat_params, net.flat_params)
