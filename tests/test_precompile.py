"""`kernel-api precompile`: the top-ranked kernels of a shapes file compiled into the disk cache
in worker processes, without a GPU; a later process loads them from the cache."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kernel_api.cli.commands import main
from kernel_api.cli.precompile import load_shapes

# Our providers: the torch provider's kernels compile nothing ahead of time, and PickAny may rank
# cuBLAS first for these small problems.
OURS = ["--provider", "cutedsl", "--provider", "cuda_src"]
SHAPES = [{"op": "softmax", "rows": 64, "cols": 1000, "dtype": "bf16"},
          {"op": "gemm", "m": 256, "n": 256, "k": 128, "dtype": "bf16", "layout": "tnt"}]


def assert_warm(report: dict) -> None:
    """Every kernel the new process compiled was a hit of its provider's disk cache (CuTe DSL
    objects: "cutedsl"; NVRTC cubins: "cubin"), whichever of our providers PickAny ranked first."""
    for namespace, provider in (("cutedsl", "cutedsl"), ("cubin", "cuda_src")):
        chosen = report["providers"].count(provider)
        assert report[namespace]["hits"] == chosen and report[namespace]["misses"] == 0, report


def _entries(root):
    return {os.path.relpath(os.path.join(d, f), root): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, files in os.walk(root) for f in files if f.endswith(".bin")
            and os.path.relpath(d, root) in ("cutedsl", "cubin")}  # compiled kernels, not remembered compiles


# A new process compiles the top-ranked kernel of each shape for cc 90 and reports the disk
# caches' counters and the time the compiles took.
_NEW_PROCESS = textwrap.dedent("""
    import json, sys, time
    from kernel_api import registry
    from kernel_api.cli.problems import gemm_arguments, softmax_arguments
    from kernel_api.tuning.policies import rank_candidates
    from kernel_api.providers.cutedsl import kernel as cute_kernel
    from kernel_api.nvrtc import compiler
    problems = [softmax_arguments(64, 1000, "bf16"), gemm_arguments(256, 256, 128, None, "bf16", "tnt")]
    chosen = [rank_candidates(registry.get_kernels(a, cc=90, providers=["cutedsl", "cuda_src"]), a)[0]
              for a in problems]
    start = time.perf_counter()
    for kernel, args in zip(chosen, problems):
        kernel.compile(args, cc=90)
    seconds = time.perf_counter() - start
    print(json.dumps({"cutedsl": cute_kernel._artifacts.stats, "cubin": compiler._cache.stats,
                      "seconds": seconds, "providers": sorted(k.metadata.provider for k in chosen)}))
