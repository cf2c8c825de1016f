"""Where the host time of a GPT-2 prefill step goes, per configuration (cProfile of warm steps).

    python3 benchmarks/host_profile_gpt2.py [--configs patched,compiled+patched] [--steps 5] [--layers 12]

GPT-2 (transformers, random weights, bf16) at batch 8 x 1024 on the GPU; after warm-up, runs
``--steps`` prefill forwards under cProfile and prints the CUDA-event time per step and the top
functions by total and cumulative time. A diagnostic for benchmarks/e2e_gpt2.py's host-bound rows.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import kernel_api.nn  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="patched,compiled+patched")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--top", type=int, default=25)
    opts = p.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    for config in opts.configs.split(","):
        model = GPT2LMHeadModel(GPT2Config(n_layer=opts.layers)).to("cuda", torch.bfloat16).eval()
        if "patched" in config:
            kernel_api.nn.patch(model)
        run = torch.compile(model) if config.startswith("compiled") else model
        with torch.no_grad():
            for _ in range(3):
                run(ids)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            profiler = cProfile.Profile()
            start.record()
            profiler.enable()
            for _ in range(opts.steps):
                run(ids)
            profiler.disable()
            end.record()
            torch.cuda.synchronize()
        print(f"== {config}: {start.elapsed_time(end) / opts.steps:.3f} ms per step (under cProfile)")
        for key in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(opts.top)
            print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-6000:])


if __name__ == "__main__":
    main()
