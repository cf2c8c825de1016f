"""The causal-LM loss of transformers models through `ops.cross_entropy` and
`ops.linear_cross_entropy`.

Two pieces, both installed on one ``*ForCausalLM`` model by `kernel_api.nn.patch`:

- `causal_lm_loss`, the model's ``loss_function``: transformers' ``ForCausalLMLoss`` (labels
  shifted left, ``ignore_index`` at the end, mean over the counted tokens, or the sum over
  ``num_items_in_batch``) with `ops.cross_entropy` on the logits as they are, without the f32
  copy of them that transformers makes.
- `fused_loss_forward`, the model's forward while training with labels: the base model's hidden
  states go with the ``lm_head`` weight into `ops.linear_cross_entropy`, which never holds the
  (tokens x vocab) logits; the output's ``logits`` is None, as in Liger's fused forward. Without
  labels, in eval mode, with ``logits_to_keep``, or with hidden states that the op does not take,
  the model's own forward runs (with `causal_lm_loss`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import ops
from .edits import positional_names
from .mixin import ops_take

_IGNORE_INDEX = -100


def _shifted(labels: torch.Tensor, shift_labels: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """Each position's next token (``ignore_index`` after the last), flat."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _reduced(loss: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch: Any = None,
                   ignore_index: int = _IGNORE_INDEX, shift_labels: torch.Tensor | None = None,
                   **kwargs: Any) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` through `ops.cross_entropy` (same arguments, an f32 loss)."""
    target = _shifted(labels, shift_labels, ignore_index).to(logits.device)
    flat = logits.reshape(-1, vocab_size)
    if not ops_take(flat):
        from transformers.loss.loss_utils import ForCausalLMLoss
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = ops.cross_entropy(flat, target, ignore_index=ignore_index, reduction=reduction)
    return _reduced(loss.float(), num_items_in_batch)


def linear_causal_lm_loss(hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor,
                          num_items_in_batch: Any = None, ignore_index: int = _IGNORE_INDEX,
                          shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """The loss of ``lm_head(hidden)`` against the shifted labels, by `ops.linear_cross_entropy`."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    target = _shifted(labels, shift_labels, ignore_index).to(hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = ops.linear_cross_entropy(flat, lm_head.weight, target, lm_head.bias, ignore_index=ignore_index,
                                    reduction=reduction)
    return _reduced(loss.float(), num_items_in_batch)


def _output_fields(model: torch.nn.Module) -> tuple[type, tuple[str, ...]]:
    """The causal-LM output class and the fields it copies from the base model's output."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    names = tuple(f.name for f in dataclasses.fields(CausalLMOutputWithPast) if f.name not in ("loss", "logits"))
    return CausalLMOutputWithPast, names


def fused_loss_forward(model: torch.nn.Module) -> Callable:
    """A forward for ``model`` (a transformers ``*ForCausalLM`` with ``model`` and ``lm_head``
    children) that computes the training loss from the hidden states (module docstring), bound
    to it as a method (so that a deep copy of the model gets one bound to the copy)."""
    original = type(model).forward
    names = positional_names(original)  # (for positional arguments: read here, not per call)
    output_class, fields = _output_fields(model)

    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args:
            if len(args) > len(names):
                return original(self, *args, **kwargs)
            kwargs.update(zip(names, args))
        labels, keep = kwargs.get("labels"), kwargs.get("logits_to_keep", 0)
        lm_head = self.lm_head
        if labels is None or not self.training or not (type(keep) is int and keep == 0) or not isinstance(
                getattr(lm_head, "weight", None), torch.Tensor):
            return original(self, **kwargs)
        kwargs.pop("labels")
        kwargs.pop("logits_to_keep", None)
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        outputs = self.model(**kwargs)
        hidden = outputs[0]
        logits = None
        if ops_take(hidden, lm_head.weight):
            loss = linear_causal_lm_loss(hidden, lm_head, labels, **kwargs)
        else:
            logits = lm_head(hidden)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        rest = {} if isinstance(outputs, tuple) else {name: getattr(outputs, name, None) for name in fields}
        result = output_class(loss=loss, logits=logits, **rest)
        return result if return_dict else result.to_tuple()

    return types.MethodType(forward, model)
