"""The dense layer kernel (csrc/cuda/dense_layer.cu): dqn_ops's own GEMM with the work after it in
its epilogue, run where its switch (dqn_ops.dense_kernel) gives it the layer: a dense hidden
layer's F32 bias, ReLU and rounding to BF16; the output layer's every head (of one network or
both) in one launch; and in the backward a layer's input gradient masked by the ReLU before it,
with its BF16 copy. The CUDA tests here force it on for every layer it can run (K a multiple of
8, N even). Its tile shape depends on the number of rows; every element must be the same bits
whichever shape runs it."""
import re

import pytest
import torch

from backward_check import BACKWARD_BARS
from conftest import requires_cuda, switch_at_first_use
import dqn_ops
from dqn_ops import DQNConfig, _C, dense_kernel
from dqn_ops.step import InternalOpsStep
from poison import poison_cuda_cache
from reference import dueling_head_grad, head_widths, logical_activations, mirror_layers, reference_backward, rel_err
from step_check import same_bits, snapshot
from test_network_shapes import check_bf16_mirror_emulated, make_net

# Widths that leave tails in every dimension of the kernel's tiles: K = 40 (the states) and 136
# (130 stored rounded up to 8) are not multiples of its K tile (64), N = 136 and 56 not of 64 or
# 128; the heads' merged first layer is dense too (K = 256, N = 24 + 2 x 16).
SHAPE = DQNConfig(state_dim=40, trunk_hidden=(130, 256), value_hidden=24, adv_hidden=16, atoms=5, branches=(2, 3))
# Rows that take each tile shape for the 256-wide layer on a GPU of 132 SMs (dense_layer picks
# the largest tile whose grid covers the SMs): 32 x 64 at 300, 64 x 64 at 3000, 128 x 128 at
# 9000; and one row.
BATCHES = [1, 300, 3000, 9000]
# Two head layers, equal branches: the second head layer and the output layer are block-diagonal
# with a group of two same-shape blocks (a problem of batch 2: its x, W and outputs strided).
DEEP_HEADS = DQNConfig(state_dim=40, trunk_hidden=(130, 64), value_hidden=(24, 16), adv_hidden=(16, 24), atoms=5,
                       branches=(3, 3))


@pytest.fixture
def kernel_mode(request):
    """The dense kernel's mode for one test (default "on"), the process's restored after it."""
    before = dense_kernel.set_mode(getattr(request, "param", "on"))
    yield dense_kernel.mode()
    dense_kernel.set_mode(before)


def test_the_mode_switch_round_trips_and_refuses_an_unknown_mode():
    before = dense_kernel.mode()
    assert before in dense_kernel.MODES
    try:
        for m in dense_kernel.MODES:
            dense_kernel.set_mode(m)
            assert dense_kernel.mode() == m
        with pytest.raises(ValueError, match="expected one of"):
            dense_kernel.set_mode("fast")
        assert dense_kernel.mode() == dense_kernel.MODES[-1]
    finally:
        dense_kernel.set_mode(before)


