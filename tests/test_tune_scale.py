"""Tuning at scale: sharding problems over GPUs (`tune_shapes`, ``kernel-api tune --shapes``) and
over torch.distributed ranks (``torchrun -m kernel_api.tune``).

CPU: the sharding, the arguments a worker rebuilds, the command line's errors, the parent's
merge of the records, and the all-gather of records across two gloo ranks started by torchrun
(with a stand-in tuner). GPU: real tuning on every visible GPU, and torchrun on up to 2 GPUs.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernel_api
from kernel_api import DeviceError, GemmArguments
from kernel_api.cli.commands import main
from kernel_api.cli.problems import gemm_arguments, softmax_arguments
from kernel_api.tuning import scale
from kernel_api.tuning.compile_worker import arguments_from_description, describe_arguments
from kernel_api.tuning.records import TuningRecord, TuningRecords, records_from_json
from kernel_api.tuning.scale import ShapeTuning, shard_by_cost, tune_shapes, tuning_cost

REPO = Path(__file__).resolve().parents[1]
SHAPES = [{"op": "gemm", "m": 256, "n": 256, "k": 128, "dtype": "bf16", "layout": "tnt"},
          {"op": "softmax", "rows": 64, "cols": 1000, "dtype": "bf16"}]


# ---- sharding -------------------------------------------------------------------------------
def test_shards_are_balanced_deterministic_and_hold_every_problem_once():
    costs = [5.0, 1.0, 8.0, 3.0, 3.0, 2.0, 7.0, 4.0, 0.5, 6.0]
    shards = shard_by_cost(costs, 3)
    assert sorted(i for s in shards for i in s) == list(range(len(costs)))
    loads = [sum(costs[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(costs[i] for s in shards for i in s[-1:])  # LPT's bound: one problem
    assert max(loads) <= sum(costs) / 3 + max(costs) / 3 + 1e-9
    assert shard_by_cost(costs, 3) == shards  # deterministic
    assert [s[0] for s in shards] == [2, 6, 9]  # costliest first, each onto the least loaded GPU
    assert shard_by_cost([1.0, 1.0, 1.0, 1.0], 2) == [[0, 2], [1, 3]]  # ties: lower index, lower shard
    assert shard_by_cost([1.0], 3) == [[0], [], []]
    assert shard_by_cost([], 2) == [[], []]
    with pytest.raises(ValueError, match="count must be >= 1"):
        shard_by_cost([1.0], 0)
    with pytest.raises(ValueError, match=r"costs\[1\] must be a finite cost"):
        shard_by_cost([1.0, float("nan")], 2)


def test_tuning_cost_grows_with_the_work_and_small_problems_cost_about_the_same():
    small, other_small = gemm_arguments(64, 64, 64), gemm_arguments(128, 64, 64)
    big = gemm_arguments(8192, 8192, 8192)
    assert tuning_cost(big) > 1.5 * tuning_cost(small)  # 30 runs of ~2 ms beside the fixed part
    assert tuning_cost(other_small) == pytest.approx(tuning_cost(small), rel=1e-3)
    assert tuning_cost(big, repeat=60) > tuning_cost(big, repeat=30)
    assert tuning_cost(softmax_arguments(32768, 4096)) > tuning_cost(softmax_arguments(64, 64))


def test_shards_of_the_benchmark_shapes_carry_about_equal_gpu_work():
    """The 16 GEMMs of benchmarks/tune_scale.py split over 2 GPUs with about equal FLOPs: the
    host's share per candidate (about 2 ms) no longer outweighs the GPU's (it split them 55/45)."""
    from kernel_api.cli.precompile import entry_arguments, load_shapes

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "tune_scale_shapes.json")
    problems = [entry_arguments(e, i) for i, e in enumerate(load_shapes(path))]
    shards = shard_by_cost([tuning_cost(a) for a in problems], 2)
    flops = [sum(2 * problems[i].M * problems[i].N * problems[i].K for i in shard) for shard in shards]
    assert max(flops) / min(flops) < 1.1, flops


def test_a_worker_rebuilds_the_arguments_with_memory_on_a_device():
    A = torch.empty(100, 64, dtype=torch.bfloat16)[:, :48]  # strided, with an offset below
    B = torch.empty(48 * 72 + 3, dtype=torch.bfloat16)[3:].view(48, 72)
    args = GemmArguments(A, B, torch.empty(100, 72, dtype=torch.bfloat16))
    kind, description = describe_arguments(args)
    rebuilt = arguments_from_description(kind, description, device="cpu")
    assert rebuilt.signature == args.signature
    for mine, theirs in ((rebuilt.A, A), (rebuilt.B, B)):
        assert mine.device.type == "cpu" and mine.shape == theirs.shape and mine.stride() == theirs.stride()
    assert (rebuilt.B.data_ptr() // 2) % 8 == (B.data_ptr() // 2) % 8


def test_problems_a_worker_cannot_rebuild_are_refused_by_index(monkeypatch):
    monkeypatch.setattr(scale, "_visible_devices", lambda devices: [0, 1])
    meta = dict(device="meta", dtype=torch.float32)
    with_epilogue = GemmArguments(torch.empty(8, 8, **meta), torch.empty(8, 8, **meta), torch.empty(8, 8, **meta),
                                  epilogue=kernel_api.EpilogueArguments(activation="relu"))
    with pytest.raises(ValueError, match=r"shapes\[1\]: GemmArguments cannot be tuned by tune_shapes"):
        tune_shapes([gemm_arguments(64, 64, 64), with_epilogue])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_tune_shapes_without_a_gpu_says_so():
    with pytest.raises(DeviceError, match="needs a CUDA GPU"):
        tune_shapes([gemm_arguments(64, 64, 64)])


def test_the_parent_merges_the_shard_records_and_reports_in_order(monkeypatch, tmp_path):
    """One device: the shard runs in this process with a read-only view of the records; the
    winners (not the ones that came from a record) are merged by the caller in one go."""
    store = TuningRecords(tmp_path / "t.sqlite")
    old = store.record("Fake GPU", 90, "op0", "s", "old_winner", 1.0, {}, {})
    seen = {}

    def fake_shard(entries, device, options, records, done):
        seen.update(device=device, read_only=records.read_only, options=options, order=[e[0] for e in entries])
        out = []
        for index, kind, _ in entries:
            if index == 0:
                out.append(ShapeTuning(index, device, "old_winner", 1.0, True, old))
            elif index == 2:
                out.append(ShapeTuning(index, device, failure="NoKernelFoundError: none"))
            else:
                rec = records.record("Fake GPU", 90, f"op{index}", kind, f"k{index}", 0.5, {}, {})
                out.append(ShapeTuning(index, device, f"k{index}", 0.5, False, rec))
            done(out[-1])
        return out

    monkeypatch.setattr(scale, "_visible_devices", lambda devices: [3])
    monkeypatch.setattr(scale, "tune_shard", fake_shard)
    progress = []
    shapes = [gemm_arguments(64, 64, 64), gemm_arguments(4096, 4096, 4096), softmax_arguments(64, 64)]
    results = tune_shapes(shapes, max_candidates=8, repeat=5, bucket="pow2_m", records=store,
                          progress=lambda d, t, label: progress.append((d, t)), power_state="own")
    assert seen["device"] == 3 and seen["read_only"] and seen["order"][0] == 1  # the costliest first
    assert seen["options"].max_candidates == 8 and seen["options"].repeat == 5 and seen["options"].bucket == "pow2_m"
    assert seen["options"].power_state == "own"
    assert [r.index for r in results] == [0, 1, 2] and results[2].failure.startswith("NoKernelFoundError")
    assert sorted(progress) == [(1, 3), (2, 3), (3, 3)]
    assert {r.operation: r.kernel_name for r in store.all()} == {"op0": "old_winner", "op1": "k1"}


def _threaded_shard(seen, barrier):
    """A stand-in `tune_shard` for two threads: both must be inside it at once (the barrier
    times out if the shards ran one after another)."""
    import threading

    def shard(entries, device, options, records, done):
        seen[device] = dict(thread=threading.current_thread().name, bucket=options.bucket,
                            read_only=records.read_only, order=[e[0] for e in entries])
        barrier.wait(timeout=10)
        out = []
        for index, kind, _ in entries:
            rec = records.record("Fake GPU", 90, f"op{index}", kind, f"k{index}", 0.5, {}, {})
            out.append(ShapeTuning(index, device, f"k{index}", 0.5, False, rec))
            done(out[-1])
        return out

    return shard


def test_threads_tune_the_shards_at_once_and_the_caller_merges(monkeypatch, tmp_path):
    """isolation="threads" (the default): one thread per GPU in this process, running at the same
    time; a bucket function is passed as it is (no worker has to import it); the records are
    merged by the caller."""
    import threading

    seen = {}
    monkeypatch.setattr(scale, "_visible_devices", lambda devices: [0, 1])
    monkeypatch.setattr(scale, "tune_shard", _threaded_shard(seen, threading.Barrier(2)))
    store = TuningRecords(tmp_path / "t.sqlite")
    bucket = lambda args: "b"  # noqa: E731 - a local function: no worker process could import it
    shapes = [gemm_arguments(64, 64, 64), gemm_arguments(4096, 4096, 4096), softmax_arguments(64, 64)]
    progress = []
    results = tune_shapes(shapes, bucket=bucket, records=store, progress=lambda d, t, label: progress.append(d))
    assert sorted(seen) == [0, 1] and {v["thread"] for v in seen.values()} == {"kernel_api-tune-gpu0",
                                                                                "kernel_api-tune-gpu1"}
    assert all(v["bucket"] is bucket and v["read_only"] for v in seen.values())
    assert seen[0]["order"] == [1]  # the costliest problem alone on the first GPU
    assert [r.index for r in results] == [0, 1, 2] and [r.device for r in results] == [1, 0, 1]
    assert sorted(progress) == [1, 2, 3]
    assert sorted(r.operation for r in store.all()) == ["op0", "op1", "op2"]


def test_a_failing_progress_callback_stops_every_thread_and_is_raised(monkeypatch, tmp_path):
    import threading

    monkeypatch.setattr(scale, "_visible_devices", lambda devices: [0, 1])
    monkeypatch.setattr(scale, "tune_shard", _threaded_shard({}, threading.Barrier(2)))

    def progress(done, total, label):
        raise RuntimeError("progress bar broke")

    store = TuningRecords(tmp_path / "t.sqlite")
    with pytest.raises(RuntimeError, match="progress bar broke"):
        tune_shapes([gemm_arguments(64, 64, 64), gemm_arguments(128, 64, 64), gemm_arguments(256, 64, 64),
                     gemm_arguments(512, 64, 64)], records=store, progress=progress)
    assert store.all() == []  # nothing merged from a tuning that failed
    assert not [t for t in threading.enumerate() if t.name.startswith("kernel_api-tune-gpu")]


def test_tune_shapes_refuses_an_unknown_power_state(monkeypatch):
    monkeypatch.setattr(scale, "_visible_devices", lambda devices: [0])
    with pytest.raises(ValueError, match="power_state must be 'shared' or 'own', got 'cool'"):
        tune_shapes([gemm_arguments(64, 64, 64)], power_state="cool")


def test_shards_tune_with_the_power_state_asked_for(monkeypatch, tmp_path):
    """`tune_shard` builds its PickBest with the options' power state."""
    made = []

    class Recorder(scale.PickBest):
        def __init__(self, **kw):
            made.append(kw["power_state"])
            super().__init__(**kw)

    monkeypatch.setattr(scale, "PickBest", Recorder)
    monkeypatch.setattr(scale.torch.cuda, "set_device", lambda device: None, raising=False)
    options = scale.TuneOptions(power_state="own")
    try:
        scale.tune_shard([], 0, options, TuningRecords(tmp_path / "t.sqlite"))
    except Exception:  # nothing to tune; only the policy's construction matters here
        pass
    assert made == ["own"]


