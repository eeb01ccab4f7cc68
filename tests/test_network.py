"""bf16_dueling_forward, mixed_backward and DuelingBranchQNet against independent references."""
import io

import pytest
import torch
import torch.nn.functional as F

import dqn_ops
from backward_check import check_backward_within_bars
from conftest import DEVICES, behind_a_sleep, requires_cuda, warm_side_stream
from dqn_ops import DQNConfig, DuelingBranchQNet, ParamLayout
from poison import poison_cuda_cache
from reference import CONFIGS, TINY, ReferenceNet, logical_activations, padding_mask, reference_net_like, rel_err


def make_net(config, device, **kw):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    return DuelingBranchQNet(config, generator=g, **kw).to(device)


def random_states(config, batch, device, dtype=torch.float32):
    return torch.randn(batch, config.state_dim, device=device, dtype=dtype)


# ----------------------------------------------------------------------------------------
# Layout

def test_reference_config_has_the_designs_parameter_count():
    c = DQNConfig()
    assert c.num_parameters == 287_998
    layout = ParamLayout(c)
    assert len(layout.weight_matrices()) == 10
    assert all(off % 8 == 0 for off, _ in layout.segments.values())
    assert layout.numel >= c.num_parameters


def test_layout_views_tile_the_buffer_without_overlap():
    for c in list(CONFIGS.values()) + [TINY]:
        L = ParamLayout(c)
        mark = torch.zeros(L.numel, dtype=torch.int32)
        for view in L.views(mark).values():  # strided where a stored input width was rounded up
            view += 1
        assert mark.max() == 1 and mark.sum() == c.num_parameters


def test_a_layout_pickled_before_the_aligned_buffer_still_gives_its_own_views():
    """A ParamLayout pickled before the buffer stored the aligned network (no row_strides, no
    stored group configs) described a buffer of the config itself: its unpickled views are the
    contiguous [out, in] blocks at its offsets, and its encode() is the one it was made with."""
    c = CONFIGS["odd_widths"]
    state = dict(ParamLayout(c).__dict__)
    old_tensors, offset = [], 0  # the contiguous layout of c itself, written out for the check
    for name, shape, _ in state["tensors"]:
        old_tensors.append((name, shape, offset))
        offset += shape[0] * (shape[1] if len(shape) == 2 else 1)
    state.update(tensors=old_tensors, numel=offset)
    for key in ("row_strides", "_stored_groups"):
        del state[key]
    old = ParamLayout.__new__(ParamLayout)
    old.__setstate__(state)
    flat = torch.arange(float(offset))
    for name, shape, off in old_tensors:
        view = old.views(flat)[name]
        assert view.is_contiguous() and torch.equal(view.reshape(-1), flat[off:off + view.numel()]), name
    assert old.encode()[1:10] == [c.state_dim, c.atoms, 1, 1, 0, c.num_branches, *c.branches, len(c.trunk_hidden)]
    assert old.encode()[10:12] == list(c.trunk_hidden)  # the config's own widths, not rounded up


# ----------------------------------------------------------------------------------------
# Forward

