"""Epilogue functions on the CPU: the front end (functions and source strings alike), one-line
errors naming the node and its line, binding to a GEMM's operands, the structure key (scalar
values never split kernels), the float64 reference evaluator against the same function run
as torch code, metadata refusals that name the node, the traced op, and compiles of fused
kernels for sm_90a and sm_80 without a GPU (their PTX read for the fused loads, stores and
atomics)."""

import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kernel_api
from kernel_api import EpilogueArguments, GemmArguments
from kernel_api.arguments.epilogue import FusedEpilogueSignature
from kernel_api.epilogue import EpilogueError, bind, evaluate, named_graph, parse
from kernel_api.metadata import EpilogueMetadata
from kernel_api.metadata.epilogue import FUNCTION_FEATURES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
relu, sigmoid, tanh, gelu = torch.relu, torch.sigmoid, torch.tanh, torch.nn.functional.gelu


def epi_full(accum, C, alpha, bias, col):
    z = relu(alpha * accum + bias) * C
    w = sigmoid(z) - col / 2.0
    D = tanh(w) + torch.maximum(z, w)
    return D, z


def _line_of(fn, text):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


# ---- front end -------------------------------------------------------------------------------
def test_function_and_source_string_parse_to_one_structure():
    src = textwrap.dedent(inspect.getsource(epi_full))
    g1, g2 = parse(epi_full), parse(src)
    assert g1.structure == g2.structure
    assert g1.params == ("C", "alpha", "bias", "col")
    assert g1.output_names() == ("D", "z")
    # lines count in the file for a function, from 1 for a string
    assert g1.nodes[-1].line == _line_of(epi_full, "D = tanh(w)")
    assert g2.nodes[-1].line == 4


def test_one_line_statements_and_module_spellings():
    g = parse("def epi(accum, C): z = torch.relu(accum); D = F.gelu(z, approximate='tanh') * C; return D")
    kinds = [(n.kind, n.attr) for n in g.nodes]
    assert ("unary", "relu") in kinds and ("unary", "gelu_tanh") in kinds
    g = parse("def epi(accum): D = multiply_add(accum, 2.0, 1.0); m = max(accum, dim=1); return D, m")
    assert [n.kind for n in g.nodes].count("binary") == 2
    assert g.nodes[-1].attr == ("max", "row")
    g = parse("def epi(accum): D = cast(accum, 'bf16') + accum.to(torch.float16); return D")
    assert [n.attr for n in g.nodes if n.kind == "cast"] == ["bf16", "f16"]


def test_common_subexpressions_are_one_node():
    g = parse("def epi(accum): a = relu(accum); b = relu(accum); D = a + b; return D")
    assert [n.attr for n in g.nodes].count("relu") == 1


@pytest.mark.parametrize("source, line, node, words", [
    ("def epi(accum):\n    z = foo(accum)\n    D = z\n    return D", 2, "foo(accum)", "unknown function 'foo'"),
    ("def epi(accum):\n    D = accum\n    D = relu(D)\n    return D", 3, "D = relu(D)", "assigned twice"),
    ("def epi(accum):\n    z = relu(accum)\n    return z", 3, "return z", "must name D"),
    ("def epi(accum):\n    s = sum(accum)\n    D = accum + s\n    return D, s", 3, "s", "cannot feed another node"),
    ("def epi(accum):\n    D = accum ** 2\n    return D", 2, "accum ** 2", "unsupported operator Pow"),
    ("def epi(accum):\n    D = accum + q\n    return D", 2, "q", "unknown name 'q'"),
    ("def epi(accum):\n    for i in x:\n        pass\n    return accum", 2, None, "unsupported statement (For)"),
    ("def epi(x):\n    D = x\n    return D", 1, None, "first parameter must be named accum"),
    ("def epi(accum, C):\n    D = accum\n    return D, C", 3, "C", "is an input"),
    ("def epi(accum):\n    D = sum(accum, dim=1)\n    return D", 2, "sum(accum, dim=1)", "cannot be a reduction"),
    ("def epi(accum):\n    D = sum(accum, dim=2)\n    return D", 2, "sum(accum, dim=2)", "reduces along M (0), N (1)"),
    ("def epi(accum):\n    s = sum(accum)\n    D = accum\n    return D", 2, "sum(accum)", "must be returned"),
    ("def epi(accum):\n    D = relu(accum, accum)\n    return D", 2, "relu(accum, accum)", "takes 1 argument"),
    ("def epi(accum):\n    D = accum +\n    return D", 2, None, "syntax error"),
])
def test_errors_are_one_line_naming_node_and_line(source, line, node, words):
    with pytest.raises(EpilogueError) as err:
        parse(source)
    message = str(err.value)
    assert "\n" not in message and words in message, message
    assert err.value.line == line, message
    if node is not None:
        assert err.value.node == node, message
    assert f"line {line}" in message