def test_tune_shapes_refuses_an_unknown_isolation(monkeypatch):
    monkeypatch.setattr(scale, "_visible_devices", lambda devices: [0, 1])
    with pytest.raises(ValueError, match="isolation must be one of"):
        tune_shapes([gemm_arguments(64, 64, 64)], isolation="fork")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a worker that cannot use its GPU")
def test_a_worker_that_dies_fails_its_problems_with_its_stderr(monkeypatch, tmp_path):
    """Two worker processes started (as on two GPUs) on a machine without CUDA: each dies at its
    first CUDA call, and each of its problems is reported failed with the worker's last words."""
    monkeypatch.setattr(scale, "_visible_devices", lambda devices: [0, 1])
    store = TuningRecords(tmp_path / "t.sqlite")
    results = tune_shapes([gemm_arguments(64, 64, 64), gemm_arguments(256, 256, 256), softmax_arguments(64, 64)],
                          records=store, isolation="processes")
    assert [r.index for r in results] == [0, 1, 2] and {r.device for r in results} == {0, 1}
    for r in results:
        assert r.record is None and r.failure.startswith(f"the tuning worker for GPU {r.device} exited (1) before "
                                                         f"it finished: ")
        assert "CUDA" in r.failure.splitlines()[0]  # its traceback's last line, then the tail
    assert store.all() == []


