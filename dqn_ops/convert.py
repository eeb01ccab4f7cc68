"""Weights between ``DuelingBranchQNet`` and plain PyTorch modules (docs/networks.md).

``from_torch(module, config)`` builds a ``DuelingBranchQNet`` holding the weights of any module
whose ``nn.Linear`` layers have the config's shapes (CleanRL's ``QNetwork``, a hand-written
network, ``dqn_ops.rl.baseline.TorchQNet``); ``to_torch(net)`` gives the plain network
(``TorchQNet``) with the net's weights, or writes them into a given module.

Each of our layers (the names of ``ParamLayout``: ``s<i>``, ``v<j>``, ``a<j>.<d>`` or
``q<j>.<d>``; an ensemble's head layers prefixed by their member, ``e<m>.v<j>``, ``e<m>.a<j>.<d>``)
is matched with one layer of the module, the first way that applies:

1. ``mapping`` given: ``{our_name: their_module_path}`` for every layer of ours (module paths
   as ``named_modules()`` spells them: ``"network.0"``).
2. By name: the module's state dict has ``<our_name>.weight`` and ``<our_name>.bias`` for every
   layer of ours (a ``TorchQNet``, a ``DuelingBranchQNet``, a module built with our names).
3. By order: the module's ``nn.Linear`` layers in the order it registers them
   (``named_modules()``) are ours in ParamLayout's order of weights: the trunk ``s1..sL``, then
   head by head in head order (the value head first with dueling, then branch 0, 1, ...; an
   ensemble's E value heads, then member 0's branch heads, member 1's, ...) its layers
   ``1..H`` and its output layer ``H + 1``.

By name and by order, every parameter of the module must be in a matched layer (a module with
more to it is another network); with a mapping, the layers it leaves out are the caller's
choice. Every layer must have a bias and the shapes of ours.
"""
from __future__ import annotations

from typing import List, Mapping, NamedTuple, Optional

import torch
from torch import Tensor, nn

from .layout import DQNConfig, ParamLayout
from .network import DuelingBranchQNet


class _Match(NamedTuple):
    ours: str                 # our layer name ('s1', 'a2.0')
    shape: tuple              # our weight's shape (out, in)
    theirs: str               # their module path or state-dict prefix
    weight: Optional[Tensor]  # their tensors (the module's own, not copies)
    bias: Optional[Tensor]


def _our_layers(config: DQNConfig):
    """(name, weight shape) of each layer, in ParamLayout's order of weights."""
    return [(name, tuple(shape)) for name, shape in ParamLayout(config).layers()]


def _shape(t: Optional[Tensor]) -> str:
    return "none" if t is None else str(list(t.shape))


def _linear_list(linears) -> str:
    return ", ".join(f"'{p}' [{m.out_features}, {m.in_features}]" for p, m in linears) or "none"


def _ours_list(ours) -> str:
    return ", ".join(f"'{n}' [{s[0]}, {s[1]}]" for n, s in ours)


