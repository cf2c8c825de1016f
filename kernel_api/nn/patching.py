"""`patch` and `unpatch`: route a model's projections through kernel_api, reversibly.

    model = kernel_api.nn.patch(model)     # every nn.Linear / GPT-2 Conv1D -> kernel_api GEMMs
    model = kernel_api.nn.unpatch(model)   # the original modules back, the same objects
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from .linear import Conv1DLinear, Linear, conv1d_from

# Set on the patched root: [(parent, attribute, original, replacement)], in patching order.
_RECORDS = "_kernel_api_patches"
# Parents whose forward is known to apply ``activation`` right after ``projection`` (and use the
# activation nowhere else), by class name: GPT2MLP's forward is c_proj(act(c_fc(x))), dropout.
_FUSIBLE_PARENTS = {"GPT2MLP": ("c_fc", "act")}
# transformers activation modules that compute an epilogue activation, by class name. (Its
# plain "GELUActivation" is the exact erf GELU: not fused.) NewGELUActivation is gelu_new.
_TRANSFORMERS_ACTIVATIONS = {"NewGELUActivation": "gelu", "GELUTanh": "gelu", "PytorchGELUTanh": "gelu",
                             "FastGELUActivation": "gelu", "SiLUActivation": "silu"}


class FusedActivation(torch.nn.Identity):
    """Stands where an activation module was, after `patch` fused that activation into the
    epilogue of the projection before it (``fused_into``); `unpatch` puts the module back."""

    def __init__(self, activation: str, fused_into: str) -> None:
        super().__init__()
        self.activation, self.fused_into = activation, fused_into

    def extra_repr(self) -> str:
        return f"{self.activation!r} fused into {self.fused_into!r}"


def _is_from_transformers(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "transformers"


def _projection_kind(module: torch.nn.Module) -> str | None:
    """"linear" for a plain torch.nn.Linear, "conv1d" for transformers' Conv1D, else None.
    Subclasses of torch.nn.Linear are left alone: their forward may differ."""
    if type(module) is torch.nn.Linear:
        return "linear"
    if isinstance(module, Conv1DLinear):
        return None
    if any(c.__name__ == "Conv1D" and _is_from_transformers(c) for c in type(module).__mro__):
        return "conv1d"
    return None


def _activation_name(module: Any) -> str | None:
    """The epilogue activation ``module`` computes, or None when it is not one we fuse."""
    kind = type(module)
    if kind is torch.nn.ReLU:
        return "relu"
    if kind is torch.nn.GELU:
        return "gelu" if module.approximate == "tanh" else None
    if kind is torch.nn.SiLU:
        return "silu"
    if _is_from_transformers(kind):
        return _TRANSFORMERS_ACTIVATIONS.get(kind.__name__)
    return None


def _fusions(root: torch.nn.Module) -> dict[int, tuple[torch.nn.Module, str, torch.nn.Module, str]]:
    """id(projection) -> (parent, activation attribute, activation module, activation name) for
    each projection that a known activation follows, where both appear once in ``root``."""
    seen: dict[int, int] = {}
    for parent in root.modules():
        for child in parent._modules.values():  # (children() would count a repeated child once)
            if child is not None:
                seen[id(child)] = seen.get(id(child), 0) + 1
    found = {}
    for parent in root.modules():
        pairs = []
        if isinstance(parent, torch.nn.Sequential):
            names = list(parent._modules)
            pairs = list(zip(names, names[1:]))
        elif type(parent).__name__ in _FUSIBLE_PARENTS:
            pairs = [_FUSIBLE_PARENTS[type(parent).__name__]]
        for proj_name, act_name in pairs:
            proj, act = getattr(parent, proj_name, None), getattr(parent, act_name, None)
            if not isinstance(proj, torch.nn.Module) or not isinstance(act, torch.nn.Module):
                continue
            activation = _activation_name(act)
            if (activation is not None and _projection_kind(proj) is not None and seen.get(id(proj)) == 1
                    and seen.get(id(act)) == 1):
                found[id(proj)] = (parent, act_name, act, activation)
    return found


def _replacement(module: torch.nn.Module, kind: str, activation: str | None, name: str) -> torch.nn.Module:
    new = Linear.from_linear(module, activation) if kind == "linear" else conv1d_from(module, activation)
    new.kernel_api_name = name  # for error messages
    return new


def patch(module: torch.nn.Module, *, include: Callable[[str], bool] | None = None,
          fuse_activations: bool = True) -> torch.nn.Module:
    """Replace, in place, every ``torch.nn.Linear`` (exactly that class) and every transformers
    GPT-2 ``Conv1D`` in ``module`` by a kernel_api layer holding the same Parameter objects, so
    ``state_dict`` keys and values do not change; return the module (the replacement when
    ``module`` itself is such a layer).

    ``include(qualified_name) -> bool`` picks the layers (default: all). With
    ``fuse_activations``, a projection followed by a known activation (torch ReLU, tanh GELU,
    SiLU; transformers' gelu_new and tanh GELUs) in an ``nn.Sequential`` or a GPT-2 MLP gets
    that activation in its GEMM epilogue, and the activation module is replaced by a
    `FusedActivation` identity. `unpatch` undoes all of it. A module with nothing to patch is
    returned unchanged, with a warning.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if include is not None and not callable(include):
        raise TypeError(f"include: expected a callable taking a module name, got {type(include).__name__}")
    root_kind = _projection_kind(module)
    if root_kind is not None:
        if include is not None and not include(""):
            warnings.warn("kernel_api.nn.patch: include() excluded the module itself; nothing patched", stacklevel=2)
            return module
        new = _replacement(module, root_kind, None, "")
        new.__dict__[_RECORDS] = [(None, "", module, new)]
        return new
    fusions = _fusions(module) if fuse_activations else {}
    records = module.__dict__.setdefault(_RECORDS, [])
    done: dict[int, torch.nn.Module] = {}  # a module shared by several parents gets one replacement
    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent._modules.items()):  # (named_children() skips repeats)
            kind = None if child is None else _projection_kind(child)
            if kind is None:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            new = done.get(id(child))
            if new is None:
                if include is not None and not include(name):
                    continue
                fusion = fusions.get(id(child))
                new = done[id(child)] = _replacement(child, kind, fusion[3] if fusion else None, name)
                if fusion is not None:
                    act_parent, act_attr, act, activation = fusion
                    marker = FusedActivation(activation, name)
                    setattr(act_parent, act_attr, marker)
                    records.append((act_parent, act_attr, act, marker))
            setattr(parent, child_name, new)
            records.append((parent, child_name, child, new))
    if not records:
        del module.__dict__[_RECORDS]
        warnings.warn(f"kernel_api.nn.patch: {type(module).__name__} has no torch.nn.Linear or transformers Conv1D "
                      f"to patch{' that include() accepts' if include is not None else ''}; returned unchanged",
                      stacklevel=2)
    return module


def unpatch(module: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: put back the original modules (the same objects) in every place `patch`
    changed, latest first; return the module (the original layer when `patch` replaced the
    module itself). A module that was not patched is returned unchanged, with a warning."""
    records = module.__dict__.pop(_RECORDS, None)
    if not records:
        warnings.warn(f"kernel_api.nn.unpatch: {type(module).__name__} was not patched; returned unchanged",
                      stacklevel=2)
        return module
    for parent, attr, original, replacement in reversed(records):
        if parent is None:  # patch replaced the root itself
            return original
        if getattr(parent, attr, None) is replacement:
            setattr(parent, attr, original)
    return module


def patched_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of each kernel_api layer in ``module``."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, (Linear, Conv1DLinear))]
