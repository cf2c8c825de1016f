"""Decode attention against a KV cache: kernel_api's CUDA C++ kernel (`CudaAttentionDecode`,
through a bound `Kernel.run`) against torch's SDPA (its default backend; GQA with
``enable_gqa=True``) and FlashAttention-4 (``flash_attn.cute``) when importable, in one process.

Each case times the contestants alternately (`house_timing.time_group`: shuffled order, each
launch between its own CUDA events, queued behind a sleep kernel so host time stays out), on
operand sets rotated past the L2 cache, and prints the effective bandwidth (TB/s: the bytes of
K and V read once plus q read and out written, counted the same for every contestant) and our
speedup over each anchor (ratio > 1: ours is faster). Non-causal, as SDPA's ``is_causal`` is
aligned top-left; with one query the mask is empty anyway.

KV caches of per-row lengths (``cache_seqlens``, FlashAttention's kvcache form) come first: batch
64 over a preallocated 4096-token cache, rows' lengths spread over 128-4096 or all equal (128,
1024, 4096). Ours reads the lengths on the device; the anchors are SDPA given the equivalent
boolean mask over the whole cache (what torch offers for such a batch), SDPA on the ``[:, :L]``
views when every row holds L (per-length: SDPA at its best), our kernel on those views, and
FA4 with ``seqused_k`` when importable. Their TB/s count only the keys the rows hold.

    python3 benchmarks/attention_decode.py [--quick] [--fa4] [--sweep] [--tilings] [--cases all|cache|dense] [--tag TAG]

``--sweep`` also times our kernel at every fixed split count (`SPLITS`), to tune `plan`;
``--tilings`` at every tiling (`TILINGS`: keys per chunk, ring depth, CTAs per SM).
JSON: benchmarks/results/attention_decode-<device>[-<tag>].json (and $OUT when set).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import results_io  # noqa: E402
from house_timing import geomean, time_group  # noqa: E402

from kernel_api.arguments.attention import AttentionArguments  # noqa: E402
from kernel_api.providers.cuda_src.kernels.attention_decode import (  # noqa: E402
    D64_LONG, D64_MANY_WAVES, D64_SHORT_ONE_WAVE, DEFAULT_TILING, SPLITS, CudaAttentionDecode, plan)

#: Operand bytes rotated through per case: past the H200's L2 several times over.
ROTATE_BYTES = 256 << 20
#: (batch, heads_q, heads_kv, head_dim, seqlen_q, seqlen_k)
FULL = [(b, hq, hkv, d, lq, sk) for b in (64, 8, 1) for hq, hkv in ((32, 8), (32, 32)) for d in (128, 64)
        for lq in (1, 4) for sk in (128, 512, 1024, 4096)]
QUICK = ([(64, hq, hkv, 128, lq, sk) for hq, hkv in ((32, 8), (32, 32)) for lq in (1, 4)
          for sk in (128, 512, 1024, 4096)]
         + [(b, 32, 8, 128, 1, sk) for b in (8, 1) for sk in (1024, 4096)]
         + [(64, 32, 8, 64, 1, sk) for sk in (128, 512, 1024, 2048, 4096)]
         + [(64, 32, 32, 64, 1, 1024), (64, 12, 12, 64, 1, 128), (8, 32, 8, 64, 1, 4096)])
#: ``--tilings``: our kernel with each of these tilings (the plan's splits for each), beside the
#: shipped choice.
TILINGS = {"default": DEFAULT_TILING, "d64_short_one_wave": D64_SHORT_ONE_WAVE, "d64_long": D64_LONG,
           "d64_many_waves": D64_MANY_WAVES}


#: KV caches of per-row lengths: (batch, heads_q, heads_kv, head_dim, seqlen_q, capacity, lengths),
#: lengths "spread" (uniform over 128..capacity, seeded) or every row's.
CACHE_CASES = [(64, 32, 8, 128, 1, 4096, "spread"), (64, 32, 8, 128, 1, 4096, 128), (64, 32, 8, 128, 4, 4096, "spread"),
               (64, 32, 8, 128, 1, 4096, 1024), (64, 32, 8, 128, 1, 4096, 4096)]


def _fa4_kvcache():
    """FA4's forward taking ``seqused_k`` (its kvcache lengths), or None."""
    try:
        from flash_attn.cute.interface import _flash_attn_fwd
    except Exception:  # noqa: BLE001 - not installed, or its import fails here
        return None
    return _flash_attn_fwd


def _fa4():
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # noqa: BLE001 - not installed, or its import fails here
        return None
    return flash_attn_func


