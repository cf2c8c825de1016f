"""The kernel author's contract, as `kernel_api.kernel` writes it: five required hooks, at most
three optional ones, and class attributes with defaults for the rest."""

import re

import kernel_api.kernel as kernel_module
from kernel_api.kernel import OPTIONAL_HOOKS, REQUIRED_HOOKS, Kernel


def test_the_required_hooks_are_the_abstract_methods():
    assert set(Kernel.__abstractmethods__) == set(REQUIRED_HOOKS)
    assert REQUIRED_HOOKS == ("compile", "_run", "generate_kernels", "_supports", "get_workspace_size")


def test_at_most_three_optional_hooks_each_with_a_default():
    assert len(OPTIONAL_HOOKS) <= 3
    for hook in OPTIONAL_HOOKS:
        method = getattr(Kernel, hook)
        assert callable(method) and not getattr(method, "__isabstractmethod__", False), hook


def test_tuning_knobs_are_plain_attributes_with_defaults():
    assert Kernel.workspace_free is False
    assert Kernel.performance_hint == 0.5
    assert Kernel.compiles_from_cache_only is False


def test_the_module_docstring_lists_exactly_the_hooks():
    doc = kernel_module.__doc__
    required = doc[doc.index("Required hooks"):doc.index("Optional hooks")]
    optional = doc[doc.index("Optional hooks"):doc.index("``run`` and ``supports`` are final")]
    listed = lambda part: re.findall(r"^- ``(\w+)\(", part, re.MULTILINE)  # noqa: E731
    assert listed(required) == list(REQUIRED_HOOKS)
    assert listed(optional) == list(OPTIONAL_HOOKS)