def test_error_in_a_function_names_its_file_line():
    def bad(accum):
        D = accum.exp2()
        return D

    with pytest.raises(EpilogueError) as err:
        parse(bad)
    assert err.value.line == _line_of(bad, "accum.exp2()") and "'bad'" in str(err.value)


def test_lambda_is_refused():
    with pytest.raises(EpilogueError, match="lambda"):
        parse(lambda accum: accum)


# ---- binding and the structure key -----------------------------------------------------------
def _gemm(M=24, N=40, K=16, L=None, dtype=torch.float16):
    lead = () if L is None else (L,)
    return (torch.randn(*lead, M, K, dtype=dtype), torch.randn(*lead, K, N, dtype=dtype),
            torch.empty(*lead, M, N, dtype=dtype))


def test_broadcast_kinds_become_stride_patterns():
    A, B, out = _gemm(L=3)
    src = "def epi(accum, a, b, c, d, e, f): D = accum + a + b + c + d + e + f; return D"
    ops = dict(a=torch.randn(3, 24, 40), b=torch.randn(40), c=torch.randn(1, 40), d=torch.randn(24, 1),
               e=torch.randn(3, 24, 1), f=torch.randn(3, 1, 40).half())
    bound = bind(parse(src), ops, out, 3, 24, 40)
    assert [k.pattern for k in bound.operand_keys] == [(-1, -1, 1), (0, 0, 1), (0, 0, 1), (0, 1, 0), (-1, 1, 0),
                                                       (-1, 0, 1)]
    assert [t.shape for t in bound.operands] == [torch.Size([3, 24, 40])] * 6
    for view, given in zip(bound.operands, ops.values()):  # each view reads the broadcast values
        torch.testing.assert_close(view, torch.broadcast_to(given, (3, 24, 40)))


def test_operands_remade_for_another_call_are_what_binding_gives():
    """`operand_sources` of one binding remake, for another call's values of the same metadata,
    exactly the operands `bind` gives for them (views of the new tensors, the new scalars, the
    literals), in bind's order: parameters, extra outputs, literals."""
    from kernel_api.epilogue import operand_sources, remake_operands

    A, B, out = _gemm(L=3)
    src = ("def epi(accum, res, bias, col, alpha): Z = alpha * accum + res + bias * col + 2.5; "
           "D = relu(Z); rowmax = max(Z, dim=1); return D, Z, rowmax")

    def values():
        return dict(res=torch.randn(3, 24, 40)[:, :, :40], bias=torch.randn(40), col=torch.randn(3, 24, 1),
                    alpha=float(torch.rand(())), Z=torch.empty(3, 24, 40).half(), rowmax=torch.zeros(24, 1))

    first = bind(parse(src), values(), out, 3, 24, 40)
    sources = operand_sources(first)
    for _ in range(2):
        given = values()
        expected = bind(parse(src), given, out, 3, 24, 40).operands
        remade = remake_operands(sources, given)
        assert len(remade) == len(expected) == len(first.operands)
        for got, want in zip(remade, expected):
            if isinstance(want, torch.Tensor):
                assert (got.shape, got.stride(), got.data_ptr()) == (want.shape, want.stride(), want.data_ptr())
            else:
                assert type(got) is type(want) and got == want


