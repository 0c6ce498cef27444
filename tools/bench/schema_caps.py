"""What each of protocol/structured.py's caps on a schema refuses, and what the engine would cost without it.

The caps are checked on the schema's JSON before anything compiles (`check_schema`): its bytes, its JSON values,
their nesting, an object's optional properties and a pattern's `{m,n}`; an enum's length and a pattern's are
measured too, to show why they have no cap of their own. A cap is right when it refuses
only what LLGuidance cannot serve in bounded time and memory. So, for each cap:

- **JSONSchemaBench**: how many of its schemas the cap refuses (the full sets with `--data auto`, else the
  shipped sample);
- **a family of schemas growing in that one dimension**, from a quarter of the cap to many times it, each
  compiled with every cap lifted and the compile deadline at 60 s: the compile time, the first mask's time, a
  mask's p99 over a walk of a valid instance, and the process's resident memory growth.

    python -m tools.bench.schema_caps --data auto --out docs/benchmarks/schemas/caps

Writes schema_caps.json, .md and .png under --out (tools/bench/harness.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from protocol import grammar, modelfiles, structured
from tools.bench import harness, schemas

WORDS = "the robot walks to the red door and waits there until it opens "


def _deep(n: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "integer"}
    for _ in range(n // 2):  # each object level is two JSON levels (properties, then the name)
        node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
    return node


def _deep_value(n: int) -> Any:
    value: Any = 1
    for _ in range(n // 2):
        value = {"a": value}
    return value


# family -> (structured's cap, or a size where there is none; a schema of size n; a valid instance of it)
FAMILIES: dict[str, tuple[str | int, Callable[[int], Any], Callable[[int], Any]]] = {
    "bytes": (  # required properties (optional ones meet MAX_OPTIONAL_PROPERTIES first) with descriptions
        "MAX_SCHEMA_BYTES",
        lambda n: {
            "type": "object",
            "properties": {f"p{i}": {"type": "string", "description": WORDS * 3} for i in range(n // 230)},
            "required": [f"p{i}" for i in range(n // 230)],
        },
        lambda n: {f"p{i}": "x" for i in range(n // 230)},
    ),
    "nodes": (
        "MAX_SCHEMA_NODES",
        lambda n: {"enum": [f"value-{i}" for i in range(n)]},
        lambda n: f"value-{n - 1}",
    ),
    "optional": (
        "MAX_OPTIONAL_PROPERTIES",
        lambda n: {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}},
        lambda n: {"p0": 0, f"p{n - 1}": 1},
    ),
    "depth": ("MAX_SCHEMA_DEPTH", _deep, _deep_value),
    "pattern": (
        4096,  # no cap: the schema's bytes bound it
        lambda n: {"type": "string", "pattern": "^(" + "|".join(f"w{i:05d}" for i in range(n // 7)) + ")$"},
        lambda n: f"w{n // 7 - 1:05d}",
    ),
    "repeat": (
        "MAX_PATTERN_REPEAT",
        lambda n: {"type": "string", "pattern": f"^a{{{n}}}$"},
        lambda n: "a" * n,
    ),
}
CAPS = ("MAX_SCHEMA_BYTES", "MAX_SCHEMA_NODES", "MAX_SCHEMA_DEPTH", "MAX_OPTIONAL_PROPERTIES", "MAX_PATTERN_REPEAT")
MULTIPLES = (0.25, 1.0, 4.0, 16.0)


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@contextmanager
def lifted() -> Any:
    """Every cap off and a 60 s deadline, for the families' measurements."""
    saved = {name: getattr(structured, name) for name in (*CAPS, "COMPILE_TIMEOUT_S")}
    for name in CAPS:
        setattr(structured, name, 1 << 40)
    structured.COMPILE_TIMEOUT_S = 60.0
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(structured, name, value)


def family_row(vocab: structured.Vocabulary, tokenize, name: str, multiple: float) -> dict[str, Any]:
    constant, make, instance = FAMILIES[name]
    base = getattr(structured, constant) if isinstance(constant, str) else constant
    n = max(2, int(base * multiple))
    row: dict[str, Any] = {"cap": name, "constant": constant, "multiple": multiple, "n": n}
    if not isinstance(constant, str):
        row["constant"] = "none (the bytes)"
    try:
        text = json.dumps(make(n), separators=(",", ":"))
    except RecursionError:  # deeper than Python's json writes (a caller could not send it either)
        return {**row, "within_caps": False, "compiled": False, "engine": "not written: Python's json recursion"}
    row["bytes"] = len(text)
    try:
        structured.check_schema(text)
        row["within_caps"] = True
    except grammar.SchemaError as e:
        row["within_caps"], row["refusal"] = False, str(e)[:120]
    with lifted():
        rss0, t0 = rss_kib(), time.perf_counter()
        try:
            constraint = vocab.schema(text)
        except grammar.GrammarError as e:
            row.update(compile_s=time.perf_counter() - t0, compiled=False, engine=str(e)[:120])
            return row
        row.update(compile_s=time.perf_counter() - t0, compiled=True)
        state = constraint.start()
        t1 = time.perf_counter()
        try:
            state.mask()
        except grammar.GrammarError as e:
            row.update(instance=f"engine error: {str(e)[:100]}", rss_mib=(rss_kib() - rss0) / 1024)
            return row
        row["first_mask_us"] = (time.perf_counter() - t1) * 1e6
        times = []
        for t in tokenize(json.dumps(instance(n)))[:200]:
            t1 = time.perf_counter()
            allowed = state.mask()
            times.append(time.perf_counter() - t1)
            if not allowed[t]:
                row["instance"] = "refused"
                break
            try:
                state.accept(t)
            except grammar.GrammarError as e:  # LLGuidance's own limits, met while walking
                row["instance"] = f"engine error: {str(e)[:100]}"
                break
        row["mask_us_p99"] = float(np.percentile(np.array(times) * 1e6, 99)) if times else None
        row["rss_mib"] = (rss_kib() - rss0) / 1024
    return row