@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_float64_path_equals_nn_linear_reference(name):
    c = CONFIGS[name]
    net = make_net(c, "cpu").double()
    ref = reference_net_like(net)
    s = random_states(c, 33, "cpu", torch.float64)
    out = net.forward_full(s)
    q_ref, head_ref = ref(s)
    torch.testing.assert_close(out.q_logits, q_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.head_logits, head_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_forward_error_at_most_twice_autocast(device, name):
    """Our BF16 forward vs float64, against PyTorch autocast BF16 on the same inputs."""
    c = CONFIGS[name]
    net = make_net(c, device)
    ref64 = reference_net_like(net)
    s = random_states(c, 256, device)
    if device == "cuda":
        poison_cuda_cache()
    out = net.forward_full(s)
    q_ref, head_ref = ref64(s.double().cpu())
    ref32 = reference_net_like(net, torch.float32, device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        q_amp, head_amp = ref32(s)
    for ours, amp, exact in [(out.q_logits, q_amp, q_ref), (out.head_logits, head_amp, head_ref)]:
        e_ours, e_amp = rel_err(ours, exact), rel_err(amp.float(), exact)
        assert e_ours <= 2 * e_amp, f"{name}: BF16 forward error {e_ours:.2e} vs autocast {e_amp:.2e}"
        assert e_ours < 2e-2


def head_column_rows(config, rows: str) -> int:
    """A batch whose rows make the CUDA output-bias + dueling kernel give each head its own grid
    column ("few": their blocks, of 256 threads with a thread per atom, fewer than the SMs) or
    walk a row's heads in one ("many"; csrc/cuda/dueling.cuh split_heads)."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    rows_per_block = 256 // min(config.atoms, 256)
    return max(sms // 2, 1) * rows_per_block if rows == "few" else sms * rows_per_block + 7


@requires_cuda
@pytest.mark.parametrize("rows", ["few", "many"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_forward_matches_cpu_bf16_emulation(name, rows):
    """The CPU kernel rounds exactly where the GPU does; only F32 summation order differs."""
    c = CONFIGS[name]
    net = make_net(c, "cuda")
    s = random_states(c, head_column_rows(c, rows), "cuda")
    poison_cuda_cache()
    gpu = net.forward_full(s)
    cpu = net.to("cpu").forward_full(s.cpu())
    assert len(gpu.activations) == len(cpu.activations) == 1 + len(c.hidden_widths)
    named = [("q_logits", gpu.q_logits, cpu.q_logits), ("head_logits", gpu.head_logits, cpu.head_logits)]
    named += [(f"activations[{i}]", a, b) for i, (a, b) in enumerate(zip(gpu.activations, cpu.activations))]
    for name_, a, b in named:
        assert a.dtype == b.dtype and a.shape == b.shape, name_
        assert rel_err(a, b) < 2e-3, f"{name_}: {rel_err(a, b):.2e}"
    assert torch.equal(gpu.activations[0].cpu(), cpu.activations[0])  # one rounding of the same F32 values
    logical_activations(c, gpu.activations)  # the stored network's extra units: exactly zero


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_state_stays_visible_in_its_samples_outputs(device):
    """A non-finite input must reach the outputs (the trainer's non-finite check reads the loss and
    the gradient): the hidden layers' ReLU keeps a NaN a NaN, on every device and whichever way
    the bias and ReLU run (kernel or GEMM epilogue); the other samples stay finite."""
    c = CONFIGS["reference"]
    net = make_net(c, device)
    s = random_states(c, 64, device)
    s[5, 3] = float("nan")
    out = net.forward_full(s)
    named = [("q_logits", out.q_logits), ("head_logits", out.head_logits)]
    named += [(f"activations[{i}]", t) for i, t in enumerate(out.activations)]
    for name_, t in named:
        t = t.float()
        assert torch.isnan(t[5]).any(), f"{name_}: the NaN state's row lost its NaN"
        assert torch.isfinite(torch.cat([t[:5], t[6:]])).all(), name_


# ----------------------------------------------------------------------------------------
# Backward

@pytest.mark.parametrize("name", list(CONFIGS))
def test_float64_backward_equals_autograd_of_nn_linear_reference(name):
    c = CONFIGS[name]
    net = make_net(c, "cpu").double()
    ref = reference_net_like(net)
    s = random_states(c, 17, "cpu", torch.float64).requires_grad_()
    s_ref = s.detach().clone().requires_grad_()
    gq = torch.randn(17, c.total_actions, c.atoms, dtype=torch.float64)
    gh = torch.randn(17, c.head_out, dtype=torch.float64)
    q, head = net.forward_full(s)[:2]
    ((q * gq).sum() + (head * gh).sum()).backward()
    q_r, head_r = ref(s_ref)
    ((q_r * gq).sum() + (head_r * gh).sum()).backward()
    views = net.layer_views(net.flat_params.grad)
    for pname, p in ref.named_parameters():
        torch.testing.assert_close(views[pname], p.grad, rtol=1e-10, atol=1e-10, msg=pname)
    torch.testing.assert_close(s.grad, s_ref.grad, rtol=1e-10, atol=1e-10)
    assert (net.flat_params.grad[padding_mask(net.layout, "cpu")] == 0).all()


@pytest.mark.parametrize("precision", [None, "fp32"])
def test_forward_backward_returns_one_gradient_per_passed_input(precision):
    """The dispatcher drops a trailing argument equal to its default (backward_precision), and
    some torch versions' autograd wrapper for an op with a Tensor[] output takes back exactly one
    gradient per input the call passed: the formula must count them, not the schema's."""
    from dqn_ops import ops

    net = DuelingBranchQNet(TINY, generator=torch.Generator().manual_seed(0))
    states = torch.randn(3, TINY.state_dim)
    fwd = ops.bf16_dueling_forward(states, net.flat_params.detach(), net.params_bf16, net._layout_ints,
                                   *([precision] if precision else []))
    passed = 4 if precision is None else 5

    class Ctx:
        needs_input_grad = (False, True) + (False,) * (passed - 2)
        saved_tensors = (*fwd.activations, net.flat_params.detach(), net.params_bf16)
        layout, precision = net._layout_ints, "fp32"

    for grad_q in (torch.ones_like(fwd.q_logits), None):
        grads = ops._forward_backward(Ctx, grad_q, None, None)
        assert len(grads) == passed and (grads[1] is not None) == (grad_q is not None)


def test_gradcheck_float64():
    c = TINY
    layout = ParamLayout(c).encode()
    net = make_net(c, "cpu").double()
    p = net.flat_params.detach().clone().requires_grad_()
    s = random_states(c, 4, "cpu", torch.float64).requires_grad_()

    def f(states, params):
        # The mirror is taken from params inside f, so gradcheck's perturbations reach it.
        out = dqn_ops.bf16_dueling_forward(states, params, params.detach().clone(), layout)
        return out.q_logits, out.head_logits

    assert torch.autograd.gradcheck(f, (s, p), eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("B", [256, 1100])  # the CUDA bias gradients sum 512-row chunks past 512 rows
def test_backward_vs_float64_within_bars(device, precision, name, B):
    """mixed_backward vs a hand-written float64 backward of the same forward, per precision."""
    check_backward_within_bars(make_net(CONFIGS[name], device), name, precision, B)


# An ensemble: its 5 value heads a group of 5 same-shape blocks (the branch heads, of 3 and 2
# actions, groups of one). A wide trunk: its 1536 x 1536 layer's dW has 144 output tiles of 128 x
# 128, so on a device of 132 SMs (H100, H200) it takes 2 chunks, and at 32868 and 49221 rows the
# batch of whole chunks is a single GEMM (one whole chunk, then the shorter last one).
SPLIT_CONFIGS = {"reference": CONFIGS["reference"], "odd_widths": CONFIGS["odd_widths"],
                 "ensemble_5": DQNConfig(state_dim=24, trunk_hidden=(64, 48), value_hidden=32, adv_hidden=16,
                                         atoms=21, branches=(3, 2), ensemble=5),
                 "wide_trunk": DQNConfig(state_dim=24, trunk_hidden=(1536, 1536), value_hidden=32, adv_hidden=16,
                                         atoms=5, branches=(3, 2))}


@requires_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SPLIT_CONFIGS))
@pytest.mark.parametrize("B", [32768, 32868, 49221])
def test_cuda_weight_gradients_split_along_the_rows_within_bars(precision, name, B):
    """From 32768 rows the CUDA backward splits a dW GEMM's K (the rows) into chunks and sums their
    products: whole chunks, a shorter last one (32868, 49221), groups of several blocks (the
    ensemble's), the row offsets of unaligned widths (odd_widths), a single whole chunk before
    the shorter one (wide_trunk)."""
    check_backward_within_bars(make_net(SPLIT_CONFIGS[name], "cuda"), name, precision, B)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_without_grad_states_returns_none_and_same_params_grad(device):
    c = CONFIGS["odd_widths"]
    net = make_net(c, device)
    saved = net.forward_full(random_states(c, 40, device))
    gq = torch.randn(40, c.total_actions, c.atoms, device=device)
    a, ga = dqn_ops.mixed_backward(gq, None, saved, net.flat_params.detach(), net.params_bf16, net._layout_ints,
                                   "fp32", need_grad_states=False)
    b, gb = dqn_ops.mixed_backward(gq, None, saved, net.flat_params.detach(), net.params_bf16, net._layout_ints,
                                   "fp32", need_grad_states=True)
    assert ga is None and gb.shape == (40, c.state_dim)
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------
# Module

def test_state_dict_has_nn_linear_names_and_round_trips():
    c = CONFIGS["five_branches"]
    net = make_net(c, "cpu")
    ref = ReferenceNet(c)
    assert set(net.state_dict()) == set(ref.state_dict())
    ref.load_state_dict(net.state_dict())  # ours -> plain PyTorch
    other = make_net(c, "cpu")
    other.load_state_dict(ref.state_dict())  # plain PyTorch -> ours
    assert torch.equal(other.flat_params, net.flat_params)
    assert torch.equal(other.params_bf16, net.flat_params.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="size mismatch"):
        make_net(CONFIGS["one_branch"], "cpu").load_state_dict(make_net(DQNConfig(state_dim=16, trunk_hidden=(64, 32), value_hidden=24, adv_hidden=16, atoms=51, branches=(5,)), "cpu").state_dict())


def test_torch_optim_on_the_flat_parameter_follows_nn_linear_training():
    """Adam over our one flat parameter == Adam over the nn.Linear layers (Adam is elementwise)."""
    c = TINY
    net = make_net(c, "cpu").double()
    ref = reference_net_like(net)
    assert [p is net.flat_params for p in net.parameters()] == [True]
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    s = random_states(c, 64, "cpu", torch.float64)
    target = torch.randn(64, c.total_actions, c.atoms, dtype=torch.float64)
    for _ in range(20):
        for model, o in ((net, opt), (lambda x: ref(x)[0], opt_ref)):
            o.zero_grad()
            F.mse_loss(model(s), target).backward()
            o.step()
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(net.state_dict()[name], p, rtol=1e-9, atol=1e-12, msg=name)
    net.float()
    net(s.float())
    assert torch.equal(net.params_bf16, net.flat_params.detach().to(torch.bfloat16))


def test_module_to_double_and_back_keeps_values():
    net = make_net(TINY, "cpu")
    before = net.flat_params.detach().clone()
    net.double()
    assert net.flat_params.dtype == torch.float64 and net.params_bf16.dtype == torch.float64
    net.float()
    assert torch.equal(net.flat_params.detach(), before)
    assert "parameters=" in repr(net)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device):
    c = TINY
    net = make_net(c, device)
    s = random_states(c, 8, device)
    compiled = torch.compile(net, fullgraph=True)
    q_c = compiled(s)
    q_c.square().sum().backward()
    g_c = net.flat_params.grad.clone()
    net.flat_params.grad = None
    q_e = net(s)
    q_e.square().sum().backward()
    torch.testing.assert_close(q_c, q_e, rtol=0, atol=0)
    torch.testing.assert_close(g_c, net.flat_params.grad, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------
# opcheck (schema, fake kernel, autograd registration, AOT dispatch)

@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    c = CONFIGS["odd_widths"]
    net = make_net(c, device)
    layout = net._layout_ints
    s = random_states(c, 12, device)
    params = net.flat_params.detach().clone().requires_grad_()
    torch.library.opcheck(torch.ops.dqn_ops.bf16_dueling_forward.default,
                          (s, params, net.params_bf16, layout, "tf32"))
    saved = torch.ops.dqn_ops.bf16_dueling_forward.default(s, params.detach(), net.params_bf16, layout, "tf32")
    gq = torch.randn(12, c.total_actions, c.atoms, device=device)
    for need in (False, True):
        torch.library.opcheck(torch.ops.dqn_ops.mixed_backward.default,
                              (gq, None, saved[2], params.detach(), net.params_bf16, layout, "bf16", need))


# ----------------------------------------------------------------------------------------
# Bad input

def _forward_args(device="cpu", c=TINY, batch=4):
    net = make_net(c, device)
    return dict(states=random_states(c, batch, device), params=net.flat_params.detach(), params_bf16=net.params_bf16,
                layout=net._layout_ints)


def _call_forward(a):
    return dqn_ops.bf16_dueling_forward(a["states"], a["params"], a["params_bf16"], a["layout"],
                                        a.get("precision", "tf32"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(states=a["states"][:, :-1]), r"states: expected shape \[\*, 5\], got \[4, 4\]"),
    (lambda a: a.update(states=a["states"].double()), "states: expected dtype Float, got Double"),
    (lambda a: a.update(states=a["states"][:0]), "at least 1 row"),
    (lambda a: a.update(states=torch.randn(5, 4, device=a["states"].device).t()), "states: expected a contiguous tensor"),
    (lambda a: a.update(params=a["params"][:-8]), r"params: expected shape \["),
    (lambda a: a.update(params_bf16=a["params_bf16"].half()), "params_bf16: expected dtype BFloat16"),
    (lambda a: a.update(layout=a["layout"][:-1]), "layout: ended after 25 entries, before the buffer length"),
    (lambda a: a.update(layout=[1, *a["layout"][1:]]),  # a stale format
     r"layout: expected the int\[\] from dqn_ops.ParamLayout.encode\(\) \(format 4, .*\), got first entry 1"),
    (lambda a: a.update(layout=[*a["layout"][:-2], a["layout"][-2] + 1, a["layout"][-1]]), "not a non-negative multiple of 8"),
    (lambda a: a.update(layout=[*a["layout"][:-1], 8]), "lies outside the buffer"),
    (lambda a: a.update(precision="tf16"), "expected one of 'tf32', 'bf16', 'fp32', got 'tf16'"),
])
def test_forward_bad_input_names_op_and_argument(device, mutate, match):
    a = _forward_args(device)
    mutate(a)
    with pytest.raises(RuntimeError, match="dqn_ops.bf16_dueling_forward: .*" + match):
        _call_forward(a)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_bad_input_names_op_and_argument(device):
    a = _forward_args(device)
    saved = _call_forward(a)
    c = TINY
    gq = torch.randn(4, c.total_actions, c.atoms, device=device)

    def call(gq=gq, gh=None, saved=saved, precision="tf32"):
        return dqn_ops.mixed_backward(gq, gh, saved, a["params"], a["params_bf16"], a["layout"], precision)

    op = "dqn_ops.mixed_backward: "
    with pytest.raises(RuntimeError, match=op + "grad_q and grad_head are both None"):
        call(gq=None)
    with pytest.raises(RuntimeError, match=op + r"grad_q: expected shape \[4, 5, 3\], got \[4, 5, 2\]"):
        call(gq=gq[..., :2].contiguous())
    with pytest.raises(RuntimeError, match=op + r"grad_head: expected shape \[4, 18\]"):
        call(gh=torch.zeros(4, 3, device=device))
    acts = saved.activations
    # TINY's 7-unit trunk layer is stored 8 wide (DQNConfig.aligned): its activation's shape
    with pytest.raises(RuntimeError, match=op + r"activations\[1\]: expected shape \[4, 8\], got \[3, 8\]"):
        call(saved=[acts[0], acts[1][:3], *acts[2:]])
    with pytest.raises(RuntimeError, match=op + r"activations\[3\]: expected dtype BFloat16, got Float"):
        call(saved=[*acts[:3], acts[3].float()])
    with pytest.raises(RuntimeError, match=op + r"activations: expected 4 tensors \(the states and each hidden layer"):
        call(saved=acts[:3])
    with pytest.raises(RuntimeError, match=op + "precision: expected one of"):
        call(precision="half")


