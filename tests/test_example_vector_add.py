"""examples/vector_add, the operation docs/adding-an-operation.md walks through: its kernels are
found for matching arguments and refused, with the reason, for the rest; they compile for sm_90a
without a GPU and (on a GPU) compute ``x + y``. The doc's code snippets are the example's code."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

import kernel_api
from kernel_api import Arguments, SoftmaxArguments
from kernel_api.errors import CompilationError, DeviceError, NoKernelFoundError
from kernel_api.providers.cutedsl import CuTeDSLProvider

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DOC = ROOT / "docs" / "adding-an-operation.md"
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@pytest.fixture(scope="module")
def va():
    """The example package, imported from examples/ (it is no part of kernel_api) and registered
    for this module's tests only."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import vector_add
    finally:
        sys.path.remove(str(EXAMPLES))
    if vector_add.CuteVectorAdd not in CuTeDSLProvider.kernel_classes():
        CuTeDSLProvider.register(vector_add.CuteVectorAdd)  # (unregistered by an earlier module run)
    yield vector_add
    CuTeDSLProvider.unregister(vector_add.CuteVectorAdd)


def _args(va, n, dtype=torch.float16, device="cpu"):
    x = torch.randn(n, device=device).to(dtype)
    return va.VectorAddArguments(x, torch.randn(n, device=device).to(dtype), torch.empty_like(x))


def _names(args):
    return [k.metadata.kernel_name for k in kernel_api.get_kernels(args, providers="cutedsl")]


# ---- the package is an example, not part of kernel_api -------------------------------------------

def test_examples_are_not_part_of_kernel_api(va):
    package = Path(kernel_api.__file__).parent
    assert Path(va.__file__).resolve().parent == EXAMPLES / "vector_add"
    assert importlib.util.find_spec("kernel_api.examples") is None
    assert not (EXAMPLES / "__init__.py").exists()  # examples/ itself is no package
    # Nothing in kernel_api imports it, and the install's package list leaves it out.
    assert not [p for p in package.rglob("*.py") if "vector_add" in p.read_text()]
    from setuptools import find_packages

    installed = find_packages(str(ROOT), include=["kernel_api*"])
    assert "kernel_api" in installed and not [p for p in installed if "vector_add" in p or "examples" in p]
    assert 'include = ["kernel_api*"]' in (ROOT / "pyproject.toml").read_text()


# ---- the Arguments contract ----------------------------------------------------------------------

def test_arguments_fill_every_slot_the_base_declares(va):
    """Kernel.run keeps its state in Arguments' private slots; a subclass that leaves one unset
    loses the bound launch or fails in run. Checks the example against the base as it is."""
    args = _args(va, 1000)
    for slot in Arguments.__slots__:
        getattr(args, slot)  # AttributeError: the example no longer sets a slot the base declares
    assert not hasattr(args, "__dict__")  # slotted, like kernel_api's own arguments
    assert list(args.tensor_attributes) == ["x", "y", "out"]  # the order kernels take them
    assert args.device == torch.device("cpu") and args.device_index == -1
    assert args.signature[-1] == -1 and hash(args.signature) == hash(_args(va, 8).signature)
    assert args.tensor_attributes["x"].divisibility == 8  # 1000 = 8 * 125; torch aligns its allocations


def test_construction_refuses_mismatches_naming_the_operand(va):
    x = torch.randn(7, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"operand y: shape \(8,\) must equal x's \(7,\)"):
        va.VectorAddArguments(x, torch.randn(8, dtype=torch.float16), torch.empty_like(x))
    with pytest.raises(TypeError, match=r"operand out: dtype torch.float32 must equal x's torch.float16"):
        va.VectorAddArguments(x, x.clone(), torch.empty(7))
    with pytest.raises(ValueError, match=r"operand x: expected a 1-D tensor, got shape \(2, 3\)"):
        va.VectorAddArguments(torch.randn(2, 3), torch.randn(2, 3), torch.empty(2, 3))
    with pytest.raises(ValueError, match=r"operand y: must be contiguous, got stride 2"):
        va.VectorAddArguments(x, torch.randn(14, dtype=torch.float16)[::2], torch.empty_like(x))
    with pytest.raises(TypeError, match=r"operand x: torch dtype torch.complex64 is not supported"):
        c = torch.zeros(4, dtype=torch.complex64)
        va.VectorAddArguments(c, c, c.clone())
    with pytest.raises(TypeError, match=r"operand y: expected a torch.Tensor, got list"):
        va.VectorAddArguments(x, [1.0] * 7, torch.empty_like(x))


def test_check_memory_refuses_a_partly_overlapping_output(va):
    buf = torch.randn(16)
    x, y = buf[:8], torch.randn(8)
    va.VectorAddArguments(x, y, x).check_memory()  # in place: each element read before it is written
    with pytest.raises(ValueError, match="operand out: overlaps operand x"):
        va.VectorAddArguments(x, y, buf[4:12]).check_memory()


