"""A Llama stack (transformers LlamaForCausalLM, random weights, bf16) end to end: torch eager,
kernel_api.nn.patch, torch.compile, and torch.compile of the patched model, in one process.

    python3 benchmarks/e2e_llama.py [--quick] [--model 8b,small] [--configs eager,patched,...]
                                    [--phases prefill,train] [--layers 4] [--tag TAG] [--budget-s S]
                                    [--without flash_attn]
    python3 benchmarks/e2e_llama.py --smoke      # control flow only: a tiny Llama on the CPU

Models (LlamaConfig, GQA, SwiGLU MLP, RMSNorm, RoPE, untied lm_head):
  8b     Llama-3-8B-shaped layers: hidden 4096, intermediate 14336, 32 heads of 128, 8 key/value
         heads, vocab 128256; ``--layers`` of them (default 4);
  small  Llama-3.2-1B-shaped layers with a 32000 vocabulary: hidden 2048, intermediate 8192,
         32 heads of 64, 8 key/value heads; ``--layers`` of them.
Both at batch 4 x 2048 tokens.

Phases (each step timed with CUDA events after torch.cuda.synchronize(), fresh random token ids
each step, median of the timed steps after warm-up):
  prefill  forward, eval, no_grad, no cache, all logits;
  train    forward + loss + backward + AdamW step + zero_grad, the model and the optimizer
           state in bf16 (no autocast, no master weights), model.train(). The patched model's
           training forward computes the loss from the hidden states (ops.linear_cross_entropy)
           and returns no logits.
Peak memory: torch.cuda.max_memory_allocated over the timed steps (statistics reset before
them), and the memory held before them (weights, optimizer state); the seeded model the
configurations copy waits on the CPU.

``--packed``: the training phase's batch is one row of packed sequences (the batch's tokens in
sequences of varied lengths, position ids restarting at each, as padding-free collators make
them): transformers' SDPA layers take the block-causal mask built from the position ids, the
patched layers variable-length attention (`kernel_api.nn.packed`; eager only, a compiled model
keeps the mask).

Configurations: eager, patched, compiled, compiled+patched; named with --configs, also
compiled-ro and compiled-ro+patched (torch.compile(mode="reduce-overhead"), CUDA graphs; prefill
only, their ratios against compiled-ro). They are deep copies of one seeded model, so patching or training one does not touch
the others; compiled configurations call torch._dynamo.reset() first; a patched model is
unpatched when its phase ends (patch's RoPE function is module-wide while a patched model holds it). Each (model,
configuration, phase) is guarded: a failure is recorded as an error string and the rest runs.

Correctness, in the same run: prefill logits of the first sequence of a fixed input (of the timed
shape) within bf16 noise: their norm-wise distance from the f32 model's at most 1.5 times eager
bf16's (the distance from eager's logits is reported too); loss curves over the first ``--loss-steps`` (default 20)
training steps from the same initial state on the same batches (counting sequences from random
starts, so that the curve falls), max |loss - loss_eager| relative to the mean eager loss
<= 5e-2. Those steps are also the warm-up and compile steps of the training phase.

Attention candidates: kernel_api's plugins load through their entry points, so FlashAttention-4
serves the patched model's attention when the kernel-api-flash-attn plugin is installed
(``pip install --no-deps --no-build-isolation -e examples/plugins/kernel-api-flash-attn``); the
run records the providers present, the plugins that failed to load, and each patched
configuration's chosen attention kernels, and for the compiled ones the attention problems that run
as torch's cuDNN op in the graph (`kernel_api.nn.attention_lowering`: where only torch's kernels
serve them); ``--without flash_attn`` leaves the plugin out (the torch provider's attention then
serves).

Prints a table (model, phase, configuration: ms, tokens/s, ratios against eager and against
torch.compile, peak memory and its ratios) and the targets (`TARGETS`), met or not. Writes
benchmarks/results/e2e_llama-<device>[-<tag>].json (copied to $OUT when set). Exit status 1
when a correctness check failed, else 0.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = ["eager", "patched", "compiled", "compiled+patched"]
# Run only when named, prefill only: torch.compile(mode="reduce-overhead") (CUDA graphs), whose
# ratios are against compiled-ro.
OPTIONAL_CONFIGS = ["compiled-ro", "compiled-ro+patched"]
PHASES = ["prefill", "train"]
MODELS = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256),
    "small": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                  vocab_size=32000),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=256),
}
# A configuration's logits are within bf16 noise when their distance from the f32 model's is at
# most this many times eager bf16's distance (4 random layers: about 1.7e-2 each, norm-wise).
LOGITS_NOISE = 1.5
LOSS_TOL = 5e-2
# (phase, configuration, baseline, bound, what): the targets for a Llama stack; "ms" compares step
# times (baseline / configuration), "memory" peak memory (configuration / baseline, at most).
TARGETS = [("prefill", "patched", "compiled", 1.0, "ms"), ("prefill", "compiled+patched", "compiled", 1.2, "ms"),
           ("train", "patched", "eager", 1.5, "ms"), ("train", "patched", "compiled", 1.1, "ms"),
           ("train", "patched", "eager", 0.75, "memory")]


def log(*parts) -> None:
    print(*parts, flush=True)


def err_str(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


# ---------------------------------------------------------------- timing
def timed_steps(step, setup, warmup: int, steps: int, device) -> tuple[float, list]:
    """Median ms of ``step(setup())`` over ``steps`` calls after ``warmup``; ``setup`` runs
    outside the timed region, then the device is synchronized, so each step is timed from an
    idle GPU, host launch overhead included."""
    import torch
    cuda = device.type == "cuda"
    for _ in range(warmup):
        step(setup())
    times = []
    for _ in range(steps):
        args = setup()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(args)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            step(args)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), times


def rel_err(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def memory_gb(device) -> dict:
    import torch
    if device.type != "cuda":
        return {}
    return {"peak_gb": torch.cuda.max_memory_allocated() / 2**30}


def reset_peak(device) -> float | None:
    """Resets the peak statistics; the memory allocated now, in GB."""
    import torch
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / 2**30


def profile_table(step, setup, ctx, rows: int = 18) -> str:
    """torch.profiler's table of the GPU kernels of two more steps, by total GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(setup())
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="device_time_total", row_limit=rows, max_name_column_width=70)


