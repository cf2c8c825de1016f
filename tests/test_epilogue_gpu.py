"""Epilogue functions fused into the GEMMs, on the GPU, against float64 references.

Every emitter (the SM90 warp-specialized GEMM, the SM80 tensor-op and SIMT GEMMs) runs one rich
epilogue (a full bf16 input, a row bias, a per-batch column scale, a runtime scalar, an extra
f32 output and a row-sum reduction) in all eight layouts, with batches, leading dimensions padded
past the extents, and every output inside a NaN-filled buffer whose padding must stay NaN. Sizes
are odd for the SIMT kernel; the TMA and cp.async kernels need contiguous extents in multiples
of 16 bytes, so theirs are multiples of 8 but of no tile. Fresh random data each run; the reference is `kernel_api.epilogue.evaluate` in
float64 on ``A.double() @ B.double()``.
"""

import itertools

import pytest
import torch

import kernel_api
from kernel_api import EpilogueArguments, GemmArguments
from kernel_api.epilogue import evaluate, parse

pytestmark = pytest.mark.gpu

#: (L, M, N, K) per emitter (the SIMT kernel takes any alignment)
SIZES = {"sm90": (2, 200, 216, 88), "sm80": (2, 200, 216, 88), "simt": (2, 197, 211, 83)}
#: (kernel class, a name part picking one configuration)
EMITTERS = {
    "sm90": ("Sm90WarpSpecializedGemm", "tile128x128x64_cluster2x1_pingpong_swz8m_epi32"),
    "sm80": ("Sm80TensorOpGemm", ""),
    "simt": ("SimtGemm", ""),
}
LAYOUTS = ["".join(p) for p in itertools.product("tn", repeat=3)]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 2e-4}
relu, sigmoid, gelu = torch.relu, torch.sigmoid, torch.nn.functional.gelu


def rich(accum, C, alpha, bias, scale):
    z = gelu(alpha * accum + bias)
    D = z * C + scale
    s = sum(z, dim=1)
    return D, z, s


