"""``kernel-api bench|tune|cache info``: measure every candidate against torch (and each
provider's best against it), tune and record, inspect the caches (``cache clear`` is in
`kernel_api.cli.cache`)."""

from __future__ import annotations

import json
from typing import Any

import torch

from .. import registry
from ..arguments import AttentionArguments, GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments
from ..core.cache import cache_dir
from ..core.files import atomic_file
from ..tuning.records import TuningRecords
from ..tuning.reference import random_like
from ..tuning.policies import DEFAULT_POWER_STATE, PickBest, rank_candidates
from ..tuning.settings import settings
from ..tuning.timing import rotation_count, time_cuda
from .cache import namespace_folders
from .errors import require
from .format import format_table
from .progress import progress


def _torch_baseline(args: Any) -> Any:
    """What ``bench`` times as torch's call for ``args``: torch's own function where one call is
    the operation (``matmul``, ``softmax`` and its backward), else the torch provider's kernel
    for it (torch's operators, as `PickBest` ranks them first), run on each input set."""
    if isinstance(args, GemmArguments):
        return lambda a: torch.matmul(a.A, a.B, out=a.out)
    if isinstance(args, SoftmaxArguments):
        return lambda a: torch.softmax(a.x, dim=-1)
    if isinstance(args, SoftmaxBackwardArguments):
        return lambda a: torch._softmax_backward_data(a.grad_out, a.out, -1, a.out.dtype)
    kernels = registry.get_kernels(args, providers=["torch"]) if "torch" in registry.available_providers() else []
    if not kernels:
        raise ValueError(f"bench: no torch kernel takes {type(args).__name__} to time against")
    kernel = rank_candidates(kernels, args)[0]
    artifact = kernel.compile(args)
    return lambda a: kernel.run(a, artifact)


def work_of(args: Any) -> tuple[float, str]:
    """(amount, unit) for throughput: FLOPs for GEMM and attention (the two products over the
    (query, key) pairs the mask leaves, ``4 * d`` each; a packed batch's offsets are read once),
    bytes moved for the rest."""
    if isinstance(args, GemmArguments):
        return 2.0 * args.M * args.N * args.K * args.L, "TFLOP/s"
    if (isinstance(args, AttentionArguments) and args.cache_seqlens is None
            and not (args.varlen and args.cu_seqlens_q.device.type == "meta")):  # (meta offsets hold no values)
        if not args.varlen:
            pairs = args.batch * attended_pairs(args.seqlen_q, args.seqlen_k, args.causal)
        else:
            ends_q, ends_k = args.cu_seqlens_q.tolist(), args.cu_seqlens_k.tolist()
            pairs = sum(attended_pairs(q1 - q0, k1 - k0, args.causal) for q0, q1, k0, k1 in
                        zip(ends_q, ends_q[1:], ends_k, ends_k[1:]))
        return 4.0 * args.heads_q * pairs * args.head_dim, "TFLOP/s"
    return float(sum(t.numel() * t.element_size() for t in args.tensors().values())), "TB/s"


def attended_pairs(sq: int, sk: int, causal: bool) -> int:
    """The (query, key) pairs of one head of attention of ``sq`` queries over ``sk`` keys that its
    mask leaves: all of them, or under the bottom-right aligned causal mask, query ``i`` sees the
    first ``i + sk - sq + 1`` keys (none when that is not positive)."""
    if not causal:
        return sq * sk
    first = max(sq - sk, 0)  # queries before it see no key; from it each sees one more, the last all sk
    seeing = sq - first
    low = sk - sq + first + 1  # the keys the first of them sees
    return seeing * (2 * low + seeing - 1) // 2


def provider_bests(rows: list[dict]) -> list[dict]:
    """Each provider's fastest measured kernel among ``rows`` (`bench`'s), fastest first.

    Args:
        rows: dicts with ``kernel``, ``provider``, ``median_ms`` (None: failed) and ``vs_torch``;
            the torch baseline's row (kernel "torch") is left out.

    Returns:
        One row per provider with a kernel that ran; a provider whose every kernel failed has
        ``kernel`` None.
    """
    best: dict[str, dict] = {}
    for r in rows:
        if r["kernel"] == "torch" and r["provider"] == "torch":
            continue
        found = best.get(r["provider"])
        if r["median_ms"] is not None and (found is None or found["median_ms"] is None
                                           or r["median_ms"] < found["median_ms"]):
            best[r["provider"]] = {"provider": r["provider"], "kernel": r["kernel"], "median_ms": r["median_ms"],
                                   "vs_torch": r["vs_torch"]}
        elif found is None:
            best[r["provider"]] = {"provider": r["provider"], "kernel": None, "median_ms": None, "vs_torch": None}
    return sorted(best.values(), key=lambda b: (b["median_ms"] is None, b["median_ms"] or 0.0))


