"""GPT-2 (124M, bf16, random weights) end to end: torch eager, eager + kernel_api.nn.patch,
torch.compile, and torch.compile of the patched model, in one process (issue #17 item 4).

    python3 benchmarks/e2e_gpt2.py [--quick] [--tag TAG] [--configs eager,patched,...] [--phases prefill,decode,train]
    python3 benchmarks/e2e_gpt2.py --smoke      # control flow only: a 2-layer stand-in model on the CPU

Phases (each timed with CUDA events around the step alone, torch.cuda.synchronize() before it,
fresh random token ids each step, median of the timed steps after warm-up):
  prefill  forward at batch 8 x sequence 1024 (eval, no_grad, no cache);
  decode   forward of one new token at batch 64 with a KV cache of 128 tokens: the cache is built
           once by a use_cache=True forward of a 64 x 128 prompt (by the uncompiled module, so
           torch.compile only sees the one-token step), and before every step, outside the timed
           region, it is cut back to the prompt with DynamicCache.crop(128) (transformers'
           crop slices, so the prompt's keys/values are never written; where crop is missing, a
           deep copy of the pristine cache is used instead);
  train    forward + loss + backward + AdamW step + zero_grad at batch 8 x 1024, the model and
           the optimizer state in bf16 (no autocast, no master weights), model.train().
Dropout is 0 in the config (resid/embd/attn_pdrop), so that the loss curves of the
configurations can be compared step by step.

Configurations are deep copies of one seeded model, so patching or training one does not touch
the others; compiled configurations call torch._dynamo.reset() first. Each (configuration,
phase) is guarded: a failure is recorded as an error string and the rest still runs.

Correctness, in the same run: each configuration's prefill logits (and one decode step's) against
eager's on the same input, norm-wise relative error <= 2e-2; loss curves over 20 training steps
(same initial state, same seeded batches) against eager's, max |loss - loss_eager| relative to
the mean eager loss <= 5e-2. The training phase runs those 20 steps first (they are also the
compile/warm-up steps), then times further steps.

Prints a table last (phase x configuration: ms, tokens/s, speed-up vs eager and vs compile) and
the issue's targets, met or not. Writes benchmarks/results/e2e_gpt2-<device>[-<tag>].json and a
bar chart .png beside it (and copies to $OUT when set). Exit status 1 when a correctness check
failed, else 0 (timing errors are reported, not fatal).
"""

from __future__ import annotations

import argparse
import copy
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
PHASES = ["prefill", "decode", "train"]
LOGITS_TOL = 2e-2
LOSS_TOL = 5e-2
LOSS_STEPS = 20
# (phase, configuration, baseline, at least): the issue's targets.
TARGETS = [("prefill", "patched", "eager", 1.10), ("prefill", "compiled+patched", "compiled", 1.0),
           ("train", "patched", "eager", 1.05)]


def log(*parts) -> None:
    print(*parts, flush=True)


def err_str(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


# ---------------------------------------------------------------- the --smoke stand-in model
class _SmokeCache:
    """The bits of transformers' DynamicCache the benchmark uses: per-layer keys/values that
    grow on use, get_seq_length and crop."""

    def __init__(self):
        self.kv = []

    def get_seq_length(self):
        return self.kv[0][0].shape[1] if self.kv else 0

    def crop(self, n):
        self.kv = [(k[:, :n], v[:, :n]) for k, v in self.kv]


def _smoke_model(vocab=256, d=32, layers=2):
    """A 2-layer GPT-like LM with GPT2LMHeadModel's call signature (input_ids, labels,
    past_key_values, use_cache -> .logits/.loss/.past_key_values) and nn.Linear projections."""
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(approximate="tanh"),
                                           torch.nn.Linear(4 * d, d))

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(vocab, d)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
            self.lm_head = torch.nn.Linear(d, vocab, bias=False)
            self.lm_head.weight = self.wte.weight
            self.config = SimpleNamespace(vocab_size=vocab)

        def forward(self, input_ids, labels=None, past_key_values=None, use_cache=False):
            x = self.wte(input_ids)
            cache = past_key_values if past_key_values is not None else (_SmokeCache() if use_cache else None)
            for i, blk in enumerate(self.blocks):
                q, k, v = blk.qkv(blk.ln1(x)).chunk(3, -1)
                if cache is not None:
                    if len(cache.kv) > i:
                        k, v = torch.cat([cache.kv[i][0], k], 1), torch.cat([cache.kv[i][1], v], 1)
                        cache.kv[i] = (k, v)
                    else:
                        cache.kv.append((k, v))
                att = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[1] == k.shape[1])
                x = x + blk.proj(att)
                x = x + blk.mlp(blk.ln2(x))
            logits = self.lm_head(x)
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
            return SimpleNamespace(logits=logits, loss=loss, past_key_values=cache)

    return LM()


