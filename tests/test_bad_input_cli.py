"""Bad input on the command line: ``kernel-api explain OP ...`` and ``kernel-api list ...`` with
sizes of 0, negative, not integers or past torch's int64, products too large for a tensor, unknown
type names, providers and compute capabilities, and missing options. Each exits non-zero with one
line on stderr and no traceback: argparse's usage error, or ``kernel-api: error: ...`` naming the
option (never a raw torch message cut to its first line). Run in process through
`kernel_api.cli.commands.main`; two runs of ``python3 -m kernel_api`` check the process itself.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kernel_api.cli.commands import main

HUGE = str(10**30)
BIG = str(2**40)
GEMM = ["gemm", "--m", "4", "--n", "4", "--k", "4"]
ATTENTION = ["attention", "--batch", "1", "--heads", "4", "--seqlen-q", "4", "--head-dim", "8"]
ROPE = ["rope", "--batch", "1", "--seq", "4", "--heads", "4", "--head-dim", "8"]

# (arguments after the command, what the one line says); None: argparse's usage error
BAD = [
    (["gemm", "--m", "0", "--n", "4", "--k", "4"], "--m must be an integer >= 1, got 0"),
    (["gemm", "--m", "4", "--n", "-3", "--k", "4"], "--n must be an integer >= 1, got -3"),
    (["gemm", "--m", "4", "--n", "4", "--k", "-" + HUGE], "--k must be an integer >= 1"),
    (["gemm", "--m", "4", "--n", "4", "--k", "1.5"], None),
    (["gemm", "--m", "4", "--n", "4", "--k", "nan"], None),
    (["gemm", "--m", HUGE, "--n", "4", "--k", "4"], f"--m must be at most {2**63 - 1}"),
    ([*GEMM, "--batch", HUGE], "--batch must be at most"),
    ([*GEMM, "--batch", "0"], "--batch must be an integer >= 1, got 0"),
    (["gemm", "--m", BIG, "--n", "1", "--k", BIG, "--batch", "2"], "gemm: tensors of these sizes cannot be made"),
    (["gemm", "--m", BIG, "--n", "4", "--k", BIG, "--layout", "nnn"], "gemm: tensors of these sizes cannot be made"),
    ([*GEMM, "--dtype", "f17"], "--dtype: unknown type name 'f17'"),
    ([*GEMM, "--dtype", "bool"], "--dtype: unknown type name 'bool'"),
    ([*GEMM, "--out-dtype", "complex64"], "--out-dtype: unknown type name 'complex64'"),
    ([*GEMM, "--accumulator", "nope"], "--accumulator: unknown type name 'nope'"),
    ([*GEMM, "--accumulator", "i32"], "accumulator_type: i32 is not a floating-point type"),
    ([*GEMM, "--layout", "xyz"], "--layout: layout 'xyz'"),
    (["gemm", "--m", "4", "--n", "4"], None),
    ([*GEMM, "--provider", "nope"], "--provider: unknown provider 'nope'"),
    ([*GEMM, "--provider", ","], "--provider: expected a provider name"),
    ([*GEMM, "--cc", "0"], "--cc: '0' is not a compute capability"),
    ([*GEMM, "--cc", "abc"], "--cc: 'abc' is not a compute capability"),
    ([*GEMM, "--cc", HUGE], "--cc: "),
    (["nope"], None),
    ([], None),
    (["softmax", "--rows", "0", "--cols", "8"], "--rows must be an integer >= 1, got 0"),
    (["softmax", "--rows", "4", "--cols", str(10**21)], "--cols must be at most"),
    (["softmax", "--rows", "4", "--cols", "8", "--dtype", ""], "--dtype: unknown type name ''"),
    (["rms_norm", "--rows", "4", "--cols", "8", "--weight-dtype", "nope"], "--weight-dtype: unknown type name"),
    (["layer_norm", "--rows", BIG, "--cols", BIG], "layer_norm: tensors of these sizes cannot be made"),
    ([*ATTENTION[:4], "3", "--kv-heads", "2", *ATTENTION[5:]], "--heads (3) must be a multiple of --kv-heads (2)"),
    ([*ATTENTION, "--kv-heads", "0"], "--kv-heads must be an integer >= 1, got 0"),
    ([*ATTENTION, "--seqlen-k", HUGE], "--seqlen-k must be at most"),
    (["attention", "--batch", "1", "--heads", "1", "--seqlen-q", str(2**62), "--head-dim", "2"],
     "attention: tensors of these sizes cannot be made"),
    (["cross_entropy", "--rows", "4", "--classes", "0"], "--classes must be an integer >= 1, got 0"),
    (["cross_entropy", "--rows", "4", "--classes", "8", "--dtype", "i32"], "operand logits: dtype torch.int32"),
    (["gated_activation", "--rows", "4", "--cols", "8", "--activation", "relu"], "--activation must be one of"),
    ([*ROPE[:-1], "7"], "--head-dim must be even, got 7"),
    ([*ROPE, "--kv-heads", "-1"], "--kv-heads must be an integer >= 1, got -1"),
    (["rope", "--batch", "1", "--seq", HUGE, "--heads", "1", "--head-dim", "2"], "--seq must be at most"),
]
LIST_ONLY = [
    (["--provider", "nope"], "--provider: unknown provider 'nope'"),
    (["--provider", "torch", "--cc", "abc"], "--cc: 'abc' is not a compute capability"),
    (["--cc", "90"], "list: give a problem"),
    ([], "list: give a problem"),
    (["softmax", "--rows", "4"], None),
]


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        status = exc.code
    return status, capsys.readouterr().err


def _check(status: int, err: str, said: str | None) -> None:
    assert status not in (0, None), err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    if said is None:  # argparse: its usage, then one error line
        assert lines and ": error: " in lines[-1] and all("error" not in line for line in lines[:-1]), err
        return
    assert len(lines) == 1 and lines[0].startswith("kernel-api: error: "), err
    assert said in lines[0], err
    assert "--debug" not in lines[0], err  # the message is ours, not a cut multi-line one


@pytest.mark.parametrize("argv, said", [([command, *args], said) for command in ("explain", "list")
                                        for args, said in BAD if args or command == "explain"],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_problem_options_are_one_line(argv, said, capsys):
    _check(*_run(argv, capsys), said)


@pytest.mark.parametrize("args, said", LIST_ONLY, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_list_options_are_one_line(args, said, capsys):
    _check(*_run(["list", *args], capsys), said)


@pytest.mark.parametrize("argv, said", [
    (["explain", "gemm", "--m", HUGE, "--n", "4", "--k", "4"], "--m must be at most"),
    (["list", "softmax", "--rows", "4"], None),
])
def test_the_process_exits_with_one_line(argv, said):
    done = subprocess.run([sys.executable, "-m", "kernel_api", *argv], capture_output=True, text=True, timeout=300)
    _check(done.returncode, done.stderr, said)
