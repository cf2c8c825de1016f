"""The "torch" provider (PyTorch's GEMM and softmax as kernels), PickAny's ranking of it, and
``kernel_api.settings(providers=...)``. GPU tests (marked) run the kernels and the front door."""

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments, get_kernels, ops
from kernel_api.providers.torch_ops.kernels import TorchGemm, TorchSoftmax, TorchSoftmaxBackward
from kernel_api.tuning.policies import rank_candidates
from kernel_api.tuning.settings import current


def _gemm_args(M, N, K, dtype=torch.bfloat16, b_col=True, device="cpu", epilogue=None):
    A = torch.empty(M, K, dtype=dtype, device=device)
    B = torch.empty(N, K, dtype=dtype, device=device).t() if b_col else torch.empty(K, N, dtype=dtype, device=device)
    return GemmArguments(A, B, torch.empty(M, N, dtype=dtype, device=device), epilogue=epilogue)


def _ranked(args):
    return [k.metadata.kernel_name for k in rank_candidates(get_kernels(args, cc=90), args)]


def test_torch_provider_is_listed_beside_ours_for_every_layout_and_dtype():
    assert "torch" in kernel_api.available_providers()
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for b_col in (False, True):
            args = _gemm_args(37, 53, 29, dtype, b_col)  # odd: no alignment at all
            torch_kernels = [k for k in get_kernels(args, cc=90) if k.metadata.provider == "torch"]
            assert [type(k) for k in torch_kernels] == [TorchGemm]
    # column-major output, fused epilogue, batched
    A, B = torch.empty(3, 8, 16), torch.empty(3, 16, 24)
    out = torch.empty(3, 24, 8).transpose(-1, -2)
    epi = kernel_api.EpilogueArguments(alpha=2.0, bias=torch.empty(24), activation="silu")
    assert any(k.metadata.provider == "torch" for k in get_kernels(GemmArguments(A, B, out, epilogue=epi), cc=90))
    for dtype in (torch.bfloat16, torch.float64):
        x = torch.empty(5, 7, dtype=dtype)
        assert [type(k) for k in get_kernels(SoftmaxArguments(x, torch.empty_like(x)), cc=90, providers="torch")] \
            == [TorchSoftmax]
        assert [type(k) for k in get_kernels(SoftmaxBackwardArguments(x, x, torch.empty_like(x)), cc=90,
                                             providers=["torch"])] == [TorchSoftmaxBackward]


def test_torch_kernels_compile_to_nothing_without_a_gpu():
    args = _gemm_args(64, 64, 64)
    kernel = get_kernels(args, cc=90, providers="torch")[0]
    artifact = kernel.compile(args, cc=90)
    assert artifact.compiled_obj is None and artifact.kernel is kernel
    assert kernel.get_workspace_size(args) == 0
    # tile filters pass the library's instances over instead of failing on them
    assert not get_kernels(args, cc=90, providers="torch", metadata_filter=lambda m: m.design.tile_shape[0] == 128)


