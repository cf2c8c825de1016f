"""Fused linear cross-entropy and cross-entropy, forward+backward: kernel_api against torch eager,
torch.compile and Liger, in one process.

    python3 benchmarks/cross_entropy.py [--shapes 8192x4096x128256,16384x2048x32000] [--chunks 512,2048]
                                        [--serial] [--breakdown 1024] [--repeat 10] [--no-compile] [--no-rows]
    python3 benchmarks/cross_entropy.py --quick [--no-linear]   # the smaller shape, 5 steps each, no torch.compile

Per shape (tokens x hidden -> vocabulary, bf16, random weights, ``--ignored`` of the targets
ignored: none by default; fine-tuning masks the prompts, and our op skips those tokens) and
contestant, one training step's loss: forward, ``backward()``, the gradients of the hidden states
and the weight made fresh (``.grad = None`` before each step):

- ``ours``: ``kernel_api.ops.linear_cross_entropy(h, w, t)``; ``ours_c<N>``: the same with
  ``N`` tokens per chunk (``--chunks``; `cross_entropy_math.CHUNK_TOKENS`); ``ours_serial``
  (``--serial``): the gradient GEMMs on one stream (`cross_entropy_math.OVERLAP_GRADIENT_GEMMS`);
- ``eager``: ``F.cross_entropy(F.linear(h, w), t)``; ``compile``: ``torch.compile`` of it;
- ``liger``: ``LigerFusedLinearCrossEntropyLoss()(w, h, t)`` (when liger_kernel imports).

Time: the median of ``--repeat`` steps, contestants in shuffled turns (benchmarks/house_timing.py
``time_group``: CUDA events around each step). Memory: the peak of ``torch.cuda.max_memory_allocated``
during one step minus what was allocated before it (the inputs), so the gradients the step leaves
count. Printed: ms, GB, and each anchor's time and memory over ours (above 1: ours is faster or
smaller). Also (unless ``--no-rows``) the per-row loss alone on (tokens x vocabulary) bf16 logits:
``ops.cross_entropy`` against ``F.cross_entropy``, Liger's cross-entropy and (``--rows-compile``) torch.compile, with
the bandwidth of ours (the logits read once and the gradient written once; the second read of
each row, for the gradient, comes from L2).
With ``--host``, first the host time of a repeated call at a host-bound size (16 x 4096 bf16
logits, as benchmarks/host_latency_ops.py times it, with its ``measure``): ``ops.cross_entropy``
with each reduction, ``ops.cross_entropy_backward``, and a mean's forward and ``backward()``,
against torch's own call for the same work, and the chosen kernel's launch alone.
JSON: benchmarks/results/cross_entropy-<device>.json (and a copy in ``$OUT``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import results_io  # noqa: E402
from house_timing import time_group  # noqa: E402

from kernel_api import ops  # noqa: E402
from kernel_api.arguments import cross_entropy_math  # noqa: E402

#: The issue's anchors (H200, torch 2.11, Liger 0.8.5): ms and GB of extra peak memory.
ANCHORS = {"8192x4096x128256": {"eager": (47.8, 12.6), "compile": (39.2, 3.2), "liger": (54.2, 1.18)},
           "16384x2048x32000": {"eager": (14.7, 6.3), "compile": (10.7, 1.25), "liger": (11.7, 0.26)}}


def _liger():
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # noqa: BLE001 - the benchmark runs without Liger
        print(f"liger_kernel unavailable: {exc}")
        return None, None
    return LigerFusedLinearCrossEntropyLoss(), LigerCrossEntropyLoss()


def _with(fn, **settings):
    """``fn`` run with `cross_entropy_math`'s module settings (CHUNK_TOKENS, ...) changed."""
    def run(*args):
        saved = {k: getattr(cross_entropy_math, k) for k in settings}
        for k, v in settings.items():
            setattr(cross_entropy_math, k, v)
        try:
            return fn(*args)
        finally:
            for k, v in saved.items():
                setattr(cross_entropy_math, k, v)
    return run


def _step(loss_fn, leaves):
    def step(_i=0):
        for v in leaves:
            v.grad = None
        loss_fn().backward()
    return step


def peak_extra_gb(step, leaves) -> float:
    """GB allocated at the peak of one step beyond what was allocated before it."""
    for v in leaves:
        v.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    for v in leaves:
        v.grad = None
    return peak / 1e9