def _sdpa_backend(q, k, v, gqa, mask=None):
    """The backend SDPA's dispatcher picks for these operands (its name), or "?"."""
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(int(torch._fused_sdp_choice(q, k, v, attn_mask=mask, enable_gqa=gqa))).name
    except Exception:  # noqa: BLE001 - a private helper: absent or changed in this torch
        return "?"


def _bytes(b, hq, hkv, d, lq, sk, element):
    return element * d * b * (2 * sk * hkv + 2 * lq * hq)


def _add_split_sweep(fns, args, sets):
    """Our kernel at every fixed split count (`SPLITS`), as ``fns["ours_cl<n>"]`` over the
    rotated argument sets (each instance run once first, so its compile is not timed)."""
    for cl in SPLITS:
        fixed = next(kk for kk in CudaAttentionDecode.generate_kernels(None) if kk.supports(args[0]))
        fixed.splits = cl
        fixed.run(args[0])
        fns[f"ours_cl{cl}"] = (lambda t: lambda i: t.run(args[i % sets]))(fixed)


def _add_tilings(fns, args, sets):
    """Our kernel with every tiling of `TILINGS` (its head dim's), as ``fns["ours_<name>"]``."""
    for name, tiling in TILINGS.items():
        if name != "default" and args[0].head_dim != 64:
            continue
        fixed = next(kk for kk in CudaAttentionDecode.generate_kernels(None) if kk.supports(args[0]))
        fixed.tiling = tiling
        fixed.run(args[0])
        fns[f"ours_{name}"] = (lambda t: lambda i: t.run(args[i % sets]))(fixed)


