"""Attention forward and forward+backward: ``kernel_api.ops.attention`` (the policy's choice
over every provider, and each provider alone) against ``torch.nn.functional.scaled_dot_product_attention``
under autograd (its default backend: cuDNN on an H200 with torch 2.11), SDPA's flash backend, and
FlashAttention-4's own ``flash_attn_func`` when importable, in one process.

Each case times the contestants alternately (`house_timing.time_group`: shuffled order, each
launch between its own CUDA events, queued behind a sleep kernel), on operand sets rotated past
the L2 cache, and prints TFLOP/s (forward ``4 b h sq sk d``, halved for causal; the backward
2.5 times that) and each contestant's speed against SDPA's default (ratio > 1: faster). SDPA
takes its natural (batch, heads, seqlen, head_dim) tensors; kernel_api and FA4 FlashAttention's
(batch, seqlen, heads, head_dim). A forward+backward launch is the forward with gradients
wanted, then ``torch.autograd.grad`` of q, k and v for a fixed output gradient, in the calling
thread (so ``kernel_api.settings`` scopes the backward's choice too).

    python3 benchmarks/attention.py [--quick] [--repeat N] [--no-kernels] [--tag TAG] [--cases issue,llama]

Cases: ``issue`` (default), the model-operations issue's shapes (multi-head); ``llama``, a
Llama-3-8B layer's attention (b4, 32 query heads over 8 KV heads, s2048, d128, causal: GQA,
SDPA with ``enable_gqa``); ``d64`` and ``d128``, the issue's shapes of that head dim, causal and
full; ``varlen``, packed batches of sequences (``cu_seqlens``): equal lengths, where SDPA's dense
call over the same tokens is the anchor, and mixed lengths, where the anchor is the torch
provider's FlashAttention-2 varlen kernel through the op (SDPA takes no sequence offsets).

Each case then times every forward kernel that writes the log-sum-exp and every backward kernel
on its own (bound `Kernel.run` calls; ``--no-kernels`` skips it): the numbers PickAny's speeds
(`TorchAttention`'s ``BACKENDS``, FA4's ``SPEED_VS_*`` and its tiles' ``speed_vs_sdpa``) come
from. FA4's plugin offers a forward per tile (`kernel_api_flash_attn.tiles`): ``ops_fa4`` runs
PickAny's choice among them, the kernel rows time each one. ``ops_cutedsl`` runs kernel_api's
own Hopper forward (`Sm90Attention`) through the op, forward only.

JSON: benchmarks/results/attention-<device>[-<tag>].json (and $OUT when set); one line per case
and mode is printed as it finishes.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import sys
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import results_io  # noqa: E402
from house_timing import time_group  # noqa: E402

import kernel_api  # noqa: E402
from kernel_api import ops  # noqa: E402

#: Operand bytes rotated through per case: past the H200's L2 several times over.
ROTATE_BYTES = 256 << 20


class Case(NamedTuple):
    """One attention problem: q has ``heads`` heads, k and v ``heads_kv`` (GQA when fewer)."""

    batch: int
    heads: int
    heads_kv: int
    seqlen: int
    head_dim: int
    causal: bool

    @property
    def label(self) -> str:
        heads = f"h{self.heads}" if self.heads_kv == self.heads else f"h{self.heads}/{self.heads_kv}"
        return f"b{self.batch} {heads} s{self.seqlen} d{self.head_dim} {'causal' if self.causal else 'full'}"


#: The issue's shapes, and a Llama-3-8B layer's attention (GQA); by head dim, causal and full.
CASES = {"issue": [Case(4, 32, 32, 4096, 128, True), Case(16, 16, 16, 1024, 64, True),
                   Case(4, 32, 32, 4096, 128, False)],
         "llama": [Case(4, 32, 8, 2048, 128, True)],
         "d64": [Case(16, 16, 16, 1024, 64, True), Case(16, 16, 16, 1024, 64, False)],
         "d128": [Case(4, 32, 32, 4096, 128, True), Case(4, 32, 32, 4096, 128, False)]}
#: Packed batches: ``(lengths, heads, heads_kv, head_dim, causal)``. The equal-length ones hold the
#: tokens of the issue's dense shapes.
VARLEN_CASES = [((4096,) * 4, 32, 32, 128, True), ((7000, 4096, 2048, 1024, 1000, 600, 400, 216), 32, 8, 128, True),
                ((1024,) * 16, 16, 16, 64, True), ((3000, 1500, 700, 300, 77, 1), 16, 16, 64, False)]
#: The backward's FLOPs against the forward's (five matmuls against two).
BACKWARD_FLOPS = 2.5


def _flash_attn_plugin() -> str | None:
    """Load the FA4 plugin from examples/plugins when its library imports; its provider name."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "plugins",
                          "kernel-api-flash-attn")
    sys.path.insert(0, folder)
    try:
        import kernel_api_flash_attn  # noqa: F401  (registers the flash_attn provider)
    except Exception as exc:  # noqa: BLE001 - FA4 absent or broken here: its contestants are left out
        print(f"FA4 plugin not loaded: {type(exc).__name__}: {exc}")
        return None
    return "flash_attn"