# ---------------------------------------------------------------- timing
def timed_steps(step, setup, warmup: int, steps: int, device) -> tuple[float, list]:
    """Median ms of ``step(setup())`` over ``steps`` calls after ``warmup``; ``setup`` (fresh
    inputs, cache reset) runs outside the timed region, then the device is synchronized, so each
    step is timed from an idle GPU, host launch overhead included."""
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


# ---------------------------------------------------------------- phases
def build(base, name: str, device, dtype, compile_backend):
    """A deep copy of ``base`` on ``device``/``dtype``, patched and/or compiled per ``name``:
    (module to call, the uncompiled module)."""
    import torch
    import kernel_api.nn
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    if "patched" in name:
        model = kernel_api.nn.patch(model)
    if "compiled" in name:
        torch._dynamo.reset()
        return torch.compile(model, backend=compile_backend), model
    return model, model


def phase_prefill(run, raw, ctx, ref):
    import torch
    B, T, V = ctx.prefill_batch, ctx.prefill_seq, ctx.vocab
    raw.eval()
    out = {"tokens_per_step": B * T}
    with torch.no_grad():
        ms, _ = timed_steps(lambda ids: run(input_ids=ids, use_cache=False),
                            lambda: torch.randint(0, V, (B, T), device=ctx.device),
                            ctx.warmup, ctx.steps["prefill"], ctx.device)
        out["ms"] = ms
        logits = run(input_ids=ctx.check_ids, use_cache=False).logits
    compare_logits(out, ref, "prefill_logits", logits, ctx)
    return out


def compare_logits(out, ref, key, logits, ctx):
    """The eager (reference) run keeps its logits under ``key``; the others record their error."""
    if ctx.is_reference:
        ref[key] = logits
    elif key in ref:
        out["logits_rel_err"] = rel_err(logits, ref[key])
        out["logits_ok"] = out["logits_rel_err"] <= LOGITS_TOL


def phase_decode(run, raw, ctx, ref):
    import torch
    B, P, V = ctx.decode_batch, ctx.prompt_len, ctx.vocab
    raw.eval()
    out = {"tokens_per_step": B, "prompt_len": P}
    with torch.no_grad():
        # The prompt runs through the uncompiled module: the same cache, and no compile of a
        # shape that is not timed.
        cache = raw(input_ids=ctx.prompt_ids, use_cache=True).past_key_values
        if hasattr(cache, "crop"):
            out["cache_reset"] = f"{type(cache).__name__}.crop({P}) before each step"

            def reset():
                cache.crop(P)
                return cache
        else:
            out["cache_reset"] = f"copy.deepcopy of the pristine {type(cache).__name__} before each step"
            pristine = cache

            def reset():
                return copy.deepcopy(pristine)

        def setup():
            return torch.randint(0, V, (B, 1), device=ctx.device), reset()

        ms, _ = timed_steps(lambda a: run(input_ids=a[0], past_key_values=a[1], use_cache=True),
                            setup, ctx.warmup, ctx.steps["decode"], ctx.device)
        out["ms"] = ms
        c = reset()
        if hasattr(c, "get_seq_length"):
            out["cache_len_before_step"] = int(c.get_seq_length())
        logits = run(input_ids=ctx.decode_check_ids, past_key_values=c, use_cache=True).logits
    compare_logits(out, ref, "decode_logits", logits, ctx)
    return out