# ---- the command line -----------------------------------------------------------------------
def _cli(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_tune_shapes_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"op": "gemm", "m": 64, "n": 0, "k": 64}]))
    status, _, err = _cli(capsys, "tune", "--shapes", str(bad))
    assert status == 2 and err.count("\n") == 1
    assert f"shapes file {bad}: entry 0 (gemm): field 'n' must be an integer >= 1, got 0" in err
    status, _, err = _cli(capsys, "tune", "--shapes", str(tmp_path / "missing.json"))
    assert status == 2 and err.count("\n") == 1 and "missing.json" in err
    good = tmp_path / "shapes.json"
    good.write_text(json.dumps(SHAPES))
    for devices, message in (("0,x", "--devices: expected comma-separated GPU indices such as 0,1, got '0,x'"),
                             ("-1", "--devices: GPU indices are >= 0, got '-1'")):
        status, _, err = _cli(capsys, "tune", "--shapes", str(good), "--devices", devices)
        assert status == 2 and err == f"kernel-api: error: {message}\n"
    status, _, err = _cli(capsys, "tune", "--shapes", str(good), "--max-candidates", "0")
    assert status == 2 and "--max-candidates must be >= 1, got 0" in err
    status, _, err = _cli(capsys, "tune")
    assert status == 2 and "give a shapes file (--shapes FILE) or a problem" in err
    status, _, err = _cli(capsys, "tune", "--shapes", str(good), "gemm", "--m", "8", "--n", "8", "--k", "8")
    assert status == 2 and "--shapes is for a shapes file" in err
    status, _, err = _cli(capsys, "tune", "--isolation", "processes", "gemm", "--m", "8", "--n", "8", "--k", "8")
    assert status == 2 and "--isolation is for a shapes file" in err
    with pytest.raises(SystemExit):  # argparse's own message for a value outside the choices
        main(["tune", "--shapes", str(good), "--isolation", "fork"])
    assert "invalid choice: 'fork'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cli_tune_shapes_without_a_gpu_exits_3(tmp_path, capsys):
    good = tmp_path / "shapes.json"
    good.write_text(json.dumps(SHAPES))
    status, _, err = _cli(capsys, "tune", "--shapes", str(good), "--devices", "0")
    assert status == 3 and err.count("\n") == 1 and "tune_shapes needs a CUDA GPU" in err