@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 14336, 4096),
                                   (16384, 16384, 1024), (2048, 2048, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pickany_keeps_our_tensor_core_kernels_first_where_their_tiles_fill_the_waves(shape, dtype):
    """The aligned GEMM shapes of benchmarks/gemm_shapes.py (PickBest's Sm90 matched cuBLAS within 3% there): ours."""
    names = _ranked(_gemm_args(*shape, dtype=dtype))
    first_torch = next(i for i, n in enumerate(names) if n.startswith("TorchGemm"))
    first_simt = next(i for i, n in enumerate(names) if n.startswith("SimtGemm"))
    assert names[0].startswith("Sm90"), names[:3]
    assert first_torch < first_simt  # cuBLAS above the SIMT fallback even here


@pytest.mark.parametrize("shape,b_col", [((3072, 768, 8192), False),
                                         ((64, 2304, 768), False), ((64, 768, 3072), False),
                                         ((128, 8192, 8192), True)])
def test_pickany_takes_cublas_where_our_tiles_leave_sms_idle(shape, b_col):
    """GPT-2's mlp.c_proj dW (K = 8192, few output tiles: cuBLAS 0.68x the time of our 128x128
    and 128x256 tiles on the H200; 0.84x that of the 128x160 tile on the H100), decode
    projections (M = 64) and a thin prefill: cuBLAS splits K where whole tiles cannot fill the
    SMs, which the tile model charges our kernels for. (c_fc's dW, 768x3072x8192, takes the
    128x160 tile: 120 tiles, one wave, 1.00x cuBLAS on the H200 and 0.97x on the
    H100; tests/test_gemm_selection_replay.py.)"""
    M, N, K = shape
    if shape[2] == 8192 and not b_col:  # dW = X^T @ dY: A column-major
        A = torch.empty(K, M, dtype=torch.bfloat16).t()
        args = GemmArguments(A, torch.empty(K, N, dtype=torch.bfloat16), torch.empty(M, N, dtype=torch.bfloat16))
    else:
        args = _gemm_args(M, N, K, b_col=b_col)
    assert _ranked(args)[0].startswith("TorchGemm")


@pytest.mark.parametrize("shape", [(256, 384, 512), (512, 512, 768), (384, 256, 1000)])
def test_pickany_takes_cublas_for_small_problems_it_would_not_split(shape):
    """A few output tiles over a short K: cuBLAS takes them whole, with no split-K reduction to
    pay for (a split keeps at least `TORCH_SPLIT_K_MIN_PIECE` of K per piece). A split-K term
    without that floor charged 256 x 384 x 512 33 splits, which ranked our tile kernel first and failed
    test_front_door_honours_settings_providers on the H200."""
    M, N, K = shape
    assert _ranked(_gemm_args(M, N, K))[0].startswith("TorchGemm")


def test_pickany_keeps_our_tensor_cores_first_for_an_unaligned_output():
    """GPT-2's lm_head at a decode batch (N = 50257: output rows of odd length): our Sm80 family
    writes any output alignment (measured 0.04 ms against cuBLAS's alignment-1 kernel, 0.16 ms),
    and Sm90RealignedGemm stages only the 6 MB output around the wgmma kernel."""
    names = _ranked(_gemm_args(64, 50257, 768))
    assert names[0].startswith(("Sm80", "Sm90Realigned")), names[:3]
    assert names.index(next(n for n in names if n.startswith("TorchGemm"))) < \
        names.index(next(n for n in names if n.startswith("SimtGemm")))


@pytest.mark.parametrize("shape", [(1001, 1003, 999), (129, 257, 65), (4096, 4096, 4095), (8191, 768, 3071)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pickany_prefers_torch_to_simt_where_simt_is_our_only_kernel(shape, dtype):
    # (f32: 3xTF32 takes any alignment too; its place is the next test's. f16/bf16:
    # Sm90RealignedGemm too, ranked in test_gemm_realigned.py. The one place SIMT leads,
    # bf16 problems of a few microseconds, is test_unaligned_cost_models.py's.)
    names = [n for n in _ranked(_gemm_args(*shape, dtype=dtype))
             if "_tf32x3_" not in n and not n.startswith("Sm90RealignedGemm")]
    assert names[0].startswith("TorchGemm"), names[:3]
    assert all(n.startswith("SimtGemm") for n in names[1:])



def test_settings_providers_restricts_and_keys_the_front_door_caches():
    base = current()
    assert base.providers is None and base.policy_id == id(base.policy)  # unrestricted: keyed as before
    with kernel_api.settings(providers=["cutedsl", "cuda_src"]) as ours:
        assert ours.providers == ("cuda_src", "cutedsl") and ours.policy is base.policy
        assert ours.policy_id != base.policy_id
        with kernel_api.settings(num_workers=2) as inner:  # inherited, same cache key
            assert inner.providers == ours.providers and inner.policy_id == ours.policy_id
    with kernel_api.settings(providers=["cuda_src", "cutedsl", "cutedsl"]) as again:
        assert again.policy_id == ours.policy_id  # a scope entered again reuses its choices
    with kernel_api.settings(providers="torch") as theirs:
        assert theirs.policy_id not in (base.policy_id, ours.policy_id)
    with kernel_api.settings(policy=kernel_api.PickAny(), providers=["torch"]) as other:
        assert other.policy_id != theirs.policy_id
    with pytest.raises(ValueError, match="unknown provider 'cublas'"):
        with kernel_api.settings(providers=["cublas"]):
            pass
    with pytest.raises(ValueError, match="at least one"):
        with kernel_api.settings(providers=[]):
            pass
    assert current() is base


# ---- GPU ------------------------------------------------------------------------------------
def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("bias_kind", [None, "row", "column"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_torch_gemm_runs_every_epilogue(dtype, bias_kind, activation):
    M, N, K = 96, 80, 72
    A = torch.randn(M, K, device="cuda", dtype=dtype)
    B = torch.randn(N, K, device="cuda", dtype=dtype).t()
    C = torch.randn(M, N, device="cuda", dtype=dtype)
    bias = {None: None, "row": torch.randn(N, device="cuda", dtype=dtype),
            "column": torch.randn(M, 1, device="cuda", dtype=dtype)}[bias_kind]
    for alpha, beta in ((1.0, 0.0), (0.5, 0.25)):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)  # sentinel
        epi = kernel_api.EpilogueArguments(alpha=alpha, beta=beta, C=C if beta else None, bias=bias,
                                           activation=activation)
        args = GemmArguments(A, B, out, epilogue=epi)
        kernel = get_kernels(args, providers="torch")[0]
        kernel.run(args)
        torch.cuda.synchronize()
        z = alpha * (A.double() @ B.double()) + (beta * C.double() if beta else 0)
        if bias is not None:
            z = z + bias.double()
        ref = {None: z, "relu": torch.relu(z), "gelu": torch.nn.functional.gelu(z, approximate="tanh"),
               "silu": torch.nn.functional.silu(z)}[activation]
        # (f64: cuBLASLt's fused tanh-GELU rounds differently from torch's, ~1e-11 relative)
        assert _rel(out, ref) <= {torch.bfloat16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-10}[dtype]


@pytest.mark.gpu
def test_torch_softmax_forward_and_backward_run():
    x = torch.randn(33, 1000, device="cuda", dtype=torch.float32)
    out = torch.full_like(x, float("nan"))
    args = SoftmaxArguments(x, out)
    get_kernels(args, providers="torch")[0].run(args)
    ref = torch.softmax(x.double(), -1)
    g = torch.randn_like(x)
    grad_in = torch.full_like(x, float("nan"))
    bargs = SoftmaxBackwardArguments(g, out, grad_in)
    get_kernels(bargs, providers="torch")[0].run(bargs)
    torch.cuda.synchronize()
    assert _rel(out, ref) <= 1e-5
    assert _rel(grad_in, ref * (g.double() - (g.double() * ref).sum(-1, keepdim=True))) <= 1e-5


@pytest.mark.gpu
def test_front_door_honours_settings_providers():
    from kernel_api.ops import dispatch
    ops.clear_dispatch_cache()
    A = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    ref = A.double() @ B.double()

    def kernel_used():
        # the entry of the one choice in the cache for the current scope
        token = current().scope_token
        return [found[0] for key, found in dispatch._dispatch.items() if key[0] == id(token)]

    for _ in range(2):  # the second round comes from the caches: each scope keeps its own choice
        with kernel_api.settings(providers=["torch"]):
            assert _rel(ops.gemm(A, B), ref) <= 1e-2
            assert ops.gemm(A, B).shape == (256, 384)
            assert [k.metadata.provider for k in kernel_used()] == ["torch"]
        with kernel_api.settings(providers=["cutedsl", "cuda_src"]):
            assert _rel(ops.gemm(A, B), ref) <= 1e-2
            assert [k.metadata.provider for k in kernel_used()] in (["cutedsl"], ["cuda_src"])
    # the default (all providers) keeps our tensor-core kernel where its tiles fill the waves,
    # and takes cuBLAS for this small problem (6 output tiles on 132 SMs)
    ops.gemm(A, B)
    assert kernel_used()[0].metadata.provider == "torch"
    A1 = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    B1 = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    ops.gemm(A1, B1)
    assert any(k.metadata.provider == "cutedsl" for k in kernel_used())
    # an odd shape (only SIMT of ours fits) goes to torch by default
    A2 = torch.randn(101, 77, device="cuda", dtype=torch.bfloat16)
    B2 = torch.randn(77, 55, device="cuda", dtype=torch.bfloat16)
    assert _rel(ops.gemm(A2, B2), A2.double() @ B2.double()) <= 1e-2
    assert any(type(k) is TorchGemm for k in kernel_used())


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_torch_gemm_launcher_takes_each_calls_bias_and_stream(activation):
    """Repeated front-door calls with torch's kernel come from ops' fast dictionary (TorchGemm's
    launcher): each call's own bias and values, on the stream asked for."""
    from kernel_api.ops import dispatch
    act = {None: lambda z: z, "relu": torch.relu, "gelu": lambda z: torch.nn.functional.gelu(z, approximate="tanh")}
    W = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16) * 0.05
    side = torch.cuda.Stream()
    with kernel_api.settings(providers=["torch"]):
        for step in range(3):
            x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
            bias = torch.randn(384, device="cuda", dtype=torch.bfloat16)
            ref = act[activation](x.double() @ W.double() + bias.double())
            assert _rel(ops.gemm(x, W, bias=bias, activation=activation), ref) <= 2e-2, step
            side.wait_stream(torch.cuda.current_stream())
            out = ops.gemm(x, W, bias=bias, activation=activation, stream=side)  # not the current stream
            torch.cuda.current_stream().wait_stream(side)
            assert _rel(out, ref) <= 2e-2, step
        token = current().scope_token
    assert any(len(key) == 4 and key[0][0] == id(token) and key[2] == activation for key in dispatch._fast)


def test_pickany_takes_cublaslt_gelu_epilogue_for_gpt2_c_fc():
    """GPT-2's c_fc (8192 x 3072 x 768, row bias, tanh GELU): cuBLASLt's fused epilogue ran in
    0.069 ms against our best 0.081 ms on the H200; with the bias alone ours stays first."""
    bf = dict(dtype=torch.bfloat16)
    A, B, out = torch.empty(8192, 768, **bf), torch.empty(768, 3072, **bf), torch.empty(8192, 3072, **bf)
    gelu = kernel_api.EpilogueArguments(bias=torch.empty(3072, **bf), activation="gelu")
    assert _ranked(GemmArguments(A, B, out, epilogue=gelu))[0].startswith("TorchGemm")
    bias_only = kernel_api.EpilogueArguments(bias=torch.empty(3072, **bf))
    assert _ranked(GemmArguments(A, B, out, epilogue=bias_only))[0].startswith("Sm90")


@pytest.mark.parametrize("M,N,K,ours", [(8192, 768, 768, True), (8192, 2304, 768, True),
                                        (8192, 768, 3072, False), (8192, 768, 2304, False)])
def test_pickany_weighs_cublas_per_output_work_against_short_k(M, N, K, ours):
    """GPT-2's projections with their row bias (the "GPT-2 and sweep" runs of tests/data): at K = 768 our
    Sm90 kernels ran 1.08-1.26x faster than cuBLAS (H100, H200), at K = 2304-3072 cuBLAS ran
    1.04-1.2x faster; a flat cuBLAS efficiency took cuBLAS for all four."""
    bf = dict(dtype=torch.bfloat16)
    args = GemmArguments(torch.empty(M, K, **bf), torch.empty(K, N, **bf), torch.empty(M, N, **bf),
                         epilogue=kernel_api.EpilogueArguments(bias=torch.empty(N, **bf)))
    first = _ranked(args)[0]
    assert first.startswith("Sm90" if ours else "TorchGemm"), first


@pytest.mark.gpu
@pytest.mark.parametrize("allocate", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ops_gemm_runs_torch_chosen_problems_from_the_c_table(allocate, dtype):
    """A problem the policy gives cuBLAS (`TorchGemm`) is recorded as a torch call after its first
    ops.gemm; repeated plain calls replay torch.matmul from C (nothing reaches ops' Python fast
    path) and write the right values (into a NaN-filled output, or a new one torch allocates)."""
    from kernel_api import native
    from kernel_api.ops import dispatch as ops

    if native.entry() is None:
        pytest.skip(f"no CPython entry points here: {native.why_not_entry()}")
    ops.clear_dispatch_cache()
    A = torch.randn(96, 72, device="cuda", dtype=dtype)
    B = torch.randn(80, 72, device="cuda", dtype=dtype).t()
    out = torch.empty(96, 80, device="cuda", dtype=dtype)
    with kernel_api.settings(providers="torch"):
        kernel_api.ops.gemm(A, B) if allocate else kernel_api.ops.gemm(A, B, out=out)
        assert native.entry().replays() == 1  # one recipe for the call's key
        ops._fast.clear()
        for _ in range(2):
            A.copy_(torch.randn_like(A))
            if allocate:
                got = kernel_api.ops.gemm(A, B)
                assert got.shape == (96, 80) and got.is_contiguous() and got.dtype == dtype
            else:
                out.fill_(float("nan"))
                got = kernel_api.ops.gemm(A, B, out=out)
                assert got is out
            torch.cuda.synchronize()
            assert _rel(got, A.double() @ B.double()) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)
        # served from C: the Python path would have recorded its launch again
        assert not ops._fast
    ops.clear_dispatch_cache()
    assert native.entry().replays() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("allocate", [False, True])
def test_ops_gemm_runs_torch_chosen_bias_epilogues_from_the_c_entry_points(activation, allocate):
    """A row bias (and relu / gelu) on a problem the policy gives cuBLAS: after the first call,
    repeated calls replay torch.addmm's from C (nothing reaches ops' Python fast
    path) and write the right values, into a NaN-filled output or a new one; the same through a
    kernel_api.nn.Linear under no_grad."""
    import kernel_api.nn
    from kernel_api import native
    from kernel_api.ops import dispatch as ops

    if native.entry() is None:
        pytest.skip(f"no CPython entry points here: {native.why_not_entry()}")
    ops.clear_dispatch_cache()
    A = torch.randn(96, 72, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(80, 72, device="cuda", dtype=torch.bfloat16).t()
    bias = torch.randn(80, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(96, 80, device="cuda", dtype=torch.bfloat16)
    act = {None: lambda z: z, "relu": torch.relu,
           "gelu": lambda z: torch.nn.functional.gelu(z, approximate="tanh")}[activation]
    with kernel_api.settings(providers="torch"):
        call = (lambda: kernel_api.ops.gemm(A, B, bias=bias, activation=activation)) if allocate else \
            (lambda: kernel_api.ops.gemm(A, B, out=out, bias=bias, activation=activation))
        call()
        assert native.entry().replays() == 1
        ops._fast.clear()
        for _ in range(2):
            A.copy_(torch.randn_like(A))
            bias.copy_(torch.randn_like(bias))
            out.fill_(float("nan"))
            got = call()
            assert allocate or got is out
            torch.cuda.synchronize()
            assert _rel(got, act(A.double() @ B.double() + bias.double())) <= 1e-2
        assert not ops._fast  # served from C: the Python path would have recorded its launch again
        layer = kernel_api.nn.Linear(72, 80, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(96, 72, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            layer(x)
            ops._fast.clear()
            got = layer(x)
        assert not ops._fast and _rel(got, x.double() @ layer.weight.double().t() + layer.bias.double()) <= 1e-2
    ops.clear_dispatch_cache()


def test_torch_gemm_replays_the_product_with_the_least_dispatch():
    """The recipe a plain product records is torch.mm for 2-D operands and torch.bmm for batches
    of one size (matmul reaches them after its own dispatch), torch.matmul otherwise; each gives
    matmul's result."""
    kernel = next(iter(TorchGemm.generate_kernels(None)))
    cases = [((6, 5), (5, 4), torch.mm), ((3, 6, 5), (3, 5, 4), torch.bmm)]
    for a_shape, b_shape, expected in cases:
        A, B = torch.randn(*a_shape), torch.randn(*b_shape)
        out = torch.empty(*a_shape[:-1], b_shape[-1])
        launcher = kernel._launcher(GemmArguments(A, B, out), None)
        assert launcher.torch_call is expected
        assert torch.allclose(launcher.torch_call(A, B), torch.matmul(A, B))
    from kernel_api.providers.torch_ops.kernels import _product_call
    assert _product_call(torch.randn(3, 6, 5), torch.randn(1, 5, 4)) is torch.matmul
