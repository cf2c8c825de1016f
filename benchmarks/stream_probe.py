"""How fast each way of staging a persistent CTA's parts in shared memory copies, against torch's
copy of the same bytes in the same process: the long-row softmax's memory structure without its
math or its waits (kernels in stream_probe.cu).

    python3 benchmarks/stream_probe.py [--mbytes 64,128,256] [--repeats 3] [--iters 30] [--tag TAG]

Contestants (``name``: kernel, template arguments U x THREADS x NSLOT x PD x LAG x flag):
``grid``: a non-persistent copy, 4 vectors a thread; ``regs``: persistent, the next part in
registers; ``ring*``: the window softmax's cp.async ring (parts of U x 256 vectors, PD parts
ahead, the output LAG grids behind, SYNC: a block barrier per step); ``bulk*``: one TMA bulk
copy per part on an mbarrier, the output by each thread's stores or one bulk store. Per case:
TB/s (read + write of the whole parts that fit the case; torch copies the same bytes) of the
median of ``--iters`` launches alternated with torch's ``dst.copy_(src)`` (`time_cuda_pair`, two
buffer sets past L2), ``--repeats`` times; each kernel's output is checked equal to its input
first (the session 36 run predates the whole-parts rule: its ring6 rows, whose 24 KB parts do
not divide the cases, are marked BAD for the bytes they left uncopied). JSON: benchmarks/results/stream-probe-<device>[-tag].json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from kernel_api.core.streams import stream_handle  # noqa: E402
from kernel_api.nvrtc.compiler import compile_cuda  # noqa: E402
from kernel_api.nvrtc.launcher import CudaLauncher  # noqa: E402
from kernel_api.tuning.timing import time_cuda_pair  # noqa: E402
from results_io import result_name, write_result_with_text  # noqa: E402

THREADS = 256
#: name -> (kernel, template arguments: U, NSLOT, PD, LAG, flag); the ring is NSLOT x U x THREADS vectors.
CONTESTANTS = {
    "regs8": ("reg_copy", (8,)),
    "ring8-s3p1l1-sync": ("ring_copy", (8, 3, 1, 1, 1)),
    "ring8-s3p1l1": ("ring_copy", (8, 3, 1, 1, 0)),
    "ring8-s2p1l0-sync": ("ring_copy", (8, 2, 1, 0, 1)),
    "ring4-s4p2l1-sync": ("ring_copy", (4, 4, 2, 1, 1)),
    "ring4-s6p4l1-sync": ("ring_copy", (4, 6, 4, 1, 1)),
    "ring6-s4p2l1-sync": ("ring_copy", (6, 4, 2, 1, 1)),
    "ring2-s10p8l1-sync": ("ring_copy", (2, 10, 8, 1, 1)),
    "bulk8-s3p1l1": ("bulk_copy", (8, 3, 1, 1, 0)),
    "bulk8-s3p1l1-out": ("bulk_copy", (8, 3, 1, 1, 1)),
    "bulk4-s6p4l1": ("bulk_copy", (4, 6, 4, 1, 0)),
    "bulk4-s6p4l1-out": ("bulk_copy", (4, 6, 4, 1, 1)),
    "bulk2-s12p10l1": ("bulk_copy", (2, 12, 10, 1, 0)),
    "bulk2-s12p10l1-out": ("bulk_copy", (2, 12, 10, 1, 1)),
}


def expression(kernel: str, targs: tuple[int, ...]) -> str:
    if kernel == "reg_copy":
        return f"reg_copy<{targs[0]}, {THREADS}>"
    u, nslot, pd, lag, flag = targs
    return f"{kernel}<{u}, {THREADS}, {nslot}, {pd}, {lag}, {flag}>"


def ring_bytes(kernel: str, targs: tuple[int, ...]) -> int:
    return 0 if kernel == "reg_copy" else targs[1] * targs[0] * THREADS * 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mbytes", default="64,128,256", help="bytes copied per case, MiB")
    ap.add_argument("--only", default="", help="comma-separated contestant names (default: all)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tag", default="")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("stream_probe.py needs a CUDA GPU")
    chosen = {k: v for k, v in CONTESTANTS.items() if not opts.only or k in opts.only.split(",")}
    device = torch.cuda.current_device()
    cc = torch.cuda.get_device_capability(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    with open(os.path.join(ROOT, "benchmarks", "stream_probe.cu")) as f:
        source = f.read()
    exprs = {name: expression(*spec) for name, spec in chosen.items()}
    compiled = compile_cuda(source, cc=cc, name_expressions=["grid_copy", *exprs.values()], source_name="stream_probe.cu")
    launchers = {name: CudaLauncher(compiled, expr, name) for name, expr in exprs.items()}
    grid_launcher = CudaLauncher(compiled, "grid_copy", "grid")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = stream_handle(torch.cuda.current_stream(), device)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sms": sms, "cases": []}
    header = f"{'contestant':>22} {'ring KB':>7} {'grid':>5} " + " ".join(f"{m + ' MiB':>16}" for m in opts.mbytes.split(","))
    rows = {name: [] for name in ["grid", *chosen]}
    grids = {}
    for mib in map(int, opts.mbytes.split(",")):
        nbytes = mib << 20
        srcs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(2)]
        dsts = [torch.empty_like(s) for s in srcs]
        nvec = nbytes // 16

        def grid_run(i: int) -> None:
            grid_launcher.launch(stream, device, -(-nvec // (4 * THREADS)), THREADS, 0,
                                 (srcs[i].data_ptr(), dsts[i].data_ptr(), nvec))

        runners = {"grid": (grid_run, 0, nvec)}
        for name, (kernel, targs) in chosen.items():
            launcher, smem = launchers[name], ring_bytes(kernel, targs)
            parts = nvec // (targs[0] * THREADS)
            grid = min(launcher.max_coresident(device, THREADS, smem), 2 * sms, parts)
            grids[name] = grid
            if kernel == "reg_copy":
                def run(i: int, launcher=launcher, grid=grid, parts=parts) -> None:
                    launcher.launch(stream, device, grid, THREADS, 0, (srcs[i].data_ptr(), dsts[i].data_ptr(), parts))
            else:
                def run(i: int, launcher=launcher, grid=grid, parts=parts, smem=smem) -> None:
                    launcher.launch(stream, device, grid, THREADS, smem,
                                    (srcs[i].data_ptr(), dsts[i].data_ptr(), parts, sink.data_ptr()), cooperative=True)
            runners[name] = (run, smem, parts * targs[0] * THREADS)
        case = {"mbytes": mib, "results": {}}
        for name, (run, smem, covered) in runners.items():
            n = covered * 4  # (int32 words of the whole parts: a part size that does not divide the case copies less)
            dsts[0].fill_(-1)
            run(0)
            torch.cuda.synchronize()
            ok = bool(torch.equal(dsts[0][:n], srcs[0][:n]))
            times = [time_cuda_pair(lambda i: dsts[i][:n].copy_(srcs[i][:n]), run, sets=2, repeat=opts.iters)
                     for _ in range(opts.repeats)]
            tbs = [2 * covered * 16 / (k * 1e-3) / 1e12 for _, k in times]
            copy_tbs = [2 * covered * 16 / (c * 1e-3) / 1e12 for c, _ in times]
            ratio = statistics.median(c / k for c, k in times)
            case["results"][name] = {"correct": ok, "tbs": tbs, "torch_copy_tbs": copy_tbs, "ratio_to_torch": ratio,
                                     "grid": grids.get(name), "ring_bytes": smem}
            rows[name].append(f"{statistics.median(tbs):5.2f} {ratio:4.2f}{'' if ok else ' BAD'}".rjust(16))
            print(f"{mib} MiB {name}: {statistics.median(tbs):.2f} TB/s, {ratio:.3f} of torch "
                  f"({statistics.median(copy_tbs):.2f}){'' if ok else ' WRONG OUTPUT'}", flush=True)
        report["cases"].append(case)
    lines = [f"TB/s and ratio to torch's copy in the same run ({report['device']}, {sms} SMs)", header]
    for name, cells in rows.items():
        kernel_targs = chosen.get(name)
        kb = ring_bytes(*kernel_targs) // 1024 if kernel_targs else 0
        lines.append(f"{name:>22} {kb:7d} {grids.get(name, 0):5d} " + " ".join(cells))
    print("\n".join(lines))
    for path in write_result_with_text(result_name("stream-probe", report["device"], opts.tag), report, lines):
        print("wrote", path)


if __name__ == "__main__":
    main()