def phase_train(run, raw, ctx, ref):
    import torch
    B, T, V = ctx.train_batch, ctx.train_seq, ctx.vocab
    raw.train()
    opt = torch.optim.AdamW(raw.parameters(), lr=ctx.lr)
    out = {"tokens_per_step": B * T, "precision": f"{ctx.dtype} weights, grads and AdamW state, no autocast"}

    def step(ids):
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    # Loss curve first, from the shared initial state (also the warm-up / compile steps).
    losses = [step(ids).item() for ids in ctx.loss_batches]
    out["losses"] = losses
    if ctx.is_reference:
        ref["losses"] = losses
    elif "losses" in ref:
        diff = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
        scale = statistics.fmean(abs(b) for b in ref["losses"])
        out["loss_max_abs_diff"] = diff
        out["loss_max_rel_diff"] = diff / scale
        out["loss_ok"] = diff / scale <= LOSS_TOL
    ms, _ = timed_steps(step, lambda: torch.randint(0, V, (B, T), device=ctx.device),
                        ctx.warmup, ctx.steps["train"], ctx.device)
    out["ms"] = ms
    del opt
    return out


PHASE_FNS = {"prefill": phase_prefill, "decode": phase_decode, "train": phase_train}


# ---------------------------------------------------------------- report
def speedups(results: dict) -> None:
    for phase, per in results.items():
        for name, r in per.items():
            if "ms" not in r:
                continue
            r["tokens_per_s"] = r["tokens_per_step"] / (r["ms"] * 1e-3)
            for base in ("eager", "compiled"):
                b = per.get(base, {})
                if "ms" in b:
                    r[f"speedup_vs_{base}"] = b["ms"] / r["ms"]


def table(results: dict, configs: list) -> str:
    head = f"{'phase':8} {'config':17} {'ms':>9} {'tokens/s':>12} {'vs eager':>9} {'vs compile':>10}  check"
    lines = [head, "-" * len(head)]
    for phase, per in results.items():
        for name in configs:
            r = per.get(name)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"{phase:8} {name:17} ERROR {r['error'][:150]}")
                continue
            check = []
            if "logits_rel_err" in r:
                check.append(f"logits rel {r['logits_rel_err']:.2e} {'ok' if r['logits_ok'] else 'FAIL'}")
            if "loss_max_rel_diff" in r:
                check.append(f"loss max|d| {r['loss_max_abs_diff']:.3g} (rel {r['loss_max_rel_diff']:.2e}) "
                             f"{'ok' if r['loss_ok'] else 'FAIL'}")
            fmt = lambda k: f"{r[k]:.3f}x" if k in r else "-"  # noqa: E731
            lines.append(f"{phase:8} {name:17} {r['ms']:9.3f} {r['tokens_per_s']:12.0f} {fmt('speedup_vs_eager'):>9} "
                         f"{fmt('speedup_vs_compiled'):>10}  {'; '.join(check)}")
    return "\n".join(lines)


def targets(results: dict) -> list:
    found = []
    for phase, name, base, want in TARGETS:
        r, b = results.get(phase, {}).get(name, {}), results.get(phase, {}).get(base, {})
        entry = {"phase": phase, "config": name, "baseline": base, "target": want}
        if "ms" in r and "ms" in b:
            entry["ratio"] = b["ms"] / r["ms"]
            entry["met"] = entry["ratio"] >= want
        else:
            entry["met"] = None
            entry["note"] = "not measured: " + (r.get("error") or b.get("error") or "configuration not run")[:200]
        found.append(entry)
    return found