# ---------------------------------------------------------------- phases
def build(base, name: str, device, dtype, compile_backend, kinds=None, lowering="auto"):
    """A deep copy of ``base`` on ``device``/``dtype``, patched and/or compiled per ``name``:
    (module to call, the uncompiled module)."""
    import torch
    import warnings
    import kernel_api.nn
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    if "patched" in name:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = kernel_api.nn.patch(model, kinds=kinds)
        for w in caught:
            log(f"    patch: {w.message}")
        if lowering != "auto":
            kernel_api.nn.set_compile_lowering(model, lowering)
    if "compiled" not in name:
        return model, model
    torch._dynamo.reset()
    if "-ro" not in name or compile_backend != "inductor":
        return torch.compile(model, backend=compile_backend), model
    compiled = torch.compile(model, mode="reduce-overhead")

    def run(*args, **kwargs):  # (a new CUDA-graph step: the previous replay's outputs are done with)
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return run, model


def attention_kernels() -> list:
    """The attention kernels kernel_api chose so far in this process (names, sorted)."""
    from kernel_api import ops
    return sorted({kernel.name for _, kernel in ops.chosen_kernels() if "Attn" in kernel.name
                   or "Attention" in kernel.name})


def phase_prefill(run, raw, ctx, ref):
    import torch
    B, T, V = ctx.batch, ctx.seq, ctx.vocab
    raw.eval()
    out = {"tokens_per_step": B * T}
    with torch.no_grad():
        for _ in range(ctx.warmup):  # (also the compile, at the timed shape: no dynamic-shape recompile)
            run(input_ids=torch.randint(0, V, (B, T), device=ctx.device), use_cache=False)
        out["held_gb"] = reset_peak(ctx.device)
        ms, _ = timed_steps(lambda ids: run(input_ids=ids, use_cache=False),
                            lambda: torch.randint(0, V, (B, T), device=ctx.device),
                            0, ctx.steps["prefill"], ctx.device)
        out.update(memory_gb(ctx.device))
        out["ms"] = ms
        if ctx.profile:
            out["profile"] = profile_table(lambda ids: run(input_ids=ids, use_cache=False),
                                           lambda: torch.randint(0, V, (B, T), device=ctx.device), ctx)
        # the first sequence's logits, kept on the CPU (the peaks above hold no reference)
        logits = run(input_ids=ctx.check_ids, use_cache=False).logits[0].float().cpu()
    out["logits_rel_err_vs_f32"] = rel_err(logits, ctx.f32_logits)
    if ctx.is_reference:
        ref["prefill_logits"] = logits
        ref["eager_err_vs_f32"] = out["logits_rel_err_vs_f32"]
    elif "prefill_logits" in ref:
        out["logits_rel_err"] = rel_err(logits, ref["prefill_logits"])
        out["logits_ok"] = out["logits_rel_err_vs_f32"] <= LOGITS_NOISE * ref["eager_err_vs_f32"]
    return out


