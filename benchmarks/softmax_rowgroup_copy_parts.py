import statistics, torch, kernel_api
from kernel_api import SoftmaxArguments
from kernel_api.providers.cuda_src.kernels import softmax_rowgroup as rg
res = []
for rows, cols, dt in ((32, 2**20, torch.bfloat16), (8, 2**22, torch.bfloat16), (32, 2**20, torch.float32), (8, 2**22, torch.float32)):
    xs = [torch.randn(rows, cols, device="cuda", dtype=dt) for _ in range(4)]
    ys = [torch.empty_like(x) for x in xs]
    argss = [SoftmaxArguments(x, y) for x, y in zip(xs, ys)]
    base = next(k for k in kernel_api.get_kernels(argss[0]) if isinstance(k, rg._RowGroupBase) and k.ctas_per_sm == 1)
    times = {}
    kernels = {}
    for parts in (1, 2, 4):
        k = type(base)(base.metadata, base.params); k.copy_parts = parts
        kernels[parts] = (k, k.compile(argss[0]))
    for parts, (k, art) in kernels.items():
        k.run(argss[0], compiled_artifact=art); torch.cuda.synchronize()
        ref = torch.softmax(xs[0].float(), -1)
        assert torch.allclose(ys[0].float(), ref, atol=1e-2 if dt != torch.float32 else 1e-6), parts
    for rep in range(30):
        for parts, (k, art) in kernels.items():
            a = argss[rep % 4]
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(); k.run(a, compiled_artifact=art); e1.record(); torch.cuda.synchronize()
            times.setdefault(parts, []).append(e0.elapsed_time(e1) * 1e3)
    nbytes = 2 * rows * cols * xs[0].element_size()
    line = f"{rows}x{cols} {dt}: " + "  ".join(f"parts {p}: {statistics.median(t):.1f} us ({nbytes/statistics.median(t)/1e6:.2f} TB/s)" for p, t in times.items())
    print(line, flush=True)
