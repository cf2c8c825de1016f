"""`Linear`: a `torch.nn.Linear` whose forward is one `kernel_api.ops.gemm` with the bias (and an
optional activation) fused in the epilogue.

    layer = kernel_api.nn.Linear(768, 3072, activation="gelu", device="cuda", dtype=torch.bfloat16)
    y = layer(x)          # gelu_tanh(x @ W^T + b), one GEMM

Also `Conv1DLinear`, the same forward for transformers' GPT-2 ``Conv1D`` (weight stored
(in, out)), made as a subclass of the patched module's own class by `kernel_api.nn.patch`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..arguments.epilogue import ACTIVATIONS
from ..core import tracing
from ..core.errors import DeviceError
from ..native import recipes
from ..ops import dispatch as _ops
from . import lowering as _lowering
from .mixin import declare_behind as _declare_behind

# The epilogue's activations as torch functions (gelu: the tanh approximation, as the epilogue).
_TORCH_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}
#: Where `kernel_api.nn.patch` keeps, in a projection's ``__dict__`` (not as a submodule: the
#: model's modules and state_dict stay as patched), the activation module it fused into it.
REPLACED_ACTIVATION = "kernel_api_replaced_activation"
_autocast_enabled = torch.is_autocast_enabled
_grad_enabled = torch.is_grad_enabled
_is_dynamo_compiling = tracing.is_dynamo_compiling
_dispatch_modes = tracing.dispatch_mode_depth
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: True)
_GEMM_OP = _ops.GEMM_OP
#: A layer's own number in call keys: its forward as one call (input, weight, bias, activation).
LINEAR_OP = recipes.op_number("kernel_api.nn.Linear")
#: The same for inputs of other ranks than 2, keyed with the weight itself: (input, weight, bias, activation).
LINEAR_ANY_RANK_OP = recipes.op_number("kernel_api.nn.Linear, any rank")
_linear = F.linear


def _check_activation(activation: Any) -> str | None:
    if activation is None:
        return None
    if not isinstance(activation, str) or activation.lower() not in ACTIVATIONS:
        raise ValueError(f"activation: unknown {activation!r}; expected one of {ACTIVATIONS} or None")
    return activation.lower()


def _check_device(layer: torch.nn.Module, x: torch.Tensor) -> None:
    """DeviceError naming the layer unless ``x`` is on a device the front door launches on
    (`dispatch.LAUNCH_DEVICE_TYPES`) or on meta."""
    if not (x.is_cuda or x.is_meta) and x.device.type not in _ops.LAUNCH_DEVICE_TYPES:
        raise DeviceError(f"{_layer_name(layer)}: input is on {x.device}; kernel_api.nn layers run on CUDA tensors "
                          f"(move the model with .cuda(), or kernel_api.nn.unpatch it)")


def _project(layer: torch.nn.Module, x: torch.Tensor, weight_kn: torch.Tensor, bias: torch.Tensor | None,
             activation: str | None, fuse_when_training: bool) -> torch.Tensor:
    """``activation(x @ weight_kn + bias)`` over x's last dimension, leading dimensions kept.

    Under autograd (grad mode on and x or a parameter requiring grad) the activation, unless
    ``fuse_when_training``, is applied by torch after the GEMM (bias still fused): torch keeps
    the pre-activation for the derivative, where the fused op's backward would recompute it
    with one more GEMM (`kernel_api.ops.library`)."""
    _check_device(layer, x)
    if _autocast_enabled("cuda"):
        # As torch.nn.Linear under autocast: operands in the autocast dtype.
        dtype = torch.get_autocast_dtype("cuda")
        x, weight_kn = x.to(dtype), weight_kn.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    elif x.dtype != weight_kn.dtype:
        raise TypeError(f"{_layer_name(layer)}: input dtype {x.dtype} differs from the weight's {weight_kn.dtype}; "
                        f"cast the input or the layer (.to(dtype))")
    elif bias is not None and bias.dtype != weight_kn.dtype:
        raise TypeError(f"{_layer_name(layer)}: bias dtype {bias.dtype} differs from the weight's {weight_kn.dtype}")
    K, N = weight_kn.shape
    if x.shape[-1] != K:
        raise ValueError(f"{_layer_name(layer)}: input has {x.shape[-1]} features in its last dimension, "
                         f"the layer takes {K}")
    two_d = x.dim() == 2  # (the common case: no reshapes either way)
    x2 = x if two_d else x.reshape(-1, K)
    unfused = activation is not None and not fuse_when_training and _grad_enabled() and (
        x.requires_grad or weight_kn.requires_grad or (bias is not None and bias.requires_grad))
    if x2.shape[0] == 0:  # nothing to launch; torch gives the empty result (and its grads)
        y = F.linear(x2, weight_kn.t(), bias)
        unfused = activation is not None
    else:
        y = _ops.gemm(x2, weight_kn, bias=bias, activation=None if unfused else activation)
    if unfused:
        y = _TORCH_ACTIVATIONS[activation](y)
    return y if two_d else y.reshape(*x.shape[:-1], N)


def _compiled(layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              weight_is_kn: bool) -> torch.Tensor:
    """The forward as Dynamo traces it: kernel_api's GEMM op or plain aten, as
    `lowering.choose` decides for this layer and the shapes static now. ``weight`` is (N, K)
    (torch.nn.Linear) or, with ``weight_is_kn``, (K, N) (GPT-2's Conv1D)."""
    forced = layer.compile_lowering
    activation = layer.activation
    K, N = weight.shape if weight_is_kn else weight.shape[::-1]
    rows = _lowering.static_rows(x)
    training = _grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad))
    if _lowering.aten_whatever_the_problem(forced, rows, _lowering.columns_aligned(N, weight.dtype)):
        chosen = "aten"
    else:
        chosen = _lowering.choose(forced, rows, K, N, x.dtype, activation, bias is not None, training,
                                  x.device.index if x.is_cuda else -1)
    if chosen == "kernel_api":
        return _project(layer, x, weight if weight_is_kn else weight.t(), bias, activation,
                        layer.fuse_activation_when_training)
    _check_device(layer, x)
    if activation is not None and forced != "aten" and _lowering.aten_fuses_activation(
            activation, rows, x.is_cuda, training, x, weight, bias):
        x2 = x.reshape(-1, K)
        y = torch._addmm_activation(bias, x2, weight if weight_is_kn else weight.t(), use_gelu=activation == "gelu")
        return y.view(*x.shape[:-1], N)
    if weight_is_kn:  # transformers' Conv1D forward
        x2 = x.reshape(-1, K)
        y = (x2 @ weight if bias is None else torch.addmm(bias, x2, weight)).view(*x.shape[:-1], N)
    else:
        y = F.linear(x, weight, bias)
    if activation is None:
        return y
    # The model's own activation module where patch fused one: the graph is then the unpatched
    # model's (transformers' gelu_new formula fuses into a faster Inductor kernel than F.gelu's).
    replaced = getattr(layer, REPLACED_ACTIVATION, None)
    return replaced(y) if replaced is not None else _TORCH_ACTIVATIONS[activation](y)


