"""Framework integration on a GPU: CUDA graphs, torch.compile, autograd, workspaces, devices."""

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments, SoftmaxArguments
from kernel_api.ops import dispatch as ops  # the front door's module: its caches and launch records
from integration_kernels import WorkspaceTestKernel, workspace_kernel

pytestmark = pytest.mark.gpu


def _rand(*shape, dtype=torch.float16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _gemm_ref(A, B):
    return (A.double() @ B.double()).to(A.dtype)


def test_cuda_graph_replays_ops_and_run_with_new_data():
    A, B, x = _rand(128, 64), _rand(64, 96), _rand(32, 200, dtype=torch.float32)
    args = GemmArguments(A, B, torch.full((128, 96), float("nan"), device="cuda", dtype=torch.float16))
    kernel = kernel_api.get_kernels(args)[0]
    artifact = kernel.compile(args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile and fill the dispatch cache outside capture
        ops.gemm(A, B), ops.softmax(x)
        kernel.run(args, compiled_artifact=artifact)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_gemm = ops.gemm(A, B)
        y_soft = ops.softmax(x)
        kernel.run(args, compiled_artifact=artifact)
    for _ in range(3):  # new inputs each replay, written into the captured buffers
        A.copy_(_rand(128, 64)), B.copy_(_rand(64, 96)), x.copy_(_rand(32, 200, dtype=torch.float32))
        args.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y_gemm, _gemm_ref(A, B), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(args.out, _gemm_ref(A, B), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(y_soft, torch.softmax(x.double(), -1).float(), atol=1e-5, rtol=1e-4)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 128, device="cuda", dtype=torch.float16) / 8)

    def forward(self, x):
        h = ops.gemm(x, self.w, bias=None, alpha=0.5)
        return ops.softmax(h.float() * 2.0, -1)


def test_torch_compile_fullgraph_runs_the_registry_kernels():
    model = _Block()
    x = _rand(32, 64)
    with torch.no_grad():
        expected = torch.softmax((0.5 * (x.double() @ model.w.double())).half().double() * 2.0, -1)
        compiled = torch.compile(model, fullgraph=True)
        got = compiled(x)
        x2 = _rand(32, 64)
        got2 = compiled(x2)
        expected2 = torch.softmax((0.5 * (x2.double() @ model.w.double())).half().double() * 2.0, -1)
    torch.testing.assert_close(got.double(), expected, atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(got2.double(), expected2, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("shape", [(16, 100), (4, 3, 1000), (2, 4096)])
def test_softmax_autograd_matches_torch(shape):
    x = torch.randn(*shape, device="cuda", dtype=torch.float32, requires_grad=True)
    x_ref = x.detach().double().requires_grad_()
    upstream = torch.randn(*shape, device="cuda", dtype=torch.float32)
    y = ops.softmax(x)
    (y * upstream).sum().backward()
    y_ref = torch.softmax(x_ref, -1)
    (y_ref * upstream.double()).sum().backward()
    torch.testing.assert_close(y.double(), y_ref.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, atol=1e-6, rtol=1e-4)
    # plain .sum() hands the backward an expanded (stride-0) gradient
    x.grad = None
    ops.softmax(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.zeros_like(x), atol=1e-6, rtol=0)


def test_gemm_autograd_matches_torch():
    A = _rand(96, 64).requires_grad_()
    B = _rand(64, 80).requires_grad_()
    bias = _rand(80).requires_grad_()
    g = _rand(96, 80)
    ops.gemm(A, B, bias=bias, alpha=0.5).backward(g)
    Ad, Bd, bd = (t.detach().double().requires_grad_() for t in (A, B, bias))
    (0.5 * (Ad @ Bd) + bd).backward(g.double())
    for got, ref in ((A.grad, Ad.grad), (B.grad, Bd.grad), (bias.grad, bd.grad)):
        torch.testing.assert_close(got.double(), ref, atol=5e-2, rtol=2e-2)


def test_workspace_comes_from_torch_on_the_launch_stream():
    kernel = workspace_kernel()
    x = torch.randn(7, 301, device="cuda")
    out = torch.full_like(x, float("nan"))
    args = SoftmaxArguments(x, out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    kernel.run(args, stream=side)  # no workspace given: Kernel.run allocates it
    side.synchronize()
    ws = WorkspaceTestKernel.last_workspace
    assert ws.device == x.device and ws.dtype == torch.uint8 and ws.numel() == 4 * x.numel()
    torch.testing.assert_close(ws.view(torch.float32)[: x.numel()].view_as(x), 2 * x)
    torch.testing.assert_close(out, 2 * x + 1)
    # a caller's workspace is used as given
    mine = torch.zeros(4 * x.numel(), dtype=torch.uint8, device="cuda")
    out.fill_(float("nan"))
    kernel.run(args, workspace=mine)
    torch.cuda.synchronize()
    assert WorkspaceTestKernel.last_workspace is mine
    torch.testing.assert_close(mine.view(torch.float32).view_as(x), 2 * x)


def test_operands_device_index_is_honoured():
    ops.clear_dispatch_cache()
    A, B = _rand(64, 64).to("cuda:0"), _rand(64, 64).to("cuda:0")
    y = ops.gemm(A, B)
    assert y.device == torch.device("cuda:0")
    # the choice's key holds the problem key, whose signature ends with the device index
    assert any(problem[0][-1] == 0 for problem, _ in ops.chosen_kernels())
    torch.testing.assert_close(y, _gemm_ref(A, B), atol=2e-2, rtol=2e-2)
    if torch.cuda.device_count() < 2:
        pytest.skip("a second GPU is needed to check launching on a non-current device")
    A1, B1 = A.to("cuda:1"), B.to("cuda:1")
    with torch.cuda.device(0):
        for _ in range(3):  # the first call chooses and records, the later ones take the fast path
            A1.copy_(_rand(64, 64).to("cuda:1"))
            y1 = ops.gemm(A1, B1)
            torch.cuda.synchronize(1)
            assert y1.device == torch.device("cuda:1")
            torch.testing.assert_close(y1, _gemm_ref(A1, B1), atol=2e-2, rtol=2e-2)
        # the same kernel instance runs on both devices (artifacts and launch constants per device)
        out0, out1 = torch.empty_like(y), torch.empty_like(y1)
        args0, args1 = GemmArguments(A, B, out0), GemmArguments(A1, B1, out1)
        kernel = kernel_api.PickAny().choose(args0, kernel_api.get_kernels(args0))
        for _ in range(2):
            kernel.run(args0)
            with torch.cuda.device(1):
                kernel.run(args1)
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    torch.testing.assert_close(out0, _gemm_ref(A, B), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out1, _gemm_ref(A1, B1), atol=2e-2, rtol=2e-2)


@pytest.fixture
def our_kernels():
    """Our providers only: these tests follow our kernels' launchers into the native replay
    (PickAny ranks cuBLAS first for problems this small)."""
    with kernel_api.settings(providers=["cutedsl", "cuda_src"]):
        yield


def test_ops_gemm_fast_path_reuses_launchers_only_for_identical_metadata(our_kernels):
    from kernel_api.ops.dispatch import _raw_gemm_key
    from kernel_api.tuning.settings import current

    ops.clear_dispatch_cache()
    expected = set()

    def call(A, B):
        out = torch.full((A.shape[0], B.shape[1]), float("nan"), device="cuda", dtype=A.dtype)
        assert ops.gemm(A, B, out=out) is out
        torch.testing.assert_close(out, _gemm_ref(A, B), atol=2e-2, rtol=2e-2)
        expected.add(_raw_gemm_key(current().scope_token, A, B, out))
        # at most one launcher per distinct raw metadata (pointer bits included); kernels
        # without a fast launcher (e.g. those needing a workspace) record none
        assert set(ops._fast) <= expected

    A, B = _rand(96, 64), _rand(64, 80)
    call(A, B)
    assert len(ops._fast) == 1
    for _ in range(3):  # same metadata, new data and buffers: served by the recorded launchers
        call(_rand(96, 64), _rand(64, 80))
    assert len(expected) <= 8  # at most the 2 x 2 x 2 pointer-alignment classes of the allocator
    # Different strides, layouts, offsets (alignment) and shapes each get their own entry.
    storage = _rand(96 * 64 + 8)
    for A3 in (A.t().contiguous().t(), storage[1:1 + 96 * 64].view(96, 64), storage[8:8 + 96 * 64].view(96, 64),
               _rand(95, 64), _rand(96, 128)[:, :64]):
        call(A3, _rand(A3.shape[1], 80))
    # Another policy never sees the first policy's launchers.
    with kernel_api.settings(policy=kernel_api.PickAny()):
        call(A, B)
    assert len({key[0] for key in ops._fast}) == 2
    # every TVM-FFI launcher the chosen kernels offered is recorded for replay from C as well (a
    # Python launcher, such as the realigned GEMM's with its per-call workspace, is not)
    assert ops._entry is not None and ops._entry.replays() == sum(entry.launcher.ffi for entry in ops._fast.values())


def test_repeated_ops_gemm_calls_are_replayed_from_c(our_kernels):
    ops.clear_dispatch_cache()
    A, B = _rand(256, 128), _rand(128, 192)
    out = torch.empty(256, 192, device="cuda", dtype=torch.float16)
    ops.gemm(A, B, out=out)  # chooses, compiles, launches, records
    assert ops._entry is not None, kernel_api.native.why_not_entry()
    assert ops._entry.replays() == 1
    ops._fast.clear()  # from here on only the C replay can skip the Python path (which would re-record)
    for _ in range(3):
        A.copy_(_rand(256, 128))
        out.fill_(float("nan"))
        assert ops.gemm(A, B, out=out) is out
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _gemm_ref(A, B), atol=2e-2, rtol=2e-2)
    assert not ops._fast and ops._entry.replays() == 1
    # New buffers may fall in another pointer-alignment class (a new entry); results stay right.
    y = ops.gemm(A, B)
    torch.testing.assert_close(y, _gemm_ref(A, B), atol=2e-2, rtol=2e-2)
    square = _rand(256, 256)
    ops.gemm(square, _rand(256, 256), out=torch.empty_like(square))
    with pytest.raises(ValueError, match="operand out: shares memory with operand A"):
        ops.gemm(square, _rand(256, 256), out=square)  # recorded metadata, but in place: refused
    ops.gemm(A, B, out=out, alpha=0.5)  # an epilogue takes the Python path
    torch.testing.assert_close(out, (0.5 * A.double() @ B.double()).half(), atol=2e-2, rtol=2e-2)
    with torch.no_grad():  # operands that require grad, outside grad mode
        w = B.clone().requires_grad_()
        torch.testing.assert_close(ops.gemm(A, w), _gemm_ref(A, B), atol=2e-2, rtol=2e-2)


def test_ops_gemm_fast_path_honours_the_stream_and_graph_capture():
    A, B = _rand(128, 64), _rand(64, 128)
    ops.gemm(A, B)  # record the launcher
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = ops.gemm(A, B)
    explicit = ops.gemm(A, B, stream=side)
    side.synchronize()
    torch.testing.assert_close(y, _gemm_ref(A, B), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(explicit, _gemm_ref(A, B), atol=2e-2, rtol=2e-2)
    out = torch.empty(128, 128, device="cuda", dtype=torch.float16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gemm(A, B, out=out)
    for _ in range(2):
        A.copy_(_rand(128, 64))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _gemm_ref(A, B), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_repeated_runs_of_the_same_arguments_see_new_data(dtype):
    """The second run of an arguments object takes the launch bound to its tensors."""
    A, B = _rand(200, 72, dtype=dtype), _rand(72, 136, dtype=dtype)
    out = torch.empty(200, 136, device="cuda", dtype=dtype)
    kernels = kernel_api.get_kernels(GemmArguments(A, B, out))
    assert kernels
    for kernel in kernels[:: max(1, len(kernels) // 6)]:
        args = GemmArguments(A, B, out)  # fresh: a binding belongs to the first artifact run with them
        artifact = kernel.compile(args)
        for assume in (False, True, True):
            A.copy_(_rand(200, 72, dtype=dtype))
            out.fill_(float("nan"))
            kernel.run(args, compiled_artifact=artifact, assume_supported_args=assume)
            torch.cuda.synchronize()
            ref = A.double() @ B.double()
            tol = 2e-2 if dtype != torch.float32 else 1e-2
            torch.testing.assert_close(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
        if kernel.workspace_free:  # kernels that need a workspace get one per run: nothing to bind
            assert args._binding.artifact is artifact


@pytest.mark.parametrize("assume", [True, False], ids=["vouched", "checked"])
def test_bound_runs_see_new_data_on_any_stream_and_in_graphs(assume):
    """A second run of the same arguments takes their bound launch: with the native entry
    (kernel_api.native.entry) a C launch reading the live tensors for both kinds of run; without
    it, checked runs convert the live tensors and vouched ones use operands packed once. Either
    way new data written in place is seen, on the current stream, a side stream and inside a
    captured graph."""
    import tvm_ffi

    from kernel_api import native

    A, B = _rand(256, 64), _rand(64, 128)
    out = torch.empty(256, 128, device="cuda", dtype=torch.float16)
    args = GemmArguments(A, B, out)
    kernel = _PreferCuteDsl().choose(args, kernel_api.get_kernels(args))
    artifact = kernel.compile(args)
    kernel.run(args, compiled_artifact=artifact)
    live, snapshot = args._binding.launch, args._binding.snapshot
    if native.entry() is not None:
        assert isinstance(live, native.entry().BoundLaunch) and snapshot is live
        assert live.tensors == (A, B, out)
    else:
        assert snapshot is not live and sum(isinstance(a, tvm_ffi.Tensor) for a in snapshot.args) == 3

    def run(**kw):
        kernel.run(args, compiled_artifact=artifact, assume_supported_args=assume, **kw)

    def check():
        torch.testing.assert_close(out, _gemm_ref(A, B), atol=2e-2, rtol=2e-2)

    for _ in range(2):
        A.copy_(_rand(256, 64)), B.copy_(_rand(64, 128)), out.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        check()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    A.copy_(_rand(256, 64)), out.fill_(float("nan"))
    torch.cuda.synchronize()
    run(stream=side)
    side.synchronize()
    check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(2):
        A.copy_(_rand(256, 64)), out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check()
    assert args._binding.launch is live and args._binding.snapshot is snapshot


class _PreferCuteDsl(kernel_api.Policy):
    """Chooses a CuTe DSL kernel when one is among the candidates (their launches are recordable)."""

    def choose(self, args, candidates):
        return next((k for k in candidates if type(k).__name__.startswith("Cute")), candidates[0])


def test_repeated_ops_softmax_calls_are_replayed_from_c():
    ops.clear_dispatch_cache()
    x = _rand(64, 300, dtype=torch.float32)
    out = torch.empty_like(x)
    grad = _rand(64, 300, dtype=torch.float32)
    grad_in = torch.empty_like(x)
    with kernel_api.settings(policy=_PreferCuteDsl()):
        ops.softmax(x, out=out)
        ops.softmax_backward(grad, out, grad_in=grad_in)
        assert ops._entry is not None and ops._entry.replays() == 2
        for _ in range(3):
            x.copy_(_rand(64, 300, dtype=torch.float32)), grad.copy_(_rand(64, 300, dtype=torch.float32))
            out.fill_(float("nan")), grad_in.fill_(float("nan"))
            assert ops.softmax(x, out=out) is out
            assert ops.softmax_backward(grad, out, grad_in=grad_in) is grad_in
            torch.cuda.synchronize()
            ref = torch.softmax(x.double(), -1)
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(grad_in.double(), ref * (grad.double() - (grad.double() * ref).sum(-1, keepdim=True)),
                                       atol=1e-5, rtol=1e-4)
        assert ops._entry.replays() == 2
        # recorded tensors, another dimension: another call key (never the last dimension's recipe)
        assert ops.softmax(x, dim=0, out=out) is out
        torch.testing.assert_close(out.double(), torch.softmax(x.double(), 0), atol=1e-5, rtol=1e-4)