def test_cli_tune_parses_its_options(tmp_path, capsys, monkeypatch):
    good = tmp_path / "shapes.json"
    good.write_text(json.dumps(SHAPES))
    calls = []

    def fake_tune_shapes(arguments, devices, **kw):
        calls.append((arguments, devices, kw))
        rec = TuningRecord("Fake GPU", 90, "op", "s", "k0", 0.25, {}, {}, "2026-01-01T00:00:00+00:00", "key")
        return [ShapeTuning(0, 0, "k0", 0.25, False, rec), ShapeTuning(1, 1, failure="RuntimeError: boom")]

    monkeypatch.setattr(scale, "tune_shapes", fake_tune_shapes)
    export = tmp_path / "winners.json"
    status, out, err = _cli(capsys, "tune", "--shapes", str(good), "--devices", "0,1", "--max-candidates", "8",
                            "--workers", "3", "--force", "--bucket", "pow2_m", "--export", str(export),
                            "--isolation", "processes", "--power-state", "own")
    assert status == 1  # a problem failed
    (arguments, devices, kw), = calls
    assert devices == [0, 1] and len(arguments) == 2 and isinstance(arguments[0], GemmArguments)
    assert kw["max_candidates"] == 8 and kw["num_workers"] == 3 and kw["force"] and kw["bucket"] == "pow2_m"
    assert kw["isolation"] == "processes" and kw["power_state"] == "own"
    _cli(capsys, "tune", "--shapes", str(good))
    assert calls[-1][2]["isolation"] == "threads" and calls[-1][2]["power_state"] == "own"  # the defaults
    assert "entry 0 (gemm 256x256x128 bf16 tnt): k0 250.0 us (measured on GPU 0)" in out
    assert "entry 1 (softmax 64x1000 bf16): RuntimeError: boom" in err
    assert [r.kernel_name for r in records_from_json(json.loads(export.read_text()))] == ["k0"]