def linear_case(tokens, hidden, vocab, args, liger) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=g) / hidden ** 0.5).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    t[torch.rand(tokens, device="cuda", generator=g) < args.ignored] = -100
    leaves = (h, w)

    def eager():
        return F.cross_entropy(F.linear(h, w), t)

    compiled = torch.compile(eager)
    losses = {"ours": lambda: ops.linear_cross_entropy(h, w, t), "eager": eager}
    for c in args.chunks:
        losses[f"ours_c{c}"] = _with(lambda: ops.linear_cross_entropy(h, w, t), CHUNK_TOKENS=c)
    if args.serial:
        losses["ours_serial"] = _with(lambda: ops.linear_cross_entropy(h, w, t), OVERLAP_GRADIENT_GEMMS=False)
    if not args.no_compile:
        losses["compile"] = compiled
    if liger is not None:
        losses["liger"] = lambda: liger(w, h, t)
    steps = {name: _step(fn, leaves) for name, fn in losses.items()}
    values, grads = {}, {}
    for name, fn in losses.items():  # warm-up (compiles), and the values compared
        for v in leaves:
            v.grad = None
        loss = fn()
        loss.backward()
        values[name] = float(loss.detach())
        grads[name] = (h.grad.float(), w.grad.float())
    ref_h, ref_w = grads["eager"]
    check = {name: {"loss_diff": abs(values[name] - values["eager"]),
                    "grad_h_rel": float((gh - ref_h).norm() / ref_h.norm()),
                    "grad_w_rel": float((gw - ref_w).norm() / ref_w.norm())} for name, (gh, gw) in grads.items()}
    del grads, ref_h, ref_w
    for v in leaves:
        v.grad = None
    memory = {name: peak_extra_gb(step, leaves) for name, step in steps.items()}
    times, behind = time_group(steps, args.repeat)
    return {"times_ms": times, "host_behind": behind, "extra_peak_gb": memory, "check": check}


def rows_case(tokens, vocab, args, liger_ce) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(tokens, vocab, device="cuda", generator=g) * 2).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    leaves = (x,)

    def eager():
        return F.cross_entropy(x, t)

    losses = {"ours": lambda: ops.cross_entropy(x, t), "eager": eager}
    if args.rows_compile:
        losses["compile"] = torch.compile(eager)
    if liger_ce is not None:
        losses["liger"] = lambda: liger_ce(x, t)
    steps = {name: _step(fn, leaves) for name, fn in losses.items()}
    values = {}
    for name, fn in losses.items():
        x.grad = None
        loss = fn()
        loss.backward()
        values[name] = float(loss.detach())
    memory = {name: peak_extra_gb(step, leaves) for name, step in steps.items()}
    times, behind = time_group(steps, args.repeat)
    moved = 2 * tokens * vocab * 2  # the logits read and the gradient written (the second read is from L2)
    chosen = sorted({k.metadata.kernel_name for _, k in ops.chosen_kernels()
                     if type(k).__name__.startswith(("CudaCrossEntropy", "TorchCrossEntropy"))})
    return {"times_ms": times, "host_behind": behind, "extra_peak_gb": memory,
            "loss": values, "ours_tb_s": moved / (times["ours"] * 1e-3) / 1e12, "chosen": chosen}


def host_case(args) -> dict:
    """Host microseconds per repeated call (module docstring), medians over repeats."""
    import statistics

    from host_latency_ops import kernel_alone, measure

    from kernel_api.core.streams import to_cuda_stream

    rows, vocab = 16, 4096
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    target[::5] = -100
    grad_loss = torch.randn(rows, device="cuda")
    lse = torch.logsumexp(logits.float(), -1)
    leaf = logits.detach().clone().requires_grad_()
    with torch.enable_grad():
        kept = F.cross_entropy(leaf.float(), target, reduction="none")

    def ours_step():
        with torch.enable_grad():
            ops.cross_entropy(leaf, target).backward()

    def torch_step():
        with torch.enable_grad():
            F.cross_entropy(leaf, target).backward()

    pairs = {
        "none": (lambda: ops.cross_entropy(logits, target, reduction="none"),
                 lambda: F.cross_entropy(logits, target, reduction="none")),
        "mean": (lambda: ops.cross_entropy(logits, target), lambda: F.cross_entropy(logits, target)),
        "sum": (lambda: ops.cross_entropy(logits, target, reduction="sum"),
                lambda: F.cross_entropy(logits, target, reduction="sum")),
        "backward": (lambda: ops.cross_entropy_backward(grad_loss, logits, target, lse),
                     lambda: torch.autograd.grad(kept, (leaf,), grad_loss, retain_graph=True)),
        "mean forward+backward": (ours_step, torch_step),
    }
    table, stream = {}, to_cuda_stream(None)
    with torch.no_grad():
        for name, (ours, theirs) in pairs.items():
            table[f"{name} | ops"], table[f"{name} | torch"] = ours, theirs
            alone = kernel_alone(ours, stream) if name != "mean forward+backward" else None
            if alone is not None:
                table[f"{name} | kernel"] = alone
        samples = measure(table, 50 if args.quick else 200, 7 if args.quick else 25, torch.cuda.synchronize)
    result = {}
    for name in pairs:
        a, b, c = samples[f"{name} | ops"], samples[f"{name} | torch"], samples.get(f"{name} | kernel")
        result[name] = {"ops_us": statistics.median(a), "torch_us": statistics.median(b),
                        "difference_us": statistics.median(x - y for x, y in zip(a, b)),
                        "kernel_us": statistics.median(c) if c else None}
    return result


