"""Row-group softmax launches for Nsight Compute: by default a lone 1x1M bf16 row (one wave) and
32x1M (four waves), three launches each; with ``--case`` one shape, dtype, direction and
variant (CTAs per SM; 0: discovery's first). ``--family window`` or ``stream`` launches that
long-row family's instance instead (the CTAs per SM field ignored), e.g. its DRAM bytes and
L2 hit rate:

    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
-k regex:window --launch-skip 1 --launch-count 1 python3 benchmarks/softmax_rowgroup_ncu.py --family window \
--case 32 1048576 bf16 fwd 0

    ncu --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
-k regex:rowgroup python3 benchmarks/softmax_rowgroup_ncu.py

(results/ncu-rowgroup-<device>-s24.txt.) Where the consumers' time goes, per SASS instruction
(session 34; summarised by ncu_sass_regions.py):

    ncu --set full --import-source yes --launch-skip 1 --launch-count 1 -k regex:rowgroup -o fwd \
python3 benchmarks/softmax_rowgroup_ncu.py --case 32 1048576 bf16 fwd 1
    ncu -i fwd.ncu-rep --page source --csv --print-source sass > fwd_sass.csv
    python3 benchmarks/ncu_sass_regions.py fwd_sass.csv
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_api  # noqa: E402
from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments  # noqa: E402
from kernel_api.providers.cuda_src.kernels import softmax_rowgroup as rg  # noqa: E402
from kernel_api.providers.cuda_src.kernels import softmax_stream as ss  # noqa: E402
from kernel_api.providers.cuda_src.kernels import softmax_window as sw  # noqa: E402
from softmax import DTYPES  # noqa: E402

FAMILIES = {"rowgroup": rg._RowGroupBase, "window": sw._WindowBase, "stream": ss._StreamBase}


def launch(rows: int, cols: int, dtype: torch.dtype, backward: bool = False, ctas_per_sm: int | None = None,
           times: int = 3, family: str = "rowgroup") -> None:
    """``times`` launches of the family's instance (discovery's first, or the row-group one with
    ``ctas_per_sm``) on fresh random data."""
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    if backward:
        y = torch.softmax(x.float(), -1).to(dtype)
        args = SoftmaxBackwardArguments(torch.randn_like(x), y, torch.empty_like(x))
    else:
        args = SoftmaxArguments(x, torch.empty_like(x))
    kernel = next(k for k in kernel_api.get_kernels(args) if isinstance(k, FAMILIES[family])
                  and (family != "rowgroup" or ctas_per_sm in (None, k.ctas_per_sm)))
    artifact = kernel.compile(args)
    for _ in range(times):
        kernel.run(args, compiled_artifact=artifact)
    torch.cuda.synchronize()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs=5, metavar=("ROWS", "COLS", "DTYPE", "DIR", "CTAS_PER_SM"),
                    help="one case: e.g. 32 1048576 bf16 fwd 1")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="rowgroup")
    opts = ap.parse_args()
    if opts.case:
        rows, cols, dname, direction, cps = opts.case
        launch(int(rows), int(cols), DTYPES[dname], direction == "bwd", int(cps) or None, family=opts.family)
    else:
        for rows, cols in ((1, 2**20), (32, 2**20)):
            launch(rows, cols, torch.bfloat16)
