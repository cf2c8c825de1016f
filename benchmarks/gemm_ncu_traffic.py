"""One warm launch each of cuBLAS and our GEMM kernels, for Nsight Compute's traffic counters:
where a kernel's energy per GEMM could go (issue #16, goal 5; benchmarks/NOTES-sm90.md,
session 40: at the power cap a GEMM's time is its energy over the power limit).

    ncu --profile-from-start off --clock-control none --metrics \
dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,l1tex__data_bank_reads.sum,\
l1tex__data_bank_writes.sum,sm__inst_executed.sum,sm__cycles_elapsed.avg,gpu__time_duration.sum \
python3 benchmarks/gemm_ncu_traffic.py --dtype bf16 --size 8192 --candidates <as gemm_power.py>

Every contestant is compiled and launched once before the profiled range (a CuTe DSL kernel's
first launch loads its module), then each launches once inside it (cudaProfilerStart/Stop), in
the order cuBLAS, then the candidates; the report lists them in that order.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from gemm_power import DTYPES, find_kernel  # noqa: E402
from kernel_api.arguments import GemmArguments  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--candidates", nargs="+", required=True)
    opts = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gemm_ncu_traffic.py needs a CUDA GPU", file=sys.stderr)
        return 2
    n, dtype = opts.size, DTYPES[opts.dtype]
    A = torch.randn(n, n, device="cuda", dtype=dtype)
    B = torch.randn(n, n, device="cuda", dtype=dtype)
    out = torch.empty(n, n, device="cuda", dtype=dtype)
    args = GemmArguments(A, B, out)
    launches = [("cuBLAS", lambda: torch.matmul(A, B, out=out))]
    for cand in opts.candidates:
        k = find_kernel(cand, args)
        art = k.compile(args)
        launches.append((k.metadata.kernel_name, lambda k=k, art=art: k.run(args, compiled_artifact=art)))
    for _, launch in launches:  # module loads and warm-up outside the profiled range
        launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _, launch in launches:
        launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled, in order:", ", ".join(name for name, _ in launches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