""")


def test_precompile_fills_the_cache_and_a_new_process_hits_it(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(cache))
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(SHAPES))
    assert main(["precompile", "--shapes", str(shapes), "--cc", "90", "--top", "1", "--workers", "2", *OURS]) == 0
    assert "precompiled 2 kernel(s) for 2 problem(s), cc 90" in capsys.readouterr().out
    first = _entries(cache)
    assert len(first) == 2, first  # one compiled object per problem (softmax, GEMM)

    done = subprocess.run([sys.executable, "-c", _NEW_PROCESS], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "KERNEL_API_CACHE_DIR": str(cache)})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert_warm(report)
    for namespace in ("cutedsl", "cubin"):
        assert report[namespace]["writes"] == 0, report
    assert report["seconds"] < 10, report  # loose: loading, not compiling (which takes seconds each)

    # A second precompile compiles nothing: every entry is a cache hit, so no file is rewritten.
    assert main(["precompile", "--shapes", str(shapes), "--cc", "90", *OURS]) == 0
    assert _entries(cache) == first


@pytest.mark.parametrize("content, message", [
    ("[", "not valid JSON"),
    ("{}", "expected a non-empty JSON list"),
    ("[3]", "entry 0 must be an object"),
    ('[{"op": "conv"}]', "entry 0: field 'op' must be one of ['attention', 'cross_entropy', 'gated_activation', "
                         "'gemm', 'layer_norm', 'rms_norm', 'rope', 'softmax'], got 'conv'"),
    ('[{"op": "attention", "batch": 1, "heads": 2, "seqlen_q": 8}]', "entry 0 (attention): field 'head_dim' is missing"),
    ('[{"op": "attention", "batch": 1, "heads": 2, "seqlen_q": 8, "head_dim": 64, "causal": 1}]',
     "entry 0 (attention): field 'causal' must be true or false, got 1"),
    ('[{"op": "rms_norm", "rows": 4, "cols": 8, "weight_dtype": "f9"}]', "entry 0 (rms_norm): field 'weight_dtype': unknown type name 'f9'"),
    ('[{"op": "gated_activation", "rows": 4, "cols": 8, "activation": "relu"}]',
     "entry 0 (gated_activation): field 'activation' must be one of ['silu', 'gelu_tanh', 'gelu'], got 'relu'"),
    ('[{"op": "attention", "batch": 1, "heads": 3, "kv_heads": 2, "seqlen_q": 8, "head_dim": 64}]',
     "entry 0 (attention): --heads (3) must be a multiple of --kv-heads (2)"),
    ('[{"op": "softmax", "rows": 4, "cols": 8}, {"op": "gemm", "m": 1, "n": 2}]', "entry 1 (gemm): field 'k' is missing"),
    ('[{"op": "gemm", "m": 0, "n": 2, "k": 2}]', "entry 0 (gemm): field 'm' must be an integer >= 1, got 0"),
    ('[{"op": "gemm", "m": 1, "n": "2", "k": 2}]', "entry 0 (gemm): field 'n' must be an integer >= 1, got '2'"),
    ('[{"op": "gemm", "m": 1, "n": 2, "k": 2, "dtype": "f7"}]', "entry 0 (gemm): field 'dtype': unknown type name 'f7'"),
    ('[{"op": "gemm", "m": 1, "n": 2, "k": 2, "layout": "tx"}]', "entry 0 (gemm): field 'layout'"),
    ('[{"op": "softmax", "rows": 1, "cols": 2, "m": 3}]', "entry 0 (softmax): unknown field(s) 'm'"),
])
def test_a_bad_shapes_file_is_one_line_naming_the_entry_and_field(tmp_path, capsys, content, message):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(content)
    assert main(["precompile", "--shapes", str(shapes), "--cc", "90", *OURS]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "shapes.json" in err and message in err, err


def test_bad_options_and_defaults(tmp_path, capsys):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(SHAPES))
    assert main(["precompile", "--shapes", str(shapes), "--cc", "banana"]) == 2
    assert main(["precompile", "--shapes", str(shapes), "--cc", "90", "--top", "0"]) == 2
    assert "--top must be >= 1" in capsys.readouterr().err
    assert main(["precompile", "--shapes", str(tmp_path / "missing.json"), "--cc", "90", *OURS]) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert load_shapes(shapes)[0] == {"op": "softmax", "rows": 64, "cols": 1000, "dtype": "bf16", "backward": False}
    assert load_shapes(shapes)[1]["batch"] is None


def test_a_problem_without_kernels_is_reported_and_exits_1(tmp_path, capsys):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([{"op": "softmax", "rows": 4, "cols": 8, "dtype": "i32"}]))
    assert main(["precompile", "--shapes", str(shapes), "--cc", "90", *OURS]) == 1
    captured = capsys.readouterr()
    assert "entry 0: no kernel: no kernel for SoftmaxArguments" in captured.err
    assert "precompiled 0 kernel(s) for 1 problem(s), cc 90" in captured.out and "1 failed" in captured.out


def test_precompile_ranks_only_the_named_providers(tmp_path, monkeypatch, capsys):
    """--provider torch: the vendor kernels are ranked alone, and they leave nothing to cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(cache))
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(SHAPES[1:]))
    assert main(["precompile", "--shapes", str(shapes), "--cc", "90", "--provider", "torch"]) == 0
    assert "precompiled 1 kernel(s) for 1 problem(s), cc 90" in capsys.readouterr().out
    assert _entries(cache) == {}
