"""JSON schemas through structured output as each side builds it: what compiles, what is refused, how fast.

Both sides run LLGuidance (protocol/structured.py: check_schema, then the compile), each over its own model's
vocabulary, built the way the product builds it:
- `robot`: the draft model's, as open_decoder's Drafter holds it (`drafter.grammars`);
- `server`: the target's, as the verifier compiles an open's grammar (`load_target(...).grammar`, the default
  llamacpp engine).

For each schema: compiled, refused with a typed error (SchemaError or GrammarError, a reason the endpoint answers
with 400) or broken (any other exception: a 500), and the compile time. For MaskBench's schemas, each of their
valid and invalid instances is walked token by token (the instance's JSON as llama.cpp tokenizes it): a mask at
every position (timed), the token checked against it. A schema passes MaskBench when it compiles, every valid
instance is allowed to its end and every invalid one is cut somewhere.

The data is JSONSchemaBench (github.com/guidance-ai/jsonschemabench, Geng et al. 2025): its `data/<category>/`
schemas and `maskbench/data/` schemas with instances. The full sets are not shipped: `--data auto` fetches them once
from GitHub's archive of JSB_COMMIT and checks them by content (tools/bench/jsb_data.py); `--data DIR` reads a
checkout of that repository at JSB_COMMIT. Without it, the sample in tools/schemas/maskbench-sample.jsonl (112
MaskBench schemas, 8 of each category of at most 12 KB, with their instances) stands in for both.

    python -m tools.bench.schemas --out docs/benchmarks/schemas                       # the sample, ~1 min
    python -m tools.bench.schemas --data auto --out bench_results/schemas             # 20,864 schemas, ~8 min

Writes schemas.json, schemas.md and schemas.png under --out (tools/bench/harness.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from protocol import grammar, modelfiles
from tools.bench import harness, jsb_data

JSB_COMMIT = jsb_data.JSB_COMMIT
SAMPLE = Path(__file__).resolve().parents[1] / "schemas" / "maskbench-sample.jsonl"
SIDES = ("robot", "server")


class Side:
    """One side's structured output: compile(schema) -> a start state factory; refusals are typed."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "robot":
            from agent.decoding import DecoderSettings, open_decoder

            drafter = open_decoder(DecoderSettings(threads=1)).drafter
            self._compile: Callable[[str], Any] = drafter.grammars.schema
        elif name == "server":
            from server_bridge.target import load_target

            target = load_target(threads=1)
            self._compile = lambda text: target.grammar({"json_schema": text})
        else:
            raise ValueError(f"a side is one of {', '.join(SIDES)}, not {name!r}")

    def compile(self, schema: Any) -> Callable[[], Any]:
        return self._compile(schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))).start


def categories(args: argparse.Namespace) -> Iterator[tuple[str, str, Any, list[dict[str, Any]]]]:
    """(category, id, schema, MaskBench instances or []) of every schema the run reads."""
    rng = random.Random(args.seed)
    if not args.data:
        for line in SAMPLE.read_text().splitlines():
            r = json.loads(line)
            yield r["category"], r["id"], r["schema"], r["tests"]
        return
    root = jsb_data.ensure() if args.data == "auto" else Path(args.data)
    groups: dict[str, list[Path]] = {}
    for path in sorted((root / "maskbench" / "data").glob("*.json")):
        name = path.name.split("---")[0] if "---" in path.name else path.name.split("_")[0]  # JME_1.json
        groups.setdefault(f"maskbench/{name}", []).append(path)
    for folder in sorted(p for p in (root / "data").iterdir() if p.is_dir()):
        groups[folder.name] = sorted(folder.glob("*.json"))
    for name, paths in groups.items():
        for path in rng.sample(paths, min(args.per_category, len(paths))) if args.per_category else paths:
            doc = json.loads(path.read_text())
            mask = name.startswith("maskbench/")
            yield name, path.name, doc["schema"] if mask else doc, doc.get("tests", []) if mask else []


def walk(start: Callable[[], Any], ids: list[int], times: list[float]) -> bool:
    """Whether every token of `ids` is allowed in turn (a mask computed and timed at each position)."""
    state = start()
    for t in ids:
        t0 = time.perf_counter()
        allowed = state.mask()
        times.append(time.perf_counter() - t0)
        if not allowed[t]:
            return False
        state.accept(t)
    return True