def phase_train(run, raw, ctx, ref):
    import torch
    B, T, V = ctx.batch, ctx.seq, ctx.vocab
    raw.train()
    opt = torch.optim.AdamW(raw.parameters(), lr=ctx.lr)
    out = {"tokens_per_step": B * T, "precision": f"{ctx.dtype} weights, grads and AdamW state, no autocast"}
    shape, extra = ((1, B * T), dict(position_ids=ctx.positions, use_cache=False)) if ctx.packed else ((B, T), {})
    if ctx.packed:
        out["packed_lengths"] = ctx.packed_lengths

    def step(ids):
        labels = ids.view(shape)
        if ctx.packed:  # (no sequence's first token is a label of the one before, as padding-free collators do)
            labels = labels.clone()
            labels[0, ctx.starts] = -100
        loss = run(input_ids=ids.view(shape), labels=labels, **extra).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    losses = [step(ids).item() for ids in ctx.loss_batches]  # also the warm-up / compile steps
    out["losses"] = losses
    if ctx.is_reference:
        ref["losses"] = losses
    elif "losses" in ref:
        diff = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
        scale = statistics.fmean(abs(b) for b in ref["losses"])
        out["loss_max_abs_diff"] = diff
        out["loss_max_rel_diff"] = diff / scale
        out["loss_ok"] = diff / scale <= LOSS_TOL
    out["held_gb"] = reset_peak(ctx.device)
    ms, _ = timed_steps(step, lambda: torch.randint(0, V, (B, T), device=ctx.device), 0, ctx.steps["train"],
                        ctx.device)
    out.update(memory_gb(ctx.device))
    out["ms"] = ms
    if ctx.profile:
        out["profile"] = profile_table(step, lambda: torch.randint(0, V, (B, T), device=ctx.device), ctx)
    return out


