"""Where a kernel's warps spend their time, from Nsight Compute's per-instruction source page
(``ncu -i REPORT --page source --csv --print-source sass > FILE``; FILE may be gzipped): the
warp-stall reasons over the whole kernel, then the code cut into regions of instructions that run
equally often (a loop body, a per-wave section), each with its share of the stall samples, its
instructions executed and its most common opcodes; regions under ``--min-share`` are left out.

    python3 benchmarks/ncu_sass_regions.py fwd_sass.csv.gz [--min-share 0.5]
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip


def read_rows(path: str) -> tuple[list[str], list[list[str]]]:
    """The source page's header and instruction rows (the first line names the kernel)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    return rows[1], rows[2:]


def regions(header: list[str], rows: list[list[str]]) -> tuple[int, collections.Counter, list[dict]]:
    """Total samples, the stall reasons' samples, and the regions: runs of consecutive
    instructions whose execution counts agree within 2 %."""
    ix = {h: i for i, h in enumerate(header)}
    samples = lambda r: int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)  # noqa: E731
    executed = lambda r: int(r[ix["Instructions Executed"]] or 0)  # noqa: E731
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    reasons = collections.Counter()
    found: list[dict] = []
    for n, r in enumerate(rows):
        for s in stalls:
            reasons[s[len("stall_"):]] += int(r[ix[s]] or 0)
        count = executed(r)
        last = found[-1] if found else None
        if last is None or (count > 0 and abs(last["per_instruction"] - count) > max(0.02 * last["per_instruction"], 1)):
            last = {"first": n, "per_instruction": count, "samples": 0, "executed": 0, "ops": collections.Counter()}
            found.append(last)
        last["last"] = n
        last["samples"] += samples(r)
        last["executed"] += count
        words = [w for w in r[ix["Source"]].split() if not w.startswith("@")]
        if words:
            last["ops"][words[0].split(".")[0]] += 1
    return sum(samples(r) for r in rows), reasons, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--min-share", type=float, default=0.5, help="percent of the samples a region needs to be shown")
    opts = ap.parse_args()
    header, rows = read_rows(opts.path)
    total, reasons, found = regions(header, rows)
    print(f"{total} samples over {len(rows)} instructions; stall reasons (% of samples):")
    print("  " + ", ".join(f"{k} {100 * v / total:.1f}" for k, v in reasons.most_common(12)))
    print(f"{'instructions':>13} {'exec/inst':>9} {'samples':>7} {'share':>6} {'executed':>9}  opcodes")
    for g in found:
        share = 100 * g["samples"] / total
        if share >= opts.min_share:
            ops = ", ".join(f"{k} {v}" for k, v in g["ops"].most_common(6))
            print(f"{g['first']:6d}-{g['last']:<6d} {g['per_instruction']:9d} {g['samples']:7d} {share:5.1f}% "
                  f"{g['executed']:9d}  {ops}")


if __name__ == "__main__":
    main()