def _kernel_counts(fn):
    """The profiled events of fn (kernels among them), by name, with their number of launches."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key: e.count for e in prof.key_averages()}


def _kernel_names(fn):
    return list(_kernel_counts(fn))


def _cublas_gemms(names):
    """The names among profiled kernels that are cuBLAS's GEMMs (Hopper's nvjet, CUTLASS, xmma)."""
    return [n for n in names if any(k in n.lower() for k in ("gemm", "nvjet", "cutlass", "xmma"))]


def _tiles(names):
    """The tile shapes ("BM, BN") of the dense kernels among profiled kernel names."""
    return {f"{m[1]}, {m[2]}" for n in names if (m := re.search(r"dense_layer_kernel<(\d+), (\d+)", n))}


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).cuda()


def _check_formula(x, w, b, y, what):
    """y = bf16(relu(x W^T + b)) within the rounding to BF16 (2^-8 of the value) plus the F32
    sum's error (2^-16 of the sum of the products' magnitudes, a generous bound for a tensor
    core's accumulation; a wrong element is off by the size of a product), and at most 1e-3 of
    the elements (one where there are fewer than 1000) off the rounded float64 value. x, w, b, y
    float64 on the CPU."""
    ref = torch.relu(x @ w.T + b)
    magnitude = x.abs() @ w.abs().T + b.abs()
    assert ((y - ref).abs() <= 2 ** -8 * ref.abs() + 2 ** -16 * magnitude).all(), what
    assert (y != ref.to(torch.bfloat16).double()).sum() <= max(1, 1e-3 * y.numel()), what


@pytest.mark.parametrize("value,want", [(None, "auto"), ("auto", "auto"), ("1", "on"), ("0", "off"), ("on", "on"),
                                        ("fast", None)])
def test_the_environment_variable_sets_the_mode_at_its_first_use(value, want):
    lines = switch_at_first_use("DQN_OPS_DENSE_KERNEL", value, "dense_kernel", "dense_kernel.mode, dense_kernel.mode, "
                                "lambda: dense_kernel.set_mode('off'), dense_kernel.mode")
    if want is None:  # every use raises again: the setting never initialises from a bad value
        assert len(lines) == 4, lines
        for line in lines:
            assert line.startswith("RuntimeError: ") and "DQN_OPS_DENSE_KERNEL" in line and "'fast'" in line, line
    else:
        assert lines == [repr(want), repr(want), repr(want), repr("off")]


def test_the_hook_refuses_an_unknown_mode_name():
    with pytest.raises(ValueError, match="expected auto, on, 1, off or 0, got '1x'"):
        _C._set_dense_layer_mode("1x")


@requires_cuda
@pytest.mark.parametrize("B", BATCHES)
def test_cuda_dense_layers_are_the_formula_on_their_inputs(B, kernel_mode):
    """Each dense layer's output against float64 on the same input (the GPU's own activation
    before it, so a rounding flip upstream does not count here), the mirror's BF16 W and the F32
    b (_check_formula)."""
    net = make_net(SHAPE, "cuda", seed=B)
    poison_cuda_cache()
    acts = [a.double().cpu() for a in logical_activations(SHAPE, net.forward_full(
        _randn(B, SHAPE.state_dim, seed=B)).activations)]
    layers = mirror_layers(net)
    stems = [f"s{i + 1}" for i in range(len(SHAPE.trunk_hidden))]
    # The heads' first layers, side by side in head order: the one dense layer they form.
    heads = [stem.format(1) for stem, _, _ in head_widths(SHAPE)]
    weights = [layers[n] for n in stems] + [tuple(torch.cat(t) for t in zip(*(layers[n] for n in heads)))]
    for i, (w, b) in enumerate(weights):
        _check_formula(acts[i], w, b, acts[i + 1], f"layer {i + 1}")


@requires_cuda
@pytest.mark.parametrize("T", [100, 256])
@pytest.mark.parametrize("B", [3, 500, 1300])
def test_cuda_iqn_phi_and_z_in_the_epilogue(B, T, kernel_mode):
    """IQN's phi layer through the kernel: phi the formula on the GPU's own cosines, and z =
    bf16(h_L[r // N] * phi[r]) bit for bit (the product of two BF16 values is exact in F32), on
    B * N rows that are not a multiple of any tile's (9100 rows: the 128 x 128 tile at T = 256),
    with h_L 100 (104 stored) and 256 wide; and phi took the kernel (no iqn_phi_z pass)."""
    c = DQNConfig(state_dim=40, trunk_hidden=(130, T), value_hidden=24, adv_hidden=16, atoms=1, branches=(2, 3),
                  iqn_embedding=64)
    N = 7
    net = make_net(c, "cuda", seed=T + B)
    tau = torch.rand(B, N, generator=torch.Generator().manual_seed(B)).cuda()
    poison_cuda_cache()
    states = _randn(B, c.state_dim, seed=T)
    out = net.forward_full(states, tau)
    acts = [a.double().cpu() for a in logical_activations(c, out.activations)]
    L = len(c.trunk_hidden)
    h_L, (cos, phi, z) = acts[L], acts[L + 1:L + 4]  # [s, h_1 .. h_L, c, phi, z, head layers]
    _check_formula(cos, *mirror_layers(net)["phi"], phi, "phi")
    want = (h_L.repeat_interleave(N, 0) * phi).to(torch.bfloat16)
    assert torch.equal(z.to(torch.bfloat16).view(torch.int16), want.view(torch.int16))
    names = _kernel_names(lambda: net.forward_full(states, tau))
    if any("dqn_ops" in n for n in names):  # where the profiler records kernels
        assert any("dense_layer_kernel" in n for n in names) and not any("iqn_phi_z" in n for n in names), names


@requires_cuda
@pytest.mark.parametrize("B", [1, 300, 3000])
def test_cuda_both_networks_in_one_launch_give_each_pass_its_bits(B, kernel_mode):
    """The trainer's batched forward (both networks' hidden layers in one launch: a problem each,
    the second network's weights and bias, its own input past the first layer) against a pass per
    network, on SHAPE's tails, with either network's weights at the lower address and one network
    as both. Both run the output layers of the two networks in one launch; each network's logits
    are checked against the same network's logits from the other position in that launch (online
    on [s; s'] there, target on s' here), whose problems and tiles differ."""
    a, b = make_net(SHAPE, "cuda", seed=1), make_net(SHAPE, "cuda", seed=2)
    state_pairs = _randn(2 * B, SHAPE.state_dim, seed=B)
    for online, target in [(a, b), (b, a), (a, a)]:
        outs = []
        for batched in (False, True):
            poison_cuda_cache()
            outs.append(InternalOpsStep(online, target, batch_networks=batched).forward(state_pairs))
        want, got = outs
        pairs = [("logits", got.logits, want.logits), ("logits_next_target", got.logits_next_target,
                                                        want.logits_next_target)]
        pairs += [(f"activations[{i}]", x, y) for i, (x, y) in enumerate(zip(got.activations, want.activations))]
        for name, x, y in pairs:
            same_bits(x, y, name)
    ab = InternalOpsStep(a, b, batch_networks=True).forward(state_pairs)
    ba = InternalOpsStep(b, a, batch_networks=True).forward(state_pairs)
    same_bits(ab.logits_next_target, ba.logits[B:], "b on s' as the target and as the online network")
    same_bits(ba.logits_next_target, ab.logits[B:], "a on s' as the target and as the online network")
    # The batched pass ran its layers through the kernel, none through the bias + ReLU pass.
    names = _kernel_names(lambda: InternalOpsStep(a, b, batch_networks=True).forward(state_pairs))
    if any("dqn_ops" in n for n in names):  # where the profiler records kernels
        assert any("dense_layer_kernel" in n for n in names) and not any("bias_relu_bf16" in n for n in names), names


@requires_cuda
def test_cuda_dense_layers_keep_the_emulated_rounding_through_the_network(kernel_mode):
    net = make_net(SHAPE, "cuda")
    poison_cuda_cache()
    check_bf16_mirror_emulated(net, _randn(64, SHAPE.state_dim, seed=64))


@requires_cuda
@pytest.mark.parametrize("c", [SHAPE, DEEP_HEADS], ids=["shape", "deep_heads"])
@pytest.mark.parametrize("B", BATCHES)
def test_cuda_output_layer_is_the_formula_on_its_input(B, c, kernel_mode):
    """The head logits (the output layer's one launch, then the F32 bias) against float64 on the
    GPU's own last hidden activation, each head on its slice of it: within the F32 sum's error
    (2^-16 of the sum of the products' magnitudes, generous for a tensor core's accumulation; a
    wrong element is off by the size of a product)."""
    net = make_net(c, "cuda", seed=B + 3)
    poison_cuda_cache()
    out = net.forward_full(_randn(B, c.state_dim, seed=B + 3))
    h = logical_activations(c, out.activations)[-1].double().cpu()
    layers = mirror_layers(net)
    refs, magnitudes, col = [], [], 0
    for stem, hidden, _ in head_widths(c):
        w, b = layers[stem.format(len(hidden) + 1)]
        x = h[:, col:col + hidden[-1]]
        col += hidden[-1]
        refs.append(x @ w.T + b)
        magnitudes.append(x.abs() @ w.abs().T + b.abs())
    assert col == h.shape[1]
    ref, magnitude = torch.cat(refs, 1), torch.cat(magnitudes, 1)
    assert ((out.head_logits.double().cpu() - ref).abs() <= 2 ** -16 * magnitude).all()


def _check_bits_do_not_depend_on_the_rows(run, rows=9000):
    """run(rows_slice) -> tensors on those rows (any dtypes). Rows run inside the whole (128 x 128
    tiles) and alone (300: 32 x 64; 3000: 64 x 64) are the same bits, at offsets that are not
    multiples of any tile; and the comparison crossed tile shapes (where the profiler records
    kernels, on a GPU of 132 SMs as BATCHES assumes)."""
    poison_cuda_cache()
    whole = run(slice(0, rows))
    for first, count in [(0, 300), (4001, 300), (5555, 3000), (rows - 1, 1)]:
        part_rows = slice(first, first + count)
        poison_cuda_cache()
        for i, (a, b) in enumerate(zip(whole, run(part_rows))):
            bits = torch.int16 if a.element_size() == 2 else torch.int32
            assert torch.equal(a[part_rows].view(bits), b.view(bits)), (first, count, i)
    names = {count: _kernel_names(lambda: run(slice(0, count))) for count in (300, rows)}
    if all(any("dqn_ops" in n for n in v) for v in names.values()) and \
            torch.cuda.get_device_properties(0).multi_processor_count == 132:
        tiles = {count: _tiles(v) for count, v in names.items()}
        assert "128, 128" in tiles[rows] and "32, 64" in tiles[300], tiles


@requires_cuda
def test_cuda_dense_layer_bits_do_not_depend_on_the_rows_or_the_tile(kernel_mode):
    net = make_net(SHAPE, "cuda", seed=1)
    s = _randn(9000, SHAPE.state_dim, seed=1)
    _check_bits_do_not_depend_on_the_rows(lambda rows: net.forward_full(s[rows]).activations)


@requires_cuda
def test_cuda_dense_layer_keeps_a_nan_sample_nan_and_its_neighbours_finite(kernel_mode):
    net = make_net(SHAPE, "cuda", seed=2)
    s = _randn(3000, SHAPE.state_dim, seed=2)
    s[1234, 17] = float("nan")
    poison_cuda_cache()
    gpu = net.forward_full(s)
    cpu = snapshot(net).to("cpu").forward_full(s.cpu())
    for a, b in zip(gpu.activations, cpu.activations):
        assert torch.equal(a.isnan().cpu(), b.isnan())
        assert a[1234].isnan().any() and not a[torch.arange(3000, device="cuda") != 1234].isnan().any()
    assert torch.equal(gpu.q_logits.isnan().cpu(), cpu.q_logits.isnan())


@requires_cuda
@pytest.mark.parametrize("kernel_mode", ["on", "off"], indirect=True)
@pytest.mark.parametrize("B", [300, 9000])
def test_cuda_dense_layers_run_the_dense_kernel_as_the_mode_says(B, kernel_mode):
    """Every layer of SHAPE fits the kernel (K a multiple of 8, the output heads' input columns
    disjoint): with the mode "on" the forward is dqn_ops's kernels alone (no cuBLAS GEMM, no
    bias_relu pass) and the backward has no relu_backward pass; with "off" the kernel never runs."""
    net = make_net(SHAPE, "cuda")
    s = _randn(B, SHAPE.state_dim, seed=B)
    gq = _randn(B, SHAPE.q_rows, SHAPE.atoms, seed=B + 1)
    forward = lambda: net.forward_full(s)  # noqa: E731
    backward = lambda: _backward(net, out, gq)  # noqa: E731
    out = forward()
    backward()  # the first calls' one-time work outside the profiled regions
    names = _kernel_names(forward)
    if not any("dqn_ops" in n for n in names):
        pytest.skip("the profiler recorded no kernels on this machine")
    back = _kernel_names(backward)
    dense = sum("dense_layer_kernel" in n for n in names + back)
    if kernel_mode == "on":
        assert not _cublas_gemms(names) and not any("bias_relu_bf16" in n for n in names), names
        assert not any("relu_backward" in n for n in back), back
    else:
        assert dense == 0 and any("bias_relu_bf16" in n for n in names) and any("relu_backward" in n for n in back)


def _backward(net, out, gq, need_grad_states=True):
    """mixed_backward in bf16 on the gradient gq of q: the flat gradient and d(states)."""
    return dqn_ops.mixed_backward(gq, None, out, net.flat_params.detach(), net.params_bf16, net._layout_ints, "bf16",
                                  need_grad_states)


def _backward_within_the_bar(net, out, gq):
    """The bf16 backward (grad, d(states)), every layer's gradient and d(states) checked within the
    bf16 bar of the float64 backward of the GPU's own forward."""
    poison_cuda_cache()
    grad, gs = _backward(net, out, gq)
    d_head = dueling_head_grad(net.config, gq.double().cpu())
    ref_grad, ref_gs = reference_backward(net, out.activations, d_head, "mirror")
    g, r = net.layer_views(grad), net.layer_views(ref_grad)
    for name in r:
        assert rel_err(g[name], r[name]) <= BACKWARD_BARS["bf16"], (name, rel_err(g[name], r[name]))
    assert rel_err(gs, ref_gs) <= BACKWARD_BARS["bf16"]
    return grad, gs


def _check_near_the_cublas_backward(net, out, gq, grad, gs):
    """grad and d(states) gs of a backward within 2^-6 of the cuBLAS GEMM + relu_backward path's
    (mode "off", which this sets) on the same forward: the two differ by their F32 sums' order and
    the BF16 copies that order rounds the other way, far less than a wrong mask, transposition or
    tile would (a whole product's size)."""
    dense_kernel.set_mode("off")
    poison_cuda_cache()
    cublas_grad, cublas_gs = _backward(net, out, gq)
    g, cublas = net.layer_views(grad), net.layer_views(cublas_grad)
    for name in cublas:
        assert rel_err(g[name], cublas[name]) <= 2 ** -6, (name, rel_err(g[name], cublas[name]))
    assert rel_err(gs, cublas_gs) <= 2 ** -6


@requires_cuda
@pytest.mark.parametrize("c", [SHAPE, DEEP_HEADS], ids=["shape", "deep_heads"])
@pytest.mark.parametrize("B", BATCHES)
def test_cuda_input_gradients_through_the_kernel_are_the_backward_within_its_bar(B, c, kernel_mode):
    """The backward with each layer's input gradient from the kernel (its ReLU mask and BF16 copy
    in the epilogue) against the float64 backward of the GPU's own forward (every layer within the
    bf16 bar), and against the cuBLAS GEMM + relu_backward path (mode "off") on the same forward
    (_check_near_the_cublas_backward)."""
    net = make_net(c, "cuda", seed=B + 7)
    out = net.forward_full(_randn(B, c.state_dim, seed=B))
    gq = _randn(B, c.q_rows, c.atoms, seed=B + 1)
    _check_near_the_cublas_backward(net, out, gq, *_backward_within_the_bar(net, out, gq))


@requires_cuda
def test_cuda_input_gradient_bits_do_not_depend_on_the_rows_or_the_tile(kernel_mode):
    """d(states) of rows in a 9000-row backward and of the same rows alone are the same bits: every
    input gradient on the way (the heads', the head layer's, the trunk's) is the kernel's, whose
    elements depend on their own row only, whatever its tile."""
    net = make_net(SHAPE, "cuda", seed=3)
    s = _randn(9000, SHAPE.state_dim, seed=3)
    gq = _randn(9000, SHAPE.q_rows, SHAPE.atoms, seed=4)
    _check_bits_do_not_depend_on_the_rows(lambda rows: _backward(net, net.forward_full(s[rows]), gq[rows])[1:])


@requires_cuda
def test_cuda_output_layer_heads_that_share_their_input_take_the_kernel_forward_only(kernel_mode):
    """With no head layers every output head reads the whole last trunk layer: the forward runs
    them in one launch (the branch heads' group a batch of stride 0 in x), the backward's input
    gradient, a sum over the heads, stays cuBLAS's with its relu_backward pass. Both within their
    bars as above."""
    c = DQNConfig(state_dim=40, trunk_hidden=(130, 64), value_hidden=(), adv_hidden=(), atoms=5, branches=(3, 3))
    net = make_net(c, "cuda", seed=5)
    s = _randn(300, c.state_dim, seed=5)
    gq = _randn(300, c.q_rows, c.atoms, seed=6)
    poison_cuda_cache()
    check_bf16_mirror_emulated(net, s)
    out = net.forward_full(s)
    _backward_within_the_bar(net, out, gq)
    names = _kernel_names(lambda: net.forward_full(s))
    back = _kernel_counts(lambda: _backward(net, out, gq))
    if any("dqn_ops" in n for n in names):
        assert not _cublas_gemms(names), names
        # The last trunk layer's relu_backward after the heads' summed dX; the two trunk layers'
        # input gradients (the first's, d(states), unmasked) from the kernel.
        assert sum(k for n, k in back.items() if "relu_backward" in n) == 1, back
        assert sum(k for n, k in back.items() if "dense_layer_kernel" in n and "DenseEpilogue)2" in n) == 2, back


@requires_cuda
@pytest.mark.parametrize("kernel_mode", ["auto"], indirect=True)
def test_cuda_auto_takes_an_input_gradient_of_one_k_tile_at_any_size(kernel_mode):
    """Mode auto's rule for input gradients: past its bound on products (2^27) only a K of one tile
    takes the kernel. At 70,000 rows of atoms = 1 heads the output layer's dX (K = 8 padded
    columns, 70,000 x 256 x 8 products a head) is the kernel's, one launch for the value head and
    the branch heads' group; the heads' merged first layer's and the trunk's (K = 768 and 256) are
    cuBLAS's, each with its relu_backward pass. The gradients within 2^-6 of mode "off"'s."""
    c = DQNConfig(state_dim=40, trunk_hidden=(256, 256), value_hidden=256, adv_hidden=256, atoms=1, branches=(3, 3))
    net = make_net(c, "cuda", seed=11)
    rows = 70_000
    out = net.forward_full(_randn(rows, c.state_dim, seed=11))
    gq = _randn(rows, c.q_rows, c.atoms, seed=12)
    back = _kernel_counts(lambda: _backward(net, out, gq))
    if not any("dqn_ops" in n for n in back):
        pytest.skip("the profiler recorded no kernels on this machine")
    assert sum(k for n, k in back.items() if "dense_layer_kernel" in n and "DenseEpilogue)2" in n) == 1, back
    assert sum(k for n, k in back.items() if "relu_backward" in n) == 2, back
    assert _cublas_gemms(list(back)), back
    poison_cuda_cache()
    _check_near_the_cublas_backward(net, out, gq, *_backward(net, out, gq))