def test_whole_inputs_record_their_alignment_in_the_key():
    """`OperandKey.align`: whole (M, N) inputs carry the bytes dividing their address and
    strides (16 at most: what TMA needs), broadcast vectors none; it is part of the key, scalar
    values are not."""
    A, B, out = _gemm()
    src = "def epi(accum, C, bias, alpha): D = alpha * accum + C + bias; return D"
    buf = torch.randn(24, 56)
    cases = {16: buf[:, :40], 4: buf[:, 1:41], 8: torch.randn(24, 42)[:, :40], 2: torch.randn(24, 41).half()[:, 1:]}
    keys = {}
    for align, C in cases.items():
        for alpha in (0.5, 2.0):
            bound = bind(parse(src), dict(C=C, bias=torch.randn(40), alpha=alpha), out, 1, 24, 40)
            assert [k.align for k in bound.operand_keys] == [align, None, None]
            keys.setdefault(align, set()).add(bound.key)
    assert all(len(k) == 1 for k in keys.values()) and len(set.union(*keys.values())) == len(cases)


def test_alignment_of_fake_tensors_is_their_storage_offset():
    """Under torch.compile's tracing (FakeTensors refusing ``data_ptr``) an input's alignment is
    its storage offset's (storages are allocated aligned)."""
    import torch._functorch.config as functorch_config

    src = "def epi(accum, C): D = accum + C; return D"
    strict = functorch_config.fake_tensor_allow_unsafe_data_ptr_access
    functorch_config.fake_tensor_allow_unsafe_data_ptr_access = False
    try:
        with torch._subclasses.fake_tensor.FakeTensorMode():
            out = torch.empty(24, 40)
            found = [bind(parse(src), dict(C=C), out, 1, 24, 40).operand_keys[0].align
                     for C in (torch.randn(24, 40), torch.randn(24, 41)[:, 1:])]
    finally:
        functorch_config.fake_tensor_allow_unsafe_data_ptr_access = strict
    assert found == [16, 4]


@pytest.mark.parametrize("shape, words", [((24, 41), "does not broadcast"), ((2, 24, 40), "does not broadcast"),
                                          ((1, 1, 1, 40), "rank 4")])
def test_operands_that_do_not_broadcast_are_named(shape, words):
    A, B, out = _gemm(L=3)
    with pytest.raises(EpilogueError, match=f"operand C: .*{words}"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments("def e(accum, C): D = accum * C; return D",
                                                            C=torch.randn(*shape)))


def test_operand_errors_name_the_operand():
    A, B, out = _gemm()
    src = "def e(accum, C, s): D = accum * C + s; return D"
    with pytest.raises(EpilogueError, match="operand s: not given"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(src, C=torch.randn(24, 40)))
    with pytest.raises(EpilogueError, match="operand s: expected a tensor or a number, got str"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(src, C=torch.randn(24, 40), s="x"))
    with pytest.raises(EpilogueError, match="operand C: dtype torch.int64"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(src, C=torch.ones(24, 40, dtype=torch.long), s=1))
    src = "def e(accum): D = accum; z = relu(accum); m = max(accum, dim=1); return D, z, m"
    with pytest.raises(EpilogueError, match="operand z: the function returns z"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(src, m=torch.zeros(24)))
    with pytest.raises(EpilogueError, match="operand z: an extra output has the output's shape"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(src, z=torch.empty(1, 40), m=torch.zeros(24)))
    with pytest.raises(EpilogueError, match="operand m: a reduction output must be float32"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(src, z=torch.empty(24, 40), m=torch.zeros(24).half()))
    with pytest.raises(ValueError, match="operand z: shares memory with out"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(src, z=out, m=torch.zeros(24)))


@pytest.mark.parametrize("shape, axis", [((24, 1), "row"), ((24,), "row"), ((40,), "column"), ((1, 40), "column"),
                                         ((1,), "all"), ((), "all")])
def test_reduction_axis_from_the_output_shape(shape, axis):
    A, B, out = _gemm()
    src = "def e(accum): D = accum; s = sum(accum); return D, s"
    args = GemmArguments(A, B, out, epilogue=EpilogueArguments(src, s=torch.zeros(shape)))
    assert args.epilogue_signature.operand_keys[-1].axis == axis


