"""What a patched model's attention becomes under ``torch.compile``: kernel_api's ops, or
torch's cuDNN attention op called as it is.

Through kernel_api's attention a prefill is a custom op in the compiled graph
(``kernel_api::attention``), and a training forward (a gradient wanted) two
(``kernel_api::attention_forward`` and ``kernel_api::attention_backward``). When every kernel
the registry offers for the problem (forward, and backward in training) is the torch provider's,
or when the default policy (`PickAny`) ranks torch's cuDNN kernels first among all offered, or
ranks another kernel first by less than `COMPILE_MIN_SPEEDUP`, the policy runs torch's cuDNN
attention (``aten._scaled_dot_product_cudnn_attention``, or SDPA, which runs the same cuDNN
kernel on Hopper for inference; with the log-sum-exp, and cuDNN's
backward, in training, where the torch provider ranks cuDNN before FlashAttention-2 and the
materialised formula), and each custom op only adds its Python around that aten call: about 50 us
for the forward and 150 us for the backward a call on the H200 host, where Inductor calls an aten
op directly. A compiled GPT-2 training step (8 x 1024 tokens) made of those ops was host-bound.
So under Dynamo such an attention is the aten op itself, causal where the problem is (cuDNN's
causal mask is the problem's for equal lengths; SDPA's ``is_causal``, which Inductor lowers for
cuDNN to a materialised mask, is not used), and in training AOTAutograd differentiates it with
cuDNN's backward: the same kernels (or, ahead of them by a few percent, cuDNN's instead of
kernel_api's own forward), no custom op. Where another provider's kernel ranks clearly ahead
(a plugin such as FlashAttention-4's, whose backward beats cuDNN's at head dim 64), or another
policy than `PickAny` is in force while other providers offer kernels, the ops stay, and the
policy chooses per call. So do they while a `PickBest` that reads tuning records is in force,
whose measurements may rank another of torch's kernels first.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from ..core import tracing
from ..ops import dispatch as _dispatch
from . import lowering as _lowering

_log = logging.getLogger(__name__)

#: How much faster than torch's cuDNN kernel (by PickAny's estimates) another kernel must be for
#: a compiled graph to keep kernel_api's ops: an opaque custom op costs host time (126-168 us a
#: forward, 214-264 us a backward, replayed, on the H200 host: docs/performance.md, "Attention as
#: torch's cuDNN op under torch.compile") and Inductor's fusions around it. FlashAttention-4's
#: forward at head dim 128 (ranked 1.08x) and backward at head dim 64 keep the ops, as measured
#: in the compiled Llama and GPT-2 runs; kernels ranked a few percent ahead of cuDNN do not.
COMPILE_MIN_SPEEDUP = 1.08


class Problem(NamedTuple):
    """What the rule answers for: an attention's sizes, its kind, the device and the providers
    in force (the key of `decisions`)."""

    dtype: torch.dtype
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    training: bool
    device_index: int
    cc: int
    providers: Any
    pick_any: bool


@tracing.assume_constant_result
def lowers_to_cudnn(dtype: torch.dtype, batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int,
                    head_dim: int, causal: bool, training: bool, device_index: int) -> bool:
    """Under Dynamo, for an attention of these sizes on CUDA device ``device_index`` (-1: another
    device), q, k and v ``(batch, heads, seqlen, head_dim)``, with a backward to come when
    ``training``: whether it runs as torch's cuDNN attention op (the module docstring). Dynamo
    calls it while tracing and takes its answer as a constant; any failure to tell answers False
    (kernel_api's ops stay)."""
    if device_index < 0 or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        from ..core.arch import device_cc
        if _lowering._records_policy() is not None:
            return False  # (a PickBest reading tuning records chooses per call among the measured kernels)
        return _lowers(dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, training,
                       device_index, device_cc(device_index), _providers(), _pick_any())
    except Exception as exc:  # noqa: BLE001 - the ops stay, which serve any problem
        _log.debug("attention lowering not decided for %s: %s", (batch, seqlen_q, seqlen_k, heads_q, heads_kv,
                                                                 head_dim), exc)
        return False


def _providers() -> Any:
    from ..tuning.scope import current

    return current().providers


def _pick_any() -> bool:
    """Whether the policy in force is `PickAny` itself (which runs nothing to choose)."""
    from ..tuning.pick_any import PickAny
    from ..tuning.scope import current

    return type(current().policy) is PickAny


#: The answers given so far (`decisions`), by problem: Dynamo asks once per trace of a layer.
#: `kernel_api.ops.clear_dispatch_cache` forgets them with the ops' choices (a provider or plugin
#: added since answers again at the next trace).
_decided: dict[Problem, bool] = {}
_dispatch.choice_caches.append(_decided.clear)


def decisions() -> dict[Problem, bool]:
    """The attention problems the rule answered in this process (`Problem`) -> whether they run
    as torch's cuDNN op under compile (what a benchmark or a user inspecting a compiled model
    reads: kernel_api chose no kernel for those)."""
    return dict(_decided)


def lowered() -> list[str]:
    """The problems run as torch's cuDNN op in this process's compiled graphs, one line each
    (``"training b8 s1024/1024 h12/12 d64 causal"``): kernel_api chose no kernel for those, so a
    benchmark or a user reading `kernel_api.ops.chosen_kernels` finds none."""
    return sorted(f"{'training' if p.training else 'inference'} b{p.batch} s{p.seqlen_q}/{p.seqlen_k} "
                  f"h{p.heads_q}/{p.heads_kv} d{p.head_dim}{' causal' if p.causal else ''}"
                  for p, answer in _decided.items() if answer)


def _lowers(*values: Any) -> bool:
    problem = Problem(*values)
    found = _decided.get(problem)
    if found is None:
        found = _decided[problem] = _decide(*problem)
    return found


def _decide(dtype: torch.dtype, batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int,
            head_dim: int, causal: bool, training: bool, device_index: int, cc: int, providers: Any,
            pick_any: bool) -> bool:
    if not cudnn_serves(dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, training, cc,
                        providers=providers, device=f"cuda:{device_index}", pick_any=pick_any):
        return False
    if heads_q != heads_kv:
        from ..providers.torch_ops.attention import cudnn_reads_gqa

        return cudnn_reads_gqa(torch.device("cuda", device_index))
    return True


def cudnn_serves(dtype: torch.dtype, batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int,
                 head_dim: int, causal: bool, training: bool, cc: int, providers: Any = None,
                 device: str = "cuda", pick_any: bool | None = None) -> bool:
    """Whether the policy in force runs torch's cuDNN attention for an attention of these sizes
    (dense, no dropout): the forward, with the log-sum-exp and the backward too when
    ``training``. So it does when the registry offers only torch's kernels, cuDNN's among them
    (torch's provider ranks cuDNN first); and under `PickAny` (the default), which runs nothing
    to choose, when cuDNN's kernels are its choice, or its choices (forward and backward
    together) are less than `COMPILE_MIN_SPEEDUP` faster by its estimates. A kernel of another
    provider whose rank cannot be told, or another policy (a `PickBest` times the candidates),
    keeps kernel_api's ops. ``pick_any``: whether PickAny is the policy (None: whether it is in
    force now). The problem is stated on fake CUDA tensors: nothing is allocated, and no GPU is
    needed to ask."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..arguments.attention import AttentionArguments, lse_shape
    from ..arguments.attention_backward import AttentionBackwardArguments
    from ..registry import get_kernels

    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(batch, seqlen_q, heads_q, head_dim, dtype=dtype, device=device)
        k = torch.empty(batch, seqlen_k, heads_kv, head_dim, dtype=dtype, device=device)
        v = torch.empty_like(k)
        out = torch.empty_like(q)
        lse = torch.empty(lse_shape(q, False), dtype=torch.float32, device=device) if training else None
        problems = [AttentionArguments(q, k, v, out, lse, causal=causal)]
        if training:
            problems.append(AttentionBackwardArguments(torch.empty_like(q), q, k, v, out, lse, torch.empty_like(q),
                                                       torch.empty_like(k), torch.empty_like(v), causal=causal))
        offered = [(args, get_kernels(args, providers=providers, cc=cc)) for args in problems]
        if not all(any(_is_cudnn(k) for k in kernels) for _, kernels in offered):
            return False
        if all(k.metadata.provider == "torch" for _, kernels in offered for k in kernels):
            return True
        return (_pick_any() if pick_any is None else pick_any) and _pick_any_runs_cudnn(offered)


def _is_cudnn(kernel: Any) -> bool:
    return kernel.metadata.provider == "torch" and getattr(kernel.metadata.design, "backend", None) == "cudnn"


def _runs_cudnn(kernel: Any) -> bool:
    """torch's cuDNN kernel, or its SDPA (which runs cuDNN's kernel where a cuDNN one serves)."""
    return kernel.metadata.provider == "torch" and getattr(kernel.metadata.design, "backend", None) in ("cudnn",
                                                                                                       "sdpa")


def _pick_any_runs_cudnn(offered: list) -> bool:
    """Whether `PickAny` runs torch's cuDNN kernels for the problems of ``offered`` ((arguments,
    kernels) for the forward, and the backward in training) in a compiled graph: it ranks them
    (or SDPA) first, or its choices together are less than `COMPILE_MIN_SPEEDUP` faster than
    torch's best cuDNN kernels by its estimates."""
    from ..core.arch import planning_sm_count
    from ..cost.estimate import estimated_cost
    from ..tuning.pick_any import rank_candidates

    # (the SMs of the device the problems name, or the targeted machines' without a GPU)
    sms = planning_sm_count(offered[0][0].device if torch.cuda.is_available() else None)
    chosen = cudnn = 0.0
    try:
        for args, kernels in offered:
            ranked = rank_candidates(kernels, args, sms)
            chosen += estimated_cost(ranked[0], args, sms)
            cudnn += estimated_cost(next(k for k in ranked if _runs_cudnn(k)), args, sms)
    except Exception as exc:  # noqa: BLE001 - a kernel whose rank cannot be told: the ops stay
        _log.debug("attention lowering: candidates of %s not ranked: %s", offered[0][0], exc)
        return False
    # (a kernel ranked exactly the threshold ahead keeps the ops, its cost's rounding aside)
    return cudnn < (COMPILE_MIN_SPEEDUP - 1e-9) * chosen


def cudnn_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                    scale: float | None, training: bool) -> torch.Tensor:
    """torch's cuDNN attention of q, k, v ``(batch, heads, seqlen, head_dim)``, with the
    log-sum-exp its backward reads when ``training``: the output as ``(batch, seqlen, heads,
    head_dim)``."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention.default(query, key, value, None, training, 0.0, causal,
                                                                    False, scale=scale)[0]
    return out.transpose(1, 2)
