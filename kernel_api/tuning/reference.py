"""Reference results and fresh random look-alike arguments, for verification and tuning.

Every arguments type can be tuned: `random_like` gives fresh arguments of the same metadata
(`Arguments.random_like`; GEMM and softmax have their own here), `reference` the outputs its
kernels must compute in float64 where one is known (kernel_api's operations here, any other
type through `Arguments.reference_outputs`), and `tolerance` the relative error allowed. Where
no reference is known, `PickBest` compares the candidates with the torch provider's kernel.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..arguments import (Arguments, AttentionArguments, CrossEntropyArguments, CrossEntropyBackwardArguments, EpilogueArguments,
                         GatedActivationArguments, GatedActivationBackwardArguments, GemmArguments,
                         LayerNormArguments, LayerNormBackwardArguments, LinearCrossEntropyArguments,
                         RMSNormArguments, RMSNormBackwardArguments, RopeArguments, RopeBackwardArguments,
                         SoftmaxArguments, SoftmaxBackwardArguments)
from ..arguments.attention_math import attention_with_lse, torch_attention
from ..arguments.base import random_tensor_like
from ..arguments.cross_entropy_math import rows_gradient, rows_loss
from ..core.dtypes import DataType

# Relative Frobenius-norm error allowed per output dtype (tf32 math gets its own entry).
TOLERANCE = {DataType.f64: 1e-12, DataType.f32: 1e-5, DataType.tf32: 5e-3, DataType.f16: 1e-2,
             DataType.bf16: 1e-2}

#: The largest float64 intermediate (elements) a reference builds: attention's scores, the
#: linear cross-entropy's logits. Larger problems have no float64 reference (2 GiB of float64);
#: their candidates are compared with the torch provider's kernel instead.
MAX_REFERENCE_ELEMENTS = 1 << 28


def _activation(x: torch.Tensor, name: str | None) -> torch.Tensor:
    if name is None:
        return x
    if name == "relu":
        return torch.relu(x)
    if name == "gelu":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    if name == "silu":
        return x * torch.sigmoid(x)
    raise ValueError(f"unknown activation {name!r}")


def gemm_reference(args: GemmArguments) -> torch.Tensor:
    """``act(alpha * A @ B + beta * C + bias)`` in float64, shaped like ``args.out``."""
    acc = torch.matmul(args.A.double(), args.B.double())
    epi = args.epilogue
    if epi is None:
        return acc
    acc = epi.alpha * acc
    if epi.C is not None and epi.beta != 0:
        acc = acc + epi.beta * epi.C.double()
    if epi.bias is not None:
        b = epi.bias.double()
        acc = acc + (b.view(-1, 1) if epi.bias_kind == "column" else b.view(1, -1))
    return _activation(acc, epi.activation)


def softmax_reference(args: SoftmaxArguments) -> torch.Tensor:
    return torch.softmax(args.x.float(), dim=-1)


def softmax_backward_reference(args: SoftmaxBackwardArguments) -> torch.Tensor:
    y, dy = args.out.float(), args.grad_out.float()
    return y * (dy - (dy * y).sum(dim=-1, keepdim=True))


# ---- float64 references of the other operations: name of each output -> its expected value ----

def _normalized(args: Any, s: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm (``bias`` None) or LayerNorm of the rows of ``s`` (float64)."""
    if bias is None:
        return s * torch.rsqrt(s.square().mean(-1, keepdim=True) + args.eps) * weight
    centred = s - s.mean(-1, keepdim=True)
    return centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + args.eps) * weight + bias


def _norm(args: RMSNormArguments | LayerNormArguments) -> dict[str, torch.Tensor]:
    s = args.x.double()
    found = {}
    if args.residual is not None:
        s = s + args.residual.double()
        found["residual_out"] = s
    bias = None if args.bias is None else args.bias.double()
    found["out"] = _normalized(args, s, args.weight.double(), bias)
    return found


def _norm_backward(args: RMSNormBackwardArguments | LayerNormBackwardArguments) -> dict[str, torch.Tensor]:
    layer = isinstance(args, LayerNormBackwardArguments)
    x = args.x.double().requires_grad_()
    weight = args.weight.double().requires_grad_()
    bias = torch.zeros_like(weight, requires_grad=True) if layer else None
    inputs = (x, weight, bias) if layer else (x, weight)
    with torch.enable_grad():
        grads = torch.autograd.grad(_normalized(args, x, weight, bias), inputs, args.grad_out.double())
    return dict(zip(("grad_x", "grad_weight", "grad_bias"), grads))