def test_cpu_reference_path_dtype_rules():
    a = _forward_args()
    a["params_bf16"] = a["params"].double()
    with pytest.raises(RuntimeError, match=r"params_bf16: expected dtype BFloat16 \(or params' dtype Float"):
        _call_forward(a)
    a = _forward_args()
    a.update(params=a["params"].double(), states=a["states"].double())
    with pytest.raises(RuntimeError, match="a BFloat16 mirror needs Float params"):
        _call_forward(a)


@requires_cuda
def test_cuda_rejects_mixed_devices_float64_and_misaligned():
    a = _forward_args("cuda")
    with pytest.raises(RuntimeError, match="states: expected a tensor on cuda:0, got one on cpu"):
        _call_forward(dict(a, states=a["states"].cpu()))
    with pytest.raises(RuntimeError, match="params: expected dtype Float, got Double"):
        _call_forward(dict(a, params=a["params"].double(), states=a["states"].double()))
    with pytest.raises(RuntimeError, match="params_bf16: expected dtype BFloat16, got Float"):
        _call_forward(dict(a, params_bf16=a["params"].clone()))
    shifted = torch.empty(a["params"].numel() + 1, device="cuda")[1:]
    shifted.copy_(a["params"])
    with pytest.raises(RuntimeError, match="params: expected its data pointer aligned to 32 bytes"):
        _call_forward(dict(a, params=shifted))


