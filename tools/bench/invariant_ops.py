"""Which torch ops give a row different bits depending on the pass's shape, on this machine and dtype.

    python -m tools.bench.invariant_ops [--dtype bfloat16] [--threads 1] [--out docs/benchmarks/batch_invariant_cpu]

The measurement behind server_bridge/engines/invariant_torch.py. For each op, random rows (seeded)
run alone and inside passes of other sizes; a row "differs" when its output is not bit-identical:

- linear, the shipped target's shapes (K x N): each row alone (M = 1), and padded to 2 rows, against
  the same rows in passes of M = 2, 5, 40, 160 rows;
- SDPA (9 query heads, 3 KV heads, D = 64, a causal mask): a query at position p against its slot's
  keys, alone (no mask, keys 0..p), and in passes of n query rows with the keys cut at p + n, or
  rounded up to a multiple of 64 (and longer: other sessions' slots); the reference is a block of 4
  copies of the query with the keys rounded up, what the mode runs.

Writes invariant_ops.json and invariant_ops.md to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

LINEARS = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]


def linear_rows(k: int, n: int, dtype: torch.dtype, rows: int = 160) -> dict[str, int]:
    """Rows (of `rows`) whose bits differ from the padded single row's, per way of running them."""
    g = torch.Generator().manual_seed(k * 7 + n)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(dtype)
    padded = torch.cat([F.linear(x[i : i + 1].expand(2, -1), w)[:1] for i in range(rows)])
    out = {"M=1": int((torch.cat([F.linear(x[i : i + 1], w) for i in range(rows)]) != padded).any(1).sum())}
    for m in (2, 5, 40, 160):
        y = torch.cat([F.linear(x[i : i + m], w) for i in range(0, rows - m + 1, m)])
        out[f"M={m}"] = int((y != padded[: len(y)]).any(1).sum())
    return out


def sdpa_rows(dtype: torch.dtype) -> tuple[int, dict[str, int]]:
    """(queries tried, per way of running a query: how many differ from the mode's 4-row, 64-key-block run)."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, length = 9, 3, 64, 1100
    keys = torch.randn(1, kv_heads, length, d, generator=g).to(dtype)
    values = torch.randn(1, kv_heads, length, d, generator=g).to(dtype)
    queries = (torch.randn(1, heads, length, d, generator=g) * 2).to(dtype)
    up = lambda x: -(-x // 64) * 64  # noqa: E731

    def first_row(qpos: list[int], n_keys: int) -> torch.Tensor:
        mask = (torch.arange(n_keys)[None] <= torch.tensor(qpos)[:, None])[None, None]
        kv = (keys[:, :, :n_keys], values[:, :, :n_keys])
        return F.scaled_dot_product_attention(queries[:, :, qpos], *kv, attn_mask=mask, enable_gqa=True)[0, :, 0]

    counts: dict[str, int] = {}
    tried = 0
    for p in range(40, 1000, 11):
        tried += 1
        ref = first_row([p] * 4, up(p + 1))
        runs = {
            "alone, no mask": F.scaled_dot_product_attention(
                queries[:, :, [p]], keys[:, :, : p + 1], values[:, :, : p + 1], enable_gqa=True
            )[0, :, 0],
            "2 rows, keys in 64s": first_row([p, p + 1], up(p + 2)),
            "3 rows, keys in 64s": first_row([p, p + 1, p + 2], up(p + 3)),
        }
        for n in (4, 5, 8, 32):
            runs[f"{n} rows, keys cut at p + {n}"] = first_row(list(range(p, p + n)), p + n)
            runs[f"{n} rows, keys in 64s"] = first_row(list(range(p, p + n)), up(p + n))
            runs[f"{n} rows, keys in 64s + 192"] = first_row(list(range(p, p + n)), min(length, up(p + n) + 192))
        for name, row in runs.items():
            counts[name] = counts.get(name, 0) + int(not torch.equal(row, ref))
    return tried, counts


def markdown(report: dict) -> str:
    cols = list(next(iter(report["linear"].values())))
    lines = [
        f"# Rows against the pass's shape: torch {torch.__version__} CPU, {report['dtype']}, "
        f"{report['threads']} thread(s)",
        "",
        f"`{report['command']}`",
        "",
        "linear: rows (of 160) whose bits differ from the same row run padded to 2 rows",
        "",
        "| K x N | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for shape, row in report["linear"].items():
        lines.append(f"| {shape} | " + " | ".join(str(row[c]) for c in cols) + " |")
    lines += [
        "",
        f"SDPA: queries (of {report['sdpa_queries']}) whose output differs from 4 copies of the query with "
        "the keys rounded up to a multiple of 64",
        "",
        "| how the query runs | differ |",
        "|---|---|",
    ]
    lines += [f"| {name} | {n} |" for name, n in report["sdpa"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench_results/invariant_ops")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tried, sdpa = sdpa_rows(dtype)
    report = {
        "command": "python -m tools.bench.invariant_ops " + " ".join(argv if argv is not None else sys.argv[1:]),
        "dtype": args.dtype,
        "threads": args.threads,
        "torch": torch.__version__,
        "linear": {f"{k} x {n}": linear_rows(k, n, dtype) for k, n in LINEARS},
        "sdpa_queries": tried,
        "sdpa": sdpa,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "invariant_ops.json").write_text(json.dumps(report, indent=1))
    (out / "invariant_ops.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