def bench(args: Any, limit: int | None = None, num_workers: int | None = None, plot: str | None = None,
          json_path: str | None = None, show: Any = print, providers: Any = None) -> list[dict]:
    """Compile, verify and time every candidate (best-ranked first, up to ``limit``) plus torch,
    then show each provider's best against torch (`provider_bests`).

    Args:
        args: the problem, on a CUDA GPU.
        limit: only the ``limit`` best-ranked candidates (default: all).
        num_workers: compile worker processes.
        plot: write a bar chart (PNG) here.
        json_path: write the rows (and ``provider_bests``) as JSON here.
        show: prints a line.
        providers: only these providers' kernels (names or classes; default: all).

    Returns:
        One row per kernel, torch's first among equals, fastest first.
    """
    if plot:  # before the measurements, not after them
        require("matplotlib", "--plot", "plot")
    candidates = registry.get_kernels(args, providers=providers)
    if not candidates:
        raise registry.no_kernel_error(args)
    ranked = rank_candidates(candidates, args)[:limit] if limit else rank_candidates(candidates, args)
    picker = PickBest(num_workers=num_workers, max_candidates=None, use_records=False, progress=progress("bench"))
    cc = torch.cuda.get_device_capability(args.device)
    picker._precompile(args, ranked, cc[0] * 10 + cc[1])
    measurements = picker._measure(args, ranked)
    amount, unit = work_of(args)
    sets = rotation_count(sum(t.numel() * t.element_size() for t in args.tensors().values()))
    inputs = [random_like(args) for _ in range(sets)]
    baseline = _torch_baseline(args)
    torch_ms = time_cuda(lambda i: baseline(inputs[i]), sets=sets)["median_ms"]
    rows = [{"kernel": "torch", "provider": "torch", "median_ms": torch_ms, "throughput": amount / torch_ms / 1e9,
             "vs_torch": 1.0, "error": None, "failure": None}]
    for m, k in zip(measurements, ranked):
        rows.append({"kernel": m.kernel_name, "provider": k.metadata.provider, "median_ms": m.median_ms,
                     "throughput": None if m.median_ms is None else amount / m.median_ms / 1e9,
                     "vs_torch": None if m.median_ms is None else torch_ms / m.median_ms,
                     "error": m.error, "failure": m.failure})
    rows.sort(key=lambda r: (r["median_ms"] is None, r["median_ms"] or 0.0))

    table = [(r["kernel"], r["provider"], "-" if r["median_ms"] is None else f"{r['median_ms'] * 1e3:.1f}",
              "-" if r["throughput"] is None else f"{r['throughput']:.1f}",
              "-" if r["vs_torch"] is None else f"{r['vs_torch']:.2f}",
              r["failure"] or ("-" if r["error"] is None else f"{r['error']:.1e}")) for r in rows]
    show(f"{args!r} on {torch.cuda.get_device_name(args.device)}")
    show(format_table(("kernel", "provider", "us", unit, "vs torch", "rel. error / failure"), table))
    bests = provider_bests(rows)
    show("best per provider:")
    show(format_table(("provider", "kernel", "us", "vs torch"),
                      [(b["provider"], b["kernel"] or "(every kernel failed)",
                        "-" if b["median_ms"] is None else f"{b['median_ms'] * 1e3:.1f}",
                        "-" if b["vs_torch"] is None else f"{b['vs_torch']:.2f}") for b in bests]))
    if json_path:
        with atomic_file(json_path, "w") as f:  # a reader never sees half a file
            json.dump({"device": torch.cuda.get_device_name(args.device), "problem": repr(args), "unit": unit,
                       "rows": rows, "provider_bests": bests}, f, indent=2)
    if plot:
        _plot(rows, unit, plot, repr(args))
    return rows