def test_config_validation():
    with pytest.raises(ValueError, match="branches must be a non-empty tuple"):
        DQNConfig(branches=())
    with pytest.raises(ValueError, match="atoms must be >= 1"):
        DQNConfig(atoms=0)
    with pytest.raises(ValueError, match="backward_precision must be one of"):
        DuelingBranchQNet(TINY, backward_precision="fp16")


# ----------------------------------------------------------------------------------------
# CUDA graphs, streams and host syncs

@requires_cuda
@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp32"])
def test_cuda_graph_replay_equals_eager(precision):
    c = CONFIGS["five_branches"]
    net = make_net(c, "cuda")
    layout, params, mirror = net._layout_ints, net.flat_params.detach(), net.params_bf16
    s = random_states(c, 128, "cuda")
    gq = torch.randn(128, c.total_actions, c.atoms, device="cuda")

    def step():
        out = dqn_ops.bf16_dueling_forward(s, params, mirror, layout)
        grad, gs = dqn_ops.mixed_backward(gq, out.head_logits * 0.01, out, params, mirror, layout, precision, True)
        return out.q_logits, grad, gs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: cuBLAS handle and workspace exist before capture (docs/design.md)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = step()
    for _ in range(3):  # fresh inputs each replay, into the captured buffers
        s.copy_(torch.randn_like(s))
        gq.copy_(torch.randn_like(gq))
        for t in static_out:
            t.fill_(float("nan"))
        g.replay()
        eager = step()
        for a, b in zip(static_out, eager):
            assert torch.equal(a, b)


