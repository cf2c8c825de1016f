"""`ResidualBlock`: a transformer block whose residual adds run in the epilogue of the projection
ending each branch.

The pre-norm blocks `kernel_api.nn.patch` knows compute

    h = x + attn(norm1(x))        # attn ends with its output projection (then maybe a dropout)
    y = h + mlp(norm2(h))         # mlp ends with its down projection (then maybe a dropout)

`ResidualBlock.forward` runs the same submodules in the same order, but hands ``x`` (``h``) to
the output (down) projection first (`kernel_api.nn.fusion.armed`), which returns its output
with the residual added (`FusedProjection`); the block then adds nothing. The block adds it
itself after a dropout that is active (training, p > 0) and after a projection that was not
called.

`LLAMA_DECODER_LAYER` and `GPT2_BLOCK` say where the known blocks keep their parts
(`BlockSpec`). The block's own forward runs instead where the epilogue would not gain
(`fusion.worth_arming`: small eager calls, autograd, projections lowered to aten under
torch.compile) and where this forward would not be its
equal: positional arguments past its signature, or arguments that `BlockSpec.own_forward_if`
names (GPT-2's cross-attention). Arguments the block's forward takes by name go to the
attention, as its forward passes them (those with a default other than None get that default).
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch

from ..core import tracing
from .fusion import FusedProjection, armed, worth_arming
from .mixin import forward_behind


class BlockSpec(NamedTuple):
    """Where a block keeps its parts (attribute names) and how its forward calls them.

    Attributes:
        norm1, attn, attn_proj, attn_dropout: the first branch: its norm, the attention module,
            the attention's output projection and the dropout after it (None: none).
        norm2, mlp, mlp_proj, mlp_dropout: the second branch, the same for the MLP.
        own_forward_if: arguments that, given (not None), send the call to the block's own forward.
        not_for_attention: arguments of the block's forward it does not pass to the attention.
    """

    norm1: str
    attn: str
    attn_proj: str
    attn_dropout: str | None
    norm2: str
    mlp: str
    mlp_proj: str
    mlp_dropout: str | None
    own_forward_if: tuple[str, ...] = ()
    not_for_attention: tuple[str, ...] = ()


LLAMA_DECODER_LAYER = BlockSpec("input_layernorm", "self_attn", "o_proj", None,
                                "post_attention_layernorm", "mlp", "down_proj", None)
GPT2_BLOCK = BlockSpec("ln_1", "attn", "c_proj", "resid_dropout", "ln_2", "mlp", "c_proj", "dropout",
                       own_forward_if=("encoder_hidden_states",),
                       not_for_attention=("encoder_hidden_states", "encoder_attention_mask"))


def forward_parameters(cls: type) -> tuple[tuple[str, Any], ...] | None:
    """(name, default) of the parameters of ``cls.forward`` after ``hidden_states`` (the
    positional-or-keyword and keyword-only ones), or None when its first is not
    ``hidden_states``."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]  # (self)
    if not params or params[0].name != "hidden_states":
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple((p.name, None if p.default is inspect.Parameter.empty else p.default)
                 for p in params[1:] if p.kind in kinds)


def fits(module: torch.nn.Module, spec: BlockSpec) -> bool:
    """Whether ``module`` holds the parts ``spec`` names and its forward reads them and takes
    ``hidden_states`` first."""
    forward = inspect.unwrap(type(module).forward)
    names = set(getattr(getattr(forward, "__code__", None), "co_names", ()))
    parts = (spec.norm1, spec.attn, spec.norm2, spec.mlp)
    if not set(parts) <= names or forward_parameters(type(module)) is None:
        return False
    attn, mlp = getattr(module, spec.attn, None), getattr(module, spec.mlp, None)
    return all(isinstance(getattr(module, p, None), torch.nn.Module) for p in parts) and isinstance(
        getattr(attn, spec.attn_proj, None), torch.nn.Module) and isinstance(getattr(mlp, spec.mlp_proj, None),
                                                                            torch.nn.Module)