def jsb_refusals(args: argparse.Namespace) -> list[dict[str, Any]]:
    """How many JSONSchemaBench schemas each cap refuses (check_schema's message names the cap)."""
    names = {
        "MAX_SCHEMA_BYTES": "bytes; at most",
        "MAX_SCHEMA_NODES": "values",
        "MAX_SCHEMA_DEPTH": "nests deeper",
        "MAX_OPTIONAL_PROPERTIES": "optional properties",
        "MAX_PATTERN_REPEAT": "repeats",
    }
    counts = dict.fromkeys(names, 0)
    total = 0
    for _, _, schema, _ in schemas.categories(args):
        total += 1
        try:
            structured.check_schema(json.dumps(schema, separators=(",", ":")))
        except grammar.SchemaError as e:
            for cap, words in names.items():
                if words in str(e):
                    counts[cap] += 1
                    break
    return [
        {"constant": cap, "value": getattr(structured, cap), "refused": n, "of": total} for cap, n in counts.items()
    ]


def measure(args: argparse.Namespace) -> dict:
    from llama_cpp import Llama

    gguf = modelfiles.shipped_gguf()
    vocab = structured.Vocabulary.from_gguf(gguf)
    n_vocab = vocab.n_vocab
    llama = Llama(str(gguf), vocab_only=True, verbose=False)

    def tokenize(text: str) -> list[int]:
        return list(llama.tokenize(text.encode(), add_bos=False, special=False))

    rows = []
    for name in harness.names(args.caps):
        for multiple in MULTIPLES[:2] if args.quick else MULTIPLES:
            row = family_row(vocab, tokenize, name, multiple)
            rows.append(row)
            print(f"  {name} x{multiple:g}: {row}", file=sys.stderr, flush=True)
            if row.get("compile_s", 0) > args.stop_s:  # larger would only take longer
                break
    return {"families": rows, "jsb": jsb_refusals(args), "vocab": n_vocab, "draft": gguf.name, "data": args.data}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data", default="", help="auto, a JSONSchemaBench checkout, or unset: the sample")
    ap.add_argument("--per-category", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--caps", default=",".join(FAMILIES), help=f"comma-separated: {', '.join(FAMILIES)}")
    ap.add_argument("--stop-s", type=float, default=20.0, help="stop a family once one compile takes this long")


REPORT = harness.Report(
    "schema_caps",
    "# What the schema caps refuse, and what the engine would cost without them",
    [
        harness.Table(
            "jsb",
            [
                harness.Col("constant", "cap"),
                harness.Col("value"),
                harness.Col("refused", "JSONSchemaBench schemas it refuses"),
                harness.Col("of"),
            ],
            title="## JSONSchemaBench ({data})",
        ),
        harness.Table(
            "families",
            [
                harness.Col("cap"),
                harness.Col("multiple", "x cap", "{:g}"),
                harness.Col("n"),
                harness.Col("bytes"),
                harness.Col("within_caps", "within the caps"),
                harness.Col("compiled"),
                harness.Col("compile_s", "compile s", "{:.3f}"),
                harness.Col("first_mask_us", "first mask us", "{:.0f}"),
                harness.Col("mask_us_p99", "mask us p99", "{:.0f}"),
                harness.Col("rss_mib", "RSS growth MiB", "{:.1f}"),
                harness.Col("instance", "walk"),
            ],
            title="## Schemas growing in one dimension, compiled with every cap lifted",
            note="Vocabulary: {vocab} tokens of {draft}. Each family grows one dimension from a quarter of its cap; "
            "a family stops once a compile takes --stop-s. Mask p99: over a walk of a valid instance (200 tokens "
            "at most).",
        ),
    ],
    harness.Plot(
        "families",
        x="multiple",
        ys={"compile s": "compile_s"},
        group="cap",
        xlabel="size, in multiples of the cap",
        ylabel="compile s",
        title="Compile time against each cap",
        hline=structured.COMPILE_TIMEOUT_S,
    ),
)


def main(argv: list[str] | None = None) -> int:
    return harness.main(__doc__, REPORT, measure, add_args, argv, out="bench_results/schema_caps", pin_cores=False)


if __name__ == "__main__":
    sys.exit(main())