def chart(results: dict, configs: list, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # optional
        return f"no chart: matplotlib not importable ({err_str(exc)})"
    phases = list(results)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(configs))
    for i, name in enumerate(configs):
        vals = [results[p].get(name, {}).get("speedup_vs_eager", 0.0) for p in phases]
        bars = ax.bar([j + i * width for j in range(len(phases))], vals, width, label=name)
        for bar, v in zip(bars, vals):
            ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}" if v else "err", ha="center",
                    va="bottom", fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(phases))], phases)
    ax.set_ylabel("tokens/s, relative to torch eager")
    ax.set_title("GPT-2 124M bf16: kernel_api.nn.patch and torch.compile")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    p.add_argument("--smoke", action="store_true", help="a 2-layer stand-in model on the CPU, tiny sizes, "
                   "torch.compile with the eager backend: checks the control flow only")
    p.add_argument("--tag", default="", help="appended to the result file names")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {PHASES}")
    p.add_argument("--steps", type=int, default=None, help="timed steps per phase (default 30/50/10, "
                   "--quick 10/20/5 for prefill/decode/train)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per phase (default 5, --quick 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--budget-s", type=float, default=0, help="skip (and report as skipped) the "
                   "configuration/phase pairs not started within this many seconds (default 0: no limit)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    opts = p.parse_args(argv)
    opts.configs = [c.strip() for c in opts.configs.split(",") if c.strip()]
    opts.phases = [c.strip() for c in opts.phases.split(",") if c.strip()]
    for value, allowed, what in ((opts.configs, CONFIGS, "--configs"), (opts.phases, PHASES, "--phases")):
        bad = [v for v in value if v not in allowed]
        if bad or not value:
            p.error(f"{what}: unknown {bad or 'empty list'}; choose from {allowed}")
    # Correctness and speed-ups are measured against eager: it always runs, first.
    opts.configs = ["eager"] + [c for c in CONFIGS if c in opts.configs and c != "eager"]
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    import torch

    if opts.smoke:
        device, dtype, backend = torch.device("cpu"), torch.bfloat16, "eager"
        torch.manual_seed(opts.seed)
        base = _smoke_model()
        sizes = dict(prefill_batch=2, prefill_seq=32, decode_batch=4, prompt_len=8, train_batch=2, train_seq=32)
        device_name, env = "cpu-smoke", {"model": "2-layer stand-in (--smoke)"}
    else:
        if not torch.cuda.is_available():
            log("e2e_gpt2: no CUDA device (use --smoke for a CPU control-flow check)")
            return 2
        import transformers  # lazily: --help and --smoke work without it
        device, dtype, backend = torch.device("cuda"), torch.bfloat16, "inductor"
        config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        torch.manual_seed(opts.seed)
        base = transformers.GPT2LMHeadModel(config)  # random weights, on the CPU, f32; copies are cast
        sizes = dict(prefill_batch=8, prefill_seq=1024, decode_batch=64, prompt_len=128, train_batch=8,
                     train_seq=1024)
        device_name = torch.cuda.get_device_name()
        env = {"model": "transformers.GPT2LMHeadModel(GPT2Config(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))",
               "transformers": transformers.__version__,
               "attn_implementation": getattr(base.config, "_attn_implementation", None)}
    env.update(torch=torch.__version__, device=device_name, commit=git_commit(), dtype=str(dtype),
               compile_backend=backend, seed=opts.seed,
               parameters=sum(p.numel() for p in base.parameters()))
    vocab = base.config.vocab_size
    steps = ({"prefill": 10, "decode": 20, "train": 5} if opts.quick or opts.smoke
             else {"prefill": 30, "decode": 50, "train": 10})
    if opts.steps is not None:
        steps = dict.fromkeys(steps, opts.steps)
    warmup = opts.warmup if opts.warmup is not None else (2 if opts.quick or opts.smoke else 5)
    gen = torch.Generator().manual_seed(opts.seed + 1)  # fixed check inputs, the same for every config

    def fixed(*shape):
        return torch.randint(0, vocab, shape, generator=gen).to(device)

    ctx = SimpleNamespace(device=device, dtype=dtype, vocab=vocab, steps=steps, warmup=warmup, lr=opts.lr, **sizes)
    ctx.check_ids = fixed(ctx.prefill_batch, ctx.prefill_seq)
    ctx.prompt_ids = fixed(ctx.decode_batch, ctx.prompt_len)
    ctx.decode_check_ids = fixed(ctx.decode_batch, 1)
    ctx.loss_batches = [fixed(ctx.train_batch, ctx.train_seq) for _ in range(LOSS_STEPS)]
    env.update(sizes=sizes, steps=steps, warmup=warmup, loss_steps=LOSS_STEPS, lr=opts.lr, tag=opts.tag)
    log(f"e2e_gpt2: {device_name}, torch {torch.__version__}, {env['parameters'] / 1e6:.1f}M parameters, "
        f"configs {opts.configs}, phases {opts.phases}, steps {steps}, warm-up {warmup}")

    os.makedirs(opts.out_dir, exist_ok=True)
    stem = "e2e_gpt2-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name) + (f"-{opts.tag}" if opts.tag else "")
    partial = os.path.join(os.environ.get("OUT") or opts.out_dir, stem + ".partial.json")
    results = {phase: {} for phase in opts.phases}
    ref: dict = {}
    t_all = time.perf_counter()
    for name in opts.configs:
        for phase in opts.phases:
            t0 = time.perf_counter()
            run = raw = None
            ctx.is_reference = name == "eager"
            if opts.budget_s and time.perf_counter() - t_all > opts.budget_s:
                results[phase][name] = {"error": f"skipped: past --budget-s {opts.budget_s:g}"}
                continue
            try:
                run, raw = build(base, name, device, dtype, backend)
                r = PHASE_FNS[phase](run, raw, ctx, ref)
            except Exception as exc:  # report it, keep going with the other configurations
                r = {"error": err_str(exc)}
                traceback.print_exc(limit=6, file=sys.stderr)  # (eager failing: the others' checks are skipped)
            r["wall_s"] = time.perf_counter() - t0
            results[phase][name] = r
            status = r.get("error") or f"{r['ms']:.3f} ms"
            log(f"  {phase:8} {name:17} {status}  ({r['wall_s']:.1f} s wall, "
                f"{time.perf_counter() - t_all:.0f} s total)")
            with open(partial, "w") as f:  # what is done so far survives a kill
                json.dump({"env": env, "partial": True, "results": results}, f, indent=1, default=str)
            del run, raw
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    ref.clear()

    speedups(results)
    met = targets(results)
    checks_failed = [f"{phase}/{name}" for phase, per in results.items() for name, r in per.items()
                     if r.get("logits_ok") is False or r.get("loss_ok") is False]
    record = {"benchmark": "e2e_gpt2", "env": env, "results": results, "targets": met,
              "correctness": {"logits_tol": LOGITS_TOL, "loss_rel_tol": LOSS_TOL, "failed": checks_failed},
              "wall_s": time.perf_counter() - t_all}

    json_path = os.path.join(opts.out_dir, stem + ".json")
    png = chart(results, opts.configs, os.path.join(opts.out_dir, stem + ".png"))
    record["chart"] = png
    with open(json_path, "w") as f:
        json.dump(record, f, indent=1)
    saved = [json_path] + ([png] if png.endswith(".png") else [])
    if os.path.exists(partial):
        os.remove(partial)
    if os.environ.get("OUT"):
        for path in saved:
            if os.path.dirname(os.path.abspath(path)) != os.path.abspath(os.environ["OUT"]):  # (--out-dir $OUT)
                shutil.copy(path, os.environ["OUT"])

    log("")
    log(f"saved {', '.join(saved)}" + ("" if png.endswith(".png") else f"; {png}"))
    log("decode cache: " + next((r["cache_reset"] for r in results.get("decode", {}).values()
                                 if "cache_reset" in r), "n/a"))
    log("targets (tokens/s ratio):")
    for t in met:
        state = "not measured" if t["met"] is None else ("met" if t["met"] else "NOT met")
        ratio = f"{t['ratio']:.3f}x" if "ratio" in t else t.get("note", "")
        log(f"  {t['phase']:8} {t['config']} / {t['baseline']} >= {t['target']:.2f}x: {ratio} -> {state}")
    log("correctness: " + (f"FAILED {checks_failed}" if checks_failed else
                           f"all measured checks pass (logits rel <= {LOGITS_TOL}, loss rel <= {LOSS_TOL})"))
    log("")
    log(table(results, opts.configs))
    return 1 if checks_failed else 0


if __name__ == "__main__":
    sys.exit(main())
