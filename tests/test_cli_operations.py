"""Every operation the command line describes (`kernel_api.cli.problems.PROBLEMS`) is listed,
explained and read from a shapes file through the same description, without a GPU."""

import json

import pytest
import torch

from kernel_api import registry
from kernel_api.arguments import AttentionArguments
from kernel_api.cli.commands import main
from kernel_api.cli.precompile import entry_arguments, load_shapes
from kernel_api.cli.problems import PROBLEMS

# One problem per operation: its options, and the arguments type it builds.
EXAMPLES = {
    "gemm": ({"m": 96, "n": 128, "k": 64, "layout": "tnt"}, "GemmArguments"),
    "softmax": ({"rows": 6, "cols": 1000, "backward": True}, "SoftmaxBackwardArguments"),
    "rms_norm": ({"rows": 5, "cols": 4096, "weight_dtype": "f32"}, "RMSNormArguments"),
    "layer_norm": ({"rows": 7, "cols": 768, "residual": True}, "LayerNormArguments"),
    "attention": ({"batch": 2, "heads": 8, "kv_heads": 2, "seqlen_q": 3, "seqlen_k": 129, "head_dim": 128,
                   "causal": True}, "AttentionArguments"),
    "cross_entropy": ({"rows": 9, "classes": 32000, "dtype": "f16"}, "CrossEntropyArguments"),
    "gated_activation": ({"rows": 4, "cols": 14336, "activation": "gelu_tanh"}, "GatedActivationArguments"),
    "rope": ({"batch": 1, "seq": 33, "heads": 8, "kv_heads": 2, "head_dim": 64}, "RopeArguments"),
}


def _options(values: dict) -> list[str]:
    options = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            options.append(flag)
        else:
            options += [flag, str(value)]
    return options


def test_every_operation_has_an_example_here():
    assert sorted(EXAMPLES) == sorted(PROBLEMS)


@pytest.mark.parametrize("op", sorted(EXAMPLES))
def test_list_and_explain_every_operation(op, capsys):
    values, type_name = EXAMPLES[op]
    assert main(["list", op, *_options(values), "--cc", "90"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(type_name.split("Arguments")[0]), out.splitlines()[0]
    assert "kernel(s)" in out
    assert main(["explain", op, *_options(values), "--cc", "90"]) == 0
    assert "kernel instance(s) fit" in capsys.readouterr().out


@pytest.mark.parametrize("op", sorted(EXAMPLES))
def test_the_shapes_file_builds_what_the_options_build(op, tmp_path):
    values, type_name = EXAMPLES[op]
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps([{"op": op, **values}]))
    (entry,) = load_shapes(path)
    args = entry_arguments(entry, 0)
    assert type(args).__name__.lstrip("_").startswith(type_name.split("Arguments")[0]), type(args)
    assert registry.get_kernels(args, cc=90), f"no kernel for {op} {values}"
    described = PROBLEMS[op].describe(entry)
    assert described.startswith(op + " ")


@pytest.mark.parametrize("argv, message", [
    (["list", "attention", "--batch", "2", "--heads", "6", "--kv-heads", "4", "--seqlen-q", "8", "--head-dim", "64"],
     "--heads (6) must be a multiple of --kv-heads (4)"),
    (["list", "rope", "--batch", "1", "--seq", "4", "--heads", "2", "--head-dim", "63"], "--head-dim must be even"),
    (["list", "gated_activation", "--rows", "4", "--cols", "8", "--activation", "relu"],
     "--activation must be one of ['silu', 'gelu_tanh', 'gelu'], got 'relu'"),
    (["list", "layer_norm", "--rows", "4", "--cols", "0"], "--cols must be an integer >= 1, got 0"),
    (["list", "cross_entropy", "--rows", "4", "--classes", "8", "--dtype", "f7"], "--dtype: unknown type name 'f7'"),
    (["list", "softmax", "--rows", "99999999999", "--cols", "99999999999"],
     "softmax: tensors of these sizes cannot be made"),
    (["explain", "gemm", "--m", "99999999999", "--n", "99999999999", "--k", "9"],
     "gemm: tensors of these sizes cannot be made"),
])
def test_a_bad_option_of_any_operation_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_bench_times_an_operation_without_a_torch_function_against_the_torch_providers_kernel(monkeypatch):
    """`bench`'s baseline for an operation that is not one torch call is the torch provider's
    kernel for the same arguments, run on each input set."""
    from kernel_api.cli import bench
    from kernel_api.kernel import Kernel

    p = PROBLEMS["rms_norm"]
    args = p.arguments(p.values({"rows": 4, "cols": 64}, lambda f: f.flag))
    ran = []
    monkeypatch.setattr(Kernel, "run", lambda self, a, artifact=None, *rest, **kw: ran.append((self, a)))
    baseline = bench._torch_baseline(args)
    baseline(args)
    assert [(k.metadata.provider, a) for k, a in ran] == [("torch", args)]
    monkeypatch.setattr(bench.registry, "get_kernels", lambda *a, **kw: [])
    with pytest.raises(ValueError, match="bench: no torch kernel takes RMSNormArguments"):
        bench._torch_baseline(args)


def test_list_names_each_kernels_design_in_a_few_words(capsys):
    """A tile and cluster, a library's schedule for a vendor kernel, a design's fields."""
    assert main(["list", "gemm", "--m", "64", "--n", "64", "--k", "64", "--cc", "90", "--provider", "torch"]) == 0
    out = capsys.readouterr().out
    assert "TorchGemm_bf16_ttt" in out and "library" in out and "0x0x0" not in out
    assert main(["list", "attention", "--batch", "1", "--heads", "2", "--seqlen-q", "1", "--seqlen-k", "64",
                 "--head-dim", "128", "--cc", "90", "--provider", "torch"]) == 0
    out = capsys.readouterr().out
    assert "backend=sdpa" in out and "AttentionDesign(" not in out


def test_attention_varlen_packs_the_batch_and_lists_the_variable_length_kernels(tmp_path, capsys):
    """--varlen (and "varlen" in a shapes file) packs the batch's sequences with offsets, so list,
    explain and precompile reach the variable-length kernels."""
    p = PROBLEMS["attention"]
    args = p.arguments(p.values({"batch": 3, "heads": 8, "kv_heads": 2, "seqlen_q": 100, "seqlen_k": 300,
                                 "head_dim": 128, "causal": True, "lse": True, "varlen": True}, lambda f: f.flag))
    assert args.varlen and tuple(args.q.shape) == (300, 8, 128) and tuple(args.k.shape) == (900, 2, 128)
    assert (args.batch, args.seqlen_q, args.seqlen_k) == (3, 100, 300) and tuple(args.lse.shape) == (8, 300)
    assert main(["list", "attention", "--batch", "3", "--heads", "8", "--kv-heads", "2", "--seqlen-q", "100",
                 "--head-dim", "128", "--causal", "--varlen", "--cc", "90"]) == 0
    out = capsys.readouterr().out
    assert "Sm90Attention_bf16_d128_varlen" in out and "TorchAttention_bf16_varlen" in out
    assert "Sm90Attention_bf16_d128 " not in out
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps([{"op": "attention", "batch": 2, "heads": 4, "seqlen_q": 64, "head_dim": 64,
                                 "varlen": True}]))
    (entry,) = load_shapes(path)
    assert entry_arguments(entry, 0).varlen


