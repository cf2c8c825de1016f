"""The realigned GEMM's staging copies (issue #16, goal 1): the line-copy kernel
(`kernel_api/providers/cutedsl/gemm/implementations/line_copy.cu`) against what it replaced,
torch's ``copy_`` and ``cudaMemcpy2DAsync``; then `Sm90RealignedGemm` with either against
cuBLAS on the odd shapes.

    python3 benchmarks/realign_copy.py [--repeat 30] [--gemm-repeat 20] [--tag T] [--skip-gemm]
    python3 benchmarks/realign_copy.py --parts [--pitches 16,128] [--gemm-repeat 20] [--runs 2] [--tag T]

Copies: every method of a case runs in one shuffled group (`small_m.time_group`: CUDA events
per launch, median), on operand sets rotated over >= 256 MB so that no copy reads what L2
kept; TB/s counts the bytes read + written once. Columns: line_copy (the unit `copy_lines`
picks by the line length), warp / cta (each unit forced), copy_, memcpy2d. Each method's result is checked bit for bit
against torch's, inside a sentinel-filled destination (the padding must keep its sentinel).

GEMMs: per odd shape, the realigned 128x256 cooperative and 128x128 ping-pong instances with
each copy method and torch.matmul (cuBLAS), shuffled per repetition, A/B rotated; the output
is compared with torch's. JSON and text go to benchmarks/results/realign_copy-<device>[-tag].*.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_api  # noqa: E402
from kernel_api import GemmArguments  # noqa: E402
from kernel_api.core.dtypes import DataType  # noqa: E402
from kernel_api.core.streams import to_cuda_stream  # noqa: E402
from kernel_api.providers.cutedsl.gemm.common import COLUMN_MAJOR, ROW_MAJOR  # noqa: E402
from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import Sm90Config  # noqa: E402
from kernel_api.providers.cutedsl.gemm import sm90_realigned  # noqa: E402
from kernel_api.providers.cutedsl.gemm.implementations.line_copy import copy_lines  # noqa: E402
from results_io import result_doc, result_name, write_result_with_text  # noqa: E402
from small_m import ROTATE_BYTES, copy_rate, time_group  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
SENTINEL = {torch.bfloat16: -7.0, torch.float16: -7.0, torch.float32: -7.0}

#: (label, dtype, rows, cols, row-major, direction, element offset of the unaligned side): the
#: copies of the odd group's shapes. "in": a user operand (odd leading dimension, or a view at
#: an odd offset) into its padded copy; "out": the padded out back into the user's.
COPY_CASES = [
    ("A of 4097^3", "f16", 4097, 4097, True, "in", 0),
    ("A of 4095x4096x4095", "bf16", 4095, 4095, True, "in", 0),
    ("B of 4096x50257x4096", "bf16", 4096, 50257, True, "in", 0),
    ("out of 4096x50257x4096", "bf16", 4096, 50257, True, "out", 0),
    ("out of 4097^3", "f16", 4097, 4097, True, "out", 0),
    ("out of 4097^3, f32", "f32", 4097, 4097, True, "out", 0),
    ("A col-major 4097x4097", "bf16", 4097, 4097, False, "in", 0),
    ("A of 2000x3000x1001", "bf16", 2000, 1001, True, "in", 0),
    ("big[:, 3:] 8192x8189", "bf16", 8192, 8189, True, "in", 3),
    ("A of 8200x1023", "bf16", 8200, 1023, True, "in", 0),
]

#: (label, dtype, M, N, K): the odd group (gemm_shapes.py --group odd).
GEMM_CASES = [
    ("bf16 4096x50257x4096", "bf16", 4096, 50257, 4096),
    ("bf16 4095x4096x4095", "bf16", 4095, 4096, 4095),
    ("f16 4097x4097x4097", "f16", 4097, 4097, 4097),
    ("bf16 2000x3000x1001", "bf16", 2000, 3000, 1001),
]


def _padded(rows: int, cols: int, row_major: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the padded view, its whole buffer) of a rows x cols operand, leading dimension rounded to 16 bytes."""
    align = 16 // torch.empty((), dtype=dtype).element_size()
    if row_major:
        ld = -(-cols // align) * align
        buf = torch.full((rows, ld), SENTINEL[dtype], device="cuda", dtype=dtype)
        return buf[:, :cols], buf
    ld = -(-rows // align) * align
    buf = torch.full((cols, ld), SENTINEL[dtype], device="cuda", dtype=dtype)
    return buf[:, :rows].t(), buf


def _user(rows: int, cols: int, row_major: bool, dtype: torch.dtype, offset: int, fill: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(a user operand with its odd layout, its whole buffer): contiguous rows x cols (or a view at ``offset``)."""
    if row_major:
        buf = torch.randn(rows, cols + offset, device="cuda").to(dtype) if fill else \
            torch.full((rows, cols + offset), SENTINEL[dtype], device="cuda", dtype=dtype)
        return buf[:, offset:], buf
    buf = torch.randn(cols, rows + offset, device="cuda").to(dtype) if fill else \
        torch.full((cols, rows + offset), SENTINEL[dtype], device="cuda", dtype=dtype)
    return buf[:, offset:].t(), buf


def copy_case(case: tuple, repeat: int) -> dict:
    label, dname, rows, cols, row_major, direction, offset = case
    dtype = DTYPES[dname]
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = rows * cols * size
    sets = max(2, -(-ROTATE_BYTES // (2 * nbytes)))
    pairs = []
    for _ in range(sets):
        if direction == "in":
            src, _ = _user(rows, cols, row_major, dtype, offset, fill=True)
            dst, dbuf = _padded(rows, cols, row_major, dtype)
        else:
            src, _ = _padded(rows, cols, row_major, dtype)
            src.copy_(torch.randn(rows, cols, device="cuda").to(dtype))
            dst, dbuf = _user(rows, cols, row_major, dtype, offset, fill=False)
        pairs.append((src, dst, dbuf))
    stream = torch.cuda.current_stream().cuda_stream
    device = torch.cuda.current_device()

    def line(i: int, unit: tuple[int, int] | None = None) -> None:
        src, dst, _ = pairs[i % sets]
        assert copy_lines(dst, src, row_major, stream, device, unit)

    def torch_copy(i: int) -> None:
        src, dst, _ = pairs[i % sets]
        dst.copy_(src)

    def memcpy2d(i: int) -> None:
        src, dst, _ = pairs[i % sets]
        assert sm90_realigned.copy_2d(dst, src, row_major, stream)

    methods = {"line_copy": line, "line_warp": lambda i: line(i, (32, 4)), "line_cta": lambda i: line(i, (256, 4)),
               "copy_": torch_copy, "memcpy2d": memcpy2d}
    # bit-exact against torch's copy, padding untouched
    checks = {}
    src, dst, dbuf = pairs[0]
    expect = dbuf.clone()
    expect_view = expect.as_strided(dst.shape, dst.stride(), dst.storage_offset() - dbuf.storage_offset())
    expect_view.copy_(src)
    for name, fn in methods.items():
        dbuf.fill_(SENTINEL[dtype])
        fn(0)
        torch.cuda.synchronize()
        checks[name] = bool(torch.equal(dbuf, expect))
    ms, behind = time_group(methods, repeat)
    tbs = {n: 2 * nbytes / (t * 1e-3) / 1e12 for n, t in ms.items()}
    return {"case": label, "dtype": dname, "rows": rows, "cols": cols, "row_major": row_major,
            "direction": direction, "offset": offset, "bytes": nbytes, "ms": ms, "tb_s": tbs, "exact": checks,
            "host_behind": behind}


#: Inner configurations `--parts --extra` can add to the shipped instances (name -> Sm90Config):
#: stream-K twins of the shipped tiles that also split a fuller last wave (K <= 80 k-tiles).
EXTRA_CONFIGS = {
    "coop128x256sk": Sm90Config((128, 256), (2, 1), "cooperative", swizzle=4, stream_k=True),
    "coop128x256sk80": Sm90Config((128, 256), (2, 1), "cooperative", swizzle=4, stream_k=True,
                                  sk_any_wave_max_k_tiles=80),
    "pp128x128sk80": Sm90Config((128, 128), (2, 1), "pingpong", swizzle=8, stream_k=True, sk_any_wave_max_k_tiles=80),
}


def _extra_instances(dtype: str, layouts: str, names: list[str]) -> dict:
    ab = {"bf16": DataType.bf16, "f16": DataType.f16}[dtype]
    strides = [ROW_MAJOR if c == "t" else COLUMN_MAJOR for c in layouts]
    return {n: sm90_realigned.Sm90RealignedGemm.instance(ab, ab, *strides, EXTRA_CONFIGS[n]) for n in names}


def _instances(dtype: str, layouts: str = "ttt") -> dict:
    want = {"coop128x256": "tile128x256x64_cluster2x1_cooperative_swz", "pp128x128": "tile128x128x64_cluster2x1_pingpong_swz"}
    found = {}
    for k in sm90_realigned.Sm90RealignedGemm.generate_kernels(None, cc=90):
        n = k.metadata.kernel_name
        if not n.startswith(f"Sm90RealignedGemm_{dtype}{dtype}_{dtype}_") or f"_{layouts}_" not in n:
            continue
        for short, part in want.items():
            if part in n:
                found[short] = k
    return found


def gemm_case(case: tuple, repeat: int) -> dict:
    label, dname, M, N, K = case
    dtype = DTYPES[dname]
    per_set = 2 * (M * K + K * N)
    sets = max(2, -(-ROTATE_BYTES // per_set))
    As = [torch.randn(M, K, device="cuda").to(dtype) for _ in range(sets)]
    Bs = [torch.randn(K, N, device="cuda").to(dtype) for _ in range(sets)]
    out = torch.empty(M, N, device="cuda", dtype=dtype)
    ref = torch.empty(M, N, device="cuda", dtype=dtype)
    args = [GemmArguments(As[i], Bs[i], out) for i in range(sets)]
    kernels = _instances(dname)
    fns, errors = {}, {}
    for short, k in kernels.items():
        assert k.supports(args[0]), (short, k.supports(args[0]))
        art = k.compile(args[0])
        ws = torch.empty(k.get_workspace_size(args[0]), device="cuda", dtype=torch.uint8)
        for copies in ("line_copy", "torch_copies"):
            use = copies == "line_copy"

            def run(i: int, k=k, art=art, ws=ws, use=use) -> None:
                sm90_realigned.USE_LINE_COPY = use
                k.run(args[i % sets], art, workspace=ws, assume_supported_args=True)

            fns[f"{short}+{copies}"] = run
    fns["cublas"] = lambda i: torch.matmul(As[i % sets], Bs[i % sets], out=ref)
    for name, fn in fns.items():
        if name == "cublas":
            continue
        out.fill_(float("nan"))
        fn(0)
        torch.matmul(As[0], Bs[0], out=ref)
        torch.cuda.synchronize()
        errors[name] = float(((out.float() - ref.float()).norm() / ref.float().norm()).item())
    ms, behind = time_group(fns, repeat)
    sm90_realigned.USE_LINE_COPY = True
    tflops = {n: 2 * M * N * K / (t * 1e-3) / 1e12 for n, t in ms.items()}
    return {"case": label, "M": M, "N": N, "K": K, "dtype": dname, "ms": ms, "tflops": tflops,
            "vs_cublas": {n: ms["cublas"] / t for n, t in ms.items()}, "rel_error_vs_cublas": errors,
            "host_behind": behind}


#: (label, dtype, M, N, K, B column-major): `--parts` cases, the odd group's and GPT-2's lm_head
#: over the whole vocabulary (B the (50257, 768) embedding read transposed: only out is staged).
PARTS_CASES = [
    ("f16 4097x4097x4097", "f16", 4097, 4097, 4097, False),
    ("bf16 4097x4097x4097", "bf16", 4097, 4097, 4097, False),
    ("bf16 4095x4096x4095", "bf16", 4095, 4096, 4095, False),
    ("bf16 4096x50257x4096", "bf16", 4096, 50257, 4096, False),
    ("bf16 2000x3000x1001", "bf16", 2000, 3000, 1001, False),
    ("bf16 8192x50257x768 tnt", "bf16", 8192, 50257, 768, True),
]


def parts_case(case: tuple, repeat: int, pitches: tuple[int, ...] = (0,), extra: tuple[str, ...] = (),
               cublas: bool = True) -> dict:
    """Where a realigned run's time goes, per instance: the whole run, its inner kernel alone on
    operands staged beforehand, and the staging copies alone (in, and out back), in one shuffled
    group with cuBLAS. ``whole - inner - copies`` is what running them in sequence adds.
    ``pitches``: the staged copies' pitch alignments (`sm90_realigned.STAGED_PITCH_BYTES`) to
    compare, each its own contestants (0: the module's); ``extra``: `EXTRA_CONFIGS` to add;
    ``cublas``: torch.matmul among the contestants (its reference output is computed anyway)."""
    label, dname, M, N, K, b_col = case
    dtype = DTYPES[dname]
    per_set = 2 * (M * K + K * N + M * N)
    sets = max(2, -(-ROTATE_BYTES // per_set))
    As = [torch.randn(M, K, device="cuda").to(dtype) for _ in range(sets)]
    Bs = [(torch.randn(N, K, device="cuda").to(dtype).t() if b_col else torch.randn(K, N, device="cuda").to(dtype))
          for _ in range(sets)]
    out = torch.empty(M, N, device="cuda", dtype=dtype)
    ref = torch.empty(M, N, device="cuda", dtype=dtype)
    args = [GemmArguments(As[i], Bs[i], out) for i in range(sets)]
    layouts = "tnt" if b_col else "ttt"
    kernels = _instances(dname, layouts) | _extra_instances(dname, layouts, list(extra))
    stream = torch.cuda.current_stream().cuda_stream
    device = torch.cuda.current_device()
    cu_stream = to_cuda_stream(torch.cuda.current_stream())
    default_pitch = sm90_realigned.STAGED_PITCH_BYTES
    fns, staged_names, contestants = {}, {}, []
    for pitch in [p or default_pitch for p in pitches]:
        sm90_realigned.STAGED_PITCH_BYTES = pitch
        suffix = f"@{pitch}" if len(pitches) > 1 else ""
        for short, k in kernels.items():
            art = k.compile(args[0])
            wss = [torch.empty(k.get_workspace_size(args[0]), device="cuda", dtype=torch.uint8) for _ in range(sets)]
            plan = k._plan(args[0])
            staged_names[pitch] = [f"{name} ld {stride}" for name, _, stride, _ in plan.staged]
            views = []
            for i in range(sets):
                v = {name: getattr(args[i], name) for name in plan.views}  # read in place
                staged = []
                for name, offset, stride, nbytes in plan.staged:
                    src = getattr(args[i], name)
                    dst = wss[i][offset:offset + nbytes].view(src.dtype).as_strided(src.shape, stride)
                    v[name] = dst
                    staged.append((name, dst, src))
                views.append((v, staged))
            inner_ws = [w[:plan.inner_bytes] if plan.inner_bytes else None for w in wss]

            def whole(i: int, k=k, art=art, wss=wss, pitch=pitch) -> None:
                sm90_realigned.STAGED_PITCH_BYTES = pitch
                k.run(args[i % sets], art, workspace=wss[i % sets], assume_supported_args=True)

            def inner(i: int, k=k, art=art, views=views, inner_ws=inner_ws) -> None:
                v, _ = views[i % sets]
                # (a stream-K inner kernel takes a new epoch per launch: _extra_launch_args)
                art.compiled_obj(v["A"], v["B"], v["out"], None, None, 1.0, 0.0,
                                 *k.inner._extra_launch_args(args[i % sets], inner_ws[i % sets]), cu_stream)

            for i in range(sets):  # stage every set once, so the inner kernel reads real operands
                for name, dst, src in views[i][1]:
                    if name != "out":
                        sm90_realigned.stage_copy(dst, src, k._row_major[name], stream, device)
            contestants.append(short + suffix)
            fns[f"{short}{suffix} whole"] = whole
            fns[f"{short}{suffix} inner"] = inner
            if f"copies{suffix}" not in fns:
                def copies(i: int, k=k, views=views) -> None:
                    for name, dst, src in views[i % sets][1]:
                        if name == "out":
                            sm90_realigned.stage_copy(src, dst, k._row_major[name], stream, device)
                        else:
                            sm90_realigned.stage_copy(dst, src, k._row_major[name], stream, device)

                fns[f"copies{suffix}"] = copies
    matmul = lambda i: torch.matmul(As[i % sets], Bs[i % sets], out=ref)  # noqa: E731
    if cublas:
        fns["cublas"] = matmul
    errors = {}
    for name in contestants:
        out.fill_(float("nan"))
        fns[f"{name} whole"](0)
        torch.matmul(As[0], Bs[0], out=ref)
        torch.cuda.synchronize()
        errors[name] = float(((out.float() - ref.float()).norm() / ref.float().norm()).item())
    ms, behind = time_group(fns, repeat)
    sm90_realigned.STAGED_PITCH_BYTES = default_pitch
    return {"case": label, "M": M, "N": N, "K": K, "dtype": dname, "b_col": b_col, "staged": staged_names,
            "contestants": contestants, "ms": ms, "rel_error_vs_cublas": errors, "host_behind": behind}


def parts_main(a: argparse.Namespace) -> None:
    pitches = tuple(int(p) for p in a.pitches.split(","))
    doc = result_doc(parts=[])
    device = doc["device"]
    lines = [f"{device}; ms (median of {a.gemm_repeat} shuffled launches per run, median over {a.runs} runs)",
             f"{'case':26s} {'instance':16s} {'whole':>8s} {'inner':>8s} {'copies':>8s} {'rest':>8s} {'cuBLAS':>8s}"]
    for case in [c for c in PARTS_CASES if re.search(a.cases, c[0])]:
        extra = tuple(n for n in a.extra.split(",") if n)
        runs = [parts_case(case, a.gemm_repeat, pitches, extra, not a.no_cublas) for _ in range(a.runs)]
        doc["parts"].append({"case": case[0], "runs": runs})
        med = {n: statistics.median([r["ms"][n] for r in runs]) for n in runs[0]["ms"]}
        for name in runs[0]["contestants"]:
            suffix = name[name.index("@"):] if "@" in name else ""
            pitch = int(suffix[1:]) if suffix else sm90_realigned.STAGED_PITCH_BYTES
            w, i, c = med[f"{name} whole"], med[f"{name} inner"], med[f"copies{suffix}"]
            lines.append(f"{case[0]:26s} {name:16s} {w:8.4f} {i:8.4f} {c:8.4f} {w - i - c:8.4f} {med.get('cublas', 0):8.4f}"
                         f"  (staged: {', '.join(runs[0]['staged'][pitch])}; err {runs[0]['rel_error_vs_cublas'][name]:.1e})")
            print(lines[-1], flush=True)
    write_result_with_text(result_name("realign_parts", device, a.tag), doc, lines)
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--gemm-repeat", type=int, default=20)
    p.add_argument("--runs", type=int, default=2, help="GEMM groups per case (the spread)")
    p.add_argument("--tag", default="")
    p.add_argument("--skip-gemm", action="store_true")
    p.add_argument("--parts", action="store_true",
                   help="only where each realigned GEMM's time goes: whole run, inner kernel, copies (PARTS_CASES)")
    p.add_argument("--cases", default="", help="--parts: a regular expression the case labels must match")
    p.add_argument("--no-cublas", action="store_true", help="--parts: leave torch.matmul out of the timed group")
    p.add_argument("--extra", default="", help=f"--parts: inner configurations to add ({', '.join(EXTRA_CONFIGS)})")
    p.add_argument("--pitches", default="0",
                   help="--parts: staged pitch alignments in bytes to compare, e.g. 16,128 (0: the module's)")
    a = p.parse_args()
    if a.parts:
        parts_main(a)
        return
    doc = result_doc(copy_rate_tb_s=copy_rate(), copies=[], gemms=[])
    device = doc["device"]
    lines = [f"{device}; device copy rate {doc['copy_rate_tb_s']:.2f} TB/s (read + write)", "",
             f"{'copy':28s} {'line_copy':>10s} {'warp':>6s} {'cta':>6s} {'copy_':>10s} {'memcpy2d':>10s}   TB/s; "
             f"all exact"]
    for case in COPY_CASES:
        r = copy_case(case, a.repeat)
        doc["copies"].append(r)
        t = r["tb_s"]
        lines.append(f"{r['case']:28s} {t['line_copy']:10.2f} {t['line_warp']:6.2f} {t['line_cta']:6.2f} "
                     f"{t['copy_']:10.2f} {t['memcpy2d']:10.2f}   {all(r['exact'].values())}")
        print(lines[-1], flush=True)
    if not a.skip_gemm:
        lines += ["", "GEMM (realigned instance + copies), ms per run; ratio cuBLAS / ours"]
        for case in GEMM_CASES:
            runs = [gemm_case(case, a.gemm_repeat) for _ in range(a.runs)]
            doc["gemms"].append({"case": case[0], "runs": runs})
            names = [n for n in runs[0]["ms"] if n != "cublas"]
            for n in names:
                ratios = [r["vs_cublas"][n] for r in runs]
                lines.append(f"{case[0]:24s} {n:26s} {statistics.median([r['ms'][n] for r in runs]):8.4f} ms  "
                             f"{statistics.median([r['tflops'][n] for r in runs]):6.1f} TF/s  "
                             f"x{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]  "
                             f"err {runs[0]['rel_error_vs_cublas'][n]:.1e}")
                print(lines[-1], flush=True)
            lines.append(f"{case[0]:24s} {'cublas':26s} {statistics.median([r['ms']['cublas'] for r in runs]):8.4f} ms")
            print(lines[-1], flush=True)
    write_result_with_text(result_name("realign_copy", device, a.tag), doc, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