# ---- torch.distributed: records all-gathered across ranks (gloo, CPU) ---------------------------
# Each rank gets its own cache folder (as on separate hosts) and a stand-in tuner that makes one
# record per problem, named after the problem and the rank that "tuned" it.
_RANK_SCRIPT = textwrap.dedent('''
    import json, os, sys
    os.environ["KERNEL_API_CACHE_DIR"] = os.path.join(sys.argv[1], "rank" + os.environ["RANK"])
    from kernel_api.tune import main
    from kernel_api.tuning.records import TuningRecords
    from kernel_api.tuning.scale import ShapeTuning

    def fake(entries, device, options, records):
        assert records.read_only and options.max_candidates == 4
        rank = os.environ["RANK"]
        return [ShapeTuning(i, device, f"k{i}_rank{rank}", 0.1 * (i + 1), False,
                            records.record("Fake GPU", 90, kind, json.dumps(desc["A"]["shape"]), f"k{i}_rank{rank}",
                                           0.1 * (i + 1), {}, {}))
                for i, kind, desc in entries]

    status = main(["--shapes", sys.argv[2], "--export", os.path.join(sys.argv[1], "export.json"),
                   "--max-candidates", "4"], shard_tuner=fake)
    mine = sorted(r.kernel_name for r in TuningRecords().all())
    with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump({"status": status, "records": mine}, f)
''')


def test_torchrun_gathers_every_rank_records_on_every_rank(tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    shapes = [{"op": "gemm", "m": m, "n": 512, "k": 256} for m in (64, 4096, 128, 2048, 256)]
    (tmp_path / "shapes.json").write_text(json.dumps(shapes))
    (tmp_path / "rank_script.py").write_text(_RANK_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # gloo on the CPU even on a GPU machine
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(tmp_path / "rank_script.py"), str(tmp_path), str(tmp_path / "shapes.json")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    expected = sorted({f"k{i}_rank{r}" for r in (0, 1) for i in range(5)} & set(ranks[0]["records"]))
    assert len(expected) == 5 and {n.split("_")[0] for n in expected} == {f"k{i}" for i in range(5)}
    assert {n.split("_")[1] for n in expected} == {"rank0", "rank1"}  # both ranks tuned a share
    assert ranks[0] == ranks[1] == {"status": 0, "records": expected}
    exported = records_from_json(json.loads((tmp_path / "export.json").read_text()))
    assert sorted(r.kernel_name for r in exported) == expected
    assert "tuned 5 of 5 problem(s) on 2 rank(s)" in done.stdout


def test_python_m_kernel_api_tune_reports_a_bad_shapes_file_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "kernel_api.tune", "--shapes", str(bad)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"[rank 0] kernel-api: error: shapes file {bad}")


# ---- GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("isolation", ["threads", "processes"])
def test_tune_shapes_on_every_visible_gpu_writes_the_records(tmp_path, isolation):
    store = TuningRecords(tmp_path / "tuning.sqlite")
    shapes = [gemm_arguments(512, 512, 256, dtype="bf16", layout="tnt"), softmax_arguments(256, 1024, "bf16")]
    results = tune_shapes(shapes, max_candidates=3, repeat=5, records=store, isolation=isolation)
    assert [r.failure for r in results] == [None, None]
    assert all(not r.from_record and r.median_ms > 0 for r in results)
    if torch.cuda.device_count() >= 2:
        assert {r.device for r in results} == {0, 1}  # one problem per GPU
    stored = {(r.operation, r.shape): r.kernel_name for r in store.all()}
    assert len(stored) == 2 and sorted(stored.values()) == sorted(r.kernel_name for r in results)
    again = tune_shapes(shapes, max_candidates=3, repeat=5, records=store, isolation=isolation)  # from the records
    assert all(r.from_record for r in again) and [r.kernel_name for r in again] == [r.kernel_name for r in results]


@pytest.mark.gpu
def test_torchrun_tunes_on_the_gpus_and_exports(tmp_path):
    gpus = min(2, torch.cuda.device_count())
    (tmp_path / "shapes.json").write_text(json.dumps(SHAPES))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               KERNEL_API_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(gpus), "-m", "kernel_api.tune", "--shapes", str(tmp_path / "shapes.json"),
                           "--export", str(tmp_path / "export.json"), "--max-candidates", "3", "--repeat", "5"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    exported = records_from_json(json.loads((tmp_path / "export.json").read_text()))
    assert len(exported) == 2
    stored = TuningRecords(tmp_path / "cache" / "tuning.sqlite").all()
    assert sorted(r.kernel_name for r in stored) == sorted(r.kernel_name for r in exported)