def run_case(case, dtype, repeat, fa4, sweep, tilings=False):
    b, hq, hkv, d, lq, sk = case
    element = torch.tensor([], dtype=dtype).element_size()
    moved = _bytes(b, hq, hkv, d, lq, sk, element)
    sets = max(1, min(8, ROTATE_BYTES // moved))
    ops = []
    for _ in range(sets):
        q = torch.randn(b, lq, hq, d, device="cuda").to(dtype)
        k = torch.randn(b, sk, hkv, d, device="cuda").to(dtype)
        v = torch.randn(b, sk, hkv, d, device="cuda").to(dtype)
        ops.append((q, k, v, torch.empty_like(q)))
    args = [AttentionArguments(q, k, v, o) for q, k, v, o in ops]
    kernel = next(kk for kk in CudaAttentionDecode.generate_kernels(None) if kk.supports(args[0]))
    kernel.run(args[0])
    torch.cuda.synchronize()
    ref = F.scaled_dot_product_attention(ops[0][0].transpose(1, 2), ops[0][1].transpose(1, 2),
                                         ops[0][2].transpose(1, 2), enable_gqa=hq != hkv).transpose(1, 2)
    err = float((ops[0][3].float() - ref.float()).abs().max())
    gqa = {"enable_gqa": True} if hq != hkv else {}
    backend = _sdpa_backend(*(t.transpose(1, 2) for t in ops[0][:3]), hq != hkv)
    fns = {
        "ours": lambda i: kernel.run(args[i % sets]),
        "sdpa": lambda i: F.scaled_dot_product_attention(ops[i % sets][0].transpose(1, 2),
                                                         ops[i % sets][1].transpose(1, 2),
                                                         ops[i % sets][2].transpose(1, 2), **gqa),
    }
    if fa4 is not None:
        try:
            fa4(*ops[0][:3])
            torch.cuda.synchronize()
            fns["fa4"] = lambda i: fa4(*ops[i % sets][:3])
        except Exception as exc:  # noqa: BLE001 - a shape FA4 does not take: left out
            print(f"  fa4 failed: {type(exc).__name__}: {str(exc)[:120]}")
    if sweep:
        _add_split_sweep(fns, args, sets)
    if tilings:
        _add_tilings(fns, args, sets)
    times, behind = time_group(fns, repeat)
    torch.cuda.synchronize()
    p = plan(args[0], torch.cuda.get_device_properties(0).multi_processor_count)
    row = {"case": dict(batch=b, heads_q=hq, heads_kv=hkv, head_dim=d, seqlen_q=lq, seqlen_k=sk,
                        dtype=str(dtype)[6:]),
           "plan": dict(mw=p.mw, splits=p.cl, grid=p.grid, tiling=list(vars(p.tiling).values())), "bytes": moved,
           "max_abs_err_vs_sdpa": err, "sdpa_backend": backend,
           "ms": times, "tbps": {n: moved / (t * 1e-3) / 1e12 for n, t in times.items()},
           "ratio": {n: times[n] / times["ours"] for n in times if n != "ours"}, "host_behind": behind}
    return row


def _row_lengths(batch, capacity, rule):
    if rule == "spread":
        g = torch.Generator().manual_seed(batch * 7 + capacity)
        return torch.randint(128, capacity + 1, (batch,), generator=g, dtype=torch.int32)
    return torch.full((batch,), rule, dtype=torch.int32)


def run_cache_case(case, dtype, repeat, fa4, sweep=False):
    """One KV cache of per-row lengths: ours (`CudaAttentionDecode` with ``cache_seqlens``), SDPA
    with the equivalent mask, SDPA and ours on ``[:, :L]`` views when the lengths are equal, and
    FA4 with ``seqused_k``; causal when there is more than one query."""
    from kernel_api.arguments.attention_math import cache_mask

    b, hq, hkv, d, lq, cap, rule = case
    causal = lq > 1
    lengths = _row_lengths(b, cap, rule)
    element = torch.tensor([], dtype=dtype).element_size()
    moved = element * d * (2 * hkv * int(lengths.sum()) + 2 * lq * hq * b)  # the keys the rows hold
    sets = max(1, min(8, ROTATE_BYTES // moved))
    n = lengths.cuda()
    mask = cache_mask(n, lq, cap, causal)
    ops, args = [], []
    for _ in range(sets):
        q = torch.randn(b, lq, hq, d, device="cuda").to(dtype)
        k = torch.randn(b, cap, hkv, d, device="cuda").to(dtype)
        v = torch.randn(b, cap, hkv, d, device="cuda").to(dtype)
        ops.append((q, k, v, torch.empty_like(q)))
        args.append(AttentionArguments(q, k, v, ops[-1][3], causal=causal, cache_seqlens=n))
    kernel = next(kk for kk in CudaAttentionDecode.generate_kernels(None) if kk.supports(args[0]))
    kernel.run(args[0])
    gqa = {"enable_gqa": True} if hq != hkv else {}

    def sdpa_mask(i):
        q, k, v, _ = ops[i % sets]
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, **gqa)

    ref = sdpa_mask(0).transpose(1, 2)
    torch.cuda.synchronize()
    err = float((ops[0][3].float() - ref.float()).abs().max())
    backend = _sdpa_backend(*(t.transpose(1, 2) for t in ops[0][:3]), hq != hkv, mask)
    fns = {"ours": lambda i: kernel.run(args[i % sets]), "sdpa_mask": sdpa_mask}
    if rule != "spread" and not causal:
        length = int(rule)
        views = [(q, k[:, :length], v[:, :length], torch.empty_like(q)) for q, k, v, _ in ops]
        dense = [AttentionArguments(*t) for t in views]
        twin = next(kk for kk in CudaAttentionDecode.generate_kernels(None) if kk.supports(dense[0]))
        twin.run(dense[0])
        fns["sdpa"] = lambda i: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in views[i % sets][:3]),
                                                               **gqa)
        fns["ours_dense"] = lambda i: twin.run(dense[i % sets])
    if fa4 is not None:
        try:
            got = fa4(*ops[0][:3], seqused_k=n, causal=causal)[0]
            torch.cuda.synchronize()
            fa4_err = float((got.float() - ref.float()).abs().max())
            if fa4_err > 0.1:
                print(f"  fa4 kvcache disagrees with SDPA (max err {fa4_err:.2e}): left out")
            else:
                fns["fa4_kvcache"] = lambda i: fa4(*ops[i % sets][:3], seqused_k=n, causal=causal)
        except Exception as exc:  # noqa: BLE001 - a shape or build FA4 does not take: left out
            print(f"  fa4 kvcache failed: {type(exc).__name__}: {str(exc)[:160]}")
    if sweep:
        _add_split_sweep(fns, args, sets)
    times, behind = time_group(fns, repeat)
    torch.cuda.synchronize()
    p = plan(args[0], torch.cuda.get_device_properties(0).multi_processor_count)
    return {"case": dict(batch=b, heads_q=hq, heads_kv=hkv, head_dim=d, seqlen_q=lq, capacity=cap,
                         lengths=rule if rule == "spread" else int(rule), mean_length=float(lengths.float().mean()),
                         causal=causal, dtype=str(dtype)[6:]),
            "plan": dict(mw=p.mw, splits=p.cl, grid=p.grid), "bytes": moved, "max_abs_err_vs_sdpa": err,
            "sdpa_mask_backend": backend,
            "ms": times, "tbps": {name: moved / (t * 1e-3) / 1e12 for name, t in times.items()},
            "ratio": {name: times[name] / times["ours"] for name in times if name != "ours"}, "host_behind": behind}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 64 and a few smaller cases, bf16")
    parser.add_argument("--fa4", action="store_true", help="also time flash_attn.cute (compiles per shape)")
    parser.add_argument("--sweep", action="store_true", help="also time every fixed split count")
    parser.add_argument("--tilings", action="store_true", help="also time every tiling (keys per chunk, ring, CTAs per SM)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "f16"))
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--budget-s", type=float, default=0.0, help="stop starting cases after this many seconds")
    parser.add_argument("--cases", default="all", choices=("all", "cache", "dense"),
                        help="KV caches of per-row lengths, dense caches, or both")
    parser.add_argument("--tag", default="")
    opts = parser.parse_args()
    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float16
    fa4 = _fa4() if opts.fa4 else None
    cases = (QUICK if opts.quick else FULL) if opts.cases != "cache" else []
    start = time.perf_counter()
    rows, lines, cache_rows = [], [], []
    for case in CACHE_CASES if opts.cases != "dense" else []:
        if opts.budget_s and time.perf_counter() - start > opts.budget_s:
            lines.append(f"budget spent: {len(cache_rows)} of {len(CACHE_CASES)} cache cases")
            print(lines[-1])
            break
        row = run_cache_case(case, dtype, opts.repeat, _fa4_kvcache() if opts.fa4 else None, opts.sweep)
        cache_rows.append(row)
        b, hq, hkv, d, lq, cap, rule = case
        parts = [f"{n} {row['ms'][n] * 1e3:7.1f} us {row['tbps'][n]:4.2f} TB/s" for n in row["ms"]]
        ratios = " ".join(f"x{row['ratio'][n]:.2f} vs {n}" for n in row["ratio"])
        line = (f"cache b{b} h{hq}/{hkv} d{d} q{lq} cap{cap} lengths {rule} (splits {row['plan']['splits']}): "
                + " | ".join(parts) + f" || {ratios} (err {row['max_abs_err_vs_sdpa']:.1e}, "
                f"sdpa_mask {row['sdpa_mask_backend']})")
        lines.append(line)
        print(line, flush=True)
    for anchor in ("sdpa_mask", "sdpa", "ours_dense", "fa4_kvcache"):
        got = [r["ratio"][anchor] for r in cache_rows if anchor in r["ratio"]]
        if got:
            lines.append(f"cache: geomean speedup vs {anchor}: {geomean(got):.3f} over {len(got)} cases "
                         f"(min {min(got):.2f})")
            print(lines[-1])
    for case in cases:
        if opts.budget_s and time.perf_counter() - start > opts.budget_s:
            lines.append(f"budget spent: {len(rows)} of {len(cases)} cases")
            print(lines[-1])
            break
        row = run_case(case, dtype, opts.repeat, fa4, opts.sweep, opts.tilings)
        rows.append(row)
        b, hq, hkv, d, lq, sk = case
        parts = [f"{n} {row['ms'][n] * 1e3:7.1f} us {row['tbps'][n]:4.2f} TB/s" for n in row["ms"]]
        ratios = " ".join(f"x{row['ratio'][n]:.2f} vs {n}" for n in row["ratio"])
        tiling = "/".join(map(str, row["plan"]["tiling"]))
        line = (f"b{b} h{hq}/{hkv} d{d} q{lq} k{sk} (splits {row['plan']['splits']}, tiling {tiling}): "
                + " | ".join(parts)
                + f" || {ratios} (err {row['max_abs_err_vs_sdpa']:.1e}, sdpa {row['sdpa_backend']})")
        lines.append(line)
        print(line, flush=True)
    for anchor in ("sdpa", "fa4"):
        got = [r["ratio"][anchor] for r in rows if anchor in r["ratio"]]
        if got:
            lines.append(f"geomean speedup vs {anchor}: {geomean(got):.3f} over {len(got)} cases "
                         f"(min {min(got):.2f})")
            print(lines[-1])
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": opts.dtype, "rows": rows,
           "cache_rows": cache_rows}
    name = results_io.result_name("attention_decode", torch.cuda.get_device_name(), opts.tag)
    for path in results_io.write_result_with_text(name, doc, lines):
        print("wrote", path)


if __name__ == "__main__":
    main()
