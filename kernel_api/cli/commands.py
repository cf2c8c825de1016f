"""The ``kernel-api`` command line: discover kernels for a problem and say why others don't fit.

    kernel-api list gemm --m 4096 --n 4096 --k 4096 --dtype bf16 [--layout tnt] [--cc 90]
    kernel-api list softmax --rows 4096 --cols 1024 --dtype bf16
    kernel-api list attention --batch 4 --heads 32 --kv-heads 8 --seqlen-q 2048 --head-dim 128 --causal
    (every operation of `kernel_api.cli.problems.all_problems`: ``kernel-api list OP --help``)
    kernel-api list --provider cutedsl[,torch] [--cc 90]   # a provider's kernel classes and instances
    kernel-api explain gemm ...
    kernel-api env [--json]          # versions, driver, GPUs, cache: paste it into bug reports
    kernel-api records export FILE.json | records import FILE.json   # tuning records across machines
    kernel-api precompile --shapes FILE.json --cc 90 [--top N] [--workers N]   # fill the compile cache
    kernel-api tune --shapes FILE.json [--devices 0,1] [--export FILE.json]   # tune on every GPU (GPU)
    kernel-api bundle create FILE.tar [--shapes FILE.json --cc 90] [--sign KEY] | bundle install FILE.tar --trust
    kernel-api trust add KEY.pub | trust list | trust remove SHA256:...   # keys that may sign bundles

Errors that kernel_api reports on purpose (`KernelApiError`, bad values, a missing optional
dependency) and those of the system (a missing folder, a failing disk, a locked records
database) print one line on stderr and exit non-zero; ``--debug`` (or ``KERNEL_API_DEBUG=1``)
shows the whole message and the traceback instead. When the reader of stdout goes away
(``| head``), the command exits quietly.

Problems are described with tensors on torch's "meta" device (`kernel_api.cli.problems`), so
nothing is allocated and no GPU is needed; pointers then count as fully aligned.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Sequence

import torch

from .. import registry
from ..tuning import policies
from ..core.arch import normalize_cc
from .errors import exit_status, one_line, require
from .format import format_table
from .problems import DEVICE, REQUIRED, all_problems


def _add_problem_args(sub: argparse.ArgumentParser) -> None:
    """One sub-command per operation of `all_problems`, its options made from its fields."""
    ops = sub.add_subparsers(dest="op", required=True)
    for problem in all_problems().values():
        p = ops.add_parser(problem.op, help=problem.help)
        for field in problem.fields:
            if field.kind is bool:
                p.add_argument(field.flag, dest=field.name, action="store_true", help=field.help)
                continue
            p.add_argument(field.flag, dest=field.name, type=int if field.kind is int else str,
                           required=field.default is REQUIRED,
                           default=None if field.default is REQUIRED else field.default, help=field.help or None)
        p.add_argument("--cc", default=None, help="target compute capability, e.g. 90 (default: this GPU, or all)")
        p.add_argument("--provider", action="append", default=None,
                       help="only this provider's kernels (repeatable, or comma-separated)")


def build_arguments(ns: argparse.Namespace, device: str = DEVICE) -> Any:
    """The arguments of the problem ``ns`` describes (its operation's options), tensors on
    ``device``; ValueError names the option at fault."""
    problem = all_problems()[ns.op]
    values = problem.values({f.name: getattr(ns, f.name) for f in problem.fields}, lambda f: f.flag)
    return problem.arguments(values, device)


def _design_text(design: Any) -> str:
    """A kernel's design in a few words: its tile and cluster, its row strategy, a library's
    schedule (a tile of zeros), or its fields."""
    if design is None:
        return "-"
    tile = getattr(design, "tile_shape", None)
    if tile is not None and any(tile):
        cluster = "x".join(map(str, getattr(design, "cluster_shape", (1, 1, 1))))
        return f"{'x'.join(map(str, tile))} / {cluster}"
    if tile is not None:
        return str(getattr(design, "schedule", None) or "-")
    strategy = getattr(design, "strategy", None)
    if strategy is not None:
        return f"{strategy} ({design.threads_per_row} thr/row)"
    names = ([f.name for f in dataclasses.fields(design)] if dataclasses.is_dataclass(design)
             else list(getattr(design, "_fields", ())))  # (a NamedTuple's)
    if names:
        return " ".join(f"{n}={getattr(design, n)}" for n in names if getattr(design, n) not in (None, ()))
    return str(design)


def provider_names(values: Sequence[str] | None) -> list[str] | None:
    """The provider names of ``--provider`` options (each repeatable and comma-separated).

    Args:
        values: the options' values, e.g. ``["cutedsl,torch", "cuda_src"]``; None: none given.

    Returns:
        The names in the order given, each once; None when none was given.

    Raises:
        ValueError: a name no registered provider has (the message lists those available).
    """
    if not values:
        return None
    names = list(dict.fromkeys(n.strip() for v in values for n in v.split(",") if n.strip()))
    if not names:
        raise ValueError("--provider: expected a provider name, e.g. --provider cutedsl")
    available = registry.available_providers()
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ValueError(f"--provider: unknown provider {', '.join(map(repr, unknown))}; "
                         f"available: {', '.join(available)}")
    return names


def _list_provider_kernels(names: list[str], cc: int | None) -> int:
    """``list --provider NAME`` without a problem: each provider's version, kernel classes and
    their instances (for ``cc``; default: this GPU, else every architecture)."""
    instances: dict[type, int] = {}
    for kernel in registry.get_kernels(None, cc=cc, providers=names):
        kernel_class = kernel.metadata.kernel_class
        instances[kernel_class] = instances.get(kernel_class, 0) + 1
    rows = []
    for name in names:
        provider = registry.get_provider(name)
        for kernel_class in provider.kernel_classes():
            rows.append((name, provider.version, kernel_class.__qualname__,
                         getattr(kernel_class.supported_args_type, "__name__", "?"), instances.get(kernel_class, 0)))
    if not rows:
        print(f"provider(s) {', '.join(names)}: no kernel class registered")
        return 1
    print(format_table(("provider", "version", "kernel class", "arguments", "instances"), rows))
    print(f"{len(rows)} kernel class(es), {sum(r[4] for r in rows)} instance(s)"
          + (f" for cc {cc}" if cc is not None else ""))
    return 0


def cmd_list(ns: argparse.Namespace) -> int:
    """``list``: the kernels that can run a problem, or with ``--provider`` and no problem, the
    providers' kernel classes and instances."""
    providers = provider_names((ns.list_provider or []) + (getattr(ns, "provider", None) or []))
    if ns.op is None:
        if providers is None:
            raise ValueError(f"list: give a problem (list OP ..., OP one of {', '.join(all_problems())}) "
                             "or --provider NAME")
        return _list_provider_kernels(providers, normalize_cc(ns.list_cc, "--cc"))
    args = build_arguments(ns)
    cc = normalize_cc(ns.cc if ns.cc is not None else ns.list_cc, "--cc")
    kernels = registry.get_kernels(args, cc=cc, providers=providers)
    rows = [(k.metadata.kernel_name, k.metadata.provider, _design_text(k.metadata.design), k.metadata.min_cc)
            for k in kernels]
    print(f"{args!r}")
    if not rows:
        print("no kernel found; `kernel-api explain` with the same options says why")
        return 1
    print(format_table(("kernel", "provider", "design", "min cc"), rows))
    print(f"{len(rows)} kernel(s)")
    return 0


def cmd_explain(ns: argparse.Namespace) -> int:
    """A one-screen summary (the problem, accepted kernels per class, grouped reasons per
    class); with ``--all``, every accepted kernel and every rejection with its reason."""
    args = build_arguments(ns)
    cc = normalize_cc(ns.cc, "--cc")
    explanation = registry.explain(args, cc=cc, providers=provider_names(ns.provider))
    print(explanation.all() if ns.all else explanation)
    return 0


def cmd_demo(ns: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(ns.m, ns.n, ns.k, ns.dtype, ns.max_kernels, normalize_cc(ns.cc, "--cc"))


def _gpu_arguments(ns: argparse.Namespace) -> Any:
    """Real CUDA tensors for bench/tune; without a GPU, say what would run and return None."""
    if not torch.cuda.is_available():
        args = build_arguments(ns)
        kernels = registry.get_kernels(args, cc=normalize_cc(getattr(ns, "cc", None), "--cc") or 90,
                                       providers=provider_names(ns.provider))
        print(f"kernel-api {ns.command}: no CUDA GPU here; on one it would compile, verify and time "
              f"{len(kernels)} kernel(s) for {args!r}:", file=sys.stderr)
        for k in kernels:
            print(f"  {k.metadata.kernel_name}", file=sys.stderr)
        return None
    return build_arguments(ns, device="cuda")


def cmd_bench(ns: argparse.Namespace) -> int:
    if ns.plot:  # say so before anything runs
        require("matplotlib", "--plot", "plot")
    providers = provider_names(ns.provider)
    args = _gpu_arguments(ns)
    if args is None:
        return 3
    from .bench import bench

    bench(args, limit=ns.limit, num_workers=ns.workers, plot=ns.plot, json_path=ns.json, providers=providers)
    return 0


def cmd_tune(ns: argparse.Namespace) -> int:
    if ns.op is None:
        if ns.shapes is None:
            raise ValueError("tune: give a shapes file (--shapes FILE) or a problem (tune gemm --m ... / tune softmax ...)")
        from .precompile import run_tune_shapes

        return run_tune_shapes(ns.shapes, ns.devices, ns.export, ns.max_candidates, ns.repeat, ns.shapes_workers,
                               ns.shapes_force, ns.bucket, isolation=ns.isolation, power_state=ns.power_state)
    for flag, value in (("--shapes", ns.shapes), ("--devices", ns.devices), ("--export", ns.export),
                        ("--bucket", ns.bucket), ("--isolation", ns.isolation)):
        if value is not None:
            raise ValueError(f"tune: {flag} is for a shapes file (tune --shapes FILE), not with a problem ({ns.op})")
    providers = provider_names(ns.provider)
    args = _gpu_arguments(ns)
    if args is None:
        return 3
    from .bench import tune

    tune(args, num_workers=ns.workers, force=ns.force, power_state=ns.power_state, providers=providers)
    return 0


def cmd_cache(ns: argparse.Namespace) -> int:
    from .bench import cache_info
    from .cache import run_cache_clear

    if ns.action == "info":
        cache_info()
        return 0
    return run_cache_clear(ns.yes)


def cmd_env(ns: argparse.Namespace) -> int:
    from .env import run_env

    return run_env(as_json=ns.json)


def cmd_records(ns: argparse.Namespace) -> int:
    """Export the tuning records to a JSON file, or merge one in (the newer record wins per key)."""
    from ..tuning.records import export_records, import_records

    if ns.action == "export":
        count = export_records(ns.file)
        print(f"exported {count} tuning record(s) to {ns.file}")
    else:
        counts = import_records(ns.file)
        print(f"imported {ns.file}: {counts.added} added, {counts.replaced} replaced, "
              f"{counts.kept} kept (the local record was as new or newer)")
    return 0


def cmd_precompile(ns: argparse.Namespace) -> int:
    from .precompile import run_precompile

    return run_precompile(ns.shapes, ns.cc, ns.top, ns.workers, providers=ns.provider)


def cmd_bundle(ns: argparse.Namespace) -> int:
    from .precompile import run_bundle_create, run_bundle_install

    if ns.action == "create":
        if ns.trust:
            raise ValueError("--trust is for `bundle install`")
        return run_bundle_create(ns.file, ns.shapes, ns.cc, ns.top, ns.workers, providers=ns.provider,
                                 sign_with=ns.sign)
    for flag, value in (("--shapes", ns.shapes), ("--sign", ns.sign)):
        if value is not None:
            raise ValueError(f"{flag} is for `bundle create`")
    return run_bundle_install(ns.file, trusted=ns.trust)


def cmd_trust(ns: argparse.Namespace) -> int:
    from .trust import run_trust

    return run_trust(ns.action, ns.key)


POWER_STATE_HELP = ("how the candidates are timed: each after its own settle launches at the clock its own power "
                    "draw allows (own, the default: the fastest when it alone runs back to back at the power "
                    "cap) or in turn at one shared clock (shared: the fewest cycles at the clock their mix "
                    "sets); recorded apart")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kernel-api", description="Discover, explain, benchmark and tune kernels.")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, the full message and the traceback (also: KERNEL_API_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    list_p = sub.add_parser("list", help="list the kernels that can run a problem, or a provider's kernels")
    _add_problem_args(list_p)
    list_p._subparsers._group_actions[0].required = False  # or --provider alone:
    # Their own dests: a problem's options of the same names would overwrite them with defaults.
    list_p.add_argument("--provider", dest="list_provider", action="append", default=None,
                        help="only this provider's kernels; without a problem, its version, kernel classes and "
                             "instances (repeatable, or comma-separated)")
    list_p.add_argument("--cc", dest="list_cc", default=None,
                        help="without a problem: count the instances for this compute capability, e.g. 90")
    explain_p = sub.add_parser("explain", help="say why each registered kernel does or does not fit")
    _add_problem_args(explain_p)
    for op_parser in explain_p._subparsers._group_actions[0].choices.values():
        op_parser.add_argument("--all", action="store_true",
                               help="every kernel and rejection, one per line (default: a one-screen summary)")
    bench_p = sub.add_parser("bench", help="compile, verify and time every candidate and torch (GPU)")
    tune_p = sub.add_parser("tune", help="find the fastest correct kernel and record it (GPU)")
    for p, extra in ((bench_p, True), (tune_p, False)):
        _add_problem_args(p)
    for p in (bench_p, tune_p):
        for op_parser in p._subparsers._group_actions[0].choices.values():
            op_parser.add_argument("--workers", type=int, default=None, help="compile worker processes")
            if p is bench_p:
                op_parser.add_argument("--limit", type=int, default=None, help="only the N best-ranked candidates")
                op_parser.add_argument("--plot", default=None, help="write a bar chart (PNG) here")
                op_parser.add_argument("--json", default=None, help="write the table as JSON here")
            else:
                op_parser.add_argument("--force", action="store_true", help="measure even if a record exists")
                op_parser.add_argument("--power-state", dest="power_state", choices=policies.POWER_STATES,
                                       default=argparse.SUPPRESS, help=POWER_STATE_HELP)
    tune_p._subparsers._group_actions[0].required = False  # or a shapes file:
    tune_p.add_argument("--shapes", default=None, help="tune every problem of this JSON file (the format of "
                                                       "`precompile --shapes`), sharded over the GPUs")
    tune_p.add_argument("--devices", default=None, help="with --shapes: GPU indices, e.g. 0,1 (default: all)")
    tune_p.add_argument("--export", default=None, help="with --shapes: also write the winners' records here (JSON)")
    tune_p.add_argument("--max-candidates", type=int, default=24, help="with --shapes: candidates per problem, "
                                                                       "best-ranked first (default 24)")
    tune_p.add_argument("--repeat", type=int, default=30, help="with --shapes: timed runs per candidate")
    tune_p.add_argument("--workers", dest="shapes_workers", type=int, default=None,
                        help="with --shapes: compile processes per GPU (default: CPUs / GPUs, at most 8)")
    tune_p.add_argument("--force", dest="shapes_force", action="store_true",
                        help="with --shapes: measure problems that already have a record")
    tune_p.add_argument("--bucket", default=None, help="with --shapes: record per shape bucket, e.g. pow2_m")
    tune_p.add_argument("--power-state", dest="power_state", choices=policies.POWER_STATES, default=policies.DEFAULT_POWER_STATE,
                        help=POWER_STATE_HELP)
    tune_p.add_argument("--isolation", default=None, choices=("threads", "processes"),
                        help="with --shapes on several GPUs: a thread per GPU in this process (default) or a "
                             "worker process per GPU")
    cache_p = sub.add_parser("cache", help="inspect or clear the compile caches and tuning records")
    cache_p.add_argument("action", choices=("info", "clear"))
    cache_p.add_argument("--yes", "-y", action="store_true",
                         help="clear: delete without asking (needed without a terminal)")
    demo = sub.add_parser("demo", help="discover + compile a GEMM; on a GPU also run, verify and time vs torch")
    demo.add_argument("--m", type=int, default=4096)
    demo.add_argument("--n", type=int, default=4096)
    demo.add_argument("--k", type=int, default=4096)
    demo.add_argument("--dtype", default="bf16")
    demo.add_argument("--max-kernels", type=int, default=4, help="kernels to try, one per class")
    demo.add_argument("--cc", default=None)
    env_p = sub.add_parser("env", help="versions, CUDA driver, NVRTC, GPUs, cache and native module, for bug reports")
    env_p.add_argument("--json", action="store_true", help="as JSON")
    records_p = sub.add_parser("records", help="move tuning records between machines (JSON)")
    records_p.add_argument("action", choices=("export", "import"),
                           help="export: write every record; import: merge, the newer record winning per key")
    records_p.add_argument("file", help="the JSON file")
    pre_p = sub.add_parser("precompile", help="compile the best-ranked kernels of known shapes into the cache "
                                              "(no GPU needed)")
    pre_p.add_argument("--shapes", required=True, help='JSON list of {"op": "gemm", "m", "n", "k", "dtype", '
                                                       '"layout"} or {"op": "softmax", "rows", "cols", "dtype"}')
    pre_p.add_argument("--cc", required=True, help="target compute capability, e.g. 90")
    pre_p.add_argument("--top", type=int, default=1, help="candidates per shape, in PickAny's order (default 1)")
    pre_p.add_argument("--workers", type=int, default=None, help="compile processes (default: min(4, CPUs))")
    pre_p.add_argument("--provider", action="append", default=None,
                       help="rank only this provider's kernels (repeatable; the torch provider compiles nothing)")
    bundle_p = sub.add_parser("bundle", help="carry compiled kernels and tuning records to other machines (tar)")
    bundle_p.add_argument("action", choices=("create", "install"),
                          help="create: pack the cache and records; install: check and unpack one")
    bundle_p.add_argument("file", help="the bundle (.tar)")
    bundle_p.add_argument("--shapes", default=None, help="create: compile these shapes (as `precompile` does) and "
                                                         "pack only their kernels (default: the whole cache)")
    bundle_p.add_argument("--cc", default=None, help="with --shapes: target compute capability, e.g. 90")
    bundle_p.add_argument("--top", type=int, default=1, help="with --shapes: candidates per shape (default 1)")
    bundle_p.add_argument("--workers", type=int, default=None, help="with --shapes: compile processes")
    bundle_p.add_argument("--provider", action="append", default=None,
                          help="with --shapes: rank only this provider's kernels (repeatable)")
    bundle_p.add_argument("--sign", default=None, metavar="KEY",
                          help="create: sign the bundle with this Ed25519 private key (needs cryptography)")
    bundle_p.add_argument("--trust", action="store_true",
                          help="install: you trust the bundle's source (it holds code this machine will run); "
                               "not needed for a bundle signed by a key of `kernel-api trust list`")
    trust_p = sub.add_parser("trust", help="the public keys whose signed bundles install without --trust")
    trust_p.add_argument("action", choices=("add", "list", "remove"),
                         help="add KEY.pub (an Ed25519 key: OpenSSH or PEM), list, remove SHA256:FINGERPRINT")
    trust_p.add_argument("key", nargs="?", default=None, help="add: the public key file; remove: its fingerprint")
    return parser


COMMANDS = {"list": cmd_list, "explain": cmd_explain, "demo": cmd_demo, "bench": cmd_bench, "tune": cmd_tune,
            "cache": cmd_cache, "env": cmd_env,
            "records": cmd_records, "precompile": cmd_precompile,
            "bundle": cmd_bundle, "trust": cmd_trust}


def _debug(ns: argparse.Namespace) -> bool:
    return ns.debug or os.environ.get("KERNEL_API_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def _reader_gone() -> int:
    """Exit quietly when stdout's reader has closed the pipe, as Python's documentation on
    SIGPIPE advises: stdout goes to devnull, so the interpreter's last flush at exit cannot
    fail again and print a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file (replaced by a test or an embedding)
        pass
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status. Errors kernel_api reports on purpose, and
    the system's, become one line on stderr (see `errors.exit_status`); others keep their
    traceback."""
    parser = make_parser()
    ns = parser.parse_args(argv)
    try:
        status = COMMANDS[ns.command](ns)
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not at exit
        return status
    except KeyboardInterrupt:
        if _debug(ns):
            raise
        print("kernel-api: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`kernel-api explain ... --all | head`)
        return _reader_gone()
    except Exception as exc:
        status = exit_status(exc)
        if status is None or _debug(ns):
            raise
        print(one_line(exc), file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