def one_schema(engine: Side, schema: Any, tests: list[dict[str, Any]], tokenize, times: list[float]) -> dict:
    row: dict[str, Any] = {"status": "compiled"}
    t0 = time.perf_counter()
    try:
        start = engine.compile(schema)
    except grammar.GrammarError as e:  # SchemaError included: the endpoint's 400
        row.update(status="refused", reason=str(e)[:160], refuse_ms=(time.perf_counter() - t0) * 1e3)
        return row
    except Exception as e:  # noqa: BLE001  what the engine does not turn into a reason: the endpoint's 500
        row.update(status="broken", reason=f"{type(e).__name__}: {str(e)[:160]}")
        return row
    row["compile_ms"] = (time.perf_counter() - t0) * 1e3
    if tests:
        verdicts = []
        for test in tests:
            try:
                ok = walk(start, tokenize(json.dumps(test["data"], ensure_ascii=False)), times)
            except grammar.GrammarError:
                ok = False
            verdicts.append(ok == bool(test["valid"]))
        row["maskbench_pass"] = all(verdicts)
        row["valid_refused"] = sum(1 for t, v in zip(tests, verdicts, strict=True) if t["valid"] and not v)
        row["invalid_allowed"] = sum(1 for t, v in zip(tests, verdicts, strict=True) if not t["valid"] and not v)
    return row


def summarise(category: str, engine: str, rows: list[dict], times: list[float]) -> dict:
    n = len(rows)
    compiled = [r for r in rows if r["status"] == "compiled"]
    masked = [r for r in compiled if "maskbench_pass" in r]
    ms = [r["compile_ms"] for r in compiled]
    us = np.array(times) * 1e6
    return {
        "category": category,
        "engine": engine,
        "schemas": n,
        "compiled": len(compiled) / n if n else 0.0,
        "refused": sum(r["status"] == "refused" for r in rows),
        "broken": sum(r["status"] == "broken" for r in rows),
        "compile_ms_p50": float(np.median(ms)) if ms else None,
        "compile_ms_max": max(ms) if ms else None,
        "refuse_ms_max": max((r["refuse_ms"] for r in rows if "refuse_ms" in r), default=None),
        "maskbench_schemas": sum(r["maskbench"] for r in rows),
        "maskbench_pass": sum(r["maskbench_pass"] for r in masked),
        "valid_refused": sum(r["valid_refused"] for r in masked),
        "invalid_allowed": sum(r["invalid_allowed"] for r in masked),
        "masks": len(us),
        "mask_us_p50": float(np.percentile(us, 50)) if len(us) else None,
        "mask_us_p99": float(np.percentile(us, 99)) if len(us) else None,
        "reasons": top_reasons(rows),
    }


def top_reasons(rows: list[dict], n: int = 3) -> list[str]:
    counts: dict[str, int] = {}
    for r in rows:
        if r["status"] != "compiled":
            key = r["reason"].split(":")[0] if r["status"] == "broken" else r["reason"][:70]
            counts[key] = counts.get(key, 0) + 1
    return [f"{k} ({v})" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:n]]


