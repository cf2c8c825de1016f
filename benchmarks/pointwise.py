"""SwiGLU, GeGLU and RoPE: kernel_api's ops against torch eager, torch.compile of the same
function, and Liger (liger_kernel.ops), forward and forward+backward, in one process.

Each case times the contestants alternately (`house_timing.time_group`: shuffled order, each
launch between its own CUDA events, queued behind a sleep kernel so host time stays out), on
input sets rotated past the L2 cache, and prints the effective bandwidth (TB/s: the bytes a
one-pass kernel moves, counted the same for every contestant) and our speedup over each anchor.
Small cases also time back-to-back calls as called (host time included: what a model sees).

Bytes counted: gated activation forward 3 operands (gate, up read; out written), backward 5
(grad_out, gate, up read; two gradients written), forward+backward 8; RoPE forward q and k
read and written plus cos and sin read once, backward the same again.

    python3 benchmarks/pointwise.py [--quick] [--tag TAG]

JSON: benchmarks/results/pointwise-<device>[-<tag>].json (and $OUT when set).
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

import kernel_api  # noqa: E402
from kernel_api import ops  # noqa: E402

#: Input bytes rotated through per case: past the H200's 50 MB L2 several times over.
ROTATE_BYTES = 256 << 20
#: Gated activation shapes (rows, cols) and RoPE shapes (batch, heads_q, heads_k, seq, head_dim):
#: Llama-3-8B's MLP at 16384 tokens and its attention at batch 4 x 2048 (>= 64 MB each), and small ones.
GLU_SHAPES = [(16384, 14336), (4096, 14336), (512, 4096)]
ROPE_SHAPES = [(4, 32, 8, 2048, 128), (1, 32, 8, 4096, 128), (1, 32, 8, 128, 128)]
SMALL_BYTES = 64 << 20  # cases below this also time calls as called


def _liger():
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as exc:  # noqa: BLE001 - the benchmark runs without Liger, saying so
        print(f"liger_kernel unavailable: {exc}")
        return None
    return {"swiglu": LigerSiLUMulFunction.apply, "geglu": LigerGELUMulFunction.apply,
            "rope": LigerRopeFunction.apply}


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def hf_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def eager_swiglu(g, u):
    return F.silu(g) * u


def eager_geglu(g, u):
    return F.gelu(g, approximate="tanh") * u


def _sets(one_set_bytes: int) -> int:
    return max(2, min(16, -(-ROTATE_BYTES // max(one_set_bytes, 1))))


def _as_called_us(fn, sets: int, calls: int = 200) -> float:
    """Mean microseconds per call of back-to-back calls, host time included."""
    for i in range(10):
        fn(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / calls


def _warmed(runs: dict) -> dict:
    """``runs`` after one call each (compiles, warms up), less any contestant whose call raised
    (printed): one anchor's failure leaves the others' comparison standing. Ours must run."""
    kept = {}
    for name, run in runs.items():
        try:
            run(0)
        except Exception as exc:  # noqa: BLE001 - reported, the contestant left out
            if name == "kernel_api":
                raise
            print(f"  {name} left out: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        kept[name] = run
    torch.cuda.synchronize()
    return kept


def _chosen(args) -> str:
    from kernel_api.tuning.pick_any import PickAny

    return PickAny().choose(args, kernel_api.get_kernels(args)).name


def _report(label: str, times: dict, nbytes: int, extra: dict) -> dict:
    ours = times["kernel_api"]
    entry = {"case": label, "bytes": nbytes, **extra, "ms": times,
             "tbs": {n: nbytes / (t * 1e-3) / 1e12 for n, t in times.items()},
             "speedup": {n: t / ours for n, t in times.items() if n != "kernel_api"}}
    tbs = " ".join(f"{n} {v:.2f}" for n, v in entry["tbs"].items())
    ratios = " ".join(f"x{n} {v:.2f}" for n, v in entry["speedup"].items())
    print(f"{label:<52} TB/s: {tbs} | ours vs: {ratios}", flush=True)
    if "as_called_us" in entry:
        called = " ".join(f"{n} {v:.1f}" for n, v in entry["as_called_us"].items())
        print(f"{'':<52} us/call as called: {called}", flush=True)
    return entry


def glu_case(kind: str, rows: int, cols: int, backward: bool, liger, compiled: dict, repeat: int) -> dict:
    dtype = torch.bfloat16
    n = rows * cols
    sets = _sets(3 * n * 2)
    gen = torch.Generator(device="cuda").manual_seed(rows + cols)
    grad = backward
    G = [torch.randn(rows, cols, device="cuda", dtype=dtype, generator=gen).requires_grad_(grad) for _ in range(sets)]
    U = [torch.randn(rows, cols, device="cuda", dtype=dtype, generator=gen).requires_grad_(grad) for _ in range(sets)]
    D = [torch.randn(rows, cols, device="cuda", dtype=dtype, generator=gen) for _ in range(sets)] if backward else None
    ours_fn = ops.swiglu if kind == "swiglu" else ops.geglu
    eager_fn = eager_swiglu if kind == "swiglu" else eager_geglu
    fns = {"kernel_api": ours_fn, "eager": eager_fn, "compile": compiled[kind]}
    if liger is not None:
        fns["liger"] = liger[kind]

    def runner(fn):
        if backward:
            def run(i):
                j = i % sets
                torch.autograd.grad(fn(G[j], U[j]), (G[j], U[j]), D[j])
        else:
            def run(i):
                j = i % sets
                with torch.no_grad():
                    fn(G[j], U[j])
        return run

    runs = {name: runner(fn) for name, fn in fns.items()}
    with torch.no_grad():  # agreement with eager on one set (Liger's forward is checked by its own tests)
        err = (ours_fn(G[0], U[0]).float() - eager_fn(G[0], U[0]).float()).abs().max().item()
    runs = _warmed(runs)
    times, behind = time_group(runs, repeat)
    nbytes = (8 if backward else 3) * n * 2
    from kernel_api.arguments import GatedActivationArguments

    with torch.no_grad():
        chosen = _chosen(GatedActivationArguments(G[0], U[0], torch.empty_like(G[0]),
                                                  activation="silu" if kind == "swiglu" else "gelu_tanh"))
    extra = {"op": kind, "shape": [rows, cols], "dtype": "bf16", "backward": backward, "chosen": chosen,
             "max_abs_diff_vs_eager": err, "host_behind": behind}
    if nbytes < SMALL_BYTES:
        extra["as_called_us"] = {name: _as_called_us(run, sets) for name, run in runs.items()}
    label = f"{kind} {rows}x{cols} bf16 {'fwd+bwd' if backward else 'fwd'}"
    return _report(label, times, nbytes, extra)


def rope_case(b: int, hq: int, hk: int, s: int, d: int, backward: bool, liger, compiled: dict, repeat: int) -> dict:
    dtype = torch.bfloat16
    elems = b * s * d * (hq + hk)
    sets = _sets(2 * elems * 2)
    gen = torch.Generator(device="cuda").manual_seed(b * s + d)

    def heads(h):  # transformers' layout: a transposed view of the (b, s, h, d) projection
        return torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2).requires_grad_(
            backward)

    Q = [heads(hq) for _ in range(sets)]
    K = [heads(hk) for _ in range(sets)]
    pos = torch.arange(s, device="cuda", dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)[None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    DQ = [torch.randn(b, s, hq, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2) for _ in range(sets)] \
        if backward else None
    DK = [torch.randn(b, s, hk, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2) for _ in range(sets)] \
        if backward else None
    fns = {"kernel_api": lambda q, k: ops.rope(q, k, cos, sin), "eager": lambda q, k: hf_rope(q, k, cos, sin),
           "compile": lambda q, k: compiled["rope"](q, k, cos, sin)}
    if liger is not None:
        fns["liger"] = lambda q, k: liger["rope"](q, k, cos, sin)

    def runner(fn):
        if backward:
            def run(i):
                j = i % sets
                torch.autograd.grad(fn(Q[j], K[j]), (Q[j], K[j]), (DQ[j], DK[j]))
        else:
            def run(i):
                j = i % sets
                with torch.no_grad():
                    fn(Q[j], K[j])
        return run

    runs = {name: runner(fn) for name, fn in fns.items()}
    with torch.no_grad():
        ours = ops.rope(Q[0], K[0], cos, sin)
        want = hf_rope(Q[0], K[0], cos, sin)
        err = max((a.float() - w.float()).abs().max().item() for a, w in zip(ours, want))
    runs = _warmed(runs)  # (Liger rotates q and k in place: values change, sizes do not)
    times, behind = time_group(runs, repeat)
    nbytes = (2 if backward else 1) * (2 * elems + 2 * s * d) * 2
    from kernel_api.arguments import RopeArguments

    with torch.no_grad():
        chosen = _chosen(RopeArguments(Q[0], K[0], cos, sin, torch.empty_like(Q[0]), torch.empty_like(K[0])))
    extra = {"op": "rope", "shape": [b, hq, hk, s, d], "layout": "transposed (b, s, h, d) views", "dtype": "bf16",
             "backward": backward, "chosen": chosen, "max_abs_diff_vs_eager": err, "host_behind": behind}
    if nbytes < SMALL_BYTES:
        extra["as_called_us"] = {name: _as_called_us(run, sets) for name, run in runs.items()}
    label = f"rope b{b} hq{hq} hk{hk} s{s} d{d} bf16 {'fwd+bwd' if backward else 'fwd'}"
    return _report(label, times, nbytes, extra)


def _variant_launches(kernel, module, settings: dict, arg_sets: list) -> list:
    """The recorded launches of ``kernel`` for each arguments object of ``arg_sets``, with the
    interface module's constants set to ``settings`` while compiling and recording (restored
    after): each launch keeps its own grid, block and constants."""
    settings = dict(settings)
    defines = settings.pop("defines", None)
    saved = {name: getattr(module, name) for name in settings}
    try:
        for name, value in settings.items():
            if isinstance(saved[name], dict):
                setattr(module, name, {**saved[name], **value})
            else:
                setattr(module, name, value)
        if defines is not None:
            kernel.defines = defines  # (an instance attribute over the class's; the compile key holds it)
        artifact = kernel.compile(arg_sets[0])
        return [kernel._recorded(a, artifact) for a in arg_sets]
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        kernel.__dict__.pop("defines", None)


def _time_variants(label: str, kernel, module, variants: dict, arg_sets: list, nbytes: int, repeat: int) -> dict:
    stream = torch.cuda.current_stream().cuda_stream
    tensors = [[getattr(a, n) for n in a.tensor_attributes] for a in arg_sets]
    fns = {}
    for name, settings in variants.items():
        launches = _variant_launches(kernel, module, settings, arg_sets)
        fns[name] = (lambda L, T: lambda i: L[i % len(L)].function(*T[i % len(T)], stream))(launches, tensors)
    for fn in fns.values():
        fn(0)
    torch.cuda.synchronize()
    times, _ = time_group(fns, repeat)
    tbs = {n: nbytes / (t * 1e-3) / 1e12 for n, t in times.items()}
    ranked = sorted(tbs.items(), key=lambda kv: -kv[1])
    print(f"sweep {label}: " + " ".join(f"{n} {v:.2f}" for n, v in ranked), flush=True)
    return {"case": label, "tbs": tbs, "ms": times}


#: Build variants of the gated activation kernels at the default THREADS and UNROLL: the precise
#: math for 16-bit types, and the cache hints of the 16-byte accesses.
GLU_DEFINES = {
    "precise_math": {"KA_GLU_FAST": "0"},
    "ld_nc": {"KA_GLU_LD16": '"ld.global.nc.v4.u32"'},
    "ld_plain": {"KA_GLU_LD16": '"ld.global.v4.u32"'},
    "st_cs": {"KA_GLU_ST16": '"st.global.cs.v4.u32"'},
    "ld_plain_st_cs": {"KA_GLU_LD16": '"ld.global.v4.u32"', "KA_GLU_ST16": '"st.global.cs.v4.u32"'},
}


def _copy_rate(repeat: int) -> dict:
    """torch's copy of 1 GiB (bf16), read and written: the bandwidth the sweep's rates compare with."""
    src = [torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    dst = [torch.empty_like(t) for t in src]
    ms, _ = time_group({"copy": lambda i: dst[i % 2].copy_(src[i % 2])}, repeat)
    tbs = 2 * src[0].numel() * 2 / (ms["copy"] * 1e-3) / 1e12
    print(f"sweep torch copy of 1 GiB: {tbs:.2f} TB/s", flush=True)
    return {"case": "torch copy 1 GiB", "tbs": {"copy": tbs}, "ms": ms}


def sweep(repeat: int) -> list:
    """Our kernels' build constants on the >= 64 MB shapes: the gated activation's CTA size
    (THREADS), vectors per thread (UNROLL), math and cache hints (`GLU_DEFINES`), RoPE's heads per
    thread (HEADS_PER_THREAD)."""
    from kernel_api.arguments import GatedActivationArguments, GatedActivationBackwardArguments, RopeArguments
    from kernel_api.providers.cuda_src.kernels import rope as rope_module
    from kernel_api.providers.cuda_src.kernels import swiglu as glu_module

    out = []
    dtype = torch.bfloat16
    out.append(_copy_rate(repeat))
    rows, cols = GLU_SHAPES[0]
    for backward, activation in ((False, "silu"), (True, "silu"), (False, "gelu_tanh"), (True, "gelu_tanh")):
        sets = _sets(3 * rows * cols * 2)
        if backward:
            arg_sets = [GatedActivationBackwardArguments(*[torch.randn(rows, cols, device="cuda", dtype=dtype)
                                                           for _ in range(3)],
                                                         torch.empty(rows, cols, device="cuda", dtype=dtype),
                                                         torch.empty(rows, cols, device="cuda", dtype=dtype),
                                                         activation=activation)
                        for _ in range(sets)]
        else:
            arg_sets = [GatedActivationArguments(torch.randn(rows, cols, device="cuda", dtype=dtype),
                                                 torch.randn(rows, cols, device="cuda", dtype=dtype),
                                                 torch.empty(rows, cols, device="cuda", dtype=dtype),
                                                 activation=activation)
                        for _ in range(sets)]
        kernel = next(k for k in kernel_api.get_kernels(arg_sets[0]) if k.name.endswith("_v8"))
        variants = {f"t{t}_u{u}": {"THREADS": t, "UNROLL": {backward: u}} for t in (128, 256) for u in (1, 2, 4)}
        variants.update({f"default_{name}": {"defines": defines} for name, defines in GLU_DEFINES.items()})
        nbytes = (5 if backward else 3) * rows * cols * 2
        label = f"{'glu_bwd' if backward else 'glu_fwd'} {activation} {rows}x{cols}"
        out.append(_time_variants(label, kernel, glu_module, variants, arg_sets, nbytes, repeat))
        del arg_sets
        torch.cuda.empty_cache()
    b, hq, hk, s, d = ROPE_SHAPES[0]
    for layout in ("transposed", "contiguous"):
        def heads(h):
            if layout == "transposed":
                return torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
            return torch.randn(b, h, s, d, device="cuda", dtype=dtype)
        cos, sin = torch.randn(1, s, d, device="cuda", dtype=dtype), torch.randn(1, s, d, device="cuda", dtype=dtype)
        sets = _sets(2 * b * s * d * (hq + hk) * 2)
        arg_sets = []
        for _ in range(sets):
            q, k = heads(hq), heads(hk)
            arg_sets.append(RopeArguments(q, k, cos, sin, torch.empty_like(q), torch.empty_like(k)))
        kernel = next(kn for kn in kernel_api.get_kernels(arg_sets[0]) if kn.name.endswith("_v8"))
        variants = {f"h{h}": {"HEADS_PER_THREAD": h} for h in (1, 2, 4, 8)}
        nbytes = (2 * b * s * d * (hq + hk) + 2 * s * d) * 2
        out.append(_time_variants(f"rope_fwd {layout} b{b} s{s}", kernel, rope_module, variants, arg_sets, nbytes,
                                  repeat))
        del arg_sets
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the >= 64 MB shapes and one small one, fewer repeats")
    ap.add_argument("--tag", default="")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="time our kernels' build constants instead")
    opts = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    name = results_io.result_name("pointwise", torch.cuda.get_device_name(), opts.tag)
    if opts.sweep:
        results = sweep(opts.repeat)
        for path in results_io.write_result(name.replace("pointwise-", "pointwise-sweep-"),
                                            results_io.result_doc(results=results)):
            print(f"wrote {path}")
        return
    liger = _liger()
    compiled = {"swiglu": torch.compile(eager_swiglu, dynamic=False), "geglu": torch.compile(eager_geglu, dynamic=False),
                "rope": torch.compile(hf_rope, dynamic=False)}
    glu_shapes = GLU_SHAPES[::2] if opts.quick else GLU_SHAPES
    rope_shapes = ROPE_SHAPES[::2] if opts.quick else ROPE_SHAPES
    cases = []
    for backward in (False, True):
        cases += [(glu_case, ("swiglu", rows, cols, backward)) for rows, cols in glu_shapes]
        cases += [(rope_case, (*shape, backward)) for shape in rope_shapes]
    cases += [(glu_case, ("geglu", *GLU_SHAPES[0], backward)) for backward in (False, True)]
    results, failed = [], []
    for case, params in cases:
        try:
            results.append(case(*params, liger, compiled, opts.repeat))
        except Exception as exc:  # noqa: BLE001 - one case's failure is reported, the rest still run
            print(f"{case.__name__}{params} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            failed.append({"case": f"{case.__name__}{params}", "error": f"{type(exc).__name__}: {exc}"[:2000]})
        torch.cuda.empty_cache()
        # written after every case: a run cut short keeps what it measured
        results_io.write_result(name, results_io.result_doc(liger=liger is not None, results=results, failed=failed))
    summary = {}
    for anchor in ("eager", "compile", "liger"):
        ratios = [e["speedup"][anchor] for e in results if anchor in e["speedup"]]
        if ratios:
            summary[anchor] = {"geomean": geomean(ratios), "min": min(ratios)}
            print(f"ours vs {anchor}: geomean x{summary[anchor]['geomean']:.2f}, min x{summary[anchor]['min']:.2f}")
    big = [e for e in results if e["bytes"] >= 64 << 20]
    if big:
        low = min(big, key=lambda e: e["tbs"]["kernel_api"])
        print(f"lowest ours on >= 64 MB: {low['tbs']['kernel_api']:.2f} TB/s ({low['case']})")
    doc = results_io.result_doc(liger=liger is not None, summary=summary, results=results, failed=failed)
    for path in results_io.write_result(name, doc):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