def _fa4_func() -> Callable | None:
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # noqa: BLE001
        return None
    return flash_attn_func


def _sdpa(backend: Any) -> Callable:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return run


def _ops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return ops.attention(q, k, v, causal=causal)


def _fa4(func: Callable) -> Callable:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        out = func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out
    return run


class Contestant(NamedTuple):
    """How one contestant runs: its tensors' layout ("bhsd" or "bshd"), ``run(q, k, v, causal)
    -> out``, the kernel_api providers it may use (None: all; only for kernel_api's), and whether
    it runs the forward only (a provider without a backward kernel)."""

    layout: str
    run: Callable
    providers: list[str] | None = None
    forward_only: bool = False


def contestants(fa4_provider: str | None) -> dict[str, Contestant]:
    from torch.nn.attention import SDPBackend
    found = {"sdpa": Contestant("bhsd", _sdpa(None)),
             "sdpa_flash": Contestant("bhsd", _sdpa(SDPBackend.FLASH_ATTENTION)),
             "ops": Contestant("bshd", _ops), "ops_torch": Contestant("bshd", _ops, ["torch"]),
             "ops_cutedsl": Contestant("bshd", _ops, ["cutedsl"], forward_only=True)}
    if fa4_provider is not None:
        found["ops_fa4"] = Contestant("bshd", _ops, [fa4_provider])
    func = _fa4_func()
    if func is not None:
        found["fa4"] = Contestant("bshd", _fa4(func))
    return found


def _sets(case: Case, layout: str, count: int, grad: bool) -> list[tuple]:
    def shape(heads: int) -> tuple:
        b, s, d = case.batch, case.seqlen, case.head_dim
        return (b, heads, s, d) if layout == "bhsd" else (b, s, heads, d)

    g = torch.Generator(device="cuda").manual_seed(0)
    made = []
    for _ in range(count):
        q, k, v, do = (torch.randn(shape(heads), device="cuda", dtype=torch.bfloat16, generator=g)
                       for heads in (case.heads, case.heads_kv, case.heads_kv, case.heads))
        made.append((q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad), do))
    return made


def _launcher(contestant: Contestant, sets: list[tuple], causal: bool, backward: bool) -> Callable[[int], Any]:
    """One launch of a contestant. The backward runs in the calling thread (autograd's
    multithreading off, for every contestant alike), where the provider scope is in force: the
    engine's device threads do not see `kernel_api.settings` (a context variable)."""
    run, providers = contestant.run, contestant.providers

    def scope() -> Any:
        return contextlib.nullcontext() if providers is None else kernel_api.settings(providers=providers)

    def forward(i: int) -> Any:
        q, k, v, _ = sets[i % len(sets)]
        with torch.no_grad(), scope():
            return run(q, k, v, causal)

    def training(i: int) -> Any:
        q, k, v, do = sets[i % len(sets)]
        with torch.autograd.set_multithreading_enabled(False), scope():
            out = run(q, k, v, causal)
            return torch.autograd.grad(out, (q, k, v), do)

    return training if backward else forward


def flops(b: int, h: int, s: int, d: int, causal: bool, backward: bool) -> float:
    forward = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return forward * (1 + BACKWARD_FLOPS) if backward else forward


def _choices() -> list[str]:
    from kernel_api.arguments import AttentionArguments, AttentionBackwardArguments
    return sorted({kernel.name for _, kernel in ops.chosen_kernels()
                   if issubclass(kernel.supported_args_type, (AttentionArguments, AttentionBackwardArguments))})