def _replayed(layer: torch.nn.Module, x: torch.Tensor, weight_kn: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """``activation(x @ weight_kn + bias)`` for a 2-D ``x`` replayed from C (the recipe
    `_project`'s `ops.gemm` call recorded for operands of this metadata), or None when the
    call needs the Python path (`_project`): no recipe yet, autograd, autocast, a tracer (the
    call key holds that state; Dynamo's calls take `_compiled` before this)."""
    replay = _ops.replay_call
    if replay is None or x.dim() != 2:
        return None
    return replay(_GEMM_OP, x, weight_kn, None, 1.0, 0.0, None, bias, layer.activation, None, None)


def _record_linear(layer: torch.nn.Module, x: torch.Tensor, weight_kn: torch.Tensor, bias: torch.Tensor | None,
                   y: torch.Tensor) -> None:
    """After `_project` ran a 2-D forward of ``layer`` with the kept transposed weight
    ``weight_kn`` into ``y``: record the forward for calls keyed as ``(x, weight_kn, bias,
    activation)``, which `Linear.forward` then replays with one C call. The recipe is the one
    `ops.gemm` recorded for the GEMM (the variant for ``y``'s alignment, where it made ``y``), its
    arguments taken from the layer's; where cuBLAS serves a layer without activation, torch's own
    ``torch.addmm(bias, x, W^T)`` (``torch.matmul(x, W^T)`` without a bias), the product cuBLAS
    runs, called directly. Only in the state `ops.gemm` records in (no autograd, modes or autocast)."""
    entry = _ops._entry
    if entry is None or not _ops.plain_state((x, weight_kn, bias)):
        return
    activation = layer.activation
    found = entry.recipe(_GEMM_OP, x, weight_kn, None, 1.0, 0.0, None, bias, activation, None, None)
    aligned = recipes.alignment(y.data_ptr())
    found = [r for r in found or () if r[6] is None or r[6][2] == aligned]
    if not found:
        return
    recipe = found[0]
    if not recipe[1] and activation is None:  # a torch call: cuBLAS's product
        recipe = (recipes.Call(torch.matmul, (0, 1)) if bias is None else recipes.Call(torch.addmm, (2, 0, 1))).spec()
    else:  # (A, B, bias) of gemm(A, B, out, alpha, beta, C, bias, ...) are the layer's (x, weight_kn, bias)
        recipe = recipes.remap(recipe, {0: 0, 1: 1, 6: 2})
        if recipe is None:
            return
    entry.record(LINEAR_OP, recipe, x, weight_kn, bias, activation)


def _record_linear_any_rank(layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None) -> None:
    """After `_project` ran a forward of ``layer`` for an input of another rank than 2: where
    cuBLAS (a torch call) served its GEMM of the flattened input and the layer has no activation,
    record torch's own ``F.linear(x, weight, bias)`` (what torch.nn.Linear runs: the same cuBLAS
    product on the flattened input) for forwards keyed as ``(x, weight, bias, None)``."""
    entry = _ops._entry
    if entry is None or layer.activation is not None or x.dim() < 2 or not x.is_contiguous():
        return
    x2 = x.reshape(-1, x.shape[-1])  # (a view: what `_project` passed)
    found = entry.recipe(_GEMM_OP, x2, weight.t(), None, 1.0, 0.0, None, bias, None, None, None)
    if found and not found[0][1]:
        entry.record(LINEAR_ANY_RANK_OP, recipes.Call(_linear, (0, 1, 2)).spec(), x, weight, bias, None)


# The transposed view of each Linear's weight, kept on the layer: (weight, its data pointer and
# version when viewed, weight.t()). A view made per call costs as much as the rest of a repeated
# call's Python work; a weight replaced, moved to other memory or changed in place is viewed anew.
_WEIGHT_T = "_kernel_api_weight_t"


def _keep_weight_t(layer: torch.nn.Module, weight: torch.Tensor) -> tuple:
    """Keeps ``weight.t()`` on ``layer`` (`_WEIGHT_T`); the kept tuple."""
    kept = layer.__dict__[_WEIGHT_T] = (weight, weight.data_ptr(), weight._version, weight.t())
    return kept


def _weight_t(layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """``weight.t()``, kept on ``layer`` while the weight stays what it was (`_WEIGHT_T`)."""
    kept = layer.__dict__.get(_WEIGHT_T)
    if kept is None or kept[0] is not weight or kept[1] != weight.data_ptr() or kept[2] != weight._version:
        kept = _keep_weight_t(layer, weight)
    return kept[3]


def _layer_name(layer: torch.nn.Module) -> str:
    name = getattr(layer, "kernel_api_name", None)
    return f"layer {name!r} ({type(layer).__name__})" if name else type(layer).__name__


class Linear(torch.nn.Linear):
    """`torch.nn.Linear` through `kernel_api.ops.gemm`: ``y = activation(x @ W^T + b)``.

    Same parameters, initialisation, ``state_dict`` keys and ``isinstance`` as
    `torch.nn.Linear`; ``activation`` (None, "relu", "gelu" tanh approximation, "silu") is
    fused into the GEMM's epilogue with the bias. Inputs of any rank (..., in_features) on
    CUDA; the input's dtype must be the weight's (under ``torch.autocast`` both are cast to the
    autocast dtype, as torch.nn.Linear does). Differentiable (the gradients are kernel_api
    GEMMs through transposed layouts) and traceable by ``torch.compile(fullgraph=True)``.

    While training, the activation is applied by torch after the fused-bias GEMM, so that the
    pre-activation is kept for the backward instead of recomputed by a second GEMM; set
    ``fuse_activation_when_training = True`` (class or instance) to fuse it there too.
    A CPU input raises `DeviceError` naming the layer.

    Under ``torch.compile`` the layer becomes kernel_api's GEMM op or plain aten (``F.linear``
    and the activation, for Inductor to fuse and choose its GEMM), by `kernel_api.nn.lowering`'s
    rule; ``compile_lowering`` ("auto", "aten", "kernel_api"; class or instance) forces either.
    """

    fuse_activation_when_training = False
    compile_lowering = "auto"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Any = None, *, activation: str | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = _check_activation(activation)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, activation: str | None = None) -> "Linear":
        """A `Linear` holding ``linear``'s own Parameter objects (and hooks, training flag):
        nothing is copied, so state_dict keys and values stay those of ``linear``."""
        new = _adopt(cls, linear)
        new.activation = _check_activation(activation)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _is_dynamo_compiling():
            return _compiled(self, input, self.weight, self.bias, False)
        # The forward replayed from C: the recipe `_linear_forward` recorded for a call keyed as
        # this one, with the kept transposed weight (cuBLAS's product, or our kernel's launch).
        # The parameters come from _parameters, without nn.Module.__getattr__'s frame (a
        # parametrized weight is not there and takes the Python path).
        replay = _ops.replay_call
        if replay is not None and not (_dispatch_modes() or _function_modes()):  # (data_ptr under a tracer raises)
            params = self._parameters
            weight = params.get("weight")
            if input.dim() != 2:  # torch's own F.linear, where cuBLAS serves the layer (`_record_linear_any_rank`)
                y = replay(LINEAR_ANY_RANK_OP, input, weight, params.get("bias"), self.activation)
                if y is not None:
                    return y
            else:
                kept = self.__dict__.get(_WEIGHT_T)
                if (kept is not None and kept[0] is weight and kept[1] == weight.data_ptr()
                        and kept[2] == weight._version):
                    y = replay(LINEAR_OP, input, kept[3], params.get("bias"), self.activation)
                    if y is not None:
                        return y
        return _linear_forward(self, input)

    def extra_repr(self) -> str:
        act = f", activation={self.activation!r}" if self.activation else ""
        return super().extra_repr() + act


def _linear_forward(layer: Linear, input: torch.Tensor) -> torch.Tensor:
    """`Linear.forward` when C replayed nothing: the Python path (`_project`), which records the
    GEMM's recipe, and for a 2-D input with the kept transposed weight the layer's own
    (`_record_linear`; for other ranks `_record_linear_any_rank`)."""
    weight, bias = layer.weight, layer.bias
    if weight is not layer._parameters.get("weight") or not _ops.plain_state((input, weight, bias)):
        return _project(layer, input, weight.t(), bias, layer.activation, layer.fuse_activation_when_training)
    if input.dim() != 2:
        y = _project(layer, input, weight.t(), bias, layer.activation, layer.fuse_activation_when_training)
        _record_linear_any_rank(layer, input, weight, bias)
        return y
    weight_kn = _weight_t(layer, weight)
    y = _project(layer, input, weight_kn, bias, layer.activation, layer.fuse_activation_when_training)
    _record_linear(layer, input, weight_kn, bias, y)
    return y


class Conv1DLinear(torch.nn.Module):
    """The forward of transformers' GPT-2 ``Conv1D`` (``y = x @ W + b``, W of shape (nx, nf))
    through `kernel_api.ops.gemm`, with an optional fused activation. `kernel_api.nn.patch`
    mixes it in front of the patched module's own class, so ``isinstance`` and the
    parameters stay those of ``Conv1D``. Under ``torch.compile``, as `Linear`
    (``compile_lowering``)."""

    activation: str | None = None
    fuse_activation_when_training = False
    compile_lowering = "auto"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _is_dynamo_compiling():
            return _compiled(self, input, self.weight, self.bias, True)
        params = self._parameters
        weight = params.get("weight")
        if weight is not None:
            y = _replayed(self, input, weight, params.get("bias"))
            if y is not None:
                return y
        return _project(self, input, self.weight, self.bias, self.activation, self.fuse_activation_when_training)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        act = f"activation={self.activation!r}" if self.activation else ""
        return ", ".join(p for p in (base, act) if p)


def _adopt(cls: type, module: torch.nn.Module) -> Any:
    """An instance of ``cls`` with ``module``'s state: the same Parameter, buffer and child
    objects and hooks, held in dictionaries of its own (so later assignments on one module do
    not reach the other)."""
    new = cls.__new__(cls)
    state = {}
    for key, value in module.__dict__.items():
        state[key] = value.copy() if isinstance(value, dict) else value
    new.__dict__.update(state)
    return new


_fronted_classes: dict[tuple[type, type], type] = {}


def fronted_class(front: type, cls: type, name: str, doc: str) -> type:
    """``cls`` with ``front`` before it in the method order, made once per pair (so patched
    modules of one class share one class, and isinstance checks keep working).

    Args:
        front: the class whose methods come first.
        cls: the class it is put in front of.
        name: the new class's name.
        doc: its docstring.
    """
    found = _fronted_classes.get((front, cls))
    if found is None:
        found = _fronted_classes[front, cls] = type(name, (front, cls), {"__module__": front.__module__,
                                                                         "__doc__": doc})
        _declare_behind(found, cls)
    return found


def _conv1d_class(cls: type) -> type:
    """``cls`` (a transformers Conv1D class) with `Conv1DLinear`'s forward in front."""
    return fronted_class(Conv1DLinear, cls, f"KernelApi{cls.__name__}",
                         f"{cls.__module__}.{cls.__qualname__} through kernel_api.ops.gemm (kernel_api.nn.patch).")


def conv1d_from(module: torch.nn.Module, activation: str | None = None) -> torch.nn.Module:
    """A kernel_api version of the transformers ``Conv1D`` ``module``, holding its Parameters."""
    new = _adopt(_conv1d_class(type(module)), module)
    new.activation = _check_activation(activation)
    return new
