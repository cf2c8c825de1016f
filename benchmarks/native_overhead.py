"""Host cost of the native entry points (`kernel_api.native`) per call, on the CPU.

    python benchmarks/native_overhead.py                        # this tree's installed module
    python benchmarks/native_overhead.py --against 6c7a612      # and revision 6c7a612's, interleaved
    python benchmarks/native_overhead.py --against 6c7a612 --against .:direct

Each ``--against`` adds a module to compare: ``REV[:BUILD]`` builds revision REV's native sources
(``.`` is this working tree's) into a temporary folder, with BUILD ``direct`` (default: the
single ``c++ -O2 -fPIC -shared ... -ltvm_ffi`` command kernel_api used before setup.py built the
module) or ``setuptools`` (setup.py's flags, on top of Python's CFLAGS); a path to a built
``_launch_table*.so`` is loaded as it is. Every module is loaded under its own name and has its
own launch table.

The launched "kernel" is TVM-FFI's ``testing.nop`` (a C function that returns at once), the
operands CPU tensors (A, B, out of 128x128 f16: what the GPU benchmark host_latency.py uses), so
the rows time the entry points' own work, which is the same as on a GPU but for the stream:

- bound launch: ``entry.bind(nop, (A, B, out), tail)(None)``, Kernel.run's bound path;
- table launch: ``entry.launch(tag, None, A, B, out)``, a hit in ops' C launch table;
- gemm_plain, out=out / out=None: ``ops.gemm``'s plain call in C (checks, table hit, version
  bump of a given out, or a new output);
- recall: ``entry.recall(tag, A, B, out)``, a remembered GemmArguments summary;
- GemmArguments recalled: ``GemmArguments(A, B, out)`` with kernel_api.arguments recalling
  through that module;
- and, the same for every module, the bare TVM-FFI call ``nop(A, B, out, *tail, None)`` from
  Python (which converts each tensor), for scale.

Per row and module: nanoseconds per call, the median over ``--repeats`` repeats of the mean of
``--calls`` calls; every (row, module) is timed once per repeat, in an order rotated per repeat,
and differences to the first module are medians of per-repeat differences (paired: the host's
drift cancels). Prints a table; writes benchmarks/results/native_overhead-<host>.json (and to
$OUT/ when set).
"""

from __future__ import annotations

import argparse
import functools
import importlib.machinery
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import tvm_ffi  # noqa: E402
from tvm_ffi import libinfo  # noqa: E402

import kernel_api.arguments as arguments  # noqa: E402
from kernel_api import GemmArguments, native, ops  # noqa: E402
from kernel_api.tuning.settings import _current as settings  # noqa: E402
from kernel_api.tuning.settings import current  # noqa: E402
from kernel_api.utils import to_cuda_stream  # noqa: E402

SOURCES = ("launch_table.h", "launch_table.cc", "python_entry.cc")
TAIL = (1.0, 0, True)  # constants after the tensors, as a compiled GEMM takes them
GEMM_TAG = ops._GEMM_TAG
SUMMARY_TAG = arguments._GEMM_SUMMARY


