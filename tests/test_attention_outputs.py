"""The torch provider's attention without copies, on the CPU: q, k and v reach SDPA as views (GQA
read in place, no repeated heads), outputs the op made take the backend's memory (no copy), outputs
a caller gave are written in place; repeated calls replay; and choices keyed so that a KV cache
growing by a token a step keeps its choice. Each result against the float64 reference of
tests/test_attention_op.py."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import kernel_api
from kernel_api import ops
from kernel_api.arguments import AttentionArguments, AttentionBackwardArguments
from kernel_api.arguments.attention import key_length
from kernel_api.providers.torch_ops.attention import TorchAttention, adopt

from test_attention_op import SENTINEL, _qkv, reference

#: aten ops that copy, repeat or sum tensors.
COPIES = ("aten::copy_", "aten::clone", "aten::repeat_interleave", "aten::repeat", "aten::index_select",
          "aten::cat", "aten::sum")


@pytest.fixture
def cpu_ops(monkeypatch):
    """The front door on CPU tensors, with the torch provider's kernels only."""
    from kernel_api.ops import dispatch
    monkeypatch.setattr(dispatch, "LAUNCH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    ops.clear_dispatch_cache()
    with kernel_api.settings(providers="torch"):
        yield
    ops.clear_dispatch_cache()


def python_path_runs(monkeypatch) -> list:
    """The names of the torch attention kernels whose ``_run`` (the Python path) runs from now on."""
    runs = []
    real = TorchAttention._run

    def counting(self, *rest, **named):
        runs.append(self.name)
        return real(self, *rest, **named)

    monkeypatch.setattr(TorchAttention, "_run", counting)
    return runs


def counted_choices(monkeypatch) -> list:
    """The key lengths of the problems the front door asks the registry about from now on."""
    from kernel_api.ops import dispatch
    choices = []
    real = dispatch.registry.get_kernels

    def counting(*a, **kw):
        choices.append(a[0].seqlen_k)
        return real(*a, **kw)

    monkeypatch.setattr(dispatch.registry, "get_kernels", counting)
    return choices


def _inside_a_backend(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::") and "attention" in parent.name:
            return True
        parent = parent.cpu_parent
    return False


def own_ops(fn) -> list[tuple[str, list]]:
    """(name, input shapes) of the aten ops ``fn`` ran, less those inside a backend's attention
    op (torch's own internals: SDPA's math fallback, FlashAttention-2's sum of a GQA group's key
    gradients)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return [(e.name, e.input_shapes) for e in prof.events() if e.name.startswith("aten::")
            and not _inside_a_backend(e)]


def copies_of(ran: list, *tensors: torch.Tensor) -> list:
    """The copies, repeats and sums among ``ran`` that read or write a tensor of one of
    ``tensors``' shapes, or repeat heads (whatever the shape)."""
    shapes = [list(t.shape) for t in tensors]
    return [(name, shapes_in) for name, shapes_in in ran if name in COPIES
            and (name in ("aten::repeat_interleave", "aten::repeat")
                 or any(shape in shapes for shape in shapes_in))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 9, 9, 8, 2, 16), (1, 1, 37, 4, 1, 64), (3, 5, 5, 6, 6, 8)])
def test_inference_runs_no_copy_and_no_repeated_heads(cpu_ops, dtype, shape):
    """The first call (the Python path) and the replayed ones: SDPA on views, its output handed
    to the op's out."""
    causal = shape[1] == shape[2]
    for seed in range(3):
        q, k, v = _qkv(*shape, dtype=dtype, seed=seed)
        got = []
        ran = own_ops(lambda: got.append(ops.attention(q, k, v, causal=causal)))
        assert not copies_of(ran, q, k, v), ran
        assert "aten::scaled_dot_product_attention" in [name for name, _ in ran]
        out = got[0]
        assert out.shape == q.shape and out.is_contiguous() and out.dtype == dtype
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out.double(), reference(q, k, v, causal), **tol)


def test_given_out_is_written_in_place(cpu_ops):
    """An out the caller gives keeps its memory (a copy into it), a view of a larger buffer too."""
    q, k, v = _qkv(2, 7, 11, 8, 2, 16, seed=4)
    buffer = torch.full((3, *q.shape), SENTINEL)
    for out in (torch.full_like(q, SENTINEL), buffer[1]):
        for _ in range(3):  # (the second and third replay)
            pointer = out.data_ptr()
            assert ops.attention(q, k, v, causal=True, out=out) is out
            assert out.data_ptr() == pointer
            torch.testing.assert_close(out.double(), reference(q, k, v, True), atol=2e-5, rtol=2e-5)
    assert (buffer[0] == SENTINEL).all() and (buffer[2] == SENTINEL).all()


def test_only_outputs_the_op_made_take_the_backend_memory():
    """`adopt`: a made output with the result's metadata takes its memory; otherwise a copy."""
    result = torch.randn(2, 4, 3, 8).transpose(1, 2)  # (b, s, h, d) view of (b, h, s, d)
    for made, target, shared in ((True, torch.empty(2, 4, 3, 8).transpose(1, 2), True),
                                 (False, torch.empty(2, 4, 3, 8).transpose(1, 2), False),
                                 (True, torch.empty(2, 3, 4, 8), False)):
        adopt(target, result, made)
        assert (target.data_ptr() == result.data_ptr()) == shared
        assert torch.equal(target, result)