def packed_lengths(tokens: int, seq: int, seed: int) -> list[int]:
    """Sequence lengths of a packed row of ``tokens``: drawn between ``seq // 8`` and ``2 * seq``
    (seeded), the last cut to fill the row."""
    import random
    draw, lengths = random.Random(seed), []
    while sum(lengths) < tokens:
        lengths.append(min(draw.randint(max(seq // 8, 1), 2 * seq), tokens - sum(lengths)))
    return lengths


PHASE_FNS = {"prefill": phase_prefill, "train": phase_train}
_SCOPES: list = []  # settings entered for the whole process


# ---------------------------------------------------------------- report
def ratios(results: dict) -> None:
    for per_phase in results.values():
        for per in per_phase.values():
            for name, r in per.items():
                if "ms" not in r:
                    continue
                r["tokens_per_s"] = r["tokens_per_step"] / (r["ms"] * 1e-3)
                for base in ("eager", "compiled"):
                    # (the reduce-overhead configurations against compiled-ro, in the "compiled" columns)
                    b = per.get("compiled-ro" if base == "compiled" and "-ro" in name else base, {})
                    if "ms" in b:
                        r[f"speedup_vs_{base}"] = b["ms"] / r["ms"]
                    if "peak_gb" in b and "peak_gb" in r:
                        r[f"peak_memory_vs_{base}"] = r["peak_gb"] / b["peak_gb"]


def table(results: dict, configs: list) -> str:
    head = (f"{'model':6} {'phase':8} {'config':19} {'ms':>9} {'tokens/s':>10} {'vs eager':>9} {'vs compile':>10} "
            f"{'peak GB':>8} {'mem/eager':>9} {'mem/compile':>11}  check")
    lines = [head, "-" * len(head)]
    for model, per_phase in results.items():
        for phase, per in per_phase.items():
            for name in configs:
                r = per.get(name)
                if r is None:
                    continue
                if "error" in r:
                    lines.append(f"{model:6} {phase:8} {name:19} ERROR {r['error'][:150]}")
                    continue
                check = []
                if "logits_rel_err_vs_f32" in r:
                    check.append(f"logits vs f32 {r['logits_rel_err_vs_f32']:.2e}"
                                 + (f" {'ok' if r['logits_ok'] else 'FAIL'}" if "logits_ok" in r else ""))
                if "loss_max_rel_diff" in r:
                    check.append(f"loss max|d| {r['loss_max_abs_diff']:.3g} (rel {r['loss_max_rel_diff']:.2e}) "
                                 f"{'ok' if r['loss_ok'] else 'FAIL'}")
                fmt = lambda k, f="{:.3f}x": f.format(r[k]) if k in r else "-"  # noqa: E731
                lines.append(f"{model:6} {phase:8} {name:19} {r['ms']:9.2f} {r['tokens_per_s']:10.0f} "
                             f"{fmt('speedup_vs_eager'):>9} {fmt('speedup_vs_compiled'):>10} "
                             f"{fmt('peak_gb', '{:.2f}'):>8} {fmt('peak_memory_vs_eager', '{:.3f}'):>9} "
                             f"{fmt('peak_memory_vs_compiled', '{:.3f}'):>11}  "
                             f"{'; '.join(check)}")
    return "\n".join(lines)


def targets(results: dict) -> list:
    found = []
    for model, per_phase in results.items():
        for phase, name, base, want, what in TARGETS:
            r, b = per_phase.get(phase, {}).get(name, {}), per_phase.get(phase, {}).get(base, {})
            entry = {"model": model, "phase": phase, "config": name, "baseline": base, "what": what, "target": want}
            key = "ms" if what == "ms" else "peak_gb"
            if key in r and key in b:
                entry["ratio"] = b["ms"] / r["ms"] if what == "ms" else r["peak_gb"] / b["peak_gb"]
                entry["met"] = entry["ratio"] >= want if what == "ms" else entry["ratio"] <= want
            else:
                entry["met"] = None
                entry["note"] = "not measured: " + (r.get("error") or b.get("error") or "not run")[:200]
            found.append(entry)
    return found


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except Exception:
        return None


# ---------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer warm-up and timed steps")
    p.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU (the ops launching there through "
                   "the torch provider), torch.compile with the eager backend: checks the control flow only")
    p.add_argument("--model", default="8b,small", help="comma-separated subset of 8b, small")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--tag", default="", help="appended to the result file name")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {CONFIGS + OPTIONAL_CONFIGS} (the last two prefill only)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {PHASES}")
    p.add_argument("--steps", type=int, default=None, help="timed steps per phase (default 20/10, --quick 8/4 "
                   "for prefill/train)")
    p.add_argument("--warmup", type=int, default=None, help="prefill warm-up steps (default 3, --quick 2)")
    p.add_argument("--loss-steps", type=int, default=20, help="training steps compared with eager's (default 20)")
    p.add_argument("--compile-lowering", default="auto", choices=["auto", "aten", "kernel_api"],
                   help="compile_lowering of the patched layers under torch.compile (kernel_api.nn.lowering; "
                   "default auto)")
    p.add_argument("--profile", action="store_true", help="after timing, print torch.profiler's table of the "
                   "GPU kernels of two more steps (CUDA only)")
    p.add_argument("--without", default="", help="comma-separated providers left out of kernel_api's candidates "
                   "(e.g. flash_attn: the torch provider's attention kernels serve instead of FlashAttention-4's)")
    p.add_argument("--packed", action="store_true", help="train on one row of packed sequences of varied "
                   "lengths (position ids restarting); training phase only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--budget-s", type=float, default=0, help="skip (and report as skipped) what has not started "
                   "within this many seconds (default 0: no limit)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    opts = p.parse_args(argv)
    opts.configs = [c.strip() for c in opts.configs.split(",") if c.strip()]
    opts.phases = [c.strip() for c in opts.phases.split(",") if c.strip()]
    opts.model = [c.strip() for c in opts.model.split(",") if c.strip()]
    for value, allowed, what in ((opts.configs, CONFIGS + OPTIONAL_CONFIGS, "--configs"), (opts.phases, PHASES, "--phases"),
                                 (opts.model, ["8b", "small"], "--model")):
        bad = [v for v in value if v not in allowed]
        if bad or not value:
            p.error(f"{what}: unknown {bad or 'empty list'}; choose from {allowed}")
    if opts.packed and opts.phases != ["train"]:
        p.error("--packed: a packed row is timed in the training phase only; pass --phases train")
    # Correctness and speed-ups are measured against eager: it always runs, first.
    opts.configs = ["eager"] + [c for c in CONFIGS + OPTIONAL_CONFIGS if c in opts.configs and c != "eager"]
    if opts.smoke:
        opts.model, opts.batch, opts.seq, opts.layers = ["smoke"], 2, 64, 2
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    import torch
    import transformers
    import kernel_api
    import kernel_api.nn

    if opts.smoke:
        from kernel_api.ops import dispatch
        dispatch.LAUNCH_DEVICE_TYPES = frozenset({"cuda", "cpu"})
        _SCOPES.append(kernel_api.settings(providers="torch"))
        _SCOPES[-1].__enter__()  # (held to the end of the process)
        device, dtype, backend, device_name = torch.device("cpu"), torch.float32, "eager", "cpu-smoke"
        # (the projections stay torch's: the front door's replay of a recorded GEMM asks for the
        # current CUDA device)
        kinds = [k for k in kernel_api.nn.patching.KINDS if k != "linear"]
    else:
        if not torch.cuda.is_available():
            log("e2e_llama: no CUDA device (use --smoke for a CPU control-flow check)")
            return 2
        device, dtype, backend, kinds = torch.device("cuda"), torch.bfloat16, "inductor", None
        device_name = torch.cuda.get_device_name()
    quick = opts.quick or opts.smoke
    steps = {"prefill": 8, "train": 4} if quick else {"prefill": 20, "train": 10}
    if opts.steps is not None:
        steps = dict.fromkeys(steps, opts.steps)
    warmup = opts.warmup if opts.warmup is not None else (2 if quick else 3)
    env = dict(torch=torch.__version__, transformers=transformers.__version__, device=device_name,
               commit=git_commit(), dtype=str(dtype), compile_backend=backend, seed=opts.seed, steps=steps,
               warmup=warmup, loss_steps=opts.loss_steps, lr=opts.lr, tag=opts.tag, layers=opts.layers,
               compile_lowering=opts.compile_lowering,
               batch=opts.batch, seq=opts.seq, models={})
    providers = kernel_api.available_providers()
    without = [name.strip() for name in opts.without.split(",") if name.strip()]
    if without and not opts.smoke:
        providers = [name for name in providers if name not in without]
        _SCOPES.append(kernel_api.settings(providers=providers))
        _SCOPES[-1].__enter__()  # (held to the end of the process)
    env.update(providers=providers, without=without, plugin_errors=kernel_api.plugin_errors(),
               fa4="flash_attn" in providers)
    log(f"e2e_llama: providers {providers}; FlashAttention-4 "
        + ("loaded (the flash_attn plugin)" if env["fa4"] else
           f"not loaded ({env['plugin_errors'].get('flash_attn', 'its plugin is not installed')})"))
    log(f"e2e_llama: {device_name}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"models {opts.model} x {opts.layers} layers, batch {opts.batch} x {opts.seq}, configs {opts.configs}, "
        f"phases {opts.phases}, steps {steps}")

    os.makedirs(opts.out_dir, exist_ok=True)
    stem = "e2e_llama-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name) + (f"-{opts.tag}" if opts.tag else "")
    partial = os.path.join(os.environ.get("OUT") or opts.out_dir, stem + ".partial.json")
    results: dict = {}
    t_all = time.perf_counter()
    for model_name in opts.model:
        sizes = MODELS[model_name]
        config = transformers.LlamaConfig(num_hidden_layers=opts.layers, max_position_embeddings=max(opts.seq, 4096),
                                          attention_dropout=0.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                          **sizes)
        config._attn_implementation = "sdpa"
        torch.manual_seed(opts.seed)
        with torch.device(device):  # the seeded weights are made on the device once, in f32, then copied
            base = transformers.LlamaForCausalLM(config).eval()
        V = sizes["vocab_size"]
        env["models"][model_name] = dict(config=sizes, parameters=sum(p.numel() for p in base.parameters()))
        gen = torch.Generator().manual_seed(opts.seed + 1)  # fixed check inputs, the same for every config
        ctx = SimpleNamespace(device=device, dtype=dtype, vocab=V, steps=steps, warmup=warmup, lr=opts.lr,
                              batch=opts.batch, seq=opts.seq, profile=opts.profile and device.type == "cuda",
                              packed=opts.packed)
        if opts.packed:
            ctx.packed_lengths = packed_lengths(opts.batch * opts.seq, opts.seq, opts.seed)
            ctx.positions = torch.cat([torch.arange(n) for n in ctx.packed_lengths])[None].to(device)
            ctx.starts = torch.tensor([0, *itertools.accumulate(ctx.packed_lengths)][:-1], device=device)
        ctx.check_ids = torch.randint(0, V, (opts.batch, opts.seq), generator=gen).to(device)
        with torch.no_grad():  # the reference: the f32 model's logits of the first sequence
            ctx.f32_logits = base(input_ids=ctx.check_ids[:1], use_cache=False).logits[0].float().cpu()
        base = base.to(dtype).cpu()  # (off the device while the configurations run: peaks hold only theirs)
        ctx.loss_batches = [((torch.randint(0, V, (opts.batch, 1), generator=gen) + torch.arange(opts.seq)) % V)
                            .to(device) for _ in range(opts.loss_steps)]
        results[model_name] = {phase: {} for phase in opts.phases}
        ref: dict = {}
        for name in opts.configs:
            for phase in opts.phases:
                t0 = time.perf_counter()
                run = raw = None
                ctx.is_reference = name == "eager"
                if "-ro" in name and phase != "prefill":
                    continue
                if opts.budget_s and time.perf_counter() - t_all > opts.budget_s:
                    results[model_name][phase][name] = {"error": f"skipped: past --budget-s {opts.budget_s:g}"}
                    continue
                try:
                    run, raw = build(base, name, device, dtype, backend, kinds, opts.compile_lowering)
                    r = PHASE_FNS[phase](run, raw, ctx, ref)
                    if "patched" in name:
                        r["attention_kernels"] = attention_kernels()
                    if "patched" in name and "compiled" in name:
                        from kernel_api.nn import attention_lowering
                        r["attention_as_cudnn_op"] = attention_lowering.lowered()
                except Exception as exc:  # report it, keep going with the other configurations
                    r = {"error": err_str(exc)}
                    traceback.print_exc(limit=int(os.environ.get("E2E_TRACEBACK_LIMIT", "8")), file=sys.stderr)
                r["wall_s"] = time.perf_counter() - t0
                results[model_name][phase][name] = r
                status = r.get("error") or f"{r['ms']:.2f} ms, peak {r.get('peak_gb', float('nan')):.2f} GB"
                if "profile" in r:
                    log(f"  profile of {model_name} {phase} {name}:\n{r['profile']}")
                if r.get("attention_kernels"):
                    log(f"    attention kernels chosen so far: {', '.join(r['attention_kernels'])}")
                if r.get("attention_as_cudnn_op"):
                    log(f"    attention as torch's cuDNN op in the compiled graph: {r['attention_as_cudnn_op']}")
                log(f"  {model_name:6} {phase:8} {name:19} {status}  ({r['wall_s']:.1f} s wall, "
                    f"{time.perf_counter() - t_all:.0f} s total)")
                with open(partial, "w") as f:  # what is done so far survives a kill
                    json.dump({"env": env, "partial": True, "results": results}, f, indent=1, default=str)
                if raw is not None and "patched" in name:
                    # (releases the RoPE function patch installs in transformers' modeling_llama,
                    # which the configurations after this one would run otherwise)
                    try:
                        kernel_api.nn.unpatch(raw)
                    except Exception as exc:
                        log(f"    unpatch: {err_str(exc)}")
                del run, raw
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        ref.clear()
        del base

    ratios(results)
    met = targets(results)
    checks_failed = [f"{model}/{phase}/{name}" for model, per_phase in results.items()
                     for phase, per in per_phase.items() for name, r in per.items()
                     if r.get("logits_ok") is False or r.get("loss_ok") is False]
    record = {"benchmark": "e2e_llama", "env": env, "results": results, "targets": met,
              "correctness": {"logits_noise_factor": LOGITS_NOISE, "loss_rel_tol": LOSS_TOL, "failed": checks_failed},
              "wall_s": time.perf_counter() - t_all}
    json_path = os.path.join(opts.out_dir, stem + ".json")
    with open(json_path, "w") as f:
        json.dump(record, f, indent=1)
    if os.path.exists(partial):
        os.remove(partial)
    if os.environ.get("OUT") and os.path.abspath(os.environ["OUT"]) != os.path.abspath(opts.out_dir):
        shutil.copy(json_path, os.environ["OUT"])

    log("")
    log(f"saved {json_path}")
    log("targets:")
    for t in met:
        state = "not measured" if t["met"] is None else ("met" if t["met"] else "NOT met")
        shown = f"{t['ratio']:.3f}" if "ratio" in t else t.get("note", "")
        rule = ">=" if t["what"] == "ms" else "<="
        log(f"  {t['model']:6} {t['phase']:8} {t['config']} / {t['baseline']} ({t['what']}) {rule} {t['target']:.2f}: "
            f"{shown} -> {state}")
    log("correctness: " + (f"FAILED {checks_failed}" if checks_failed else
                           f"all measured checks pass (logits within {LOGITS_NOISE}x eager's distance from f32, "
                           f"loss rel <= {LOSS_TOL})"))
    log("")
    log(table(results, opts.configs))
    return 1 if checks_failed else 0


if __name__ == "__main__":
    sys.exit(main())