def build(spec: str, folder: Path) -> tuple[Path, str]:
    """Build ``REV[:direct|setuptools]`` into ``folder``; return the module's path and how it was built."""
    rev, _, how = spec.partition(":")
    how = how or "direct"
    if how not in ("direct", "setuptools"):
        raise SystemExit(f"--against {spec}: the build is 'direct' or 'setuptools', not {how!r}")
    src = folder / "src"
    src.mkdir(parents=True)
    for name in SOURCES:
        if rev == ".":
            text = (ROOT / "kernel_api" / "native" / name).read_bytes()
        else:
            text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kernel_api/native/{name}"],
                                  check=True, capture_output=True).stdout
        (src / name).write_bytes(text)
    includes = list(dict.fromkeys([libinfo.find_include_path(), libinfo.find_dlpack_include_path(),
                                   sysconfig.get_paths()["include"]]))
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    if how == "direct":
        lib = Path(libinfo.find_libtvm_ffi()).parent
        target = folder / f"_launch_table{suffix}"
        command = [os.environ.get("CXX", "c++"), "-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
                   *(f"-I{i}" for i in includes), str(src / "launch_table.cc"), str(src / "python_entry.cc"),
                   "-o", str(target), f"-L{lib}", "-ltvm_ffi", f"-Wl,-rpath,{lib}"]
        subprocess.run(command, check=True)
        return target, " ".join(command)
    # setup.py's extension, built by setuptools in a child process (setup() wants its own argv)
    script = (
        "import sys\n"
        "from setuptools import Extension, setup\n"
        f"setup(name='bench', script_args=['build_ext', '--build-lib', {str(folder)!r}, '--build-temp', "
        f"{str(folder / 'tmp')!r}], ext_modules=[Extension('_launch_table', sources={[str(src / 'launch_table.cc'), str(src / 'python_entry.cc')]!r}, "
        f"include_dirs={includes!r}, language='c++', extra_compile_args=['-std=c++17', '-O2', '-fvisibility=hidden'])])\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=folder, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"building {spec} with setuptools failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    commands = [line for line in done.stdout.splitlines() if line.startswith(("g++", "gcc", "c++", "clang"))]
    return folder / f"_launch_table{suffix}", " && ".join(commands)


def load(path: Path, index: int) -> Any:
    """The module at ``path`` under a name of its own, configured for torch tensors and ops."""
    name = f"native_overhead_{index}._launch_table"
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
    loader.exec_module(module)
    module.configure(torch.Tensor)
    return module


def configure_ops(module: Any) -> None:
    hooks = [settings, getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0), torch.is_grad_enabled,
             ops._new_gemm_output, to_cuda_stream, torch._C._increment_version]
    try:
        module.configure_ops(*hooks)
    except TypeError:  # revisions before the version bump take five
        module.configure_ops(*hooks[:5])


