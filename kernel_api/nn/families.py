"""The transformers model families whose layers `kernel_api.nn.patch` knows, by role.

The Llama family's modeling modules (Llama, Mistral, Qwen2, Qwen3) define the same layers under
their own prefix: ``<Prefix>RMSNorm``, ``<Prefix>MLP`` (gate/up/down projections),
``<Prefix>Attention`` (through transformers' attention interface, calling the module's
``apply_rotary_pos_emb``), ``<Prefix>DecoderLayer`` (pre-norm attention and MLP branches, each
added to its input), ``<Prefix>Model`` (the base model: embeddings, layers, the causal mask) and
``<Prefix>ForCausalLM`` (``model`` and ``lm_head`` children, the loss through ``loss_function``).
GPT-2's ``GPT2Block``, ``GPT2Attention`` (through the attention interface too) and ``GPT2Model``
are known by themselves (`is_gpt2_block`, `is_gpt2_attention`, `is_gpt2_model`). A class matches a role when it is that very class of that module (checked in
``sys.modules``: nothing here imports transformers).
"""

from __future__ import annotations

import sys

#: family (the modeling module's name) -> the class-name prefix of its layers.
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
#: The roles a family's classes play.
ROLES = ("RMSNorm", "MLP", "Attention", "DecoderLayer", "Model", "ForCausalLM")


def family_role(cls: type) -> str | None:
    """The role (`ROLES`) of ``cls`` in a known family, or None."""
    module = cls.__module__
    parts = module.split(".")
    if len(parts) != 4 or parts[0] != "transformers" or parts[1] != "models" or parts[3] != f"modeling_{parts[2]}":
        return None
    prefix = FAMILIES.get(parts[2])
    if prefix is None or not cls.__qualname__.startswith(prefix):
        return None
    role = cls.__qualname__[len(prefix):]
    if role not in ROLES or getattr(sys.modules.get(module), cls.__qualname__, None) is not cls:
        return None
    return role


def is_role(module: object, role: str) -> bool:
    """Whether ``module``'s class is exactly a known family's ``role`` class."""
    return family_role(type(module)) == role


def _is_class(cls: type, module: str, name: str) -> bool:
    return cls.__module__ == module and cls.__qualname__ == name and getattr(sys.modules.get(module), name,
                                                                             None) is cls


def is_gpt2_block(module: object) -> bool:
    """Whether ``module``'s class is exactly transformers' ``GPT2Block``."""
    return _is_class(type(module), "transformers.models.gpt2.modeling_gpt2", "GPT2Block")


def is_gpt2_attention(module: object) -> bool:
    """Whether ``module``'s class is exactly transformers' ``GPT2Attention``."""
    return _is_class(type(module), "transformers.models.gpt2.modeling_gpt2", "GPT2Attention")


def is_gpt2_model(module: object) -> bool:
    """Whether ``module``'s class is exactly transformers' ``GPT2Model``."""
    return _is_class(type(module), "transformers.models.gpt2.modeling_gpt2", "GPT2Model")
