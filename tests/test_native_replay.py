"""Repeated calls replayed from C by one call key (kernel_api/native/recipes.py, python_entry.cc's
CallKey): what the key holds, what a recipe runs, when a replay declines, and which Python frames a
repeated `ops.gemm`, `ops.softmax` (under autograd too) and patched `nn.Linear` call enters.

Runs on CPU: the front door is opened to CPU tensors (`cpu_ops`) and restricted to the torch
provider, whose kernels record torch calls; launches are a Python callable converted to a
TVM-FFI function (`Recorder`).
"""

from __future__ import annotations


import pytest
import torch

import kernel_api
from kernel_api import native
from kernel_api.native import recipes
from kernel_api.ops import dispatch as ops
from test_hardening_host_cost import Frames, _front_door_frames, entry  # noqa: F401  (the entry points, fresh caches; frames entered)

tvm_ffi = pytest.importorskip("tvm_ffi")
if native.module_path() is None:
    pytest.skip("kernel_api.native._launch_table was not built by this install", allow_module_level=True)

OP = recipes.op_number("tests.replay")


@pytest.fixture
def torch_ops(cpu_ops, entry):
    """The front door on CPU tensors with the torch provider only (its kernels record torch calls)."""
    with kernel_api.settings(providers=["torch"]):
        yield entry


class Recorder:
    """A TVM-FFI stand-in for a compiled kernel: logs each call (tensors as data pointer, shape
    and strides: tensors passed as DLTensor pointers live only during the call)."""

    def __init__(self):
        self.calls = []

        def record(*args):
            self.calls.append(tuple((a.data_ptr(), tuple(a.shape), tuple(a.strides)) if hasattr(a, "data_ptr") else a
                                    for a in args))

        self.function = tvm_ffi.convert(record)


def seen(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride())


# ---- the key ------------------------------------------------------------------------------------

def test_a_call_recipe_replays_for_an_equal_key_only(entry):
    x = torch.randn(4, 8)
    recipe = recipes.Call(torch._softmax, (0, 1, recipes.constant(0)), (False,))
    assert recipes.record(entry, OP, recipe, x, -1, None, "a")
    got = entry.replay(OP, x, -1, None, "a")
    assert torch.equal(got, torch.softmax(x, -1))
    assert entry.recipe(OP, x, -1, None, "a") == (recipe.spec(),)
    for other in ((x, -1.0, None, "a"), (x, True, None, "a"), (x, -1, 0, "a"), (x, -1, None, "b"),
                  (x.t().contiguous().t(), -1, None, "a"), (x[:, :4], -1, None, "a"), (x.double(), -1, None, "a"),
                  (x, -1, None), (torch.nn.Parameter(x), -1, None, "a")):
        assert entry.replay(OP, *other) is None, other
    assert entry.replay(OP + 1, x, -1, None, "a") is None
    assert entry.replay(OP, x, -1, None, object()) is None  # not keyed: another type
    assert not recipes.record(entry, OP, recipe, x, -1, None, [1])


def test_a_str_argument_is_keyed_by_its_length_and_every_byte(entry):
    """A str is keyed whole (its length, then its bytes padded to whole words): strings that share
    a prefix, differ only past the first word or in their padding's place key apart; one too long
    to key leaves the call unkeyed (never replayed)."""
    x = torch.randn(4, 8)
    names = ["", "a", "a\x00", "gelu_tan", "gelu_tanh", "gelu_tanH", "gelu_tanh_approximate_x", "\u00e9t\u00e9"]
    for i, name in enumerate(names):
        assert recipes.record(entry, OP, recipes.Call(lambda x, i=i: i, (0,)), x, name)
    for i, name in enumerate(names):
        assert entry.replay(OP, x, name) == i, name
    assert entry.replay(OP, x, "gelu_tanh ") is None
    assert entry.replay(OP, x, "a\x00\x00") is None
    assert not recipes.record(entry, OP, recipes.Call(lambda x: 0, (0,)), x, "x" * 129)
    assert entry.replay(OP, x, "x" * 129) is None