def _gate(name: str, gate: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(gate)
    return F.gelu(gate, approximate="tanh" if name == "gelu_tanh" else "none")


def _gated(args: GatedActivationArguments) -> dict[str, torch.Tensor]:
    return {"out": _gate(args.activation, args.gate.double()) * args.up.double()}


def _gated_backward(args: GatedActivationBackwardArguments) -> dict[str, torch.Tensor]:
    gate, up = args.gate.double().requires_grad_(), args.up.double().requires_grad_()
    with torch.enable_grad():
        grad_gate, grad_up = torch.autograd.grad(_gate(args.activation, gate) * up, (gate, up), args.grad_out.double())
    return {"grad_gate": grad_gate, "grad_up": grad_up}


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``; with ``transposed`` the map's transpose,
    ``x * cos + rotate_half^T(x * sin)``."""
    if not transposed:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    y1, y2 = (x * sin).chunk(2, dim=-1)
    return x * cos + torch.cat((y2, -y1), dim=-1)


def _rope(args: RopeArguments | RopeBackwardArguments) -> dict[str, torch.Tensor]:
    cos, sin = (t.double().unsqueeze(args.unsqueeze_dim) for t in (args.cos, args.sin))
    backward = isinstance(args, RopeBackwardArguments)
    names = (("grad_q_out", "grad_q"), ("grad_k_out", "grad_k")) if backward else (("q", "q_out"), ("k", "k_out"))
    return {out: _rotated(getattr(args, x).double(), cos, sin, backward) for x, out in names}


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """A per-row operand (target, lse, grad_loss: any leading shape, maybe a broadcast scalar) as 1-D."""
    return t.reshape(-1)


def _cross_entropy(args: CrossEntropyArguments) -> dict[str, torch.Tensor]:
    logits = args.logits.reshape(-1, args.cols).double()
    target = _rows_of(args.target)
    scalars = (args.ignore_index, args.label_smoothing, args.z_loss)
    loss, lse, _ = rows_loss(logits, target, *scalars)
    shape = args.loss.shape
    found = {"loss": loss.view(shape), "lse": lse.view(shape)}
    if args.grad_logits is not None:
        grad = rows_gradient(logits, target, lse, _rows_of(args.grad_loss), *scalars)
        found["grad_logits"] = grad.view(args.logits.shape)
    return found


def _cross_entropy_backward(args: CrossEntropyBackwardArguments) -> dict[str, torch.Tensor]:
    logits = args.logits.reshape(-1, args.cols).double()
    grad = rows_gradient(logits, _rows_of(args.target), _rows_of(args.lse).double(), _rows_of(args.grad_loss),
                         args.ignore_index, args.label_smoothing, args.z_loss)
    return {"grad_logits": grad.view(args.logits.shape)}


def _linear_cross_entropy(args: LinearCrossEntropyArguments) -> dict[str, torch.Tensor] | None:
    if args.rows * args.vocab > MAX_REFERENCE_ELEMENTS:
        return None
    wanted = [(name, source) for name, source in (("grad_hidden", args.hidden), ("grad_weight", args.weight),
                                                  ("grad_bias", args.bias)) if getattr(args, name) is not None]
    leaves = {name: source.double().requires_grad_(any(source is s for _, s in wanted))
              for name, source in (("hidden", args.hidden), ("weight", args.weight), ("bias", args.bias))
              if source is not None}
    with torch.enable_grad():
        logits = leaves["hidden"] @ leaves["weight"].t()
        if "bias" in leaves:
            logits = logits + leaves["bias"]
        loss, _, _ = rows_loss(logits, args.target, args.ignore_index, args.label_smoothing, args.z_loss)
        found = {"loss": loss.detach()}
        if wanted:
            weighted = (loss * args.grad_loss.double().expand(loss.shape)).sum()
            sources = [leaves[name[5:]] for name, _ in wanted]
            found.update(zip((name for name, _ in wanted), torch.autograd.grad(weighted, sources)))
    return found


def _attention(args: AttentionArguments) -> dict[str, torch.Tensor] | None:
    if args.batch * args.heads_q * args.seqlen_q * args.seqlen_k > MAX_REFERENCE_ELEMENTS:
        return None
    q, k, v = (t.double() for t in (args.q, args.k, args.v))
    offsets = (args.cu_seqlens_q, args.cu_seqlens_k)
    if getattr(args, "lse", None) is None:
        return {"out": torch_attention(q, k, v, args.causal, args.scale, *offsets)}
    out, lse = attention_with_lse(q, k, v, args.causal, args.scale, *offsets)
    return {"out": out, "lse": lse}


#: kernel_api's own operations: arguments type -> its float64 reference (subclasses included:
#: the fused residual norms, the cross-entropy with its gradient, ...).
_REFERENCES: dict[type, Callable[[Any], dict[str, torch.Tensor] | None]] = {
    RMSNormArguments: _norm, LayerNormArguments: _norm,
    RMSNormBackwardArguments: _norm_backward, LayerNormBackwardArguments: _norm_backward,
    GatedActivationArguments: _gated, GatedActivationBackwardArguments: _gated_backward,
    RopeArguments: _rope, RopeBackwardArguments: _rope,
    CrossEntropyArguments: _cross_entropy, CrossEntropyBackwardArguments: _cross_entropy_backward,
    LinearCrossEntropyArguments: _linear_cross_entropy, AttentionArguments: _attention,
}


def _own_reference(args: Any) -> Callable[[Any], Any] | None:
    for cls in type(args).__mro__:
        found = _REFERENCES.get(cls)
        if found is not None:
            return found
    return None


def reference(args: Any) -> torch.Tensor | dict[str, torch.Tensor] | None:
    """The expected output of ``args`` computed with torch in high precision.

    Returns:
        GEMM and softmax: the tensor `output_of` names. Other operations: output name -> its
        float64 value (from the type's own `Arguments.reference_outputs` where it has one, else
        kernel_api's operations here), or None where none is known (or it would be too large,
        `MAX_REFERENCE_ELEMENTS`).
    """
    if isinstance(args, GemmArguments):
        return gemm_reference(args)
    if isinstance(args, SoftmaxArguments):
        return softmax_reference(args)
    if isinstance(args, SoftmaxBackwardArguments):
        return softmax_backward_reference(args)
    with torch.no_grad():
        if type(args).reference_outputs is not Arguments.reference_outputs:  # the type's own
            return args.reference_outputs()
        own = _own_reference(args)
        return None if own is None else own(args)


def output_of(args: Any) -> torch.Tensor:
    """The one output of GEMM and softmax arguments (what `reference` gives a tensor for)."""
    return args.grad_in if isinstance(args, SoftmaxBackwardArguments) else args.out


def tolerance(args: Any, kernel: Any = None) -> float:
    """Allowed relative error: by output dtype (other operations: that of their least precise
    floating operand, inputs included, since kernels round intermediates to it), loosened for
    tf32 math and long reductions."""
    if isinstance(args, (GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments)):
        out_dtype = args.tensor_attributes["grad_in" if isinstance(args, SoftmaxBackwardArguments) else "out"].dtype
        tol = TOLERANCE.get(out_dtype, 1e-2)
    else:
        out_dtype = None
        attributes = args.tensor_attributes.values()
        tol = max((TOLERANCE[a.dtype] for a in attributes if a.dtype in TOLERANCE), default=1e-2)
        if torch.backends.cuda.matmul.allow_tf32 and any(a.dtype is DataType.f32 and len(a.stride) >= 2
                                                         for a in attributes):
            tol = max(tol, TOLERANCE[DataType.tf32])  # f32 matrices that kernels may multiply in tf32
    math_type = getattr(getattr(getattr(kernel, "metadata", None), "operands", None), "math_type", None)
    if math_type is DataType.tf32:
        tol = max(tol, TOLERANCE[DataType.tf32])
    if isinstance(args, GemmArguments) and out_dtype is DataType.f32:
        in_dtype = args.tensor_attributes["A"].dtype
        if in_dtype in (DataType.f16, DataType.bf16):
            tol = max(tol, 1e-3)  # inputs rounded to 16 bits, output kept in f32
    return tol


def _random_like(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A tensor with t's shape, strides, dtype, device and pointer alignment, random values
    (integers in [-8, 8): GEMM operands)."""
    new = random_tensor_like(t, generator)
    if not t.is_floating_point():
        new.random_(-8, 8, generator=generator)
    return new


def random_like(args: Any, generator: torch.Generator | None = None) -> Any:
    """New arguments of the same signature (dtypes, layouts, alignment) with fresh random data.

    Outputs are poisoned with NaN so unwritten elements are caught. GEMM and softmax are made
    here; any other type makes its own (`Arguments.random_like`), the linear cross-entropy's
    hidden states scaled so its logits have unit variance.
    """
    if isinstance(args, GemmArguments):
        epi = args.epilogue
        new_epi = None
        if epi is not None:
            bias = None if epi.bias is None else _random_like(epi.bias, generator)
            if bias is not None and epi.bias_kind == "column":
                bias = bias.view(-1, 1)  # (M, 1): a column bias whatever M and N are
            new_epi = EpilogueArguments(alpha=epi.alpha, beta=epi.beta,
                                        C=None if epi.C is None else _random_like(epi.C, generator),
                                        bias=bias, activation=epi.activation)
        out = _random_like(args.out, generator).fill_(float("nan"))
        return GemmArguments(_random_like(args.A, generator), _random_like(args.B, generator), out,
                             accumulator_type=args.accumulator_type, epilogue=new_epi)
    if isinstance(args, SoftmaxArguments):
        out = torch.full_like(args.out, float("nan"))
        return SoftmaxArguments(_random_like(args.x, generator) * 4, out, dim=args.dim)
    if isinstance(args, SoftmaxBackwardArguments):
        y = torch.softmax(_random_like(args.out, generator).float(), dim=-1).to(args.out.dtype)
        return SoftmaxBackwardArguments(_random_like(args.grad_out, generator), y,
                                        torch.full_like(args.grad_in, float("nan")), dim=args.dim)
    new = args.random_like(generator)
    if isinstance(args, LinearCrossEntropyArguments):
        # Logits of unit variance, as a trained model's: with standard normal hidden states and
        # weights they would have the hidden size's variance, and their 16-bit rounding (which
        # differs between kernels' GEMMs) would tip rows whose two largest logits nearly tie.
        new.hidden.mul_(1 / math.sqrt(max(args.cols, 1)))
    return new


def input_bytes(args: Any) -> int:
    return sum(t.numel() * t.element_size() for t in args.tensors().values())