# ---- discovery and explanation --------------------------------------------------------------------

@pytest.mark.parametrize("dtype, vec", [(torch.float16, 8), (torch.bfloat16, 8), (torch.float32, 4),
                                        (torch.float64, 2)])
def test_kernels_are_found_for_matching_arguments(va, dtype, vec):
    short = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64"}[dtype]
    args = _args(va, 4096, dtype)
    assert _names(args) == [f"CuteVectorAdd_{short}_v{vec}", f"CuteVectorAdd_{short}_v1"]
    kernels = kernel_api.get_kernels(args)
    assert kernel_api.PickAny().choose(args, kernels) in kernels  # how a caller without a front door chooses


def test_an_odd_length_leaves_only_the_scalar_kernel_and_explain_says_why(va):
    args = _args(va, 7, torch.bfloat16)
    assert _names(args) == ["CuteVectorAdd_bf16_v1"]
    reasons = {r.kernel_name: r.reason for r in kernel_api.explain(args, providers="cutedsl")
               if r.kernel_name and r.kernel_name.startswith("CuteVectorAdd")}
    assert re.search(r"operand x: aligned to 1 element\(s\) but the kernel needs 8.*x.shape\[0\]=7 not a multiple of 8",
                     reasons["CuteVectorAdd_bf16_v8"]), reasons["CuteVectorAdd_bf16_v8"]
    assert "operand x: dtype bf16 but the kernel takes f16" in reasons["CuteVectorAdd_f16_v1"]


def test_an_unsupported_dtype_finds_no_kernel_and_the_error_names_the_operand(va):
    i32 = torch.arange(8, dtype=torch.int32)
    args = va.VectorAddArguments(i32, i32, torch.empty_like(i32))
    assert kernel_api.get_kernels(args) == []
    error = kernel_api.registry.no_kernel_error(args)
    assert isinstance(error, NoKernelFoundError)
    assert "operand x: dtype i32 but the kernel takes f16" in str(error)


def test_the_kernels_refuse_other_operations_arguments(va):
    kernel = kernel_api.get_kernels(_args(va, 64))[0]
    x = torch.randn(4, 64)
    status = kernel.supports(SoftmaxArguments(x, torch.empty_like(x)))
    assert not status and "kernel takes VectorAddArguments, got SoftmaxArguments" in status.error
    # ... and the other operations' kernels refuse vector add arguments the same way.
    assert "for VectorAddArguments: CuteVectorAdd" in str(kernel_api.explain(SoftmaxArguments(x, torch.empty_like(x))))


def test_supports_checks_the_32_bit_extent(va):
    kernel = kernel_api.get_kernels(_args(va, 64))[-1]  # the scalar kernel: any length
    big = torch.empty(2**31, dtype=torch.float16, device="meta")
    status = kernel.supports(va.VectorAddArguments(big, big, torch.empty_like(big)))
    assert not status and "exceeds the 32-bit extent" in status.error


# ---- compile without a GPU -----------------------------------------------------------------------

def test_compile_for_sm90a_without_a_gpu(va):
    args = _args(va, 4096, torch.float16)
    kernels = kernel_api.get_kernels(args, cc=90)
    assert [k.metadata.design.vec for k in kernels] == [8, 1]
    for kernel in kernels:
        artifact = kernel.compile(args, cc=90)
        assert artifact.cc == 90 and artifact.kernel is kernel and artifact.compiled_obj is not None
    with pytest.raises(CompilationError, match="cannot compile for compute capability 75"):
        kernels[0].compile(args, cc=75)  # below the family's min_cc


def test_run_without_cuda_tensors_says_so(va):
    args = _args(va, 16)
    kernel = kernel_api.get_kernels(args)[0]
    with pytest.raises(DeviceError, match="operand x is on cpu"):
        kernel.run(args)


# ---- the doc shows the example's code ------------------------------------------------------------

_SNIPPET = re.compile(r"<!-- from (\S+) -->\n```python\n(.*?)```", re.S)


def _appears_in_order(snippet: str, text: str) -> bool:
    """Whether the snippet's pieces (separated by lines reading ``...``) are runs of consecutive
    lines of ``text``, in order."""
    lines = text.splitlines()
    start = 0
    for piece in re.split(r"^\s*(?:# )?\.\.\.\s*$\n?", snippet, flags=re.M):
        want = piece.strip("\n").splitlines()
        if not want:
            continue
        for i in range(start, len(lines) - len(want) + 1):
            if lines[i:i + len(want)] == want:
                start = i + len(want)
                break
        else:
            return False
    return True