def test_the_key_holds_the_settings_and_torchs_state(entry):
    x = torch.randn(4, 8)
    recipes.record(entry, OP, recipes.Call(torch.softmax, (0, 1)), x, -1)
    assert entry.replay(OP, x, -1) is not None
    with kernel_api.settings(policy=kernel_api.PickAny()):
        assert entry.replay(OP, x, -1) is None
    with torch.autocast("cpu"):
        assert entry.replay(OP, x, -1) is None
    with torch.overrides.TorchFunctionMode():
        assert entry.replay(OP, x, -1) is None
    from torch.utils._python_dispatch import TorchDispatchMode

    with TorchDispatchMode():
        assert entry.replay(OP, x, -1) is None
    untied = recipes.op_number("tests.replay.no_tf32", recipes.ALL_STATE & ~recipes.TF32)
    recipes.record(entry, untied, recipes.Call(torch.softmax, (0, 1)), x, -1)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = not tf32
        assert entry.replay(OP, x, -1) is None
        assert entry.replay(untied, x, -1) is not None  # (its keys leave the flag out)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    leaf = x.clone().requires_grad_()
    same = leaf.detach()  # (the same memory and metadata)
    recipes.record(entry, OP, recipes.Call(torch.softmax, (0, 1)), same, -1)
    assert entry.replay(OP, same, -1) is not None
    assert entry.replay(OP, leaf, -1) is None  # requires_grad under grad mode: another key
    with torch.no_grad():
        assert entry.replay(OP, same, -1) is None  # grad mode: another key
        recipes.record(entry, OP, recipes.Call(torch.softmax, (0, 1)), same, -1)
        assert entry.replay(OP, leaf, -1) is not None  # (requires_grad is keyed under grad mode only)
    assert entry.replay(OP, torch._neg_view(x), -1) is None  # a lazy bit: another key


def test_tf32_for_float32_keys_the_flag_for_calls_with_a_float32_tensor_only(entry):
    """An operation whose choices follow cuBLAS's TF32 flag for float32 operands alone has its
    calls keyed by the flag only when a tensor argument is float32: a bf16 call replays whatever
    the flag says, a float32 one (or one with a float32 tensor among others) does not."""
    op = recipes.op_number("tests.replay.tf32_for_float32", recipes.ALL_STATE | recipes.TF32_FOR_FLOAT32)
    half, single = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8)
    calls = [(half, -1), (single, -1), (half, single), (torch.randn(4, 8, dtype=torch.float64), -1)]
    for call in calls:
        assert recipes.record(entry, op, recipes.Call(lambda x, y: x, (0, 1)), *call)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = not tf32
        assert entry.replay(op, half, -1) is half
        assert entry.replay(op, *calls[3]) is calls[3][0]
        assert entry.replay(op, single, -1) is None
        assert entry.replay(op, half, single) is None
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert entry.replay(op, single, -1) is single
    assert entry.replay(op, half, single) is half


def test_a_call_recipe_with_an_output_declines_when_it_overlaps(entry):
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    recipes.record(entry, OP, recipes.Call(torch.softmax, (0, recipes.constant(0)), (-1,), out=1), x, out)
    assert entry.replay(OP, x, out) is out and torch.allclose(out, torch.softmax(x, -1))
    recipes.record(entry, OP, recipes.Call(torch.softmax, (0, recipes.constant(0)), (-1,), out=1), x, x)
    assert entry.replay(OP, x, x) is None  # the same memory: the Python path judges


def test_every_argument_position_is_read_for_the_overlap_check(entry):
    # A key reads up to 16 arguments (GEMM's front door passes 10): the output may sit at any
    # of them, and an output overlapping an input still declines (the Python path judges).
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    for at in range(1, 16):
        args = [x] + [None] * 15
        args[at] = out
        recipe = recipes.Call(torch.softmax, (0, recipes.constant(0)), (-1,), out=at)
        assert recipes.record(entry, OP + at, recipe, *args)
        out.fill_(float("nan"))
        assert entry.replay(OP + at, *args) is out and torch.allclose(out, torch.softmax(x, -1)), at
        args[at] = x
        assert entry.replay(OP + at, *args) is None, at


# ---- launches -----------------------------------------------------------------------------------