def breakdown_case(tokens, hidden, vocab, chunk, args) -> dict:
    """Median ms of each piece of one chunk of ours (``chunk`` tokens), in shuffled turns: the
    logits GEMM, the row kernel (loss and in-place gradient; ``_t<N>``: with N threads per CTA),
    the hidden-state gradient GEMM, the weight gradient's ``addmm_`` (bf16 accumulator read and
    written) and its first, write-only, GEMM."""
    from kernel_api import get_kernels
    from kernel_api.arguments import CrossEntropyArguments

    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(chunk, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=g) / hidden ** 0.5
    t = torch.randint(0, vocab, (chunk,), device="cuda", generator=g)
    logits = torch.empty(chunk, vocab, device="cuda", dtype=torch.bfloat16)
    gh, gw = torch.empty_like(h), torch.zeros_like(w)
    loss, lse = torch.empty(chunk, device="cuda"), torch.empty(chunk, device="cuda")
    scale = torch.ones((), device="cuda").expand(chunk)
    from kernel_api.providers.cuda_src.kernels import cross_entropy as ce_kernels

    pieces = {"logits_gemm": lambda i: torch.mm(h, w.t(), out=logits),
              "grad_h_gemm": lambda i: torch.mm(logits, w, out=gh),
              "grad_w_addmm": lambda i: gw.addmm_(logits.t(), h),
              "grad_w_first": lambda i: torch.mm(logits.t(), h, out=gw)}
    saved = ce_kernels.ROW_THREADS
    for threads in (None, 256, 512, 1024):  # (None: the shipped rule)
        ce_kernels.ROW_THREADS = saved if threads is None else ((0, threads),)
        row_args = CrossEntropyArguments(logits, t, loss, lse, grad_logits=logits, grad_loss=scale)
        kernel = [k for k in get_kernels(row_args) if type(k).__name__.startswith("Cuda")][0]
        artifact = kernel.compile(row_args)
        name = "row_kernel" if threads is None else f"row_kernel_t{threads}"
        pieces[name] = (lambda k, a, art: lambda i: k.run(a, compiled_artifact=art))(kernel, row_args, artifact)
    ce_kernels.ROW_THREADS = saved
    times, _ = time_group(pieces, args.repeat * 2)
    flops = 2 * chunk * hidden * vocab
    chunks = -(-tokens // chunk)
    return {"chunk": chunk, "times_ms": times, "per_step_ms": {k: v * chunks for k, v in times.items()},
            "gemm_tflops": {k: flops / (v * 1e-3) / 1e12 for k, v in times.items() if "gemm" in k or "grad_w" in k},
            "row_kernel_tb_s": {k: 2 * chunk * vocab * 2 / (v * 1e-3) / 1e12 for k, v in times.items()
                                if k.startswith("row_kernel")}}


def _report(label, case, lines) -> None:
    times, memory = case["times_ms"], case["extra_peak_gb"]
    ours_t, ours_m = times["ours"], memory["ours"]
    lines.append(f"{label}:")
    for name in times:
        ratio = "" if name == "ours" else f"   time x{times[name] / ours_t:.2f}, memory x{memory[name] / ours_m:.2f} vs ours"
        lines.append(f"  {name:>10}: {times[name]:8.2f} ms  {memory[name]:6.2f} GB{ratio}")
    anchors = ANCHORS.get(label)
    if anchors:
        for name, (ms, gb) in anchors.items():
            lines.append(f"  issue's {name:>8}: {ms:8.2f} ms  {gb:6.2f} GB   time x{ms / ours_t:.2f}, "
                         f"memory x{gb / ours_m:.2f} vs ours")
    for name, c in case.get("check", {}).items():
        lines.append(f"  check {name}: |loss - eager| {c['loss_diff']:.2e}, grad_h rel {c['grad_h_rel']:.2e}, "
                     f"grad_w rel {c['grad_w_rel']:.2e}")
    if "ours_tb_s" in case:
        lines.append(f"  ours moves {case['ours_tb_s']:.2f} TB/s (the logits read once, the gradient written once)"
                     f"; chosen: {', '.join(case.get('chosen', ()))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8192x4096x128256,16384x2048x32000", help="TOKENSxHIDDENxVOCAB,...")
    ap.add_argument("--chunks", default="", help="also time ours at these tokens per chunk (comma-separated)")
    ap.add_argument("--repeat", type=int, default=10, help="timed steps per contestant")
    ap.add_argument("--ignored", type=float, default=0.0, help="share of the targets set to ignore_index")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--serial", action="store_true", help="also time ours with the gradient GEMMs on one stream")
    ap.add_argument("--no-rows", action="store_true", help="leave the per-row cross-entropy out")
    ap.add_argument("--rows-compile", action="store_true", help="time torch.compile on the per-row cross-entropy too")
    ap.add_argument("--breakdown", default="", help="also time the pieces of one chunk at these tokens per chunk")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    ap.add_argument("--quick", action="store_true", help="the smaller default shape, 5 steps, no torch.compile")
    ap.add_argument("--no-linear", action="store_true", help="the per-row cross-entropy only")
    ap.add_argument("--host", action="store_true", help="first the host time of repeated calls (module docstring)")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.repeat, args.no_compile = "16384x2048x32000", min(args.repeat, 5), True
    args.chunks = [int(c) for c in args.chunks.split(",") if c]
    liger, liger_ce = _liger() if not (args.no_linear and args.no_rows) else (None, None)
    doc = results_io.result_doc(chunk_tokens=cross_entropy_math.CHUNK_TOKENS, ignored=args.ignored, linear={}, rows={},
                                breakdown={}, host={})
    lines = []
    name = results_io.result_name("cross_entropy", torch.cuda.get_device_name(), args.tag)
    paths = None
    if args.host:
        doc["host"] = host_case(args)
        lines.append(f"host time per repeated call, 16x4096 bf16 (us, medians): {'ops':>8} {'torch':>8} "
                     f"{'ops-torch':>10} {'kernel':>8}")
        for row, r in doc["host"].items():
            kernel = "-" if r["kernel_us"] is None else f"{r['kernel_us']:.2f}"
            lines.append(f"  {row:<24} {r['ops_us']:8.2f} {r['torch_us']:8.2f} {r['difference_us']:+10.2f} "
                         f"{kernel:>8}")
        print("\n".join(lines), flush=True)
        paths = results_io.write_result_with_text(name, doc, lines)
    for shape in args.shapes.split(","):
        tokens, hidden, vocab = (int(v) for v in shape.split("x"))
        if not args.no_linear:
            case = linear_case(tokens, hidden, vocab, args, liger)
            doc["linear"][shape] = case
            _report(shape, case, lines)
            print("\n".join(lines[-20:]), flush=True)
        for chunk in [int(c) for c in args.breakdown.split(",") if c]:
            parts = breakdown_case(tokens, hidden, vocab, chunk, args)
            doc["breakdown"][f"{shape}@{chunk}"] = parts
            lines.append(f"  pieces at {chunk} tokens per chunk, ms per step: " + ", ".join(
                f"{k} {v:.2f}" for k, v in parts["per_step_ms"].items()) + "; TFLOP/s: " + ", ".join(
                f"{k} {v:.0f}" for k, v in parts["gemm_tflops"].items()) + "; row kernel TB/s (read + write): " + ", ".join(
                f"{k} {v:.2f}" for k, v in parts["row_kernel_tb_s"].items()))
        if not args.no_rows:
            rows = rows_case(tokens, vocab, args, liger_ce)
            doc["rows"][f"{tokens}x{vocab}"] = rows
            _report(f"cross_entropy {tokens}x{vocab}", rows, lines)
        gc.collect()
        torch.cuda.empty_cache()
        paths = results_io.write_result_with_text(name, doc, lines)  # (after each shape: a timeout keeps the rest)
    print("\n".join(lines))
    print(paths)


if __name__ == "__main__":
    main()