def _round8(n):
    return -(-n // 8) * 8


def matrix(lead, rows, cols, layout, dtype, fill=None):
    """(..., rows, cols) in row- ("t") or column-major ("n") order inside a larger buffer (leading
    dimension padded to 8 elements past the extent, plus 8); returns (view, buffer)."""
    if layout == "t":
        buf = torch.empty(*lead, rows, _round8(cols) + 8, device="cuda", dtype=dtype)
    else:
        buf = torch.empty(*lead, cols, _round8(rows) + 8, device="cuda", dtype=dtype)
    if fill is None:
        buf.copy_(torch.randn(buf.shape, device="cuda", dtype=torch.float32))
    else:
        buf.fill_(fill)
    view = buf[..., :cols] if layout == "t" else buf[..., :rows].transpose(-1, -2)
    return view, buf


def assert_padding_untouched(buf, view):
    mask = torch.ones_like(buf, dtype=torch.bool)
    mask.as_strided(view.shape, view.stride(), view.storage_offset() - buf.storage_offset()).fill_(False)
    assert torch.isnan(buf[mask].float()).all(), "a kernel wrote outside its output"


def pick(args, emitter):
    cls, tag = EMITTERS[emitter]
    found = [k for k in kernel_api.get_kernels(args) if k.name.startswith(cls + "_") and tag in k.name]
    if not found:
        pytest.skip(f"no {cls} instance takes {args!r} on this GPU")
    return found[0]


def check(got, want, dtype, what):
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()) * 0.05,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("emitter", list(EMITTERS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rich_epilogue_every_layout(emitter, layout):
    L, M, N, K = SIZES[emitter]
    A, _ = matrix((L,), M, K, layout[0], torch.bfloat16)
    B, _ = matrix((L,), K, N, layout[1], torch.bfloat16)
    out, out_buf = matrix((L,), M, N, layout[2], torch.bfloat16, fill=float("nan"))
    z, z_buf = matrix((L,), M, N, "t", torch.float32, fill=float("nan"))
    C = torch.randn(M, N, device="cuda").bfloat16()             # shared by the batches
    bias = torch.randn(N, device="cuda")                         # one per column, f32
    scale = torch.randn(L, M, 1, device="cuda").half()           # one per row and batch
    s = torch.zeros(M, 1, device="cuda")
    ops = dict(C=C, alpha=0.75, bias=bias, scale=scale)
    args = GemmArguments(A, B, out, epilogue=EpilogueArguments(rich, z=z, s=s, **ops))
    pick(args, emitter).run(args)
    torch.cuda.synchronize()
    want = evaluate(parse(rich), A.double() @ B.double(), ops, axes={"s": "row"})
    check(out, want["D"], torch.bfloat16, "D")
    check(z, want["z"], torch.float32, "z")
    check(s.reshape(-1), want["s"], torch.float32, "s")
    assert_padding_untouched(out_buf, out)
    assert_padding_untouched(z_buf, z)


@pytest.mark.parametrize("emitter", list(EMITTERS))
def test_rank2_scalars_change_without_a_new_kernel(emitter):
    M, N, K = 129, 72, 40
    A, _ = matrix((), M, K, "t", torch.float16)
    B, _ = matrix((), K, N, "n", torch.float16)
    out, out_buf = matrix((), M, N, "t", torch.float16, fill=float("nan"))
    src = "def epi(accum, C, alpha, beta): D = sigmoid(alpha * accum) + beta * C - 0.5; return D"
    C = torch.randn(M, N, device="cuda")
    kernel = None
    for alpha, beta in ((0.5, 2.0), (-1.25, 0.0), (3.0, -1.0)):
        args = GemmArguments(A, B, out, epilogue=EpilogueArguments(src, C=C, alpha=alpha, beta=beta))
        kernel = kernel or pick(args, emitter)
        kernel.run(args)
        want = evaluate(parse(src), A.double() @ B.double(), dict(C=C, alpha=alpha, beta=beta))["D"]
        check(out, want, torch.float16, f"alpha={alpha} beta={beta}")
    assert_padding_untouched(out_buf, out)


@pytest.mark.parametrize("emitter", list(EMITTERS))
@pytest.mark.parametrize("op, init", [("sum", 0.0), ("max", float("-inf")), ("min", float("inf"))])
def test_reductions_row_column_and_scalar(emitter, op, init):
    L, M, N, K = 3, 151, 104, 64
    A, _ = matrix((L,), M, K, "t", torch.bfloat16)
    B, _ = matrix((L,), K, N, "t", torch.bfloat16)
    out, _ = matrix((L,), M, N, "t", torch.bfloat16, fill=float("nan"))
    src = (f"def epi(accum, C): x = relu(accum) - C; D = accum; r = {op}(x, dim=1); c = {op}(x, dim=0); "
           f"a = {op}(x); return D, r, c, a")
    C = torch.randn(L, 1, N, device="cuda")
    r, c, a = (torch.full(shape, init, device="cuda") for shape in ((M, 1), (N,), (1,)))
    args = GemmArguments(A, B, out, epilogue=EpilogueArguments(src, C=C, r=r, c=c, a=a))
    pick(args, emitter).run(args)
    want = evaluate(parse(src), A.double() @ B.double(), dict(C=C))
    check(out, want["D"], torch.bfloat16, "D")
    # (max / min pick one f32 element: f32 rounding of relu(accum) - C against the float64 reference)
    tol = 1e-4 if op == "sum" else 1e-6
    torch.testing.assert_close(r.reshape(-1).double(), want["r"], rtol=tol, atol=tol * 50)
    torch.testing.assert_close(c.double(), want["c"], rtol=tol, atol=tol * 50)
    torch.testing.assert_close(a.double(), want["a"], rtol=tol, atol=tol * 500)


def test_f16_accumulation_with_an_epilogue():
    M, N, K = 256, 192, 64
    A = torch.randint(-2, 3, (M, K), device="cuda").half()
    B = torch.randint(-2, 3, (K, N), device="cuda").half()
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
    src = "def epi(accum, bias): D = relu(accum + bias); return D"
    bias = torch.randn(N, device="cuda").half()
    args = GemmArguments(A, B, out, accumulator_type=torch.float16, epilogue=EpilogueArguments(src, bias=bias))
    kernels = kernel_api.get_kernels(args)
    assert kernels and all(str(k.metadata.operands.accumulator_type) == "f16" for k in kernels)
    kernels[0].run(args)
    want = evaluate(parse(src), A.double() @ B.double(), dict(bias=bias))["D"]
    check(out, want, torch.float16, "D")


def test_ops_gemm_with_an_epilogue_function():
    torch.manual_seed(1)
    M, N, K = 300, 264, 96
    A = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    C = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    z = torch.full((M, N), float("nan"), device="cuda")

    def epi(accum, C, alpha):
        z = relu(alpha * accum)
        D = z + C
        return D, z

    D = kernel_api.ops.gemm(A, B, epilogue=epi, C=C, alpha=0.5, z=z)
    want = evaluate(parse(epi), A.double() @ B.double(), dict(C=C, alpha=0.5))
    check(D, want["D"], torch.bfloat16, "D")
    check(z, want["z"], torch.float32, "z")


def test_torch_compile_traces_the_epilogue_as_a_constant():
    M, N, K = 256, 128, 64
    A = torch.randn(M, K, device="cuda", dtype=torch.float16)
    B = torch.randn(K, N, device="cuda", dtype=torch.float16)
    bias = torch.randn(N, device="cuda", dtype=torch.float16)
    src = "def epi(accum, bias, alpha): D = tanh(alpha * accum + bias); return D"

    def f(A, B, bias, alpha):
        return kernel_api.ops.gemm(A, B, epilogue=src, bias=bias, alpha=alpha) * 2.0

    compiled = torch.compile(f, fullgraph=True)
    for alpha in (0.5, 0.25):
        got = compiled(A, B, bias, alpha)
        want = 2.0 * evaluate(parse(src), A.double() @ B.double(), dict(bias=bias, alpha=alpha))["D"]
        check(got, want, torch.float16, f"alpha={alpha}")


def test_gradcheck_in_float64():
    """The op's backward (the accumulator recomputed, the epilogue differentiated with torch,
    two GEMMs) against finite differences, through the f64 fused kernel."""
    g = torch.Generator(device="cuda").manual_seed(3)

    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float64, generator=g).requires_grad_()

    A, B, C, bias = leaf(9, 7), leaf(7, 5), leaf(9, 5), leaf(5)
    src = "def epi(accum, C, bias, alpha):\n    z = tanh(alpha * accum + bias)\n    D = z * C + sigmoid(accum)\n    return D"

    def f(A, B, C, bias):
        return kernel_api.ops.gemm(A, B, epilogue=src, C=C, bias=bias, alpha=0.7)

    assert torch.autograd.gradcheck(f, (A, B, C, bias))


_SANITIZED = r"""
import torch, kernel_api
from kernel_api import EpilogueArguments, GemmArguments
torch.manual_seed(0)
src = ("def epi(accum, C, alpha, bias, scale):\n    z = gelu(alpha * accum + bias)\n    D = z * C + scale\n"
       "    s = sum(z, dim=1)\n    return D, z, s")
for cls, tag, (L, M, N, K) in (("Sm90WarpSpecializedGemm", "tile128x128x64_cluster2x1_pingpong_swz8m", (2, 200, 216, 88)),
                               ("Sm80TensorOpGemm", "", (2, 200, 216, 88)), ("SimtGemm", "", (2, 197, 211, 83))):
    A = torch.randn(L, M, K, device="cuda").bfloat16()
    B = torch.randn(L, K, N, device="cuda").bfloat16()
    out = torch.empty(L, M, N, device="cuda").bfloat16()
    ep = EpilogueArguments(src, C=torch.randn(M, N, device="cuda").bfloat16(), alpha=0.5,
                           bias=torch.randn(N, device="cuda"), scale=torch.randn(L, M, 1, device="cuda").half(),
                           z=torch.empty(L, M, N, device="cuda"), s=torch.zeros(M, 1, device="cuda"))
    args = GemmArguments(A, B, out, epilogue=ep)
    k = [k for k in kernel_api.get_kernels(args) if k.name.startswith(cls + "_") and tag in k.name][0]
    k.run(args)
    torch.cuda.synchronize()
    print("ran", k.name)
"""


def test_memcheck_every_emitter():
    """compute-sanitizer memcheck over one fused launch of each emitter (every operand its own
    allocation, odd sizes for the SIMT kernel)."""
    from memcheck import run_memcheck

    out = run_memcheck(_SANITIZED)
    assert out.count("ran ") == 3


def _input(kind, L, M, N):
    """An (M, N) epilogue input of ``kind`` inside a larger random buffer: ``bf16_row`` / ``f32_row``
    (row-major, leading dimension padded to a 16-byte multiple: SM90 loads them by TMA),
    ``f16_col`` (column-major), ``batched`` ((L, M, N) with a padded batch stride), ``misaligned``
    (one element past a 16-byte boundary: read element-wise)."""
    dtype = {"f32_row": torch.float32, "f16_col": torch.float16}.get(kind, torch.bfloat16)
    if kind == "f16_col":
        return matrix((), M, N, "n", dtype)[0]
    if kind == "batched":
        buf = torch.randn(L, M + 3, _round8(N) + 16, device="cuda").to(dtype)
        return buf[:, :M, :N]
    if kind == "misaligned":
        buf = torch.randn(M, _round8(N) + 8, device="cuda").to(dtype)
        return buf[:, 1:N + 1]
    return matrix((), M, N, "t", dtype)[0]


@pytest.mark.parametrize("config", ["tile128x128x64_cluster2x1_pingpong_swz8m", "tile128x256x64_cluster2x1_cooperative",
                                    "tile128x128x64_cluster2x1_pingpong_streamk_swz8m"])
@pytest.mark.parametrize("kind", ["bf16_row", "f32_row", "f16_col", "batched", "misaligned", "two"])
def test_sm90_whole_inputs_staged_or_elementwise(config, kind):
    """Whole (M, N) inputs of the SM90 kernel: the ones TMA can load go through shared memory
    (OperandKey.align 16), the others element-wise; several tiles per CTA (the ring's slots and
    phases wrap), edge tiles, a second input, batches."""
    L, M, N, K = 2, 1000, 1048, 136
    A, _ = matrix((L,), M, K, "t", torch.bfloat16)
    B, _ = matrix((L,), K, N, "n", torch.bfloat16)
    out, out_buf = matrix((L,), M, N, "t", torch.bfloat16, fill=float("nan"))
    if kind == "two":
        src = "def epi(accum, C, up, alpha): D = gelu(accum) * up + alpha * C; return D"
        ops = dict(C=_input("bf16_row", L, M, N), up=_input("batched", L, M, N), alpha=-0.5)
    else:
        src = "def epi(accum, C, alpha): D = alpha * accum + C; return D"
        ops = dict(C=_input(kind, L, M, N), alpha=0.5)
    args = GemmArguments(A, B, out, epilogue=EpilogueArguments(src, **ops))
    keys = args.epilogue_signature.operand_keys
    assert [k.align for k in keys if k.kind == "load"] == ([16, 16] if kind == "two" else
                                                           [2 if kind == "misaligned" else 16])
    cls, _ = EMITTERS["sm90"]
    found = [k for k in kernel_api.get_kernels(args) if k.name.startswith(cls + "_") and config in k.name]
    if not found:
        pytest.skip(f"no {cls} {config} instance takes {args!r} on this GPU")
    found[0].run(args)
    torch.cuda.synchronize()
    want = evaluate(parse(src), A.double() @ B.double(), ops)
    check(out, want["D"], torch.bfloat16, f"D ({kind}, {config})")
    assert_padding_untouched(out_buf, out)


@pytest.mark.parametrize("config", ["tile128x128x64_cluster2x1_pingpong_swz8m", "tile128x256x64_cluster2x1_cooperative"])
@pytest.mark.parametrize("kind", ["bf16_row", "f32_row", "f16_col", "misaligned"])
def test_sm90_extra_outputs_staged_or_elementwise(config, kind):
    """Extra (L, M, N) outputs of the SM90 kernel: 16-byte aligned ones are stored by TMA through
    shared memory as D is, the others element-wise; the padding around each stays untouched."""
    L, M, N, K = 2, 1000, 1048, 136
    A, _ = matrix((L,), M, K, "t", torch.bfloat16)
    B, _ = matrix((L,), K, N, "t", torch.bfloat16)
    out, out_buf = matrix((L,), M, N, "n", torch.bfloat16, fill=float("nan"))
    dtype = {"f32_row": torch.float32, "f16_col": torch.float16}.get(kind, torch.bfloat16)
    if kind == "misaligned":
        z_buf = torch.full((L, M, _round8(N) + 8), float("nan"), device="cuda", dtype=dtype)
        z = z_buf[..., 1:N + 1]
    else:
        z, z_buf = matrix((L,), M, N, "n" if kind == "f16_col" else "t", dtype, fill=float("nan"))
    src = "def epi(accum, C): z = accum + C; D = relu(z); return D, z"
    ops = dict(C=_input("bf16_row", L, M, N))
    args = GemmArguments(A, B, out, epilogue=EpilogueArguments(src, z=z, **ops))
    assert args.epilogue_signature.operand_keys[-1].align == (2 if kind == "misaligned" else 16)
    cls, _ = EMITTERS["sm90"]
    found = [k for k in kernel_api.get_kernels(args) if k.name.startswith(cls + "_") and config in k.name]
    if not found:
        pytest.skip(f"no {cls} {config} instance takes {args!r} on this GPU")
    found[0].run(args)
    torch.cuda.synchronize()
    want = evaluate(parse(src), A.double() @ B.double(), ops)
    check(out, want["D"], torch.bfloat16, f"D ({kind}, {config})")
    check(z, want["z"], dtype, f"z ({kind}, {config})")
    assert_padding_untouched(out_buf, out)
    assert_padding_untouched(z_buf, z)