def test_a_launch_recipe_makes_its_output_as_recorded(entry):
    """A made output is a dense tensor of the recorded shape like the recorded argument; each
    recorded variant serves one pointer alignment of it (what arguments' summaries read)."""
    x = torch.randn(6, 8)
    fn = Recorder()
    room = torch.empty(48 + 256)
    for low in (16, 32, 64, 128, 256, 512, 1024):
        offset = (low - (room.data_ptr() & 1023)) % 1024 // 4
        assert recipes.alignment(room[offset:].data_ptr()) == low
        spec = recipes.Launch(fn.function, (0, recipes.MADE, recipes.constant(0)), (7,), made=(0, (6, 8), low))
        assert recipes.record(entry, OP, spec, x, None)
    assert entry.replays() == 1 and len(entry.recipe(OP, x, None)) == 7  # one key, a variant per alignment
    got = entry.replay(OP, x, None)
    assert got.shape == (6, 8) and got.dtype == x.dtype and got.is_contiguous()
    assert fn.calls[-1] == (seen(x), seen(got), 7, None)


def test_fake_tensors_never_replay(entry):
    """A tracer's fake tensors read through DLPack with a made-up data pointer (null, or a view's
    offset) that could match a real recording's alignment: their type and the dispatch mode
    are in the key, so they never replay. Under FakeTensorMode ops take the custom ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fn = Recorder()
    pool = torch.randn(4096)
    start = (-pool.data_ptr() % 1024) // 4
    A, B, out = (pool[start + i * 256:start + i * 256 + 64].view(8, 8) for i in range(3))  # 1024-byte aligned
    spec = recipes.Launch(fn.function, (0, 1, 2), output=2)
    recipes.record(entry, ops.GEMM_OP, spec, A, B, out, 1.0, 0.0, None, None, None, None, None)
    assert kernel_api.ops.gemm(A, B, out=out) is out and len(fn.calls) == 1
    with FakeTensorMode() as mode:
        fake_pool = mode.from_tensor(pool)
        views = [fake_pool[i * 256:i * 256 + 64].view(8, 8) for i in range(1, 4)]  # "pointers" 1024, 2048, 3072
        assert kernel_api.ops.gemm(*views[:2], out=views[2]) is views[2]
        assert type(kernel_api.ops.softmax(views[0])).__name__ == "FakeTensor"
    assert entry.replay(ops.GEMM_OP, *views, 1.0, 0.0, None, None, None, None, None) is None
    assert len(fn.calls) == 1


def test_a_launch_recipe_passes_views_and_bumps_a_given_outputs_version(entry):
    x, bias, out = torch.randn(4, 8), torch.randn(1, 8), torch.empty(4, 8)
    fn = Recorder()
    spec = recipes.Launch(fn.function, (0, 2, recipes.view(0), recipes.constant(0)), (1.5,), output=2,
                          views=((1, (8,), (1,), 0),))
    assert recipes.record(entry, OP, spec, x, bias, out)
    version = out._version
    assert entry.replay(OP, x, bias, out) is out and out._version > version
    assert fn.calls[-1] == (seen(x), seen(out), (bias.data_ptr(), (8,), (1,)), 1.5, None)
    assert entry.replay(OP, x, bias, x) is None  # an output overlapping an input


def test_a_recipe_that_raises_declines_quietly(entry):
    def broken(*args):
        raise RuntimeError("no")

    x = torch.randn(4, 4)
    recipes.record(entry, OP, recipes.Call(broken, (0,)), x)
    assert entry.replay(OP, x) is None and entry.replays() == 1
    entry.forget_replays()
    assert entry.replays() == 0


def test_record_names_what_it_cannot_take(entry):
    x = torch.randn(2, 2)
    with pytest.raises(TypeError, match="TVM-FFI function"):
        recipes.record(entry, OP, recipes.Launch(print, (0,)), x)
    with pytest.raises(ValueError, match="order names"):
        recipes.record(entry, OP, recipes.Call(torch.neg, (3,)), x)
    with pytest.raises(TypeError, match="recipe is"):
        entry.record(OP, (torch.neg,), x)


# ---- the front doors ----------------------------------------------------------------------------

def _python_path(monkeypatch) -> list:
    counted = []
    launch = ops._launch
    monkeypatch.setattr(ops, "_launch", lambda *a, **k: counted.append(a[0]) or launch(*a, **k))
    return counted


def test_ops_gemm_is_replayed_from_c_with_no_rule_of_its_own(torch_ops, monkeypatch):
    A, B, bias = torch.randn(16, 8), torch.randn(8, 24), torch.randn(24)
    out = torch.empty(16, 24)
    counted = _python_path(monkeypatch)
    calls = [lambda: kernel_api.ops.gemm(A, B), lambda: kernel_api.ops.gemm(A, B, out=out),
             lambda: kernel_api.ops.gemm(A, B, bias=bias), lambda: kernel_api.ops.gemm(A, B, bias=bias, activation="relu")]
    for call in calls:
        call()
    first = len(counted)
    for call in calls:
        with Frames() as frames:
            y = call()
        ours = [f for f in frames.of("kernel_api") if not f.startswith("kernel_api.providers.")]
        assert ours == _front_door_frames("gemm"), frames.entered  # (a provider's torch call aside)
    assert len(counted) == first
    assert torch.allclose(y, torch.relu(A @ B + bias), atol=1e-5)
    # what the key does not hold takes the Python path (and records it)
    kernel_api.ops.gemm(A, B, alpha=2.0)
    kernel_api.ops.gemm(A, B.t().contiguous().t())
    assert len(counted) == first + 2


def test_a_misaligned_allocating_gemm_is_split_by_python_and_its_parts_replayed(torch_ops):
    """`split_columns` is Python's rule alone: an allocating call it splits is never recorded whole
    (C would run one GEMM into a dense output); its two GEMMs into the padded output are, each
    replayed from C for a later call whose padded output has the recorded alignment."""
    A, B = torch.randn(256, 16), torch.randn(16, 67)
    y = kernel_api.ops.gemm(A, B)
    assert y.stride() == (68, 1) and torch.allclose(y, A @ B, atol=1e-4)  # two GEMMs into a padded output
    assert torch_ops.recipe(ops.GEMM_OP, A, B, None, 1.0, 0.0, None, None, None, None, None) is None
    for cols in (slice(None, 64), slice(64, None)):
        part = (A, B[:, cols], y[:, cols], 1.0, 0.0, None, None, None, None, None)
        assert torch_ops.recipe(ops.GEMM_OP, *part) is not None
        assert torch_ops.replay(ops.GEMM_OP, *part) is part[2]


def test_softmax_under_autograd_is_torchs_op_replayed_from_c(torch_ops, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # (torch's own op serves CUDA calls)
    x = torch.randn(8, 16, requires_grad=True)
    g = torch.randn(8, 16)
    kernel_api.ops.softmax(x)
    with Frames() as frames:
        y = kernel_api.ops.softmax(x)
    assert frames.of("kernel_api") == _front_door_frames("softmax"), frames.entered
    assert type(y.grad_fn).__name__ == "SoftmaxBackward0"
    (got,) = torch.autograd.grad(y, x, g)
    ref = torch.softmax(x.detach(), -1)
    assert torch.allclose(got, ref * (g - (g * ref).sum(-1, keepdim=True)), atol=1e-6)
    with torch.no_grad():  # another key: not the autograd recipe
        assert kernel_api.ops.softmax(x).grad_fn is None


def test_a_patched_linear_forward_enters_no_python_frame_of_ours_beyond_forward(torch_ops, monkeypatch):
    from kernel_api.nn import linear as nn_linear

    monkeypatch.setattr(nn_linear, "_check_device", lambda layer, x: None)
    layer = kernel_api.nn.Linear(16, 32)
    plain = kernel_api.nn.Linear(16, 32, bias=False)

    def repeated(module, x):
        for _ in range(2):
            module(x)
        with Frames() as frames:
            y = module(x)
        assert frames.of("kernel_api") == ["kernel_api.nn.linear.Linear.forward"], frames.entered
        bias = module.bias if module.bias is not None else 0
        assert y.shape == (*x.shape[:-1], 32) and torch.allclose(y, x @ module.weight.t() + bias, atol=1e-5)

    with torch.no_grad():
        for module in (layer, plain):
            repeated(module, torch.randn(2, 16))
            repeated(module, torch.randn(3, 2, 16))  # (a model's (batch, sequence, features) input: torch's F.linear)
        x = torch.randn(2, 16)
        layer(x)
        layer.weight.mul_(2)  # (a changed weight: its kept transpose is made anew)
        assert torch.allclose(layer(x), x @ layer.weight.t() + layer.bias, atol=1e-5)


def test_tensors_with_a_lazy_bit_never_replay_a_launch(entry):
    """DLPack cannot express torch's lazy negative or conjugate bit: a tensor carrying one is
    another key (the Python path, which refuses it, records none), also when its metadata and
    memory are a recorded tensor's, and when a verdict kept for a tensor object meets its bit."""
    fn = Recorder()
    A, B, out = torch.randn(8, 8), torch.randn(8, 8), torch.empty(8, 8)
    spec = recipes.Launch(fn.function, (0, 1, 2), output=2)
    recipes.record(entry, OP, spec, A, B, out)
    assert entry.replay(OP, A, B, out) is out
    negated = torch._neg_view(A)  # the same memory and metadata, negated lazily
    assert entry.replay(OP, negated, B, out) is None
    z, z2, zout = (torch.randn(8, 8, dtype=torch.complex64) for _ in range(3))
    recipes.record(entry, OP, spec, z, z2, zout)
    assert entry.replay(OP, z, z2, zout) is zout
    conj = z.conj()  # the same memory and metadata, conjugated lazily
    assert entry.replay(OP, conj, z2, zout) is None
    assert len(fn.calls) == 2
    for t in (negated, conj):
        with pytest.raises(ValueError, match="lazy"):
            entry.bind(fn.function, (t,), ())