def test_the_docs_snippets_are_the_examples_code():
    doc = DOC.read_text()
    snippets = _SNIPPET.findall(doc)
    assert len(snippets) >= 5, "docs/adding-an-operation.md lost its '<!-- from path -->' snippet markers"
    for path, snippet in snippets:
        assert _appears_in_order(snippet, (ROOT / path).read_text()), f"a snippet from {path} is not its code:\n{snippet}"
    for link in re.findall(r"\]\((\.\./[^)#]+)\)", doc):  # the files the doc links to exist
        assert (DOC.parent / link).resolve().exists(), link


def test_the_snippet_check_can_fail():
    assert _appears_in_order("a\n...\nc\n", "a\nb\nc\n")
    assert not _appears_in_order("a\nc\n", "a\nb\nc\n")
    assert not _appears_in_order("c\n...\na\n", "a\nb\nc\n")


# ---- run on a GPU --------------------------------------------------------------------------------

SENTINEL = 4096.0  # exactly representable in every dtype here, and far from any sum of randn values


def _sentinel_buffer(n, dtype, offset):
    """``out`` of length ``n`` inside a buffer filled with SENTINEL, ``offset`` elements in, and
    the buffer (to check that nothing around ``out`` was written)."""
    buf = torch.full((n + offset + 64,), SENTINEL, dtype=dtype, device="cuda")
    return buf[offset:offset + n], buf


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, offset", [(1, 0), (7, 0), (1000, 0), (4099, 0), (65536, 0), (1 << 20, 8), (1001, 1),
                                       (4096, 3)])
def test_every_kernel_computes_x_plus_y(va, dtype, n, offset):
    """Every kernel that takes the arguments (the vectorised one where length and alignment
    allow, the scalar one always; offset views are misaligned) writes x + y and nothing else."""
    torch.manual_seed(n + offset)
    x = torch.randn(n + offset, device="cuda", dtype=torch.float64).to(dtype)[offset:]
    y = torch.randn(n + offset, device="cuda", dtype=torch.float64).to(dtype)[offset:]
    kernels = kernel_api.get_kernels(va.VectorAddArguments(x, y, _sentinel_buffer(n, dtype, offset)[0]))
    vec = 16 // x.element_size()  # torch's allocations are aligned far beyond 16 bytes
    vectorised = n % vec == 0 and offset % vec == 0
    assert [k.metadata.design.vec > 1 for k in kernels] == ([True, False] if vectorised else [False])
    for kernel in kernels:
        expected = (x.double() + y.double()).to(dtype)
        out, buf = _sentinel_buffer(n, dtype, offset)
        args = va.VectorAddArguments(x, y, out)
        kernel.run(args, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=lambda m: f"{kernel.metadata.kernel_name}: {m}")
        assert (buf[:offset] == SENTINEL).all() and (buf[offset + n:] == SENTINEL).all(), kernel.metadata.kernel_name
        # Run the same arguments again with new data written into the same tensors.
        x.copy_(torch.randn(n, device="cuda", dtype=torch.float64).to(dtype))
        kernel.run(args)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, (x.double() + y.double()).to(dtype), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_and_empty(va, dtype):
    x = torch.randn(333, device="cuda", dtype=torch.float64).to(dtype)
    y = torch.randn(333, device="cuda", dtype=torch.float64).to(dtype)
    expected = (x.double() + y.double()).to(dtype)
    args = va.VectorAddArguments(x, y, x)
    kernel_api.get_kernels(args)[0].run(args)
    torch.cuda.synchronize()
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    empty = torch.empty(0, device="cuda", dtype=dtype)
    args = va.VectorAddArguments(empty, empty, empty.clone())
    for kernel in kernel_api.get_kernels(args):
        kernel.run(args)  # nothing to launch
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.float32))
def test_the_generated_operation_runs_through_ops_call_and_torch_compile(va, dtype):
    """The operation's description (vector_add/operation.py) is all it takes: ops.call runs its
    arguments, its generated function runs eagerly and under torch.compile(fullgraph=True)."""
    kernel_api.ops.clear_dispatch_cache()
    x = torch.randn(4099, device="cuda", dtype=torch.float64).to(dtype)
    y = torch.randn(4099, device="cuda", dtype=torch.float64).to(dtype)
    expected = (x.double() + y.double()).to(dtype)
    out = torch.full_like(x, SENTINEL)
    assert kernel_api.ops.call(va.VectorAddArguments(x, y, out)) is out
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(va.add(x, y), expected, rtol=0, atol=0)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda a, b: va.add(a, b), fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x, y), expected, rtol=0, atol=0)
    assert any("kernel_api_examples.vector_add" in str(n.target) for n in graphs[0].graph.nodes)
    torch.testing.assert_close(torch.compile(lambda a, b: va.add(a, b), fullgraph=True)(x, y), expected,
                               rtol=0, atol=0)  # inductor: the op stays a call of its implementation
