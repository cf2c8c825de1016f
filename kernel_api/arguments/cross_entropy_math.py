"""Cross-entropy as `CrossEntropyArguments` defines it, in torch (what every kernel must compute,
written once), and the chunk loop of the fused linear cross-entropy, which every fused kernel
runs with its own per-row kernel.

The chunk loop keeps one (chunk x vocabulary) logits buffer. Per chunk of tokens it computes
the logits with one GEMM into the buffer; the per-row kernel writes the loss and replaces the
logits with their gradient in place; two more GEMMs take the gradients of the hidden states
(written into their rows of ``grad_hidden``) and of the weight (accumulated into
``grad_weight``: the first chunk writes it, the rest add with ``addmm_``). Three GEMMs over the
whole problem, the fewest a fused loss with gradients can take; no backward pass recomputes
the logits.

The chunk's size trades memory for time. ``grad_weight`` (vocabulary x hidden) is read and
written once per chunk, whatever the chunk's size, while the chunk's weight-gradient GEMM does
``2 * tokens * vocabulary * hidden`` FLOPs: for the GEMM's math to hide that traffic the chunk
needs tokens >= 2 * (GEMM FLOP/s) / (memory bytes/s) (about 330 on an H200's 660 TFLOP/s and
4 TB/s), whatever the vocabulary and hidden size. `CHUNK_TOKENS` keeps a margin above that;
`MAX_CHUNK_BYTES` caps the buffer for very large vocabularies. Measured (H200, bf16, a training
step of the loss, `OVERLAP_GRADIENT_GEMMS` off): 512 / 1024 / 2048 tokens took 46.2 / 43.7 /
41.9 ms with 1.25 / 1.38 / 1.64 GB of extra peak memory at 8192 x 4096 -> 128256, and 13.9 /
12.1 / 11.4 ms with 0.23 / 0.26 / 0.33 GB at 16384 x 2048 -> 32000 (benchmarks/cross_entropy.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

#: Tokens per chunk of the fused linear cross-entropy (see the module docstring).
CHUNK_TOKENS = 1024
#: The largest logits chunk buffer, in bytes, whatever `CHUNK_TOKENS` says.
MAX_CHUNK_BYTES = 512 << 20
#: Chunks are multiples of this many tokens (a GEMM tile's rows), when larger.
_TILE = 64
#: Run each chunk's two gradient GEMMs on two streams: they read the same chunk and write
#: different outputs, so one's last, partly filled wave can overlap the other's work. Measured
#: (H200, bf16, 1024 tokens per chunk, a training step of the loss at the power cap): 43.65 ->
#: 42.56 ms at 8192 x 4096 -> 128256 and 12.06 -> 11.70 ms at 16384 x 2048 -> 32000, the same
#: peak memory.
OVERLAP_GRADIENT_GEMMS = True
_side_streams: dict = {}


def _side_stream(device: torch.device) -> Any:
    found = _side_streams.get(device)
    if found is None:
        found = _side_streams[device] = torch.cuda.Stream(device=device)
    return found


def chunk_tokens(rows: int, vocab: int, element_bytes: int, tokens: int | None = None,
                 max_bytes: int | None = None) -> int:
    """Tokens per chunk of the fused linear cross-entropy.

    Args:
        rows: the tokens of the problem.
        vocab: the vocabulary (the logits' row length).
        element_bytes: bytes of one logit.
        tokens, max_bytes: override `CHUNK_TOKENS` and `MAX_CHUNK_BYTES`.

    Returns:
        At least 1, at most ``rows`` (1 for an empty problem).
    """
    tokens = CHUNK_TOKENS if tokens is None else tokens
    cap = (MAX_CHUNK_BYTES if max_bytes is None else max_bytes) // max(vocab * element_bytes, 1)
    n = max(1, min(tokens, cap))
    if n > _TILE:
        n -= n % _TILE
    return max(1, min(n, rows))


def compute_type(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def rows_loss(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
              z_loss: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, valid) per row of 2-D ``logits`` in its compute type (f64 for f64, else
    f32); loss and lse are 0 on ignored rows."""
    x = logits.to(compute_type(logits))
    valid = target != ignore_index
    lse = torch.logsumexp(x, -1)
    picked = x.gather(1, torch.where(valid, target, 0).long().unsqueeze(1)).squeeze(1)
    loss = (1.0 - label_smoothing) * (lse - picked)
    if label_smoothing:
        loss = loss + label_smoothing * (lse - x.mean(-1))
    if z_loss:
        loss = loss + z_loss * lse.square()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(valid, loss, zero), torch.where(valid, lse, zero), valid


def rows_gradient(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, grad_loss: torch.Tensor,
                  ignore_index: int, label_smoothing: float, z_loss: float) -> torch.Tensor:
    """The gradient of ``sum(grad_loss * loss)`` with respect to 2-D ``logits``, in its compute
    type, given the rows' ``lse`` (any value on ignored rows)."""
    x = logits.to(compute_type(logits))
    valid = target != ignore_index
    lse = lse.to(x.dtype)
    g = torch.exp(x - lse.unsqueeze(1))
    if z_loss:
        g = g * (1.0 + 2.0 * z_loss * lse).unsqueeze(1)
    if label_smoothing:
        g = g - label_smoothing / x.shape[1]
    rows = torch.arange(x.shape[0], device=x.device)
    g[rows, torch.where(valid, target, 0).long()] -= (1.0 - label_smoothing)
    scale = torch.where(valid, grad_loss.to(x.dtype).expand(valid.shape), torch.zeros((), dtype=x.dtype,
                                                                                       device=x.device))
    return g * scale.unsqueeze(1)


#: ``row_kernel(logits, target, loss, grad_loss)``: the per-row cross-entropy of one chunk
#: (2-D logits, its targets and per-row losses); with ``grad_loss`` (not None) it also replaces
#: the logits by their gradient, in place.
RowKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], None]