def test_a_recipe_forgotten_while_it_runs_finishes(entry):
    """Python code a recipe runs may forget every recipe (clear_dispatch_cache): the replay keeps
    the one it runs until it returns."""
    x = torch.randn(4, 4)

    def forgetting(t, k):
        entry.forget_replays()
        return t * k

    recipes.record(entry, OP, recipes.Call(forgetting, (0, recipes.constant(0)), (torch.tensor(2.0),)), x)
    assert torch.equal(entry.replay(OP, x), x * 2) and entry.replays() == 0
    fn = Recorder()
    calls = []
    forget_then_record = tvm_ffi.convert(lambda *a: (calls.append(a), entry.forget_replays()))
    spec = recipes.Launch(forget_then_record, (0, 1), output=1)
    out = torch.empty(4, 4)
    recipes.record(entry, OP, spec, x, out)
    version = out._version
    assert entry.replay(OP, x, out) is out and out._version > version and len(calls) == 1 and not fn.calls


def test_an_allocating_gemm_records_its_own_recipe_beside_a_given_output_call(torch_ops, monkeypatch):
    """A call given its output and an allocating call whose new output has the same metadata share
    the Python dictionary's raw key, not the call key: the allocating call takes the Python path
    once and records its own recipe (the dictionary's entry would serve it from Python forever)."""
    from test_hardening_host_cost import aligned_like

    A, B, out = torch.randn(16, 8), torch.randn(8, 24), torch.empty(16, 24)
    for _ in range(2):
        kernel_api.ops.gemm(A, B, out=out)
    monkeypatch.setattr(ops, "_new_gemm_output", lambda A, B: aligned_like(out))  # (the raw key of out)
    y = kernel_api.ops.gemm(A, B)
    assert torch.allclose(y, A @ B, atol=1e-5)
    assert torch_ops.recipe(ops.GEMM_OP, A, B, None, 1.0, 0.0, None, None, None, None, None) is not None
    # and the other way round: a given output of an allocating call's raw key
    C, D = torch.randn(16, 8), torch.randn(8, 24)
    kernel_api.ops.gemm(C, D)
    given = aligned_like(out)
    assert kernel_api.ops.gemm(C, D, out=given) is given and torch.allclose(given, C @ D, atol=1e-5)
    assert torch_ops.recipe(ops.GEMM_OP, C, D, given, 1.0, 0.0, None, None, None, None, None) is not None