def test_arguments_built_by_the_ops_say_whether_outputs_were_made(cpu_ops, monkeypatch):
    seen = []
    real = TorchAttention._run

    def spy(self, args, *rest, **named):
        seen.append(args.outputs_made)
        return real(self, args, *rest, **named)

    monkeypatch.setattr(TorchAttention, "_run", spy)
    q, k, v = _qkv(1, 4, 4, 2, 2, 8, seed=5)
    ops.attention(q, k, v)
    ops.attention(q, k, v, out=torch.empty_like(q))
    assert seen == [True, False]
    assert AttentionArguments(q, k, v, torch.empty_like(q)).outputs_made is False


def test_repeated_calls_replay(cpu_ops, monkeypatch):
    """After the first call the launch is replayed: no arguments built, no `Kernel.run` (a call
    given its out: the same out's metadata each time; calls making theirs are keyed by the
    alignments their outputs take too)."""
    runs = python_path_runs(monkeypatch)
    q, k, v = _qkv(2, 6, 6, 8, 2, 16, seed=6)
    out = torch.full_like(q, SENTINEL)
    first = ops.attention(q, k, v, causal=True).clone()
    runs.clear()
    for _ in range(5):
        assert ops.attention(q, k, v, causal=True, out=out) is out
        torch.testing.assert_close(out, first)
    assert len(runs) == 1, runs


def test_repeated_calls_making_their_outputs_replay(cpu_ops, monkeypatch):
    """Calls that make their output replay too, although the kernel hands that output the
    backend's memory: the replay keys the alignment of the output it made (read before the
    launch), not of the memory the kernel put there, so each alignment the allocator gives the
    made output runs the Python path once at most."""
    runs = python_path_runs(monkeypatch)
    q, k, v = _qkv(2, 6, 6, 8, 2, 16, seed=9)
    first = ops.attention(q, k, v, causal=True).clone()
    kept = []
    for _ in range(40):
        got = ops.attention(q, k, v, causal=True)
        torch.testing.assert_close(got, first)
        kept.append(got)  # (kept alive: the allocator gives each call new addresses)
    assert len(runs) <= 5, runs


def test_backward_gradients_against_float64(cpu_ops):
    """The training step on the CPU (the materialised kernels) with GQA, gradients from the op."""
    from test_attention_op import reference_grads
    q, k, v = _qkv(2, 9, 9, 8, 2, 16, torch.float64, seed=7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    out = ops.attention(*leaves, causal=True)
    got = torch.autograd.grad(out, leaves, grad)
    for g, want in zip(got, reference_grads(q, k, v, grad, True)):
        torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-6)  # (the saved lse is float32)


# ---- choices of a growing KV cache ----

def test_key_length_buckets_keys_past_the_queries():
    assert [key_length(4, n) for n in (0, 3, 4)] == [0, 3, 4]
    assert key_length(1, 2) == -1 and key_length(1, 129) == key_length(1, 256) == -8
    assert key_length(1, 257) == -9 and key_length(4, 5) == -3
    assert len({key_length(1, n) for n in range(2, 4097)}) == 12


def test_problem_keys_keep_what_support_depends_on():
    """Equal, fewer and more keys than queries stay apart (cuDNN's causal mask takes equal lengths
    only); keys past the queries share a key within a power of two."""
    def key(sq, sk, cls=AttentionArguments):
        q, k, v = _qkv(1, sq, sk, 4, 2, 16)
        if cls is AttentionArguments:
            return cls(q, k, v, torch.empty_like(q), causal=True).problem_key()
        return cls(q, q, k, v, q, torch.zeros(1, 4, sq), torch.empty_like(q), torch.empty_like(k),
                   torch.empty_like(v), causal=True).problem_key()

    for cls in (AttentionArguments, AttentionBackwardArguments):
        assert len({key(8, 7, cls), key(8, 8, cls), key(8, 9, cls)}) == 3
        assert key(1, 129, cls) == key(1, 200, cls) == key(1, 256, cls) != key(1, 257, cls)


@pytest.mark.parametrize("sq", [1, 3])
def test_a_growing_kv_cache_keeps_its_choice(cpu_ops, monkeypatch, sq):
    """Decode steps over a cache growing by one token: one choice per power of two of keys, each
    result against float64."""
    choices = counted_choices(monkeypatch)
    g = torch.Generator().manual_seed(9)
    cache_k, cache_v = torch.randn(2, 80, 2, 16, generator=g), torch.randn(2, 80, 2, 16, generator=g)
    for n in range(40, 80):
        q = torch.randn(2, sq, 8, 16, generator=g)
        out = ops.attention(q, cache_k[:, :n], cache_v[:, :n], causal=True)
        torch.testing.assert_close(out.double(), reference(q, cache_k[:, :n], cache_v[:, :n], True),
                                   atol=2e-5, rtol=2e-5)
    assert choices == [40, 65], choices


# ---- whether torch's cuDNN attention reads GQA in place: the check of its answer ----

def _round_trip(q, k, v, grad, tile=False):
    """(out, lse, grad_q, grad_k, grad_v) of causal attention with SDPA and autograd; ``tile``
    maps q head h to k/v head h % heads_kv (a wrong GQA reading)."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat(1, groups, 1, 1) for t in (k, v)) if tile and groups > 1 else (k, v)
    out = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True,
                                                           enable_gqa=kk.shape[1] != q.shape[1])
    grads = torch.autograd.grad(out, (q, k, v), grad.float())
    return (out.detach(), out.detach().sum(-1), *grads)


def test_gqa_answer_is_checked_against_repeated_heads():
    from kernel_api.providers.torch_ops.attention import gqa_agrees
    g = torch.Generator().manual_seed(10)
    q, k, v, grad = (torch.randn(1, heads, 16, 8, generator=g) for heads in (4, 2, 2, 4))
    assert gqa_agrees(_round_trip, q, k, v, grad)
    assert not gqa_agrees(lambda *t: _round_trip(*t, tile=True), q, k, v, grad)