def _warmed(label: str, mode: str, launchers: dict) -> dict:
    """The launchers whose first call (choices, compiles) succeeds; each failure is printed, the
    rest timed."""
    fns = {}
    for name, fn in launchers.items():
        try:
            fn(0)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - one contestant's failure is reported, the rest timed
            print(f"{label} {mode} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        fns[name] = fn
    return fns


def _timed_row(label: str, mode: str, fns: dict, against: str, work: float, repeat: int, **fields: Any) -> dict:
    """``fns`` timed alternately (`time_group`): TFLOP/s for ``work`` FLOPs and each contestant's
    speed against contestant ``against``'s, printed as one line; the JSON row."""
    chosen = _choices()
    times, behind = time_group(fns, repeat)
    tflops = {n: work / (t * 1e-3) / 1e12 for n, t in times.items()}
    ratios = {n: times[against] / t for n, t in times.items()}
    parts = "  ".join(f"{n} {tflops[n]:.0f} ({ratios[n]:.2f}x)" for n in fns)
    print(f"{label} {mode}: TFLOP/s (vs {against}) {parts}  ops chose {chosen}{'  [host behind]' if behind else ''}",
          flush=True)
    return {"case": label, "mode": mode, **fields, "ms": times, "tflops": tflops, f"vs_{against}": ratios,
            "chosen": chosen, "host_behind": behind}


def run_case(case: Case, names: dict, repeat: int) -> list[dict]:
    b, h, s, d, causal = case.batch, case.heads, case.seqlen, case.head_dim, case.causal
    label = case.label
    per_set = 2 * b * (h + case.heads_kv) * s * d * 2
    count = max(2, math.ceil(ROTATE_BYTES / per_set))
    rows = []
    for backward in (False, True):
        ops.clear_dispatch_cache()
        sets = {layout: _sets(case, layout, count, backward) for layout in ("bhsd", "bshd")}
        mode = "fwd+bwd" if backward else "fwd"
        fns = _warmed(label, mode, {name: _launcher(contestant, sets[contestant.layout], causal, backward)
                                    for name, contestant in names.items()
                                    if not (backward and contestant.forward_only)})
        if "sdpa" in fns:
            rows.append(_timed_row(label, mode, fns, "sdpa", flops(b, h, s, d, causal, backward), repeat,
                                   sets=count))
        del sets, fns
        torch.cuda.empty_cache()
    return rows


def kernel_times(case: Case, repeat: int) -> list[dict]:
    """Every forward kernel that writes the log-sum-exp and every backward kernel on their own
    (a bound `Kernel.run` each: no op, no autograd), the materialised ``math`` ones left out:
    what PickAny's speeds are set from."""
    from kernel_api.arguments import AttentionArguments, AttentionBackwardArguments
    b, h, s, d, causal = case.batch, case.heads, case.seqlen, case.head_dim, case.causal
    label = case.label
    count = max(2, math.ceil(ROTATE_BYTES / (4 * b * (h + case.heads_kv) * s * d * 2)))
    sets = _sets(case, "bshd", count, False)
    rows = []
    forward = [AttentionArguments(q, k, v, torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32),
                                  causal=causal) for q, k, v, _ in sets]
    backward = [AttentionBackwardArguments(do, q, k, v, f.out, f.lse, torch.empty_like(q), torch.empty_like(k),
                                           torch.empty_like(v), causal=causal)
                for (q, k, v, do), f in zip(sets, forward)]
    for mode, per_set, work in (("fwd", forward, flops(b, h, s, d, causal, False)),
                                ("bwd", backward, flops(b, h, s, d, causal, True) - flops(b, h, s, d, causal, False))):
        kernels = [kern for kern in kernel_api.get_kernels(per_set[0]) if not kern.name.endswith("_math")]
        fns = {}
        for kern in kernels:
            try:
                for args in per_set:  # compiles, and fills out and lse for the backward
                    kern.run(args)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - one kernel's failure is reported, the rest timed
                print(f"{label} {mode} {kern.name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            fns[kern.name] = (lambda kern: lambda i: kern.run(per_set[i % len(per_set)]))(kern)
        if not fns:
            continue
        times, _ = time_group(fns, repeat)
        tflops = {n: work / (t * 1e-3) / 1e12 for n, t in times.items()}
        rows.append({"case": label, "mode": f"kernel {mode}", "ms": times, "tflops": tflops})
        print(f"{label} kernel {mode}: TFLOP/s " + "  ".join(f"{n} {v:.0f}" for n, v in tflops.items()), flush=True)
    del sets, forward, backward
    torch.cuda.empty_cache()
    return rows


def _varlen_contestants(fa4_provider: str | None) -> dict[str, Contestant]:
    """Contestants of a packed batch: ``run(q, k, v, causal, cu, max_len)`` on (tokens, heads,
    head_dim) tensors; SDPA's (on the dense (batch, heads, seqlen, head_dim) view of equal
    lengths) is added per case."""
    def op(q, k, v, causal, cu, max_len):
        return ops.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                             max_seqlen_k=max_len)

    found = {"ops": Contestant("packed", op), "ops_torch": Contestant("packed", op, ["torch"]),
             "ops_cutedsl": Contestant("packed", op, ["cutedsl"], forward_only=True)}
    if fa4_provider is not None:
        found["ops_fa4"] = Contestant("packed", op, [fa4_provider])
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - FA4 absent: its own function is left out
        return found

    def fa4(q, k, v, causal, cu, max_len):
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                     max_seqlen_k=max_len, causal=causal)
        return out[0] if isinstance(out, tuple) else out
    found["fa4"] = Contestant("packed", fa4)
    return found