def _match_layers(op: str, module: nn.Module, config: DQNConfig, mapping: Optional[Mapping[str, str]]):
    """Pairs each of our layers with one of the module's (see the module docstring). Returns
    (how, [_Match]) with every shape checked."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{op}: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(config, DQNConfig):
        raise TypeError(f"{op}: config must be a dqn_ops.DQNConfig, got {type(config).__name__}")
    ours = _our_layers(config)
    names = [n for n, _ in ours]
    linears = [(path, m) for path, m in module.named_modules() if isinstance(m, nn.Linear)]
    if mapping is not None:
        how = "by the mapping"
        matches = _match_by_mapping(op, module, ours, mapping, linears)
    else:
        state = module.state_dict(keep_vars=True)
        if all(f"{n}.weight" in state and f"{n}.bias" in state for n in names):
            how = "by name"
            keys = {f"{n}.{p}" for n in names for p in ("weight", "bias")}
            buffers = {b for b, _ in module.named_buffers()}
            extra = [k for k in state if k not in keys and k not in buffers]
            if extra:
                raise ValueError(f"{op}: the module has every layer of the config by name and also {extra}, which "
                                 f"the config has no place for (config {config}); pass mapping= to take only "
                                 f"some of its layers")
            matches = [_Match(n, s, n, state[f"{n}.weight"], state[f"{n}.bias"]) for n, s in ours]
        else:
            how = "by registration order"
            named = [n for n in names if f"{n}.weight" in state]
            partial = (f" (its state dict has some of our names, {named}, but not all: matching by name needs "
                       f"every one)" if named else "")
            if len(linears) != len(ours):
                raise ValueError(f"{op}: the module registers {len(linears)} nn.Linear layers ({_linear_list(linears)})"
                                 f", the config has {len(ours)} ({_ours_list(ours)}, in ParamLayout's order: trunk, "
                                 f"then each head's layers){partial}; pass mapping={{our_name: their_module_path}}")
            paths = [p for p, _ in linears]
            extra = [n for n, _ in module.named_parameters()
                     if not any(p == "" or n.startswith(p + ".") for p in paths)]
            if extra:
                raise ValueError(f"{op}: the module has parameters outside its nn.Linear layers ({extra}) that the "
                                 f"config has no place for (config {config}); pass mapping= to take only its "
                                 f"nn.Linear layers")
            matches = [_Match(n, s, p, m.weight, m.bias) for (n, s), (p, m) in zip(ours, linears)]
    for m in matches:
        if not isinstance(m.weight, Tensor) or not isinstance(m.bias, Tensor):
            missing = "weight" if not isinstance(m.weight, Tensor) else "bias"
            raise ValueError(f"{op}: our layer '{m.ours}' (weight {list(m.shape)}, bias [{m.shape[0]}]) was matched "
                             f"{how} with their '{m.theirs}', which has no {missing} tensor")
        if tuple(m.weight.shape) != m.shape or tuple(m.bias.shape) != m.shape[:1]:
            raise ValueError(f"{op}: our layer '{m.ours}' (weight {list(m.shape)}, bias [{m.shape[0]}]) was matched "
                             f"{how} with their '{m.theirs}' (weight {_shape(m.weight)}, bias {_shape(m.bias)}): the "
                             f"shapes differ (config {config})")
        if not (m.weight.is_floating_point() and m.bias.is_floating_point()):
            raise TypeError(f"{op}: their '{m.theirs}' (matched {how} with our '{m.ours}') must hold floating-point "
                            f"tensors, got {m.weight.dtype} / {m.bias.dtype}")
    return how, matches


def _match_by_mapping(op, module, ours, mapping, linears) -> List[_Match]:
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{op}: mapping must be a dict {{our_name: their_module_path}}, got {type(mapping).__name__}")
    names = [n for n, _ in ours]
    unknown = [k for k in mapping if k not in names]
    if unknown:
        raise ValueError(f"{op}: mapping has keys that are not layers of the config: {unknown}; the config's layers: "
                         f"{_ours_list(ours)}")
    missing = [n for n in names if n not in mapping]
    if missing:
        raise ValueError(f"{op}: mapping has no entry for our layer(s) {missing}; it must map every layer of the "
                         f"config: {_ours_list(ours)}")
    paths = [mapping[n] for n in names]
    bad = [p for p in paths if not isinstance(p, str)]
    if bad:
        raise TypeError(f"{op}: mapping's values must be module paths (str), got {bad}")
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise ValueError(f"{op}: mapping gives their layer(s) {twice} to more than one of our layers")
    matches = []
    for (name, shape), path in zip(ours, paths):
        try:
            sub = module.get_submodule(path)
        except AttributeError:
            raise ValueError(f"{op}: mapping['{name}'] = '{path}' is not a submodule of the module; its nn.Linear "
                             f"layers: {_linear_list(linears)}") from None
        matches.append(_Match(name, shape, path, getattr(sub, "weight", None), getattr(sub, "bias", None)))
    return matches


def from_torch(module: nn.Module, config: DQNConfig, mapping: Optional[Mapping[str, str]] = None, *,
               backward_precision: str = "tf32") -> DuelingBranchQNet:
    """A ``DuelingBranchQNet(config)`` holding the weights of ``module``'s ``nn.Linear`` layers.

    The layers are matched by ``mapping`` ({our_name: their_module_path}) when given, else by
    our names when the module's state dict has them all, else by the order the module
    registers its nn.Linear layers (= ParamLayout's order: trunk, then per head its layers,
    in head order: value heads first); see docs/networks.md. Every mismatch (layer count, a shape, a missing
    name or bias, a parameter left over) raises an error naming both sides.

    The network is on the device of the module's first matched weight; float64 when all of
    the matched tensors are (the exact CPU reference path: the mirror is float64 too), else
    float32 with its BF16 mirror. ``module`` is left unchanged, and so is torch's global RNG.
    """
    how, matches = _match_layers("from_torch", module, config, mapping)
    tensors = [t for m in matches for t in (m.weight, m.bias)]
    dtype = torch.float64 if all(t.dtype == torch.float64 for t in tensors) else torch.float32
    # A private generator: the initial weights are all overwritten below, and the caller's
    # random stream stays where it was.
    net = DuelingBranchQNet(config, backward_precision=backward_precision, generator=torch.Generator())
    net.to(device=matches[0].weight.device, dtype=dtype)
    net.load_state_dict({f"{m.ours}.{p}": t.detach() for m in matches for p, t in (("weight", m.weight),
                                                                                   ("bias", m.bias))})
    return net


@torch.no_grad()
def to_torch(net: DuelingBranchQNet, module: Optional[nn.Module] = None,
             mapping: Optional[Mapping[str, str]] = None) -> nn.Module:
    """The weights of ``net`` in plain PyTorch.

    Without ``module``: a new ``dqn_ops.rl.baseline.TorchQNet(net.config)`` (``nn.Linear``
    layers under our names, on the net's device and in its parameters' dtype) holding them.
    With ``module``: writes them into that module's layers, matched as ``from_torch`` matches
    them (``mapping``, our names, or registration order), and returns it.
    """
    if not isinstance(net, DuelingBranchQNet):
        raise TypeError(f"to_torch: net must be a dqn_ops.DuelingBranchQNet, got {type(net).__name__}")
    if module is None:
        if mapping is not None:
            raise ValueError("to_torch: mapping applies to a given module; TorchQNet takes our names")
        from .rl.baseline import TorchQNet  # here, not above: `import dqn_ops` does not load dqn_ops.rl
        with torch.device("meta"):  # no initialisation to overwrite, the global RNG untouched
            module = TorchQNet(net.config)
        module = module.to_empty(device=net.flat_params.device).to(net.flat_params.dtype)
    _, matches = _match_layers("to_torch", module, net.config, mapping)
    views = net.layer_views()
    for m in matches:
        m.weight.copy_(views[f"{m.ours}.weight"])
        m.bias.copy_(views[f"{m.ours}.bias"])
    # The matched tensors were the module's own; a layer whose weight is computed from others
    # (a parametrization) would have dropped the write: read back to be sure.
    _, again = _match_layers("to_torch", module, net.config, mapping)
    for m in again:
        for p, t in (("weight", m.weight), ("bias", m.bias)):
            if not torch.equal(t, views[f"{m.ours}.{p}"].to(device=t.device, dtype=t.dtype)):
                raise ValueError(f"to_torch: their '{m.theirs}.{p}' did not take our '{m.ours}.{p}' (a weight "
                                 f"computed from other tensors, such as a parametrization, cannot be written)")
    return module
