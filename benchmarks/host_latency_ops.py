"""Host time of a repeated ``kernel_api.ops`` call against torch's own call for the same op.

    python3 benchmarks/host_latency_ops.py            # CUDA when there is a GPU, else the CPU
    python3 benchmarks/host_latency_ops.py --quick    # fewer repeats
    python3 benchmarks/host_latency_ops.py --device cpu
    python3 benchmarks/host_latency_ops.py --parts    # where gemm(out=)'s and attention's host time goes

For each operation (softmax, gemm, the norms with and without the residual add, SwiGLU, GeGLU,
RoPE, cross-entropy, attention, and their backwards), ``ops.*`` at a host-bound size against
torch's call for the same work: ``F.rms_norm``, ``F.silu(g) * u``, ``F.cross_entropy``, SDPA, and
for a backward ``torch.autograd.grad`` of torch's forward (``torch._softmax_backward_data`` for
softmax). Every call after the first repeats the metadata of the first, so ops' calls are
replayed (`kernel_api.ops.replay`, or the C entry points for gemm and softmax).

The host time of one call is the mean over a batch of back-to-back calls, few enough that the
launch queue does not fill; every repeat times each row once, the rows in a shuffled order, so
drift spreads over all of them; the table gives medians over repeats and the median of the
paired differences (ours - torch, same repeat). On CUDA each batch is followed by a
synchronize outside the timed region.

On the CPU (``--device cpu``, for local numbers) the front door is allowed to launch on CPU
tensors (``dispatch.LAUNCH_DEVICE_TYPES`` patched, as the CPU tests do) and the settings restrict
the providers to ``torch``: the torch provider's kernels compute there, so ops' time is torch's
operators (in f32, with the provider's extra conversions and copies) plus ops' own cost; the
problems are tiny and torch runs one thread. Writes benchmarks/results/host_latency_ops-<device>.json (and
$OUT/ when set); prints the table last.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernel_api  # noqa: E402
from kernel_api import native, ops  # noqa: E402
from kernel_api.core.streams import to_cuda_stream  # noqa: E402
from kernel_api.ops import dispatch  # noqa: E402
from results_io import result_name, write_result  # noqa: E402


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _torch_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """transformers' apply_rotary_pos_emb (cos and sin unsqueezed at dim 1)."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _grad_of(forward: Callable[[], Any], inputs: tuple, grads: Any) -> Callable[[], Any]:
    """torch's backward of ``forward()`` with respect to ``inputs``: ``torch.autograd.grad`` of
    one recorded graph, kept (``retain_graph``) so every call runs the same backward."""
    with torch.enable_grad():
        out = forward()
    outs = out if isinstance(out, tuple) else (out,)
    gs = grads if isinstance(grads, tuple) else (grads,)
    return lambda: torch.autograd.grad(outs, inputs, gs, retain_graph=True)