def test_scalar_values_and_literals_share_a_key_structure_does_not():
    A, B, out = _gemm()
    C = torch.randn(24, 40)

    def sig(src, **ops):
        return GemmArguments(A, B, out, epilogue=EpilogueArguments(src, **ops)).epilogue_signature

    s1 = sig("def e(accum, C, alpha): D = alpha * relu(accum) + C * 0.5; return D", C=C, alpha=0.25)
    s2 = sig("def f(accum, X, scale): D = scale * relu(accum) + X * 3.0; return D", C=None, X=C, scale=7.0)
    assert type(s1) is FusedEpilogueSignature and s1 == s2 and hash(s1) == hash(s2)
    assert s1 != sig("def e(accum, C, alpha): D = alpha * sigmoid(accum) + C * 0.5; return D", C=C, alpha=0.25)
    assert s1 != sig("def e(accum, C, alpha): D = alpha * relu(accum) + C * 0.5; return D", C=C.half(), alpha=1)
    assert s1 != sig("def e(accum, C, alpha): D = alpha * relu(accum) + C * 0.5; return D", C=C[0], alpha=1)
    assert s1 != sig("def e(accum, C, alpha): D = alpha * relu(accum) + C * 0.5; return D", C=C,
                     alpha=torch.ones(1))


def test_the_caller_epilogue_object_is_left_unbound():
    A, B, out = _gemm()
    ep = EpilogueArguments("def e(accum, C): D = accum + C; return D", C=torch.randn(40))
    args = GemmArguments(A, B, out, epilogue=ep)
    assert ep.bound is None and args.epilogue.bound is not None and args.epilogue is not ep
    assert repr(ep) == "EpilogueArguments(e, C=(40,))"


# ---- the reference evaluator -----------------------------------------------------------------
def test_reference_matches_the_function_run_as_torch_code():
    torch.manual_seed(0)
    acc = torch.randn(2, 24, 40, dtype=torch.float64)
    ops = dict(C=torch.randn(24, 40, dtype=torch.float64), alpha=0.7, bias=torch.randn(40, dtype=torch.float64),
               col=torch.randn(2, 24, 1, dtype=torch.float64))
    got = evaluate(parse(epi_full), acc, ops)
    want_D, want_z = epi_full(acc, **ops)
    torch.testing.assert_close(got["D"], want_D, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["z"], want_z, rtol=1e-12, atol=1e-12)