def rows_for(module: Any, table: Any, nop: Any, A: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> dict:
    """The timed calls through ``module`` (its table gets the entries they hit)."""
    configure_ops(module)
    table.clear()
    table.record(current().policy_id | GEMM_TAG, nop, 3, A, B, out, *TAIL)
    # and for gemm_plain(out=None): new outputs, at any 64-byte alignment (CPU allocations vary)
    made = ops._new_gemm_output(A, B)
    buffer = torch.empty(made.numel() + 1024 // made.element_size(), dtype=made.dtype)
    for offset in range(0, 1024, 64):
        start = (offset - buffer.data_ptr()) % 1024 // made.element_size()
        table.record(current().policy_id | GEMM_TAG, nop, 3, A, B,
                     buffer[start:start + made.numel()].view(made.shape), *TAIL)
    module.forget()
    module.remember(SUMMARY_TAG, "summary", A, B, out)
    checks = {
        "table launch": module.launch(current().policy_id | GEMM_TAG, None, A, B, out) is True,
        "gemm_plain, out=out": module.gemm_plain(GEMM_TAG, A, B, out, 1.0, 0.0, None, None, None, None, None) is out,
        "recall": module.recall(SUMMARY_TAG, A, B, out) == "summary",
    }
    if not all(checks.values()):
        raise SystemExit(f"{module.__file__}: missed where it should hit: {checks}")

    module.forget()
    arguments_recall, arguments_remember = arguments._recall, arguments._remember
    arguments._recall, arguments._remember = module.recall, module.remember
    try:
        GemmArguments(A, B, out)  # remembered through this module
    finally:
        arguments._recall, arguments._remember = arguments_recall, arguments_remember

    def recalled_arguments() -> Any:
        # (the swap costs the same for every module)
        arguments._recall = module.recall
        try:
            return GemmArguments(A, B, out)
        finally:
            arguments._recall = arguments_recall

    return {
        "bound launch": functools.partial(module.bind(nop, (A, B, out), TAIL), None),
        "table launch": functools.partial(module.launch, current().policy_id | GEMM_TAG, None, A, B, out),
        "gemm_plain, out=out": functools.partial(module.gemm_plain, GEMM_TAG, A, B, out, 1.0, 0.0, None, None, None,
                                                 None, None),
        "gemm_plain, out=None": functools.partial(module.gemm_plain, GEMM_TAG, A, B, None, 1.0, 0.0, None, None, None,
                                                  None, None),
        "recall": functools.partial(module.recall, SUMMARY_TAG, A, B, out),
        "GemmArguments recalled": recalled_arguments,
    }


def measure(calls: dict[tuple[str, str], Callable[[], Any]], n: int, repeats: int) -> dict[tuple[str, str], list]:
    """ns per call of each entry, once per repeat, in an order rotated per repeat."""
    keys = list(calls)
    for fn in calls.values():
        for _ in range(min(n, 500)):
            fn()
    samples: dict[tuple[str, str], list] = {key: [] for key in keys}
    for r in range(repeats):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            fn = calls[key]
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            samples[key].append((time.perf_counter_ns() - t0) / n)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", action="append", default=[], metavar="REV[:direct|setuptools]|PATH",
                        help="another native module to time (repeatable)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=31)
    opts = parser.parse_args()

    entry = native.entry()
    if entry is None:
        raise SystemExit(f"no native entry points in this install: {native.why_not_entry()}")
    modules = {"this tree": (entry, native.table(), native.module_path(), "installed (setup.py)")}
    with tempfile.TemporaryDirectory(prefix="native_overhead-") as tmp:
        for i, spec in enumerate(opts.against):
            if os.path.exists(spec) and not os.path.isdir(spec):
                path, how = Path(spec).resolve(), "as given"
            else:
                path, how = build(spec, Path(tmp) / str(i))
            module = load(path, i)
            modules[spec] = (module, tvm_ffi.load_module(str(path)), str(path), how)

        nop = tvm_ffi.get_global_func("testing.nop")
        torch.manual_seed(0)
        A = torch.randn(128, 128, dtype=torch.float16)
        B = torch.randn(128, 128, dtype=torch.float16)
        out = torch.empty(128, 128, dtype=torch.float16)
        calls: dict[tuple[str, str], Callable[[], Any]] = {}
        for label, (module, table, _, _) in modules.items():
            for row, fn in rows_for(module, table, nop, A, B, out).items():
                calls[(row, label)] = fn
        calls[("bare TVM-FFI call", "")] = functools.partial(nop, A, B, out, *TAIL, None)
        samples = measure(calls, opts.calls, opts.repeats)
        # gemm_plain(out=None) hits only while new outputs get the recorded pointer alignment
        allocating = {label: sum(calls[("gemm_plain, out=None", label)]() is None for _ in range(200)) / 200
                      for label in modules}
        for module, table, _, _ in modules.values():
            table.clear()
            module.forget()

    labels = list(modules)
    rows = list(dict.fromkeys(row for row, _ in calls))
    result: dict[str, Any] = {}
    for row in rows:
        result[row] = {}
        for label in labels if row != "bare TVM-FFI call" else [""]:
            values = samples[(row, label)]
            item = {"ns_per_call": round(statistics.median(values), 1)}
            if label and label != labels[0]:
                first = samples[(row, labels[0])]
                item["minus_first_ns_paired"] = round(statistics.median(v - f for v, f in zip(values, first)), 1)
            result[row][label or "any"] = item

    host = platform.node() or "host"
    summary = {
        "benchmark": "native_overhead", "host": host, "cpu": platform.processor() or platform.machine(),
        "python": sys.version.split()[0], "torch": torch.__version__, "tvm_ffi": tvm_ffi.__version__,
        "calls_per_repeat": opts.calls, "repeats": opts.repeats, "tensors": "A, B, out: 128x128 float16, CPU",
        "modules": {label: {"path": path, "build": how} for label, (_, _, path, how) in modules.items()},
        "rows": result, "gemm_plain_out_none_miss_rate": allocating,
    }
    name = f"native_overhead-{host}.json"
    paths = [ROOT / "benchmarks" / "results" / name]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / name)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")

    print(f"ns per call (median of {opts.repeats} repeats x {opts.calls} calls); in brackets: minus "
          f"'{labels[0]}', paired (the comparison to trust on a busy host)")
    width = max(len(label) for label in labels)
    print(f"{'':26s}" + "".join(f"{label:>{max(width, 8) + 12}s}" for label in labels))
    for row in rows:
        cells = []
        for label in labels:
            item = result[row].get(label) or result[row].get("any") if label == labels[0] else result[row].get(label)
            if item is None:
                cells.append(f"{'':>{max(width, 8) + 12}s}")
                continue
            diff = item.get("minus_first_ns_paired")
            text = f"{item['ns_per_call']:.0f}" + (f" ({diff:+.0f})" if diff is not None else "")
            cells.append(f"{text:>{max(width, 8) + 12}s}")
        print(f"{row:26s}" + "".join(cells))
    for label, (_, _, path, how) in modules.items():
        print(f"  {label}: {path}\n      {how}")
    if any(allocating.values()):
        print(f"note: gemm_plain(out=None) missed the table in {allocating} of calls (new outputs' alignment)")


if __name__ == "__main__":
    main()