def measure(args: argparse.Namespace) -> dict:
    from llama_cpp import Llama

    gguf = modelfiles.shipped_gguf()
    llama = Llama(str(gguf), vocab_only=True, verbose=False)  # the pair's one vocabulary (the handshake checks it)

    def tokenize(text: str) -> list[int]:
        return list(llama.tokenize(text.encode(), add_bos=False, special=False))

    engines = [Side(name) for name in harness.names(args.sides)]
    schemas = list(categories(args))
    if args.quick:
        schemas = schemas[:: max(1, len(schemas) // 12)]
    rows: list[dict] = []
    for engine in engines:
        by_category: dict[str, tuple[list[dict], list[float]]] = {}
        for i, (category, sid, schema, tests) in enumerate(schemas):
            got, times = by_category.setdefault(category, ([], []))
            row = one_schema(engine, schema, tests, tokenize, times)
            got.append({"id": sid, "maskbench": bool(tests), **row})
            if (i + 1) % 200 == 0:
                print(f"  {engine.name}: {i + 1} of {len(schemas)} schemas", file=sys.stderr, flush=True)
        for category, (got, times) in by_category.items():
            rows.append(summarise(category, engine.name, got, times))
        every = [r for got, _ in by_category.values() for r in got]
        rows.append(summarise("all", engine.name, every, [t for _, ts in by_category.values() for t in ts]))
        print(f"  {engine.name}: {rows[-1]['compiled']:.1%} compiled, {rows[-1]['broken']} broken", flush=True)
    source = (
        f"JSONSchemaBench at {args.data} (commit {JSB_COMMIT} expected)" if args.data else f"the sample {SAMPLE.name}"
    )
    endpoint = []
    if args.endpoint:
        from tools.bench import schemas_endpoint

        picked = endpoint_sample(schemas, harness.names(args.endpoint_categories), args.endpoint, args.seed)
        endpoint = schemas_endpoint.summarise(schemas_endpoint.run(picked, args.endpoint_max_tokens))
    return {
        "rows": rows,
        "endpoint": endpoint,
        "source": source,
        "vocab": llama.n_vocab(),
        "draft": gguf.name,
        "endpoint_max_tokens": args.endpoint_max_tokens,
    }


def endpoint_sample(schemas: list[tuple[str, str, Any, list]], names: list[str], n: int, seed: int) -> list:
    """`n` schemas of each named category, drawn with `seed` (JSONSchemaBench's data/ sets, or the sample's)."""
    rng = random.Random(seed)
    picked = []
    for name in names:
        pool = [(c, sid, schema) for c, sid, schema, _ in schemas if c == name]
        picked += rng.sample(pool, min(n, len(pool)))
    return picked


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--data",
        default="",
        help="auto: JSONSchemaBench's full sets, fetched once from the pinned archive (tools/bench/jsb_data.py); "
        "or a checkout of github.com/guidance-ai/jsonschemabench at JSB_COMMIT; unset: the shipped sample",
    )
    ap.add_argument("--per-category", type=int, default=0, help="schemas drawn from each category (0: all)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated: {', '.join(SIDES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--endpoint",
        type=int,
        default=0,
        metavar="N",
        help="also send N schemas of each --endpoint-categories as response_format through the OpenAI endpoint "
        "(the shipped pair, a verifier started here) and judge the answers (tools/bench/schemas_endpoint.py)",
    )
    ap.add_argument("--endpoint-categories", default="Glaiveai2K,Github_easy,Github_medium,Kubernetes,Github_hard")
    ap.add_argument("--endpoint-max-tokens", type=int, default=256)


REPORT = harness.Report(
    "schemas",
    "# JSON schemas through structured output on each side ({source})",
    [
        harness.Table(
            "rows",
            [
                harness.Col("category"),
                harness.Col("engine", "side"),
                harness.Col("schemas"),
                harness.Col("compiled", fmt=harness.pct),
                harness.Col("refused", "refused (400)"),
                harness.Col("broken", "broken (500)"),
                harness.Col("compile_ms_p50", "compile ms p50", "{:.2f}"),
                harness.Col("compile_ms_max", "compile ms max", "{:.1f}"),
                harness.Col("refuse_ms_max", "refuse ms max", "{:.1f}"),
                harness.Col("maskbench_pass", "MaskBench pass"),
                harness.Col("maskbench_schemas", "of"),
                harness.Col("mask_us_p50", "mask us p50", "{:.0f}"),
                harness.Col("mask_us_p99", "mask us p99", "{:.0f}"),
            ],
            note="Vocabulary: {vocab} tokens of {draft}. Refused: a typed error naming the reason (the endpoint's "
            "400); broken: any other exception (a 500). Masks: one per token of every MaskBench instance walked.",
        ),
        harness.Table(
            "rows",
            [
                harness.Col("category"),
                harness.Col("engine", "side"),
                harness.Col("reasons", "most frequent refusals", "; ".join),
            ],
            title="## Why schemas are refused",
        ),
        harness.Table(
            "endpoint",
            [
                harness.Col("category"),
                harness.Col("schemas"),
                harness.Col("valid"),
                harness.Col("invalid"),
                harness.Col("truncated"),
                harness.Col("refused", "refused (400)"),
                harness.Col("broken", "broken (500)"),
            ],
            title="## End to end through the OpenAI endpoint (--endpoint)",
            note="response_format json_schema at temperature 0, max_tokens {endpoint_max_tokens}: valid = "
            "finish_reason stop and the content validates (jsonschema); truncated = finish_reason length.",
        ),
    ],
    harness.Plot(
        lambda result: harness.pivot(result["rows"], ["category"], "engine", "compiled"),
        x="category",
        ys=lambda result: {e: f"compiled@{e}" for e in dict.fromkeys(r["engine"] for r in result["rows"])},
        kind="bar",
        xlabel="category",
        ylabel="share compiled",
        ylim=(0.0, 1.05),
        title="Schemas compiled, by category and side",
    ),
)


def main(argv: list[str] | None = None) -> int:
    return harness.main(__doc__, REPORT, measure, add_args, argv, out="bench_results/schemas", pin_cores=False)


if __name__ == "__main__":
    sys.exit(main())
