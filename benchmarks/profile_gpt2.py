"""Where GPT-2's time goes with and without kernel_api.nn.patch: a kernel-level profile.

    python3 benchmarks/profile_gpt2.py [--sections prefill,train,decode,gemms] [--layers 12]

For GPT-2 (124M, bf16, random weights, transformers) on the GPU:
  prefill  per configuration (eager, patched, compiled, compiled+patched, and the patched ones
           with only the torch provider): median ms (CUDA events), then one step under
           torch.profiler: kernel count, summed kernel time, GEMM-kernel time, top kernels;
           Dynamo's graph count and graph breaks; the kernel PickAny chose for each new GEMM
           signature (shape, layouts, alignment);
  train    forward + backward + AdamW, the same for eager, patched and compiled+patched;
  decode   batch 64, one token, KV cache 128: median ms, cProfile of the patched step (where
           the host time goes), host microseconds per ops.gemm call with and without a bias;
  gemms    each GPT-2 GEMM (prefill, decode and backward shapes, with the model's layouts):
           torch vs kernel_api (PickAny, with and without the torch provider), CUDA events.
Writes a JSON (and the printed report) to $OUT or benchmarks/results/.
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import io
import json
import os
import pstats
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import kernel_api  # noqa: E402
import kernel_api.nn  # noqa: E402
from kernel_api.ops import dispatch as _dispatch  # noqa: E402

OURS = ["cutedsl", "cuda_src"]
GEMM_WORDS = ("gemm", "Gemm", "GEMM", "nvjet", "xmma", "cutlass", "sm90_", "sm80_", "ampere", "Sm90", "Sm80",
              "Simt", "simt", "matmul", "Matmul")
REPORT: dict = {}
LINES: list = []


def log(*parts) -> None:
    text = " ".join(str(p) for p in parts)
    LINES.append(text)
    print(text, flush=True)


def save() -> None:
    out = os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "profile_gpt2.json"), "w") as f:
        json.dump(REPORT, f, indent=1, default=str)
    with open(os.path.join(out, "profile_gpt2.txt"), "w") as f:
        f.write("\n".join(LINES) + "\n")


def median_ms(fn, setup, warmup=2, steps=5) -> float:
    for _ in range(warmup):
        fn(setup())
    times = []
    for _ in range(steps):
        a = setup()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def kernel_summary(fn, arg, top=14) -> dict:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(arg)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per: dict = {}
    for e in kernels:
        d = per.setdefault(e.name, [0, 0.0])
        d[0] += 1
        d[1] += e.time_range.elapsed_us()
    total = sum(v[1] for v in per.values())
    gemm = sum(v[1] for k, v in per.items() if any(w in k for w in GEMM_WORDS))
    gemm_n = sum(v[0] for k, v in per.items() if any(w in k for w in GEMM_WORDS))
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": len(kernels), "kernel_us": total, "gemm_kernels": gemm_n, "gemm_us": gemm,
            "top": [(k[:110], v[0], round(v[1], 1)) for k, v in rows]}


def print_summary(title, s) -> None:
    log(f"  [{title}] {s['kernels']} kernels, {s['kernel_us'] / 1e3:.3f} ms kernel time; "
        f"GEMM-like {s['gemm_kernels']} kernels {s['gemm_us'] / 1e3:.3f} ms")
    for name, n, us in s["top"]:
        log(f"      {us / 1e3:8.3f} ms {n:5d}x  {name}")


def new_choices(before: set) -> list:
    found = []
    for key, value in list(_dispatch._dispatch.items()):
        if key in before:
            continue
        sig, shape = key[1], key[2]
        if sig[0] != "gemm":
            found.append((str(shape), value[0].metadata.kernel_name, str(sig)[:120]))
            continue
        ops = [f"{a[0].name if hasattr(a[0], 'name') else a[0]}{a[1]}/{a[2]}" for a in sig[2:5]]
        found.append((str(shape), value[0].metadata.kernel_name, " ".join(ops) + f" epi={sig[6]}"))
    return found


def dynamo_stats() -> dict:
    try:
        from torch._dynamo.utils import counters
        return {"graph_breaks": sum(counters["graph_break"].values()),
                "break_reasons": list(counters["graph_break"])[:5],
                "unique_graphs": counters["stats"].get("unique_graphs", None)}
    except Exception as exc:  # noqa: BLE001
        return {"error": repr(exc)}


def build(base, name, providers=None):
    model = copy.deepcopy(base).to(device="cuda", dtype=torch.bfloat16)
    if "patched" in name:
        model = kernel_api.nn.patch(model)
    if "compiled" in name:
        torch._dynamo.reset()
        try:
            from torch._dynamo.utils import counters
            counters.clear()
        except Exception:  # noqa: BLE001
            pass
        return torch.compile(model), model
    return model, model


CONFIGS = [("eager", None), ("patched", None), ("compiled", None), ("compiled+patched", None),
           ("patched", ("torch",)), ("compiled+patched", ("torch",))]


def scope(providers):
    return kernel_api.settings(providers=list(providers)) if providers else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def section_prefill(base, V, args):
    B, T = 8, 1024
    res = REPORT.setdefault("prefill", {})
    for name, providers in CONFIGS:
        label = name + (f"[{','.join(providers)}]" if providers else "")
        t0 = time.perf_counter()
        try:
            with scope(providers):
                run, raw = build(base, name, providers)
                raw.eval()
                before = set(_dispatch._dispatch)
                with torch.no_grad():
                    fn = lambda ids: run(input_ids=ids, use_cache=False)  # noqa: E731
                    setup = lambda: torch.randint(0, V, (B, T), device="cuda")  # noqa: E731
                    ms = median_ms(fn, setup)
                    s = kernel_summary(fn, setup())
                r = {"ms": ms, **s, "choices": new_choices(before), "wall_s": time.perf_counter() - t0}
                if "compiled" in name:
                    r["dynamo"] = dynamo_stats()
        except Exception as exc:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            r = {"error": repr(exc)[:300]}
        res[label] = r
        log(f"prefill {label}: " + (f"{r['ms']:.3f} ms ({r['wall_s']:.0f} s wall) {r.get('dynamo', '')}"
                                    if "ms" in r else r["error"]))
        if "ms" in r:
            print_summary(label, r)
            for c in r["choices"]:
                log(f"      choice {c[0]:24} {c[1]:60} {c[2]}")
        save()


def section_train(base, V, args):
    B, T = 8, 1024
    res = REPORT.setdefault("train", {})
    for name, providers in [("eager", None), ("patched", None), ("patched", ("torch",)), ("compiled+patched", None)]:
        label = name + (f"[{','.join(providers)}]" if providers else "")
        t0 = time.perf_counter()
        try:
            with scope(providers):
                run, raw = build(base, name, providers)
                raw.train()
                opt = torch.optim.AdamW(raw.parameters(), lr=1e-4)
                before = set(_dispatch._dispatch)

                def step(ids):
                    loss = run(input_ids=ids, labels=ids).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                setup = lambda: torch.randint(0, V, (B, T), device="cuda")  # noqa: E731
                ms = median_ms(step, setup, warmup=3, steps=4)
                s = kernel_summary(step, setup(), top=18)
                r = {"ms": ms, **s, "choices": new_choices(before), "wall_s": time.perf_counter() - t0}
                if "compiled" in name:
                    r["dynamo"] = dynamo_stats()
                del opt
        except Exception as exc:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            r = {"error": repr(exc)[:300]}
        res[label] = r
        log(f"train {label}: " + (f"{r['ms']:.3f} ms ({r['wall_s']:.0f} s wall)" if "ms" in r else r["error"]))
        if "ms" in r:
            print_summary(label, r)
            for c in r["choices"]:
                log(f"      choice {c[0]:24} {c[1]:60} {c[2]}")
        save()
        torch.cuda.empty_cache()


def section_decode(base, V, args):
    B, P = 64, 128
    res = REPORT.setdefault("decode", {})
    for name in ("eager", "patched"):
        run, raw = build(base, name)
        raw.eval()
        with torch.no_grad():
            cache = raw(input_ids=torch.randint(0, V, (B, P), device="cuda"), use_cache=True).past_key_values

            def setup():
                cache.crop(P)
                return torch.randint(0, V, (B, 1), device="cuda")

            fn = lambda ids: run(input_ids=ids, past_key_values=cache, use_cache=True)  # noqa: E731
            ms = median_ms(fn, setup, warmup=3, steps=10)
            s = kernel_summary(fn, setup())
            r = {"ms": ms, **s}
            if name == "patched":
                prof = cProfile.Profile()
                ids = [setup() for _ in range(1)]
                prof.enable()
                for _ in range(10):
                    cache.crop(P)
                    fn(ids[0])
                prof.disable()
                torch.cuda.synchronize()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(28)
                r["cprofile_tottime"] = buf.getvalue()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
                r["cprofile_cumulative"] = buf.getvalue()
        res[name] = r
        log(f"decode {name}: {ms:.3f} ms")
        print_summary(name, s)
        if name == "patched":
            log(r["cprofile_tottime"][-6000:])
            log(r["cprofile_cumulative"][-6000:])
        save()
    # Host cost per call, M=64.
    A = torch.randn(64, 768, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(768, 2304, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2304, device="cuda", dtype=torch.bfloat16)
    host = {}
    for label, f in [("torch.addmm", lambda: torch.addmm(b, A, W)), ("torch.mm", lambda: torch.mm(A, W)),
                     ("ops.gemm bias", lambda: kernel_api.ops.gemm(A, W, bias=b)),
                     ("ops.gemm gelu", lambda: kernel_api.ops.gemm(A, W, bias=b, activation="gelu")),
                     ("ops.gemm plain", lambda: kernel_api.ops.gemm(A, W)),
                     ("torch.ops.kernel_api.gemm bias", lambda: torch.ops.kernel_api.gemm(A, W, None, b, 1.0, 0.0,
                                                                                            None))]:
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(300):
            f()
        host[label] = (time.perf_counter() - t) / 300 * 1e6
        torch.cuda.synchronize()
        log(f"host us/call {label:34} {host[label]:8.1f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        kernel_api.ops.gemm(A, W, bias=b)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    log(buf.getvalue()[-4000:])
    res["host_us_per_call"] = host
    save()


def gemm_shapes():
    """(label, M, K, N, kind): kind 'conv1d' (B = W (K, N) row-major, bias), 'lm_head' (B =
    wte.weight.t(), no bias), 'dX' (grad @ W^T: a column-major B view), 'dW' (A^T @ grad)."""
    s = []
    for M in (8192, 64):
        for K, N, nm in ((768, 2304, "c_attn"), (768, 768, "attn.c_proj"), (768, 3072, "c_fc"),
                         (3072, 768, "mlp.c_proj")):
            s.append((f"{nm} M={M}", M, K, N, "conv1d"))
        s.append((f"lm_head M={M}", M, 768, 50257, "lm_head"))
    for K, N, nm in ((768, 2304, "c_attn"), (768, 3072, "c_fc"), (3072, 768, "mlp.c_proj")):
        s.append((f"{nm} dX", 8192, N, K, "dX"))
        s.append((f"{nm} dW", K, 8192, N, "dW"))
    s.append(("lm_head dX", 8192, 50257, 768, "dX_lm"))
    s.append(("lm_head dW", 50257, 8192, 768, "dW_lm"))
    return s


def operands(M, K, N, kind):
    dt = torch.bfloat16
    r = lambda *sh: torch.randn(*sh, device="cuda", dtype=dt)  # noqa: E731
    if kind == "conv1d":
        return r(M, K), r(K, N), r(N)
    if kind == "lm_head":
        return r(M, K), r(N, K).t(), None
    if kind == "dX":  # grad (M, K') @ W^T where W (N, K') row-major: B = W.t() column-major
        return r(M, K), r(N, K).t(), None
    if kind == "dW":  # X^T (M'=K rows) @ grad: A = X.t() column-major
        return r(K, M).t(), r(K, N), None
    if kind == "dX_lm":  # grad (8192, 50257) @ weight (50257, 768)
        return r(M, K), r(K, N), None
    if kind == "dW_lm":  # grad^T (50257, 8192) @ X (8192, 768): A = grad.t()
        return r(K, M).t(), r(K, N), None
    raise ValueError(kind)


def time_pair(fns, reps=20) -> list:
    for f in fns:
        f()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            f()
            e.record()
            times[i].append((s, e))
    torch.cuda.synchronize()
    return [statistics.median(s.elapsed_time(e) for s, e in t) for t in times]


def section_gemms(base, V, args):
    from kernel_api.arguments import EpilogueArguments, GemmArguments
    from kernel_api.tuning.policies import PickAny
    res = REPORT.setdefault("gemms", [])
    log(f"{'gemm':22} {'M':>6} {'K':>6} {'N':>6} {'torch ms':>9} {'ours ms':>9} {'any ms':>9}  any / ours-only choice")
    for label, M, K, N, kind in gemm_shapes():
        try:
            sets = [operands(M, K, N, kind) for _ in range(3)]
            i = [0]

            def nxt():
                i[0] = (i[0] + 1) % 3
                return sets[i[0]]

            def t_torch():
                a, b_, bias = nxt()
                return torch.addmm(bias, a, b_) if bias is not None else torch.mm(a, b_)

            def t_any():
                a, b_, bias = nxt()
                return kernel_api.ops.gemm(a, b_, bias=bias)

            tt, ta = time_pair([t_torch, t_any])
            with kernel_api.settings(providers=OURS):
                _, to = time_pair([t_torch, t_any])  # (t_any under the scope: our kernels only)
            a, b_, bias = sets[0]
            out = torch.empty(a.shape[0], b_.shape[1], device="cuda", dtype=torch.bfloat16)
            ga = GemmArguments(a, b_, out, epilogue=None if bias is None else EpilogueArguments(bias=bias))
            cands = kernel_api.get_kernels(ga)
            any_choice = PickAny().choose(ga, cands).metadata.kernel_name
            ours = [k for k in cands if k.metadata.kernel_class.__module__.split(".")[2] != "torch_ops"]
            ours_choice = PickAny().choose(ga, ours).metadata.kernel_name if ours else None
            row = {"label": label, "M": M, "K": K, "N": N, "kind": kind, "torch_ms": tt, "any_ms": ta,
                   "ours_ms": to, "any": any_choice, "ours": ours_choice}
        except Exception as exc:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            row = {"label": label, "error": repr(exc)[:200]}
        res.append(row)
        if "error" in row:
            log(f"{label:22} ERROR {row['error']}")
        else:
            log(f"{label:22} {M:6} {K:6} {N:6} {tt:9.4f} {to:9.4f} {ta:9.4f}  {any_choice} / {ours_choice}")
        save()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default="prefill,decode,gemms,train")
    p.add_argument("--layers", type=int, default=12)
    opts = p.parse_args()
    import transformers
    cfg = transformers.GPT2Config(n_layer=opts.layers, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg)
    REPORT["env"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                     "device": torch.cuda.get_device_name(), "layers": opts.layers}
    fns = {"prefill": section_prefill, "train": section_train, "decode": section_decode, "gemms": section_gemms}
    for s in opts.sections.split(","):
        t = time.perf_counter()
        try:
            fns[s](base, cfg.vocab_size, opts)
        except Exception as exc:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            log(f"section {s} failed: {exc!r}")
        log(f"== section {s}: {time.perf_counter() - t:.0f} s")
        save()


if __name__ == "__main__":
    main()