def test_reference_unary_math_against_torch():
    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    g = parse("def e(accum): a = gelu(accum); b = gelu_tanh(accum); c = silu(accum); d = hardswish(accum); "
              "h = abs(accum) + exp(-accum); D = a + b + c + d + h; return D, a, b, c, d")
    out = evaluate(g, x, {})
    F = torch.nn.functional
    torch.testing.assert_close(out["a"], F.gelu(x))
    torch.testing.assert_close(out["b"], F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(out["c"], F.silu(x))
    torch.testing.assert_close(out["d"], F.hardswish(x))


def test_reference_reductions():
    acc = torch.randn(3, 5, 7, dtype=torch.float64)
    g = parse("def e(accum): D = accum; r = sum(accum, dim=1); c = max(accum, dim=0); s = min(accum); "
              "return D, r, c, s")
    out = evaluate(g, acc, {})
    torch.testing.assert_close(out["r"], acc.sum(dim=(0, 2)))
    torch.testing.assert_close(out["c"], acc.amax(dim=(0, 1)))
    torch.testing.assert_close(out["s"], acc.min().reshape(1))


def test_named_form_builds_the_same_ir():
    acc = torch.randn(6, 10, dtype=torch.float64)
    C, bias = torch.randn(6, 10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    g = EpilogueArguments(alpha=0.5, beta=2.0, C=C, bias=bias, activation="gelu").to_graph()
    assert g.structure == named_graph(True, True, True, "gelu").structure
    got = evaluate(g, acc, dict(alpha=0.5, beta=2.0, C=C, bias=bias))["D"]
    torch.testing.assert_close(got, torch.nn.functional.gelu(0.5 * acc + 2.0 * C + bias, approximate="tanh"))
    written = parse("def epilogue(accum, alpha, beta, C, bias): D = gelu_tanh(alpha * accum + beta * C + bias); "
                    "return D")
    assert written.structure == g.structure


# ---- metadata, discovery and explain ---------------------------------------------------------
def test_metadata_names_the_node_it_cannot_fuse():
    A, B, out = _gemm()

    def epi(accum, C):
        z = relu(accum)
        D = torch.exp(z) + C
        return D

    sig = GemmArguments(A, B, out, epilogue=EpilogueArguments(epi, C=torch.randn(24, 40))).epilogue_signature
    assert EpilogueMetadata(functions=FUNCTION_FEATURES).supports(sig)
    status = EpilogueMetadata(functions=FUNCTION_FEATURES - {"exp"}).supports(sig)
    assert not status and "`torch.exp(z)`" in status.error and f"line {_line_of(epi, 'torch.exp(z)')}" in status.error
    status = EpilogueMetadata().supports(sig)
    assert not status and "fuses only the named epilogue" in status.error


def test_fused_kernels_are_found_for_sm90_and_explain_names_the_rest():
    A, B, out = _gemm(M=256, N=256, K=64)
    ep = EpilogueArguments("def e(accum, C): D = relu(accum) * C; return D", C=torch.randn(256, 256))
    args = GemmArguments(A, B, out, epilogue=ep)
    names = {k.name.split("_")[0] for k in kernel_api.get_kernels(args, cc=90)}
    assert "Sm90WarpSpecializedGemm" in names
    text = str(kernel_api.explain(args, cc=90))
    assert "fuses only the named epilogue" in text


def test_f16_accumulation_only_when_asked():
    A, B, out = _gemm(M=256, N=256, K=64)
    def accumulators(args):
        return {(type(k).__name__, str(k.metadata.operands.accumulator_type)) for k in kernel_api.get_kernels(args, cc=90)}

    plain = accumulators(GemmArguments(A, B, out))
    assert plain and all(acc != "f16" for _, acc in plain)
    asked = accumulators(GemmArguments(A, B, out, accumulator_type=torch.float16))
    assert {("Sm90WarpSpecializedGemm", "f16"), ("Sm80TensorOpGemm", "f16")} <= asked
    assert all(acc == "f16" for _, acc in asked)


# ---- ops.gemm's hook and the traced op -------------------------------------------------------
def test_gemm_keyword_errors():
    A, B, _ = _gemm()
    with pytest.raises(TypeError, match="unexpected keyword 'C2'"):
        kernel_api.ops.gemm(A, B, C2=torch.randn(24, 40))
    with pytest.raises(TypeError, match="activation= is the named epilogue's"):
        kernel_api.ops.gemm(A, B, epilogue="def e(accum): D = accum; return D", activation="relu")
    with pytest.raises(TypeError, match="alpha= given, but the epilogue function has no parameter alpha"):
        kernel_api.ops.gemm(A, B, epilogue="def e(accum): D = accum; return D", alpha=2.0)


def test_traced_gemm_epilogue_holds_the_source_as_a_constant():
    from torch.fx.experimental.proxy_tensor import make_fx

    src = "def e(accum, C, alpha): D = relu(alpha * accum) + C; return D"

    def f(A, B, C):
        return kernel_api.ops.gemm(A, B, epilogue=src, C=C, alpha=0.5)

    A, B, _ = _gemm()
    gm = make_fx(f, tracing_mode="fake")(A, B, torch.randn(24, 40))
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "gemm_epilogue" in str(n.target)]
    assert len(calls) == 1
    assert bytes.fromhex(calls[0].args[2]).decode() == src and calls[0].args[5] == ["alpha"] and calls[0].args[6] == [0.5]
    assert [tuple(v.shape) for v in calls[0].meta["val"]] == [(24, 40)]


# ---- compiles without a GPU --------------------------------------------------------------------
_COMPILE = textwrap.dedent("""
    import sys, torch, kernel_api
    from kernel_api import EpilogueArguments, GemmArguments
    cls, cc, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    A = torch.randn(2, 256, 128).bfloat16(); B = torch.randn(2, 128, 256).bfloat16(); out = torch.empty(2, 256, 256).bfloat16()
    src = ("def epi(accum, C, alpha, bias):\\n"
           "    z = gelu(alpha * accum + bias)\\n"
           "    D = z * C\\n"
           "    s = sum(z, dim=1)\\n"
           "    return D, z, s")
    ep = EpilogueArguments(src, C=torch.randn(256, 256).bfloat16(), alpha=0.5, bias=torch.randn(256),
                           z=torch.empty(2, 256, 256).half(), s=torch.zeros(256, 1))
    args = GemmArguments(A, B, out, epilogue=ep)
    ks = [k for k in kernel_api.get_kernels(args, cc=cc) if k.name.startswith(cls) and tag in k.name]
    art = ks[0].compile(args, cc=cc)
    open(sys.argv[4], "w").write(art.compiled_obj.__ptx__)
    print("compiled", ks[0].name)
""")


@pytest.mark.parametrize("cls, cc, tag, mma", [
    ("Sm90WarpSpecializedGemm", 90, "tile128x128x64_cluster2x1_pingpong_swz8m", "wgmma.mma_async"),
    ("Sm80TensorOpGemm", 80, "", "mma.sync.aligned"),
    ("SimtGemm", 80, "", "fma.rn.f32"),
])
def test_fused_epilogue_compiles_without_a_gpu(tmp_path, cls, cc, tag, mma):
    ptx_path = tmp_path / "k.ptx"
    env = {**os.environ, "PYTHONPATH": ROOT, "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(tmp_path),
           "KERNEL_API_CACHE": "0"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, cls, str(cc), tag, str(ptx_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ptx = ptx_path.read_text()
    assert f".target sm_{cc}" in ptx and mma in ptx
    assert "ld.global" in ptx                        # the bias (f32); C (bf16) too but on SM90
    if cc == 90:  # C loaded and the extra output z (f16) stored by TMA through shared memory, as D is
        assert "ldmatrix" in ptx and ptx.count("cp.async.bulk.tensor.3d.global.shared") >= 16
    else:
        assert "st.global.b16" in ptx                # the extra output z (f16)
    assert "atom.global.add.f32" in ptx or "red.global.add.f32" in ptx  # the row sum
    assert "erf" in ptx or "ex2" in ptx or "fma" in ptx


def test_sm90_staging_plan_fits_shared_memory():
    """`plan_staged`: the staged rings (2-4 input slots, output rings as deep as D's) fit in
    the shared memory with every configuration; D's ring gives room before the A/B stages do."""
    from kernel_api.core.dtypes import DataType
    from kernel_api.providers.cutedsl.gemm import sm90_warpspecialized as sm90

    for cfg in sm90.CONFIGS:
        ab0, _, tile = sm90.plan_stages(cfg, DataType.bf16, DataType.bf16)
        rings = 2 if cfg.schedule == "pingpong" else 1
        area = tile[0] * tile[1] * rings
        for inputs, outputs in ((2, 0), (0, 2), (4, 0), (2, 2), (4, 4), (6, 0)):
            ab, epi, slots, staged_out = sm90.plan_staged(cfg, DataType.bf16, DataType.bf16, inputs, outputs)
            used = (ab * (cfg.tile_mn[0] + cfg.tile_mn[1]) * sm90.K_TILE * 2 + epi * area * (2 + outputs)
                    + slots * area * inputs + 2048)
            assert used <= sm90.SM90_SMEM_BYTES, (cfg.tag, inputs, outputs)
            assert 2 <= epi <= 4 and 2 <= ab <= ab0
            assert (slots >= 2) == (inputs > 0) and slots <= sm90.MAX_INPUT_STAGES and staged_out == (outputs > 0)
    pingpong = next(c for c in sm90.CONFIGS if c.tile_mn == (128, 128) and c.schedule == "pingpong")
    assert sm90.plan_staged(pingpong, DataType.bf16, DataType.bf16, 2, 0) == (6, 2, 2, False)


_COMPILE_STAGED = textwrap.dedent("""
    import sys, torch, kernel_api
    from kernel_api import EpilogueArguments, GemmArguments
    offset, tag = int(sys.argv[1]), sys.argv[2]
    A = torch.randn(256, 128).bfloat16(); B = torch.randn(128, 256).bfloat16(); out = torch.empty(256, 256).bfloat16()
    C = torch.randn(256, 272).bfloat16()[:, offset:offset + 256]
    args = GemmArguments(A, B, out, epilogue=EpilogueArguments("def epi(accum, C): D = accum + C; return D", C=C))
    ks = [k for k in kernel_api.get_kernels(args, cc=90) if k.name.startswith("Sm90WarpSpecializedGemm") and tag in k.name]
    art = ks[0].compile(args, cc=90)
    open(sys.argv[3], "w").write(art.compiled_obj.__ptx__)
""")


@pytest.mark.parametrize("tag", ["tile128x128x64_cluster2x1_pingpong_swz8m", "tile128x256x64_cluster2x1_cooperative"])
@pytest.mark.parametrize("offset", [0, 1])
def test_sm90_loads_aligned_inputs_by_tma(tmp_path, tag, offset):
    """A 16-byte aligned bf16 input of the SM90 kernel's epilogue is loaded by TMA into shared
    memory and read back with ldmatrix (no global loads); one element off (2-byte aligned), it
    is read element-wise from global memory."""
    ptx_path = tmp_path / "k.ptx"
    env = {**os.environ, "PYTHONPATH": ROOT, "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(tmp_path),
           "KERNEL_API_CACHE": "0"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_STAGED, str(offset), tag, str(ptx_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ptx = ptx_path.read_text()
    tma_loads = ptx.count("cp.async.bulk.tensor.2d.shared::cta.global")
    if offset == 0:
        assert "ldmatrix" in ptx and "ld.global" not in ptx and tma_loads >= 8
    else:
        assert "ldmatrix" not in ptx and "ld.global" in ptx


class _Captured(Exception):
    pass


def test_dynamo_traces_gemm_with_an_epilogue_function_in_one_graph():
    """``torch.compile(fullgraph=True)`` through ops.gemm(epilogue=fn): no graph break, one
    kernel_api::gemm_epilogue node whose source is the function's (scalars as its inputs)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            raise _Captured

        return run

    def epi(accum, bias, alpha):
        z = relu(alpha * accum + bias)
        D = z * z
        return D, z

    def f(A, B, bias, z):
        return kernel_api.ops.gemm(A, B, epilogue=epi, bias=bias, alpha=0.5, z=z) + 1.0

    torch._dynamo.reset()
    A, B, _ = _gemm()
    with pytest.raises(_Captured):
        torch.compile(f, backend=backend, fullgraph=True)(A, B, torch.randn(40), torch.empty(24, 40))
    calls = [n for n in graphs[0].graph.nodes if "gemm_epilogue" in str(n.target)]
    # (the source travels as hexadecimal UTF-8: Inductor writes str arguments into generated code)
    assert len(calls) == 1 and bytes.fromhex(calls[0].args[2]).decode() == textwrap.dedent(inspect.getsource(epi))


def test_pick_any_prefers_ping_pong_tiles_for_epilogues_with_tile_io():
    """A cooperative tile runs an epilogue's (M, N) loads with no mainloop beside them: PickAny
    ranks the ping-pong tiles first for such epilogues, the plain GEMM's choice unchanged."""
    from kernel_api.tuning.pick_any import rank_candidates

    A, B, out = (torch.empty(*s, dtype=torch.bfloat16) for s in ((4096, 4096),) * 3)
    plain = GemmArguments(A, B, out)
    fused = GemmArguments(A, B, out, epilogue=EpilogueArguments("def e(accum, C): D = accum + C; return D",
                                                                C=torch.empty(4096, 4096, dtype=torch.bfloat16)))
    vector = GemmArguments(A, B, out, epilogue=EpilogueArguments("def e(accum, b): D = relu(accum + b); return D",
                                                                 b=torch.empty(4096, dtype=torch.bfloat16)))
    first = {name: rank_candidates(kernel_api.get_kernels(a, cc=90), a)[0].name
             for name, a in (("plain", plain), ("fused", fused), ("vector", vector))}
    assert "_pingpong_" in first["fused"]
    assert "_cooperative_" in first["plain"] and first["vector"] == first["plain"]