@requires_cuda
def test_no_host_sync_in_forward_and_backward():
    c = CONFIGS["reference"]
    net = make_net(c, "cuda")
    s = random_states(c, 256, "cuda")
    gq = torch.randn(256, c.total_actions, c.atoms, device="cuda")
    args = (net.flat_params.detach(), net.params_bf16, net._layout_ints)
    out = dqn_ops.bf16_dueling_forward(s, *args)  # warm-up outside the check
    dqn_ops.mixed_backward(gq, None, out, *args, "tf32")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for precision in ("tf32", "bf16", "fp32"):
            out = dqn_ops.bf16_dueling_forward(s, *args)
            dqn_ops.mixed_backward(gq, out.head_logits, out, *args, precision, need_grad_states=True)
        q = net(s)  # the module path: mirror refresh + op + autograd
        q.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@requires_cuda
def test_ops_run_on_the_current_side_stream():
    c = CONFIGS["odd_widths"]
    net = make_net(c, "cuda")
    s = random_states(c, 64, "cuda")
    args = (net.flat_params.detach(), net.params_bf16, net._layout_ints)
    fresh = random_states(c, 64, "cuda")
    side, expected = warm_side_stream(lambda: dqn_ops.bf16_dueling_forward(fresh, *args).q_logits)
    with torch.cuda.stream(side), behind_a_sleep():
        # The side stream is busy, then writes the new states: an op that launched on any
        # other stream would run at once on the old states.
        s.copy_(fresh)
        q = dqn_ops.bf16_dueling_forward(s, *args).q_logits
    torch.cuda.synchronize()
    assert torch.equal(q, expected)


def test_a_network_pickles_whole():
    """torch.save(net) (not only its state dict): no lambda among its hooks."""
    net = DuelingBranchQNet(TINY)
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    s = torch.randn(5, net.config.state_dim)
    assert torch.equal(loaded(s), net(s))
