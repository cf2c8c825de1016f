"""`patch` and `unpatch`: route a model's layers through kernel_api, reversibly.

    model = kernel_api.nn.patch(model)     # projections (with the residual adds and gates after
                                           # them), norms, MLPs, attention, RoPE, loss
    model = kernel_api.nn.unpatch(model)   # the original modules and settings back

What `patch` does comes from a table of replacers (`REPLACERS`), one per kind of layer it
knows. A replacer either swaps a module for a kernel_api one holding the same Parameter objects
(``torch.nn.Linear``, GPT-2 ``Conv1D``, the Llama family's RMSNorm and MLP), or installs
something for a module in place (the attention implementation of the layers' config, the
module-level RoPE function their forward calls, the causal-LM loss of the model). Every change
is a record (`kernel_api.nn.edits`) kept on the patched root, which `unpatch` undoes latest
first.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Collection, NamedTuple

import torch

from .. import ops
from . import attention as _attention
from . import blocks as _blocks
from .edits import GLOBAL_HOOKS, Swapped, assign
from .families import is_gpt2_attention, is_gpt2_block, is_gpt2_model, is_role
from .fusion import fused_from
from .linear import REPLACED_ACTIVATION, Conv1DLinear, Linear, conv1d_from
from .loss import causal_lm_loss, fused_loss_forward
from .mixin import adopt
from .mlp import SwiGLUMLP
from .norm import LayerNorm, RMSNorm
from .positions import MASK_BUILDER, forward_for, mask_builder
from .rope import FUNCTION_NAME, rope_function

# Set on the patched root: the edits (kernel_api.nn.edits records), in patching order.
_RECORDS = "_kernel_api_patches"
# Parents whose forward is known to apply ``activation`` right after ``projection`` (and use the
# activation nowhere else), by class name: GPT2MLP's forward is c_proj(act(c_fc(x))), dropout.
_FUSIBLE_PARENTS = {"GPT2MLP": ("c_fc", "act")}
# transformers activation modules that compute an epilogue activation, by class name. (Its
# plain "GELUActivation" is the exact erf GELU: not fused.) NewGELUActivation is gelu_new.
_TRANSFORMERS_ACTIVATIONS = {"NewGELUActivation": "gelu", "GELUTanh": "gelu", "PytorchGELUTanh": "gelu",
                             "FastGELUActivation": "gelu", "SiLUActivation": "silu"}
# Layers with parameters that patch leaves as they are without a warning: nothing to gain.
_LEFT_AS_IS = (torch.nn.Embedding,)


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


class _Fusion(NamedTuple):
    """An activation module to fuse into the projection before it."""

    parent: torch.nn.Module  # holding the activation module
    attr: str                # its attribute there
    module: torch.nn.Module  # the activation module
    activation: str          # the epilogue's name for it


def _fusions(root: torch.nn.Module) -> dict[int, _Fusion]:
    """id(projection) -> its `_Fusion`, for each projection that a known activation follows,
    where both appear once in ``root``."""
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
                found[id(proj)] = _Fusion(parent, act_name, act, activation)
    return found


# ---- the replacers ------------------------------------------------------------------------------

@dataclass
class _Patching:
    """The state of one `patch` call, handed to the replacers."""

    fusions: dict
    records: list
    configs: set      # id() of the configs whose attention implementation was set
    rope_modules: set  # id() of the Python modules whose RoPE function this model holds
    # id() of the projections to make `FusedProjection`s -> their gate activation (None: a residual)
    fused: dict = None
    # whether the projections are patched (the "linear" replacer applies) and epilogues fused
    fuse_epilogues: bool = False


@dataclass(frozen=True)
class Replacer:
    """One kind of layer `patch` knows.

    Attributes:
        name: what ``patch(kinds=...)`` calls it.
        matches: whether a module is of this kind.
        apply: ``apply(module, qualified_name, state)`` -> the module to put in its place (a
            kernel_api layer holding its Parameters), or None when the replacer installed what
            it does in place and appended the records to ``state.records``.
        needs: the `kernel_api.ops` functions it calls (a replacer whose ops are missing is
            skipped).
        default: whether `patch` applies it when ``kinds`` is not given.
    """

    name: str
    matches: Callable[[torch.nn.Module], bool]
    apply: Callable[[torch.nn.Module, str, _Patching], torch.nn.Module | None]
    needs: tuple[str, ...] = ()
    default: bool = True

    def available(self) -> bool:
        return all(hasattr(ops, op) for op in self.needs)


def _swap_projection(module: torch.nn.Module, name: str, state: _Patching) -> torch.nn.Module:
    fusion = state.fusions.get(id(module))
    activation = fusion.activation if fusion else None
    if _projection_kind(module) == "linear":
        new = Linear.from_linear(module, activation)
    else:
        new = conv1d_from(module, activation)
    if state.fused is not None and id(module) in state.fused:
        new = fused_from(new, state.fused[id(module)])
    new.kernel_api_name = name  # for error messages
    if fusion is not None:
        new.__dict__[REPLACED_ACTIVATION] = fusion.module  # (what an aten lowering under compile runs)
        marker = FusedActivation(fusion.activation, name)
        setattr(fusion.parent, fusion.attr, marker)
        state.records.append(Swapped(fusion.parent, fusion.attr, fusion.module, marker))
    return new


def _swap_rms_norm(module: torch.nn.Module, name: str, state: _Patching) -> torch.nn.Module:
    return adopt(RMSNorm, module)


def _swap_layer_norm(module: torch.nn.Module, name: str, state: _Patching) -> torch.nn.Module:
    return adopt(LayerNorm, module)


def _is_swiglu_mlp(module: torch.nn.Module) -> bool:
    return is_role(module, "MLP") and _activation_name(getattr(module, "act_fn", None)) == "silu"


def _swap_mlp(module: torch.nn.Module, name: str, state: _Patching) -> torch.nn.Module:
    new = adopt(SwiGLUMLP, module)
    up = getattr(module, "up_proj", None)
    if state.fuse_epilogues and up is not None and _projection_kind(up) is not None:
        state.fused[id(up)] = "silu"  # up_proj's epilogue takes silu(gate_proj(x)) (SwiGLUMLP.forward)
    return new


def _block_spec(module: torch.nn.Module) -> "_blocks.BlockSpec | None":
    if is_role(module, "DecoderLayer"):
        return _blocks.LLAMA_DECODER_LAYER
    if is_gpt2_block(module):
        return _blocks.GPT2_BLOCK
    return None


def _swap_block(module: torch.nn.Module, name: str, state: _Patching) -> torch.nn.Module | None:
    spec = _block_spec(module)
    if not state.fuse_epilogues or spec is None or not _blocks.fits(module, spec):
        return None
    ends = _blocks.projections(module, spec)
    if not all(_projection_kind(p) is not None for p in ends):
        return None
    for projection in ends:
        state.fused.setdefault(id(projection), None)
    new = adopt(_blocks.ResidualBlock, module)
    cls = type(new)
    if "kernel_api_block" not in vars(cls):
        _blocks.declare(cls, spec, _blocks.forward_parameters(type(module)))
    return new


def _install_attention(module: torch.nn.Module, name: str, state: _Patching) -> None:
    config = getattr(module, "config", None)
    if config is None or id(config) in state.configs or not hasattr(config, "_attn_implementation"):
        return None
    _attention.register()
    state.configs.add(id(config))
    state.records.append(assign(config, "_attn_implementation", _attention.NAME))
    return None


def _install_positions(module: torch.nn.Module, name: str, state: _Patching) -> None:
    python_module = sys.modules.get(type(module).__module__)
    if (python_module is None or not callable(getattr(python_module, MASK_BUILDER, None))
            or "forward" in vars(module)):
        return None
    forward = forward_for(module)
    if forward is None:
        return None
    state.records.append(GLOBAL_HOOKS.acquire(python_module, MASK_BUILDER, mask_builder))
    state.records.append(assign(module, "forward", forward, instance=True))
    return None


def _install_rope(module: torch.nn.Module, name: str, state: _Patching) -> None:
    python_module = sys.modules.get(type(module).__module__)
    if (python_module is None or id(python_module) in state.rope_modules
            or not callable(getattr(python_module, FUNCTION_NAME, None))):
        return None
    state.rope_modules.add(id(python_module))
    state.records.append(GLOBAL_HOOKS.acquire(python_module, FUNCTION_NAME, rope_function))
    return None


def _install_loss(module: torch.nn.Module, name: str, state: _Patching) -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss
    if getattr(module, "loss_function", None) is ForCausalLMLoss and hasattr(ops, "cross_entropy"):
        state.records.append(assign(module, "_loss_function", causal_lm_loss))
    if (hasattr(ops, "linear_cross_entropy") and "forward" not in vars(module)
            and isinstance(getattr(module, "model", None), torch.nn.Module)
            and isinstance(getattr(module, "lm_head", None), torch.nn.Linear)):
        state.records.append(assign(module, "forward", fused_loss_forward(module), instance=True))
    return None


#: What `patch` knows, in the order it applies them to a module: the in-place installs, then at
#: most one swap (the first replacer that returns a module).
REPLACERS = (
    Replacer("attention", lambda m: is_role(m, "Attention") or is_gpt2_attention(m), _install_attention,
             needs=("attention",)),
    Replacer("rope", lambda m: is_role(m, "Attention"), _install_rope, needs=("rope",)),
    Replacer("causal_mask", lambda m: is_role(m, "Model") or is_gpt2_model(m), _install_positions),
    Replacer("loss", lambda m: is_role(m, "ForCausalLM"), _install_loss, needs=("cross_entropy",)),
    Replacer("residual", lambda m: _block_spec(m) is not None, _swap_block, needs=("gemm",)),
    Replacer("linear", lambda m: _projection_kind(m) is not None, _swap_projection, needs=("gemm",)),
    Replacer("rms_norm", lambda m: is_role(m, "RMSNorm"), _swap_rms_norm, needs=("rms_norm",)),
    Replacer("mlp", _is_swiglu_mlp, _swap_mlp, needs=("swiglu",)),
    # Opt-in: under torch.compile a custom op stands where Inductor fuses torch's LayerNorm with
    # the residual add before it (GPT-2's blocks).
    Replacer("layer_norm", lambda m: type(m) is torch.nn.LayerNorm, _swap_layer_norm, needs=("layer_norm",),
             default=False),
)
#: The replacers' names (`patch`'s ``kinds``) and those it applies by default.
KINDS = tuple(r.name for r in REPLACERS)
DEFAULT_KINDS = tuple(r.name for r in REPLACERS if r.default)
# The classes of the layers the swaps make (`patched_modules`).
# (A `blocks.ResidualBlock` runs no op of its own: its projections are listed.)
_KERNEL_API_LAYERS = (Linear, Conv1DLinear, RMSNorm, LayerNorm, SwiGLUMLP)


def _check_kinds(kinds: Collection[str] | None) -> tuple[Replacer, ...]:
    if kinds is None:
        return tuple(r for r in REPLACERS if r.default)
    if isinstance(kinds, str) or not all(isinstance(k, str) for k in kinds):
        raise TypeError(f"kinds: expected a collection of names from {KINDS}, got {kinds!r}")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"kinds: unknown {unknown}; choose from {KINDS}")
    return tuple(r for r in REPLACERS if r.name in kinds)


def _patch_one(module: torch.nn.Module, name: str, replacers: tuple[Replacer, ...], state: _Patching,
               include: Callable[[str], bool] | None) -> torch.nn.Module:
    """Apply the matching replacers to ``module``; the module to stand in its place."""
    if include is not None and not include(name):
        return module
    for replacer in replacers:
        if replacer.matches(module):
            new = replacer.apply(module, name, state)
            if new is not None:
                return new
    return module


def _left_alone(root: torch.nn.Module) -> dict[str, list[str]]:
    """Type name -> qualified names of the modules holding parameters of their own that no
    replacer knows (kernel_api layers and `_LEFT_AS_IS` types aside)."""
    found: dict[str, list[str]] = {}
    for name, module in root.named_modules():
        if (isinstance(module, _KERNEL_API_LAYERS + _LEFT_AS_IS)
                or not any(p is not None for p in module._parameters.values())
                or any(r.matches(module) for r in REPLACERS)):
            continue
        found.setdefault(type(module).__name__, []).append(name or "<root>")
    return found


def _warn_left_alone(root: torch.nn.Module) -> None:
    found = _left_alone(root)
    if found:
        parts = [f"{kind} ({len(names)}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                 for kind, names in sorted(found.items())]
        warnings.warn(f"kernel_api.nn.patch: left alone, no kernel_api layer for: {'; '.join(parts)}", stacklevel=3)


def patch(module: torch.nn.Module, *, include: Callable[[str], bool] | None = None,
          fuse_activations: bool = True, kinds: Collection[str] | None = None) -> torch.nn.Module:
    """Route, in place, the layers of ``module`` that kernel_api knows through its ops; return
    the module (the replacement when ``module`` itself is such a layer).

    The replacers (`REPLACERS`; pick some with ``kinds``, default `DEFAULT_KINDS`: all but
    ``"layer_norm"``):

    - ``"linear"``: every ``torch.nn.Linear`` (exactly that class) and transformers GPT-2
      ``Conv1D`` -> `Linear` / a Conv1D through `ops.gemm`. With ``fuse_activations``, a
      projection followed by a known activation (torch ReLU, tanh GELU, SiLU; transformers'
      gelu_new and tanh GELUs) in an ``nn.Sequential`` or a GPT-2 MLP gets that activation in
      its GEMM epilogue, and the activation module becomes a `FusedActivation` identity.
      ``fuse_activations=False`` fuses nothing after a projection (no residual, no gate either).
    - ``"residual"``: the Llama family's decoder layers and GPT-2's blocks add each branch's
      output to its input in the epilogue of the projection ending the branch (o_proj and
      down_proj; attn.c_proj and mlp.c_proj), in calls where that pays (large inference calls,
      and under torch.compile as the lowering rule says; `kernel_api.nn.fusion.worth_arming`)
      and no dropout after it is active (`kernel_api.nn.blocks`). With ``"linear"`` and
      ``fuse_activations`` only.
    - ``"rms_norm"``: the Llama family's RMSNorm (Llama, Mistral, Qwen2, Qwen3) -> `ops.rms_norm`.
    - ``"mlp"``: the family's SiLU MLP -> its projections and `ops.swiglu`; with ``"linear"`` and
      ``fuse_activations``, large inference calls multiply by ``silu(gate_proj(x))`` in up_proj's
      epilogue instead (`kernel_api.nn.mlp`).
    - ``"attention"``: the family's and GPT-2's attention layers' config gets kernel_api's attention
      implementation (`kernel_api.nn.attention`: `ops.attention`, SDPA for masks it does not take).
    - ``"rope"``: the family's ``apply_rotary_pos_emb`` -> `ops.rope` (`kernel_api.nn.rope`).
    - ``"causal_mask"``: the family's base model and GPT-2's build the causal mask without a
      packed-sequence check when they make their own position ids (`kernel_api.nn.positions`:
      under torch.compile that check makes a dense mask, and attention then skips nothing).
    - ``"loss"``: a ``*ForCausalLM``'s loss -> `ops.cross_entropy`, and while training with
      labels `ops.linear_cross_entropy` from the hidden states, never making the logits
      (`kernel_api.nn.loss`; the output's ``logits`` is then None).
    - ``"layer_norm"`` (only when asked for): ``torch.nn.LayerNorm`` (exactly that class, with
      weight and bias) -> `ops.layer_norm`.

    Swapped layers hold the same Parameter objects, so ``state_dict`` keys and values do not
    change; layers whose inputs the ops do not take (a CPU model, mixed dtypes) run their own
    forward. A replacer whose ops are missing is skipped. ``include(qualified_name) -> bool``
    picks the modules (default: all; the root's name is ""). Modules holding parameters that
    no replacer knows (``nn.Embedding`` aside) are named in a warning. `unpatch` undoes all of
    it. A module with nothing to patch is returned unchanged, with a warning.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if include is not None and not callable(include):
        raise TypeError(f"include: expected a callable taking a module name, got {type(include).__name__}")
    replacers = tuple(r for r in _check_kinds(kinds) if r.available())
    fuse = fuse_activations and any(r.name == "linear" for r in replacers)
    state = _Patching(_fusions(module) if fuse_activations else {}, [], set(), set(), {}, fuse)
    new_root = _patch_one(module, "", replacers, state, include)
    if new_root is not module:
        state.records.insert(0, Swapped(None, "", module, new_root))
    done: dict[int, torch.nn.Module] = {id(module): new_root}  # a shared module gets one replacement
    _walk(new_root, "", replacers, state, include, done)
    if not state.records:
        warnings.warn(f"kernel_api.nn.patch: {type(module).__name__} has no torch.nn.Linear, transformers Conv1D or "
                      f"other layer kernel_api knows to patch{' that include() accepts' if include is not None else ''}"
                      f"; returned unchanged", stacklevel=2)
        return module
    new_root.__dict__.setdefault(_RECORDS, []).extend(state.records)
    _warn_left_alone(new_root)
    return new_root


def _walk(parent: torch.nn.Module, prefix: str, replacers: tuple[Replacer, ...], state: _Patching,
          include: Callable[[str], bool] | None, done: dict[int, torch.nn.Module]) -> None:
    """Patch the children of ``parent`` and, depth first, theirs (those of a replacement: an
    MLP's projections are patched inside the patched MLP)."""
    for child_name, child in list(parent._modules.items()):  # (named_children() skips repeats)
        if child is None:
            continue
        name = f"{prefix}{child_name}"
        new = done.get(id(child))
        if new is None:
            new = done[id(child)] = _patch_one(child, name, replacers, state, include)
            done[id(new)] = new
            _walk(new, f"{name}.", replacers, state, include, done)
        if new is not child:
            setattr(parent, child_name, new)
            state.records.append(Swapped(parent, child_name, child, new))


def unpatch(module: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: put back the original modules (the same objects) and settings in every
    place `patch` changed, latest first; return the module (the original layer when `patch`
    replaced the module itself). A module that was not patched is returned unchanged, with a
    warning."""
    records = module.__dict__.pop(_RECORDS, None)
    if not records:
        warnings.warn(f"kernel_api.nn.unpatch: {type(module).__name__} was not patched; returned unchanged",
                      stacklevel=2)
        return module
    for record in reversed(records):
        record.undo()
    first = records[0]
    if isinstance(first, Swapped) and first.parent is None:  # patch replaced the root itself
        return first.original
    return module


def patched_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of each kernel_api layer in ``module``."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, _KERNEL_API_LAYERS)]