def test_bench_counts_dense_attention_in_flops_over_the_pairs_its_mask_leaves():
    """4 * head_dim FLOPs per (query, key) pair and head: every pair, or under the bottom-right
    aligned causal mask the pairs it leaves, whatever the two lengths; bytes for the rest."""
    from kernel_api.cli.bench import work_of

    def attention(seqlen_q, seqlen_k, causal):
        p = PROBLEMS["attention"]
        return p.arguments(p.values({"batch": 3, "heads": 4, "kv_heads": 2, "seqlen_q": seqlen_q,
                                     "seqlen_k": seqlen_k, "head_dim": 64, "causal": causal}, lambda f: f.flag))

    for sq in range(1, 24):
        for sk in range(1, 24):
            pairs = sum(min(max(i + sk - sq + 1, 0), sk) for i in range(sq))
            assert work_of(attention(sq, sk, True)) == (4.0 * 3 * 4 * pairs * 64, "TFLOP/s"), (sq, sk)
    assert work_of(attention(5, 9, False)) == (4.0 * 3 * 4 * 45 * 64, "TFLOP/s")
    # a packed batch: the pairs of each sequence, from its offsets
    q, k = torch.empty(7, 4, 64), torch.empty(12, 2, 64)
    packed = AttentionArguments(q, k, k, torch.empty_like(q), causal=True,
                                cu_seqlens_q=torch.tensor([0, 2, 7], dtype=torch.int32),
                                cu_seqlens_k=torch.tensor([0, 3, 12], dtype=torch.int32))
    pairs = sum(min(max(i + sk - sq + 1, 0), sk) for sq, sk in ((2, 3), (5, 9)) for i in range(sq))
    assert work_of(packed) == (4.0 * 4 * pairs * 64, "TFLOP/s")
    p = PROBLEMS["rms_norm"]
    assert work_of(p.arguments(p.values({"rows": 4, "cols": 8}, lambda f: f.flag)))[1] == "TB/s"


def test_a_problems_integer_inputs_hold_valid_values_on_a_real_device():
    """A tuner's fresh arguments copy integer inputs (class indices) as they are, so a problem
    made on a device that holds values gives valid ones: cross-entropy's targets are classes."""
    p = PROBLEMS["cross_entropy"]
    for _ in range(5):
        stale = torch.full((4000,), -5, dtype=torch.int64)  # memory an allocation may be given next
        del stale
        args = p.arguments(p.values({"rows": 4000, "classes": 7}, lambda f: f.flag), device="cpu")
        assert 0 <= int(args.target.min()) and int(args.target.max()) < 7