def kept_rows(target: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """The indices of the tokens whose target is not ``ignore_index``, when some are ignored;
    None when none is, or while a CUDA graph is captured (the count needs the host to wait for
    the GPU, which a capture cannot)."""
    if target.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    keep = (target != ignore_index).nonzero().squeeze(1)
    return None if keep.numel() == target.numel() else keep


def linear_cross_entropy_chunks(args: Any, row_kernel: RowKernel, tokens: int | None = None,
                                skip_ignored: bool = True) -> None:
    """Run `LinearCrossEntropyArguments` ``args`` chunk by chunk (module docstring) on the
    current stream, with ``row_kernel`` for each chunk's rows.

    Ignored tokens have loss 0 and no gradient, so with ``skip_ignored`` they take no part in
    the GEMMs: the chunks are made of the kept tokens alone (their hidden states gathered, the
    losses and hidden-state gradients scattered back; one wait for the count of kept tokens).
    Where prompts are masked (fine-tuning) that is the masked share of all the work.

    Args:
        args: the arguments; their outputs are written.
        row_kernel: see `RowKernel`.
        tokens: tokens per chunk (default: `chunk_tokens`).
        skip_ignored: leave the ignored tokens out of the GEMMs.
    """
    h, w, b = args.hidden, args.weight, args.bias
    grads = args.wants_gradient
    kept = kept_rows(args.target, args.ignore_index) if skip_ignored and args.rows else None
    n = args.rows if kept is None else kept.numel()
    if kept is not None:
        args.loss.zero_()
        if args.grad_hidden is not None:
            args.grad_hidden.zero_()
    if n == 0:
        for out in (args.grad_weight, args.grad_bias):
            if out is not None:
                out.zero_()
        return
    step = tokens or chunk_tokens(n, args.vocab, h.element_size())
    buffer = h.new_empty((min(step, n), args.vocab))
    if kept is not None:  # the chunk's losses and hidden-state gradients, scattered after
        loss_part = args.loss.new_empty((min(step, n),))
        grad_hidden_part = h.new_empty((min(step, n), h.shape[1])) if args.grad_hidden is not None else None
    wt = w.t()
    side = None
    if OVERLAP_GRADIENT_GEMMS and h.is_cuda and args.grad_hidden is not None and args.grad_weight is not None:
        main, side = torch.cuda.current_stream(h.device), _side_stream(h.device)
    for start in range(0, n, step):
        end = min(n, start + step)
        logits = buffer[: end - start]
        if kept is None:
            hc, target, loss = h[start:end], args.target[start:end], args.loss[start:end]
            grad_loss = args.grad_loss[start:end] if grads else None
            grad_hidden = args.grad_hidden[start:end] if args.grad_hidden is not None else None
        else:
            index = kept[start:end]
            hc, target, loss = h.index_select(0, index), args.target.index_select(0, index), loss_part[: end - start]
            grad_loss = args.grad_loss.index_select(0, index) if grads else None
            grad_hidden = grad_hidden_part[: end - start] if args.grad_hidden is not None else None
        if b is None:
            torch.mm(hc, wt, out=logits)
        else:
            torch.addmm(b, hc, wt, out=logits)
        row_kernel(logits, target, loss, grad_loss)
        if side is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                _weight_gradient(args, logits, hc, start == 0)
        if grad_hidden is not None:
            torch.mm(logits, w, out=grad_hidden)
        if kept is not None:
            args.loss.index_copy_(0, index, loss)
            if grad_hidden is not None:
                args.grad_hidden.index_copy_(0, index, grad_hidden)
        if args.grad_weight is not None and side is None:
            _weight_gradient(args, logits, hc, start == 0)
        if args.grad_bias is not None:
            if start == 0:
                torch.sum(logits, 0, out=args.grad_bias)
            else:
                args.grad_bias.add_(logits.sum(0))
        if side is not None:
            main.wait_stream(side)  # (before the next chunk overwrites the buffer)


def _weight_gradient(args: Any, logits: torch.Tensor, hc: torch.Tensor, first: bool) -> None:
    """``grad_weight`` (+)= the chunk's gradient logits (transposed) times its hidden states."""
    if first:
        torch.mm(logits.t(), hc, out=args.grad_weight)
    else:
        args.grad_weight.addmm_(logits.t(), hc)