def projections(module: torch.nn.Module, spec: BlockSpec) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The two projections that end the branches of ``module``."""
    return getattr(getattr(module, spec.attn), spec.attn_proj), getattr(getattr(module, spec.mlp), spec.mlp_proj)


def _branch(projection: torch.nn.Module, dropout: torch.nn.Module | None, residual: torch.Tensor,
            call: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``residual + call(*args, **kwargs)`` (its first element when it returns a tuple), the add in
    ``projection``'s epilogue when it can take it (no dropout after it that changes its output)."""
    if isinstance(projection, FusedProjection) and (dropout is None or not dropout.training or dropout.p == 0):
        hand = armed(projection, residual=residual)
        with hand:
            out = call(*args, **kwargs)
        if isinstance(out, tuple):
            out = out[0]
        return out if hand.consumed else residual + out
    out = call(*args, **kwargs)
    if isinstance(out, tuple):
        out = out[0]
    return residual + out


# The `BlockSpec` and `forward_parameters` of each class `kernel_api.nn.patch` makes, by class, with
# the parameters whose default is not None (`_declaration`): a read of the class's attributes
# through the block would be guarded at every block under Dynamo.
_declared: dict[type, tuple[BlockSpec, tuple[tuple[str, Any], ...], tuple[tuple[str, Any], ...]]] = {}


@tracing.assume_constant_result
def declared(cls: type) -> tuple | None:
    """(`BlockSpec`, parameters, those of them whose default is not None) declared for ``cls``,
    or None. Dynamo calls it while tracing and takes the answer as a constant: it guards none of
    the spec's parts (the class itself is guarded by the block's type check)."""
    return _declared.get(cls)


def _declaration(spec: BlockSpec, parameters: tuple[tuple[str, Any], ...]) -> tuple:
    """`declared`'s answer for ``spec`` and ``parameters``: the parameters whose default is not
    None listed apart, so that a call fills in only those (Dynamo traces each step of the loop)."""
    return spec, parameters, tuple([(name, default) for name, default in parameters if default is not None])


def declare(cls: type, spec: BlockSpec, parameters: tuple[tuple[str, Any], ...]) -> None:
    """Make ``cls`` (a `ResidualBlock` class) a block of ``spec`` whose forward takes ``parameters``
    (`forward_parameters`); also its ``kernel_api_block`` / ``kernel_api_parameters``."""
    cls.kernel_api_block, cls.kernel_api_parameters = spec, parameters
    _declared[cls] = _declaration(spec, parameters)


class ResidualBlock(torch.nn.Module):
    """Mixin: the block's forward with the residual adds fused (the module docstring).
    ``kernel_api_block`` (a `BlockSpec`) and ``kernel_api_parameters`` (`forward_parameters` of the
    block's class) are declared for the class `kernel_api.nn.patch` makes (`declare`)."""

    kernel_api_block: BlockSpec
    kernel_api_parameters: tuple[tuple[str, Any], ...]

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # (loops rather than generators, each read once: Dynamo traces every step here at every
        # block, a generator as a frame of its own)
        spec, params, defaults = (declared(self.__class__)
                                  or _declaration(self.kernel_api_block, self.kernel_api_parameters))
        attn, mlp = getattr(self, spec.attn), getattr(self, spec.mlp)
        attn_proj, mlp_proj = getattr(attn, spec.attn_proj), getattr(mlp, spec.mlp_proj)  # (`projections`)
        own = not worth_arming(hidden_states, (attn_proj, mlp_proj)) or len(args) > len(params)
        if not own:
            named = kwargs.copy()  # (not dict(kwargs), whose construction Dynamo traces as Python)
            for (name, _), value in zip(params, args):
                named[name] = value
            for name in spec.own_forward_if:
                if kwargs.get(name) is not None or named.get(name) is not None:
                    own = True
        if own:
            # (nothing to fuse in this call, both residuals having its rows: the block's own forward)
            return forward_behind(self, ResidualBlock)(self, hidden_states, *args, **kwargs)
        for name, default in defaults:
            if name not in named:
                named[name] = default
        for name in spec.not_for_attention:
            named.pop(name, None)
        attn_dropout = getattr(attn, spec.attn_dropout) if spec.attn_dropout else None
        mlp_dropout = getattr(mlp, spec.mlp_dropout) if spec.mlp_dropout else None
        normed = getattr(self, spec.norm1)(hidden_states)
        hidden_states = _branch(attn_proj, attn_dropout, hidden_states, attn, hidden_states=normed, **named)
        normed = getattr(self, spec.norm2)(hidden_states)
        return _branch(mlp_proj, mlp_dropout, hidden_states, mlp, normed)
