"""A model's own position ids make no packed-sequence mask under torch.compile.

transformers' causal-mask builder (``create_causal_mask``) looks for packed sequences (several
sequences in one row, their positions restarting) in the position ids it is handed, when the
call has no attention mask and no cache. Eagerly it reads their values and finds none in a
model's own positions; while tracing it cannot read values, so under ``torch.compile`` every
such call builds a dense (batch, 1, queries, keys) mask from the positions, and attention runs
masked over every key, with no causal skipping: the compiled GPT-2's 8 x 1024 prefill spent 1.39
of its 5.4 ms of GPU time on the H200 in masked attention.

A base model whose caller passes no position ids makes its own: ``0..n-1`` after the cache, one
sequence a row. `patch` wraps the forward of such a base model (`forward_for`): while Dynamo
traces a call with no position ids, no attention mask and no cache, the model's config is
marked, and the modeling module's ``create_causal_mask`` (replaced by `mask_builder`) builds the
mask for a marked config without the position ids: the plain causal mask, which SDPA runs as
``is_causal`` and kernel_api's attention as causal. Dynamo guards the call's arguments, so a later
call that passes position ids (packed training batches), a mask or a cache is traced again and
builds its mask as before. Outside tracing nothing changes: transformers reads the positions'
values itself.

A call that passes position ids with no mask and no cache, one row (packed sequences, as
padding-free collators make them), gets the sequences' offsets with transformers' block-causal
mask for them (`kernel_api.nn.packed.PackedRows`) when the model's attention is kernel_api's,
which runs them as variable-length attention. Traced, the offsets are traced from the ids and the
unused mask is left out by Inductor; eagerly the offsets are read once and the mask is made only
for a layer that runs SDPA.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable

import torch

from ..core import tracing
from .attention import NAME as ATTENTION_NAME
from .edits import positional_names
from .packed import PackedRows, position_offsets, traced_offsets

#: The modeling module's function replaced by `mask_builder`.
MASK_BUILDER = "create_causal_mask"
# What a base model's forward calls its cache, by transformers version.
_CACHE_NAMES = ("past_key_values", "cache")


class _Traced:
    """While Dynamo traces: the configs of the base models whose call makes its own positions
    (innermost last). Set and read only during tracing, where Dynamo replays the assignments.
    (An instance attribute from the start: the replayed assignment then changes no guarded
    layout, and a traced call's guards hold for the next call.)"""

    def __init__(self) -> None:
        self.configs: tuple = ()


_TRACED = _Traced()


def forward_for(model: torch.nn.Module) -> Callable | None:
    """A forward for ``model`` (a transformers base model: its forward takes ``position_ids``,
    ``attention_mask`` and a cache) that marks its config while a traced call makes its own
    positions, bound to it as a method (a deep copy of the model gets one bound to the copy);
    None when the forward takes none of those by name. It calls the class's forward of the
    moment (as ``super()`` would)."""
    parameters = positional_names(type(model).forward)
    if "position_ids" not in parameters or "attention_mask" not in parameters or not any(
            name in parameters for name in _CACHE_NAMES):
        return None
    # Where a call names position ids, a mask or a cache: by keyword (a cache under either name,
    # transformers renaming it), or by position.
    keywords = ("position_ids", "attention_mask", *_CACHE_NAMES)
    at = tuple(parameters.index(name) for name in keywords if name in parameters)

    @functools.wraps(type(model).forward)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not tracing.is_dynamo_compiling():
            return type(self).forward(self, *args, **kwargs)
        for name in keywords:
            if kwargs.get(name) is not None:
                return type(self).forward(self, *args, **kwargs)
        for i in at:
            if len(args) > i and args[i] is not None:
                return type(self).forward(self, *args, **kwargs)
        outer = _TRACED.configs
        _TRACED.configs = (*outer, self.config)
        try:
            return type(self).forward(self, *args, **kwargs)
        finally:
            _TRACED.configs = outer

    return types.MethodType(forward, model)


def mask_builder(original: Callable) -> Callable:
    """``create_causal_mask`` that, while Dynamo traces, leaves out a base model's own positions
    (`forward_for`); that answers a row of packed sequences that transformers would mask by their
    position ids alone with `PackedRows` for kernel_api's attention (traced: the offsets traced
    from the ids and transformers' mask; eagerly: the offsets read once and the mask made only
    when a layer asks); and is ``original`` otherwise."""
    read = _Reader(original)

    @functools.wraps(original)
    def create_causal_mask(*args: Any, **kwargs: Any) -> Any:
        config = read(args, kwargs, "config")
        if tracing.is_dynamo_compiling():
            configs = _TRACED.configs
            if configs and kwargs.get("position_ids") is not None and config is configs[-1]:
                kwargs["position_ids"] = None
            elif _packed_by_positions(read, args, kwargs, config):
                offsets = traced_offsets(read(args, kwargs, "position_ids"))
                return PackedRows(offsets, None, original(*args, **kwargs), None)
        elif _packed_by_positions(read, args, kwargs, config):
            offsets = position_offsets(read(args, kwargs, "position_ids"), read(args, kwargs, "inputs_embeds").device)
            return PackedRows(offsets.cu_seqlens_q, offsets.max_seqlen_q, None, _once(original, args, kwargs))
        return original(*args, **kwargs)

    return create_causal_mask


def _once(original: Callable, args: tuple, kwargs: dict) -> Callable[[], Any]:
    """``original(*args, **kwargs)``, made at the first call and kept for the next."""
    made: list = []

    def build() -> Any:
        if not made:
            made.append(original(*args, **kwargs))
        return made[0]

    return build


class _Reader:
    """An argument of a call to a mask builder by name (or a name transformers has given it in
    another version), wherever the call passed it; positions read from the signature once."""

    _ALIASES = {"cache": ("cache", "past_key_values"), "inputs_embeds": ("inputs_embeds", "input_embeds")}

    def __init__(self, original: Callable) -> None:
        parameters = inspect.signature(original).parameters
        self.positions = {name: i for i, name in enumerate(parameters)}

    def __call__(self, args: tuple, kwargs: dict, name: str) -> Any:
        for alias in self._ALIASES.get(name, (name,)):
            if alias in kwargs:
                return kwargs[alias]
            at = self.positions.get(alias)
            if at is not None and at < len(args):
                return args[at]
        return None


def _packed_by_positions(read: _Reader, args: tuple, kwargs: dict, config: Any) -> bool:
    """Whether transformers' causal mask for this call is exactly the block-causal mask of one row
    of sequences its position ids describe, and kernel_api's attention receives it: position ids
    given with no attention mask, no cache and no other mask function (transformers then splits the
    row where the ids do not go up by one), one row of at least two tokens, a causal model."""
    position_ids, embeds = read(args, kwargs, "position_ids"), read(args, kwargs, "inputs_embeds")
    if config is None or getattr(config, "_attn_implementation", None) != ATTENTION_NAME or not getattr(
            config, "is_causal", True):
        return False
    if not isinstance(position_ids, torch.Tensor) or not isinstance(embeds, torch.Tensor) or embeds.dim() != 3:
        return False
    for name in ("attention_mask", "cache", "or_mask_function", "and_mask_function", "block_sequence_ids"):
        if read(args, kwargs, name) is not None:
            return False
    return embeds.shape[0] == 1 and embeds.shape[1] >= 2 and position_ids.numel() == embeds.shape[1]