def _plot(rows: list[dict], unit: str, path: str, title: str) -> None:
    matplotlib = require("matplotlib", "--plot", "plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if r["throughput"] is not None][:30]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(good) + 1.5))
    ys = list(range(len(good)))[::-1]
    ax.barh(ys, [r["throughput"] for r in good],
            color=["tab:gray" if r["provider"] == "torch" else "tab:green" for r in good])
    # Kernel names are long: write them on the bars instead of as axis labels.
    for y, r in zip(ys, good):
        ax.text(0, y, f" {r['kernel']}  ({r['throughput']:.0f})", va="center", fontsize=6, color="black")
    ax.set_yticks([])
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def tune(args: Any, num_workers: int | None = None, force: bool = False, show: Any = print,
         power_state: str = DEFAULT_POWER_STATE, providers: Any = None) -> Any:
    """Find the fastest correct kernel for ``args`` with `PickBest` and record it (or read its record).

    Args:
        args: the problem, on a CUDA GPU.
        num_workers: compile worker processes.
        force: measure even when a record exists.
        show: prints a line.
        power_state: `PickBest`'s ``power_state``.
        providers: choose among these providers' kernels only (a `kernel_api.settings` scope, so the
            record is keyed on them, as `kernel_api.ops` under that scope looks it up); default: all.

    Returns:
        The `TuneResult`.
    """
    picker = PickBest(num_workers=num_workers, progress=progress("tune"), power_state=power_state)
    with settings(providers=providers):
        result = picker.tune(args, force=force)
    source = "tuning record" if result.from_record else "measurement"
    best = result.measurements[0] if result.from_record else min(
        (m for m in result.measurements if m.median_ms is not None), key=lambda m: m.median_ms)
    show(f"{args!r}: best {result.winner.metadata.kernel_name} ({best.median_ms * 1e3:.1f} us, from {source})")
    return result


def cache_info(show: Any = print) -> dict:
    """``cache info``: the cache folder, its entries per namespace, which folders and entries fail
    the permission rule (their entries are not loaded), the tuning records, and the bundles
    installed into it (their provenance).

    Args:
        show: prints a line.

    Returns:
        What was shown: ``directory``; ``namespaces`` (per name: ``entries``, ``bytes``, and
        ``untrusted_entries``, how many entry files fail the rule); ``untrusted`` (the cache
        folder's problem, or None); ``untrusted_namespaces`` (per failing namespace folder, its
        problem); ``tuning_records``; ``bundles`` (each provenance record, with ``present``: how
        many of its entries exist).

    Raises:
        NotADirectoryError: the cache folder is a file.
    """
    from ..core.cache import untrusted_folders
    from ..core.trust import stat_problem
    from ..tuning.bundle import entry_name_ok, installed_bundles

    root = cache_dir()
    info = {"directory": str(root), "namespaces": {}}
    folders = namespace_folders(root)  # kernel_api's own: the folder may be shared (~/.cache)
    for sub in folders:
        files = list(sub.glob("*.bin"))
        stats = [f.stat() for f in files]
        info["namespaces"][sub.name] = {"entries": len(files), "bytes": sum(st.st_size for st in stats),
                                        "untrusted_entries": sum(stat_problem(st) is not None for st in stats)}
    records = TuningRecords().all() if (root / "tuning.sqlite").exists() else []
    info["tuning_records"] = len(records)
    problems = untrusted_folders(root, [sub.name for sub in folders])
    info["untrusted"] = problems.pop(root, None)
    info["untrusted_namespaces"] = {folder.name: problem for folder, problem in problems.items()}
    info["bundles"] = installed_bundles(root)
    for b in info["bundles"]:  # a killed install leaves a record listing entries it never renamed in
        listed = b.get("entries") if isinstance(b.get("entries"), list) else []
        b["entries"] = listed
        b["present"] = sum(isinstance(n, str) and entry_name_ok(n) and (root / n).is_file() for n in listed)
    show(f"cache directory: {root}")
    if info["untrusted"]:
        show(f"  NOT LOADED: {info['untrusted']}; entries are compiled in memory instead (docs/security.md)")
    for name, problem in info["untrusted_namespaces"].items():
        show(f"  NOT LOADED: {name}: {problem}; its entries are compiled in memory instead (docs/security.md)")
    for name, d in info["namespaces"].items():
        refused = f" ({d['untrusted_entries']} fail the permission rule, not loaded)" if d["untrusted_entries"] else ""
        show(f"  {name}: {d['entries']} entries, {d['bytes'] / 1e6:.1f} MB{refused}")
    show(f"  tuning records: {len(records)}")
    for r in records[-10:]:
        show(f"    {r.device} cc{r.cc} {r.shape}: {r.kernel_name} {r.median_ms * 1e3:.1f} us ({r.created})")
    show(f"  bundles installed: {len(info['bundles'])}")
    for b in info["bundles"]:
        toolchain = ", ".join(f"{k} {v}" for k, v in sorted(b.get("toolchain", {}).items()))
        listed = len(b.get("entries", []))
        entries = f"{listed} entries" if b["present"] == listed else f"{b['present']} of {listed} entries present"
        show(f"    {b.get('installed')} {b.get('file')} sha256 {b.get('sha256')}: {entries}, "
             f"{b.get('records')} records; {b.get('vouched')}; made {b.get('created')} with {toolchain}")
    return info