def run_varlen_case(lengths: tuple, heads: int, heads_kv: int, d: int, causal: bool, names: dict,
                    repeat: int) -> list[dict]:
    """One packed batch, forward and forward+backward: each contestant against the anchor (SDPA's
    dense call when the lengths are equal, else the torch provider's varlen kernel)."""
    tokens, longest, equal = sum(lengths), max(lengths), len(set(lengths)) == 1
    label = f"varlen {len(lengths)} seqs ({tokens} tokens, longest {longest}) h{heads}" \
            f"{'' if heads_kv == heads else f'/{heads_kv}'} d{d} {'causal' if causal else 'full'}"
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    contestants = dict(names)
    if equal:
        b, s_ = len(lengths), longest
        sdpa = _sdpa(None)
        contestants["sdpa"] = Contestant("packed", lambda q, k, v, causal, cu, max_len: sdpa(
            *(t.view(b, s_, t.shape[1], d).transpose(1, 2) for t in (q, k, v)), causal))
    anchor = "sdpa" if equal else "ops_torch"
    count = max(2, math.ceil(ROTATE_BYTES / (2 * tokens * (heads + heads_kv) * d * 2)))
    work_fwd = sum(4.0 * heads * n * n * d / (2 if causal else 1) for n in lengths)
    rows = []
    for backward in (False, True):
        ops.clear_dispatch_cache()
        g = torch.Generator(device="cuda").manual_seed(0)
        sets = [tuple(torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(
            backward and i < 3) for i, h in enumerate((heads, heads_kv, heads_kv, heads))) for _ in range(count)]
        mode = "fwd+bwd" if backward else "fwd"

        def launcher(contestant: Contestant, sets: list = sets, backward: bool = backward) -> Callable[[int], Any]:
            def launch(i: int) -> Any:
                q, k, v, do = sets[i % len(sets)]
                scope = contextlib.nullcontext() if contestant.providers is None else \
                    kernel_api.settings(providers=contestant.providers)
                if not backward:
                    with torch.no_grad(), scope:
                        return contestant.run(q, k, v, causal, cu, longest)
                with torch.autograd.set_multithreading_enabled(False), scope:
                    out = contestant.run(q, k, v, causal, cu, longest)
                    return torch.autograd.grad(out, (q, k, v), do.view_as(out))
            return launch
        fns = _warmed(label, mode, {name: launcher(contestant) for name, contestant in contestants.items()
                                    if not (backward and contestant.forward_only)})
        if anchor in fns:
            work = work_fwd * (1 + BACKWARD_FLOPS) if backward else work_fwd
            rows.append(_timed_row(label, mode, fns, anchor, work, repeat, anchor=anchor, sets=count))
        del sets, fns
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (the same shapes)")
    parser.add_argument("--repeat", type=int, default=None, help="timed launches per contestant")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument("--no-kernels", action="store_true", help="skip timing each kernel on its own")
    parser.add_argument("--cases", default="issue", help=f"comma-separated case groups of {sorted([*CASES, 'varlen'])} "
                        "(default: issue)")
    opts = parser.parse_args()
    groups = [g.strip() for g in opts.cases.split(",") if g.strip()]
    unknown = [g for g in groups if g not in CASES and g != "varlen"]
    if unknown or not groups:
        parser.error(f"--cases: unknown {unknown or 'empty list'}; choose from {sorted([*CASES, 'varlen'])}")
    repeat = opts.repeat or (10 if opts.quick else 30)
    names = contestants(_flash_attn_plugin())
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; contestants {list(names)}", flush=True)
    rows = []
    name = results_io.result_name("attention", torch.cuda.get_device_name(), opts.tag)
    paths: Any = ()
    for case in [c for g in groups if g != "varlen" for c in CASES[g]]:  # (the JSON is rewritten after each case)
        rows.extend(run_case(case, names, repeat))
        if not opts.no_kernels:
            rows.extend(kernel_times(case, repeat))
        paths = results_io.write_result(name, results_io.result_doc(repeat=repeat, contestants=list(names), rows=rows))
    if "varlen" in groups:
        packed = _varlen_contestants("flash_attn" if "ops_fa4" in names else None)
        for lengths, heads, heads_kv, d, causal in VARLEN_CASES:
            rows.extend(run_varlen_case(lengths, heads, heads_kv, d, causal, packed, repeat))
            paths = results_io.write_result(name, results_io.result_doc(repeat=repeat, contestants=list(names),
                                                                        rows=rows))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
