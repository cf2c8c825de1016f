"""GPT-2's lm_head through `kernel_api.ops.gemm` with its padded output rows 16 or 128 bytes
apart (`kernel_api.ops.dispatch.LINE_PADDED_ROW_BYTES`), against torch (cuBLAS).

    python3 benchmarks/padded_rows.py [--repeat 20] [--runs 3] [--tag T]

An odd vocabulary (50257 bf16 logits, rows of 100514 bytes) makes ops.gemm allocate an output
with padded rows and compute it as two GEMMs, the aligned columns and the rest
(`dispatch.split_columns`); the backward pads the gradient's rows the same way. Contestants:
the forward (logits = x @ W^T) and the forward + backward (dx, dW) with rows padded to 16 bytes
(the rule before session 31) and to 128, and torch's own, in one shuffled group
(`small_m.time_group`: CUDA events per launch, median), inputs rotated over >= 256 MB. Each
contestant's logits and gradients are checked against torch's first. JSON and text go to
benchmarks/results/padded_rows-<device>[-tag].*.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_api import ops  # noqa: E402
from kernel_api.ops import dispatch  # noqa: E402
from results_io import result_doc, result_name, write_result_with_text  # noqa: E402
from small_m import ROTATE_BYTES, time_group  # noqa: E402

#: (label, tokens, vocabulary, hidden): GPT-2 small's lm_head at 8 x 1024 and 4 x 1024 tokens.
CASES = [("lm_head 8192x50257x768", 8192, 50257, 768), ("lm_head 4096x50257x768", 4096, 50257, 768)]
#: LINE_PADDED_ROW_BYTES per contestant: 128-byte rows from 4 KB rows on, or never (16 bytes).
PITCH_RULES = {"rows@16": 1 << 62, "rows@128": dispatch.LINE_PADDED_ROW_BYTES}


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((x.float() - ref.float()).norm() / ref.float().norm()).item())


def run_case(case: tuple, repeat: int) -> dict:
    label, M, V, H = case
    bf = dict(device="cuda", dtype=torch.bfloat16)
    per_set = 2 * (M * H + V * H + 2 * M * V)
    sets = max(2, -(-ROTATE_BYTES // per_set))
    xs = [torch.randn(M, H, **bf).requires_grad_() for _ in range(sets)]
    Ws = [(torch.randn(V, H, **bf) * 0.05).requires_grad_() for _ in range(sets)]
    grads = [torch.randn(M, V, **bf) for _ in range(sets)]
    default = dispatch.LINE_PADDED_ROW_BYTES
    fns, checks, strides = {}, {}, {}
    for name, rule in PITCH_RULES.items():
        def forward(i: int, rule=rule) -> torch.Tensor:
            dispatch.LINE_PADDED_ROW_BYTES = rule
            with torch.no_grad():
                return ops.gemm(xs[i % sets], Ws[i % sets].t())

        def train(i: int, rule=rule) -> None:
            dispatch.LINE_PADDED_ROW_BYTES = rule
            x, W = xs[i % sets], Ws[i % sets]
            x.grad = W.grad = None
            ops.gemm(x, W.t()).backward(grads[i % sets])

        fns[f"{name} fwd"], fns[f"{name} fwd+bwd"] = forward, train
    fns["torch fwd"] = lambda i: xs[i % sets].detach() @ Ws[i % sets].detach().t()

    def torch_train(i: int) -> None:
        x, W = xs[i % sets], Ws[i % sets]
        x.grad = W.grad = None
        (x @ W.t()).backward(grads[i % sets])

    fns["torch fwd+bwd"] = torch_train
    x, W, g = xs[0], Ws[0], grads[0]
    with torch.no_grad():
        ref = x @ W.t()
    x.grad = W.grad = None
    (x @ W.t()).backward(g)
    ref_dx, ref_dW = x.grad.clone(), W.grad.clone()
    for name in PITCH_RULES:
        out = fns[f"{name} fwd"](0)
        strides[name] = list(out.stride())
        fns[f"{name} fwd+bwd"](0)
        checks[name] = {"logits": _relative(out, ref), "dx": _relative(x.grad, ref_dx), "dW": _relative(W.grad, ref_dW)}
    ms, behind = time_group(fns, repeat)
    dispatch.LINE_PADDED_ROW_BYTES = default
    return {"case": label, "M": M, "V": V, "H": H, "ms": ms, "row_strides": strides, "rel_error_vs_torch": checks,
            "host_behind": behind}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tag", default="")
    a = p.parse_args()
    doc = result_doc(cases=[])
    device = doc["device"]
    lines = [f"{device}; ms, median of {a.repeat} shuffled launches per run, median [min-max] over {a.runs} runs"]
    for case in CASES:
        runs = [run_case(case, a.repeat) for _ in range(a.runs)]
        doc["cases"].append({"case": case[0], "runs": runs})
        for name in runs[0]["ms"]:
            ts = [r["ms"][name] for r in runs]
            torch_name = "torch " + name.split()[-1]
            ratios = [r["ms"][torch_name] / r["ms"][name] for r in runs]
            err = runs[0]["rel_error_vs_torch"].get(name.split()[0], {})
            lines.append(f"{case[0]:24s} {name:18s} {statistics.median(ts):8.4f} [{min(ts):.4f}-{max(ts):.4f}]  "
                         f"x{statistics.median(ratios):.3f} torch  "
                         + (f"row stride {runs[0]['row_strides'][name.split()[0]][0]}, err " +
                            ", ".join(f"{k} {v:.1e}" for k, v in err.items()) if err else ""))
            print(lines[-1], flush=True)
    name = result_name("padded_rows", device, a.tag)
    write_result_with_text(name, doc, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