def pairs(device: str) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Operation -> (ours, torch's), at host-bound sizes."""
    # CUDA: bf16 problems whose kernels take a few microseconds; the CPU computes the torch
    # provider's kernels itself, so its problems are tiny (the host cost, not the arithmetic)
    cuda = device == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    new = lambda *shape, dtype=dt: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    rows, n, vocab, seq = (16, 1024, 4096, 16) if cuda else (4, 64, 128, 4)
    x, r, w, b = new(rows, n), new(rows, n), new(n), new(n)
    g, u, dy = new(rows, 2 * n), new(rows, 2 * n), new(rows, 2 * n)
    dyn = new(rows, n)  # (a dense gradient: the row kernels' backwards take unit-stride rows)
    q, k = new(1, 8, seq, 64), new(1, 2, seq, 64)  # (batch, heads, seq, head_dim)
    cos, sin = new(1, seq, 64), new(1, seq, 64)
    logits, target = new(rows, vocab), torch.randint(0, vocab, (rows,), device=device)
    grad_loss = new(rows, dtype=torch.float32)
    A, B = new(64, 64), new(64, 64)
    aq, ak, av = (new(1, 2 * seq, 8, 64) for _ in range(3))  # (batch, seq, heads, head_dim)
    y = torch.softmax(x, -1)
    lse = torch.logsumexp(logits.float(), -1)
    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    xr, wr, br, gr, ur, qr, kr, lr = (leaf(t) for t in (x, w, b, g, u, q, k, logits))
    s = x + r
    return {
        "softmax": (lambda: ops.softmax(x), lambda: torch.softmax(x, -1)),
        "softmax backward": (lambda: ops.softmax_backward(dyn, y),
                             lambda: torch._softmax_backward_data(dyn, y, -1, y.dtype)),
        "gemm": (lambda: ops.gemm(A, B), lambda: torch.matmul(A, B)),
        "rms_norm": (lambda: ops.rms_norm(x, w, 1e-6), lambda: F.rms_norm(x, (n,), w, 1e-6)),
        "rms_norm + residual": (lambda: ops.rms_norm(x, w, 1e-6, r),
                                lambda: (F.rms_norm(x + r, (n,), w, 1e-6))),
        "rms_norm backward": (lambda: ops.rms_norm_backward(dyn, s, w, 1e-6),
                              _grad_of(lambda: F.rms_norm(xr, (n,), wr, 1e-6), (xr, wr), dyn)),
        "layer_norm": (lambda: ops.layer_norm(x, w, b, 1e-5), lambda: F.layer_norm(x, (n,), w, b, 1e-5)),
        "layer_norm + residual": (lambda: ops.layer_norm(x, w, b, 1e-5, r),
                                  lambda: F.layer_norm(x + r, (n,), w, b, 1e-5)),
        "layer_norm backward": (lambda: ops.layer_norm_backward(dyn, s, w, 1e-5),
                                _grad_of(lambda: F.layer_norm(xr, (n,), wr, br, 1e-5), (xr, wr, br), dyn)),
        "swiglu": (lambda: ops.swiglu(g, u), lambda: F.silu(g) * u),
        "geglu": (lambda: ops.geglu(g, u), lambda: F.gelu(g, approximate="tanh") * u),
        "swiglu backward": (lambda: ops.gated_activation_backward(dy, g, u, "silu"),
                            _grad_of(lambda: F.silu(gr) * ur, (gr, ur), dy)),
        "rope": (lambda: ops.rope(q, k, cos, sin), lambda: _torch_rope(q, k, cos, sin)),
        "rope backward": (lambda: ops.rope_backward(q, k, cos, sin, 1),
                          _grad_of(lambda: _torch_rope(qr, kr, cos, sin), (qr, kr), (q, k))),
        "cross_entropy": (lambda: ops.cross_entropy(logits, target, reduction="none"),
                          lambda: F.cross_entropy(logits, target, reduction="none")),
        "cross_entropy (mean)": (lambda: ops.cross_entropy(logits, target), lambda: F.cross_entropy(logits, target)),
        "cross_entropy backward": (lambda: ops.cross_entropy_backward(grad_loss, logits, target, lse),
                                   _grad_of(lambda: F.cross_entropy(lr.float(), target, reduction="none"), (lr,),
                                            grad_loss)),
        "attention": (lambda: ops.attention(aq, ak, av),
                      lambda: F.scaled_dot_product_attention(aq.transpose(1, 2), ak.transpose(1, 2),
                                                             av.transpose(1, 2)).transpose(1, 2)),
    }


def kernel_alone(ours: Callable[[], Any], stream: Any) -> Callable[[], Any] | None:
    """The chosen kernel's own launch for ``ours``' first call: its `Launcher` called on the
    arguments' tensors (outputs included, none made), or None when it offers none. What a
    replayed call cannot avoid; ops' time over it is the front door's own cost."""
    seen = []
    python_path = dispatch._launch

    def spy(args: Any, *rest: Any, **named: Any) -> Any:
        found = python_path(args, *rest, **named)
        seen.append((args, found))
        return found

    ops.clear_dispatch_cache()
    dispatch._launch = spy
    try:
        ours()
    finally:
        dispatch._launch = python_path
    if len(seen) != 1:
        return None
    args, (kernel, artifact, _) = seen[0]
    launcher = kernel._launcher(args, artifact)
    if launcher is None:
        return None
    tensors = [getattr(args, name) for name in args.tensor_attributes]
    return lambda: launcher.function(*tensors, *launcher.tail, stream)


def measure(rows: dict[str, Callable[[], Any]], calls: int, repeats: int, sync: Callable[[], None],
            clock: Callable[[], float] = time.perf_counter, seed: int = 0) -> dict[str, list[float]]:
    """Per row, the mean host time of one call (us) in each repeat; rows in shuffled turns."""
    order = list(rows)
    for fn in rows.values():  # warm: record every replay, every torch path
        for _ in range(max(20, calls // 4)):
            fn()
    sync()
    samples: dict[str, list[float]] = {label: [] for label in order}
    shuffle = random.Random(seed).shuffle
    for _ in range(repeats):
        shuffle(order)
        for label in order:
            fn = rows[label]
            t0 = clock()
            for _ in range(calls):
                fn()
            samples[label].append((clock() - t0) / calls * 1e6)
            sync()
    return samples


def parts(device: str, repeats: int) -> list[str]:
    """Where the host time of a repeated ``ops.gemm(out=)`` and ``ops.attention`` goes (``--parts``):
    each front door and its C replay called directly (a hit, and a miss: the call key and the
    lookup) against torch's call, the recipe's callable alone, and the key's parts: a call keyed
    with no state part, with one tensor, three, and with each of torch's state readers alone.
    ns per call, medians over interleaved repeats, paired with the row named."""
    import sys as _sys

    from kernel_api.native import recipes

    cuda = device == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    new = lambda *shape: torch.randn(*shape, device=device, dtype=dt)  # noqa: E731
    A, B, out, tout = new(64, 64), new(64, 64), new(64, 64), new(64, 64)
    q, k, v = new(1, 32, 8, 64), new(1, 32, 8, 64), new(1, 32, 8, 64)
    for _ in range(3):
        ops.gemm(A, B, out=out)
        ops.attention(q, k, v)
    entry = dispatch._entry
    if entry is None:
        return ["no native entry points: nothing is replayed from C"]
    gemm_op = dispatch.GEMM_OP
    attention_op = _sys.modules["kernel_api.ops.attention"]._ATTENTION_NUMBER
    rest = (False, *[None] * 8)  # (attention's other inputs, out, stream)
    found = entry.recipe(attention_op, q, k, v, *rest)
    call = found[0][0] if found else (lambda *a: None)
    other = 1 << 20  # (added to an operation's number: nothing recorded for it)
    bare = (recipes.op_number("host_latency.parts", recipes.GRAD_MODE) & ~(recipes.ALL_STATE << 32)) | (1 << 37)
    sdpa = F.scaled_dot_product_attention
    rows = {
        "torch.matmul(out=)": lambda: torch.matmul(A, B, out=tout),
        "ops.gemm(out=)": lambda: ops.gemm(A, B, out=out),
        "replay gemm hit": lambda: entry.replay(gemm_op, A, B, out, 1.0, 0.0, None, None, None, None, None),
        "replay gemm miss": lambda: entry.replay(gemm_op + other, A, B, out, 1.0, 0.0, None, None, None, None, None),
        "sdpa": lambda: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2),
        "ops.attention": lambda: ops.attention(q, k, v),
        "the recipe's callable": lambda: call(q, k, v),
        "replay attention hit": lambda: entry.replay(attention_op, q, k, v, *rest),
        "replay attention miss": lambda: entry.replay(attention_op + other, q, k, v, *rest),
        "key: no state, no argument": lambda: entry.replay(bare),
        "key: no state, 1 tensor": lambda: entry.replay(bare, A),
        "key: no state, 3 tensors": lambda: entry.replay(bare, A, B, out),
    }
    # a recipe calling a Python function against one calling a C function (C's call into Python)
    through = recipes.op_number("host_latency.parts.callables", recipes.GRAD_MODE)
    recipes.record(entry, through, recipes.Call(lambda t: t, (0,)), A, 0)
    recipes.record(entry, through, recipes.Call(id, (0,)), A, 1)
    rows["replay hit, C callable"] = lambda: entry.replay(through, A, 1)
    rows["replay hit, Python callable"] = lambda: entry.replay(through, A, 0)
    for name, bit in (("grad mode", recipes.GRAD_MODE), ("dispatch modes", recipes.DISPATCH_MODE),
                      ("function modes", recipes.FUNCTION_MODE), ("autocast", recipes.AUTOCAST),
                      ("TF32", recipes.TF32)):
        number = recipes.op_number(f"host_latency.parts.{name}", bit)
        rows[f"key: 1 tensor, {name}"] = lambda number=number: entry.replay(number, A)
    paired = {"ops.gemm(out=)": "torch.matmul(out=)", "replay gemm hit": "torch.matmul(out=)",
              "ops.attention": "sdpa", "the recipe's callable": "sdpa", "replay attention hit": "sdpa",
              "replay hit, Python callable": "replay hit, C callable",
              **{label: "key: no state, 1 tensor" for label in rows if label.startswith("key: 1 tensor")}}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.perf_counter if cuda else time.thread_time
    samples = {label: [us * 1e3 for us in values]
               for label, values in measure(rows, 200, repeats, sync, clock).items()}
    lines = [f"where the host time goes, {device} (ns per call, medians; paired: over the row named)"]
    for label, values in samples.items():
        line = f"{label:<34} {statistics.median(values):9.0f}"
        if label in paired:
            line += f"  {statistics.median(a - b for a, b in zip(values, samples[paired[label]])):+7.0f} over {paired[label]}"
        lines.append(line)
    # The key's reads of torch: through its C++ API (native/torch_reads.cc) where adopted, against
    # torch's Python readers and DLPack exchange API, the same rows measured again without them.
    reads = native.torch_reads(entry)
    if reads is not None and entry.uses_torch_reads():
        keyed = [label for label in rows if label.startswith(("replay gemm miss", "replay attention miss", "key:"))]
        entry.use_torch_reads(None)
        try:
            slow = measure({label: rows[label] for label in keyed}, 200, repeats, sync, clock)
        finally:
            entry.use_torch_reads(reads)
        lines.append("the same keys read through torch's Python readers and DLPack exchange API (torch reads off):")
        for label in keyed:
            lines.append(f"{label:<34} {statistics.median(slow[label]) * 1e3:9.0f}  (with them: "
                         f"{statistics.median(samples[label]):.0f})")
    else:
        lines.append(f"(the key reads torch through its Python functions: {native.why_not_torch_reads()})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and calls")
    parser.add_argument("--calls", type=int, default=None, help="calls per timed batch")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--only", default="", help="comma-separated operations (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated operations to leave out")
    parser.add_argument("--tag", default="", help="suffix of the JSON's name")
    parser.add_argument("--parts", action="store_true",
                        help="where a repeated ops.gemm(out=) and ops.attention spend their host time (ns)")
    opts = parser.parse_args()
    calls = opts.calls or (50 if opts.quick else 200)
    repeats = opts.repeats or (7 if opts.quick else 25)
    device = opts.device
    if device == "cpu":
        torch.set_num_threads(1)  # (tiny problems: no intra-op threads to wake)
        dispatch.LAUNCH_DEVICE_TYPES = frozenset({"cuda", "cpu"})
        scope = kernel_api.settings(providers=["torch"])
        sync = lambda: None  # noqa: E731
        where = "cpu"
    else:
        scope = kernel_api.settings()
        sync = torch.cuda.synchronize
        where = torch.cuda.get_device_name().replace(" ", "_")
    if opts.parts:
        with scope, torch.no_grad():
            print("\n".join(parts(device, repeats)))
        return
    with scope, torch.no_grad():
        table = pairs(device)
        if opts.only:
            wanted = {w.strip() for w in opts.only.split(",")}
            table = {k: v for k, v in table.items() if k in wanted}
        skipped = {w.strip() for w in opts.skip.split(",")}
        table = {k: v for k, v in table.items() if k not in skipped}
        rows: dict[str, Callable[[], Any]] = {}
        stream = None if device == "cpu" else to_cuda_stream(None)
        for op, (ours, theirs) in table.items():
            rows[f"{op} | ops"], rows[f"{op} | torch"] = ours, theirs
            try:
                alone = kernel_alone(ours, stream)
            except Exception:  # noqa: BLE001 - reported with the ops row below
                alone = None
            if alone is not None:
                rows[f"{op} | kernel"] = alone
        failed = {}
        for label, fn in list(rows.items()):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - an operation this machine cannot run: left out, said why
                failed[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                del rows[label]
        # (the CPU's clock is this thread's CPU time: other processes on a shared machine preempt
        # it, which wall time would count)
        samples = measure(rows, calls, repeats, sync, time.thread_time if device == "cpu" else time.perf_counter)
        chosen = sorted({k.metadata.kernel_name for _, k in ops.chosen_kernels()})
    results = {}
    lines = [f"host time per repeated call, {where}, {calls} calls x {repeats} repeats (medians, us; kernel: the "
             f"chosen kernel's launcher alone)",
             f"{'operation':<24} {'ops':>9} {'torch':>9} {'ops-torch':>10} {'ops/torch':>10} {'kernel':>9} "
             f"{'ops-kernel':>11}"]
    for op in table:
        a, b = samples.get(f"{op} | ops"), samples.get(f"{op} | torch")
        if a is None or b is None:
            lines.append(f"{op:<24} {'-':>9} {'-':>9}   ({failed.get(f'{op} | ops') or failed.get(f'{op} | torch')})")
            continue
        ours, theirs = statistics.median(a), statistics.median(b)
        diff = statistics.median(x - y for x, y in zip(a, b))
        results[op] = {"ops_us": ours, "torch_us": theirs, "difference_us": diff, "ratio": ours / theirs,
                       "ops_samples": a, "torch_samples": b}
        line = f"{op:<24} {ours:>9.2f} {theirs:>9.2f} {diff:>+10.2f} {ours / theirs:>10.2f}"
        c = samples.get(f"{op} | kernel")
        if c is not None:
            alone, over = statistics.median(c), statistics.median(x - y for x, y in zip(a, c))
            results[op].update(kernel_us=alone, over_kernel_us=over, kernel_samples=c)
            line += f" {alone:>9.2f} {over:>+11.2f}"
        lines.append(line)
    doc = {"device": where, "torch": torch.__version__, "calls": calls, "repeats": repeats,
           "cpu_front_door_patched": device == "cpu", "providers": ["torch"] if device == "cpu" else None,
           "chosen_kernels": chosen, "failed": failed, "results": results}
    paths = write_result(result_name("host_latency_ops", where, opts.tag), doc)
    print("chosen kernels:", ", ".join(chosen))
    for label, why in failed.items():
        print(f"not run: {label}: {why}")
    print(f"wrote {', '.join(paths)}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
