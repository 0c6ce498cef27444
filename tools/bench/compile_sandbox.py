"""What compiling a peer's grammar in a worker process costs, where LLGuidance's compile overflows its stack, and
how long a robot's small schema waits while another peer floods slow grammars (protocol/sandbox.py, issue 50).

- **limits**: for each shape of chain (tools/schemas/hostile.py: a $defs chain through anyOf, a bare $ref, allOf,
  an array's items or an object's property; Lark rules; Lark terminals), the longest that compiles on a thread with
  a worker's stack, found by bisection, each try in a process of its own (a crash costs only the try); with the
  chain as protocol/structured.py measures it, and the stack that costs a link. MAX_REFERENCE_CHAIN is set from it.
- **cost**: a schema's first use, compiled in this process alone (what it cost before the workers) and through
  the worker first, a cached one, and a worker's start.
- **fairness**: a robot's new small schemas compiled one after another, alone and while another peer sends
  40,000-alternative Lark grammars back to back (each stopped at the deadline).

    python -m tools.bench.compile_sandbox --out docs/benchmarks/compile_sandbox

Writes compile_sandbox.json, .md and .png under --out (tools/bench/harness.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from protocol import modelfiles, sandbox, structured
from protocol.grammar import GrammarError
from tools.bench import harness
from tools.schemas import hostile

SCHEMA = {  # a typical answer schema: an action with its parameters
    "type": "object",
    "properties": {
        "action": {"enum": ["move", "turn", "stop", "look"]},
        "distance_m": {"type": "number", "minimum": 0, "maximum": 5},
        "angle_deg": {"type": "integer", "minimum": -180, "maximum": 180},
        "reason": {"type": "string", "maxLength": 120},
    },
    "required": ["action"],
}
SHAPES = [*(("json_schema", s) for s in hostile.SHAPES), ("lark", "rules"), ("lark", "terminals")]


def text_of(kind: str, shape: str, n: int) -> str:
    if kind == "json_schema":
        return hostile.schema_chain(n, shape)
    return hostile.lark_chain(n, terminals=shape == "terminals")


def chain_of(kind: str, text: str) -> int:
    return structured.schema_chain(json.loads(text)) if kind == "json_schema" else structured.lark_chain(text)[0]


def probe(kind: str, shape: str, n: int, stack: int) -> None:
    """One try, in this process: the chain compiled on a thread of `stack` bytes (exit 0), or this process dies."""
    import llama_cpp  # noqa: F401  before numpy's users (CUDA builds)

    from protocol.grammar import vocab_only

    _, vocab, n_vocab = vocab_only(modelfiles.shipped_gguf())
    tokenizer = structured.tokenizer_of(vocab, n_vocab)
    text = text_of(kind, shape, n)
    out: list[str] = []

    def run() -> None:
        try:
            structured.build_matcher(tokenizer, kind, text)
            out.append("compiled")
        except GrammarError as e:
            out.append(f"refused: {e}")

    threading.stack_size(stack)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    print(json.dumps({"outcome": out[0]}))


def compiles(kind: str, shape: str, n: int, stack: int) -> bool:
    cmd = [sys.executable, "-m", "tools.bench.compile_sandbox", "--probe", kind, shape, str(n), str(stack)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return r.returncode == 0


def limit_row(kind: str, shape: str, stack: int, hi: int) -> dict[str, Any]:
    """The longest chain of this shape that compiles on `stack` bytes: bisection to 2 %."""
    lo = 8
    if compiles(kind, shape, hi, stack):
        return {"kind": kind, "shape": shape, "longest": hi, "note": "no crash up to here"}
    while hi - lo > max(2, lo // 50):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if compiles(kind, shape, mid, stack) else (lo, mid)
    chain = chain_of(kind, text_of(kind, shape, lo))
    row = {"kind": kind, "shape": shape, "longest": lo, "crashes_at": hi, "chain": chain}
    row["stack_per_chain_kib"] = stack / chain / 1024
    print(f"  {kind} {shape}: {row}", file=sys.stderr, flush=True)
    return row


def cost_rows(vocab: structured.Vocabulary, repeats: int) -> list[dict[str, Any]]:
    """ms of a first use in this process alone, through a warm worker, and from the cache; a worker's start."""
    pool = sandbox.pool_for(vocab.gguf, vocab.n_vocab)
    vocab.schema({"type": "boolean"})  # the pool's workers started
    here, worker, cached = [], [], []
    for i in range(repeats):
        text = json.dumps({**SCHEMA, "description": f"run {time.time()} {i}"}, separators=(",", ":"))
        t0 = time.perf_counter()
        structured.check_schema(text)
        structured._compile_here(vocab.tokenizer, "json_schema", text)
        here.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        vocab.schema(text)
        worker.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        vocab.schema(text)
        cached.append((time.perf_counter() - t0) * 1e3)
    start = []
    for _ in range(max(1, repeats // 4)):
        fresh = sandbox.CompilePool(vocab.gguf, vocab.n_vocab, workers=1)
        t0 = time.perf_counter()
        fresh.check("json_schema", json.dumps(SCHEMA))
        start.append((time.perf_counter() - t0) * 1e3)
        fresh.close()
    del pool
    return [
        {"path": "first use: this process alone (before)", "ms": statistics.median(here), "max_ms": max(here)},
        {"path": "first use: a worker, then here (now)", "ms": statistics.median(worker), "max_ms": max(worker)},
        {"path": "cached (before and now)", "ms": statistics.median(cached), "max_ms": max(cached)},
        {"path": "a worker's start, then its first compile", "ms": statistics.median(start), "max_ms": max(start)},
    ]


def fairness_rows(vocab: structured.Vocabulary, n: int) -> list[dict[str, Any]]:
    """The robot's compile times, alone and beside a flood."""
    rows = []
    for flood in (False, True):
        stop, refused = threading.Event(), []
        attacker = threading.Thread(target=_attack, args=(vocab, stop, refused), daemon=True)
        if flood:
            attacker.start()
            time.sleep(0.5)
        took, failed = [], 0
        for i in range(n):
            t0 = time.perf_counter()
            try:
                vocab.schema({"enum": [f"left {flood} {i} {time.time()}", "right", "stop"]}, peer="robot")
            except GrammarError:
                failed += 1
            took.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.2)
        stop.set()
        if flood:
            attacker.join(60)
        rows.append(
            {
                "flood": "another peer floods" if flood else "alone",
                "compiles": n - failed,
                "of": n,
                "p50_ms": statistics.median(took),
                "max_ms": max(took),
                "attacker_refused": len(refused),
            }
        )
    return rows


def _attack(vocab: structured.Vocabulary, stop: threading.Event, refused: list[str]) -> None:
    """Slow grammars back to back, as one peer, until `stop`."""
    while not stop.is_set():
        try:
            vocab.compile("lark", hostile.lark_alternatives(40000), peer="attacker")
        except GrammarError as e:
            refused.append(str(e))


def measure(args: argparse.Namespace) -> dict:
    vocab = structured.Vocabulary.from_gguf(modelfiles.shipped_gguf())
    shapes = SHAPES[:2] if args.quick else SHAPES
    limits = [limit_row(kind, shape, sandbox.WORKER_STACK_BYTES, args.hi) for kind, shape in shapes]
    per_link = [r["stack_per_chain_kib"] for r in limits if "stack_per_chain_kib" in r]
    return {
        "limits": limits,
        "worst_kib": max(per_link, default=0.0),
        "cap_share": structured.MAX_REFERENCE_CHAIN * max(per_link, default=0.0) / (sandbox.WORKER_STACK_BYTES / 1024),
        "stack_mib": sandbox.WORKER_STACK_BYTES / 2**20,
        "cap": structured.MAX_REFERENCE_CHAIN,
        "cost": cost_rows(vocab, 4 if args.quick else 20),
        "fairness": fairness_rows(vocab, 3 if args.quick else 10),
        "draft": modelfiles.shipped_gguf().name,
        "deadline_ms": structured.COMPILE_TIMEOUT_S * 1e3,
    }


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hi", type=int, default=8000, help="the longest chain tried")
    ap.add_argument("--probe", nargs=4, metavar=("KIND", "SHAPE", "N", "STACK"), help=argparse.SUPPRESS)


REPORT = harness.Report(
    "compile_sandbox",
    "# A peer's grammar compiled in a worker process ({draft})",
    [
        harness.Table(
            "limits",
            [
                harness.Col("kind"),
                harness.Col("shape"),
                harness.Col("longest", "longest that compiles"),
                harness.Col("crashes_at", "crashes at"),
                harness.Col("chain", "its chain (structured.py)"),
                harness.Col("stack_per_chain_kib", "stack KiB a chain link", "{:.1f}"),
            ],
            title="## Where LLGuidance's compile overflows a {stack_mib:g} MiB stack",
            note="The worst link costs {worst_kib:.1f} KiB: MAX_REFERENCE_CHAIN = {cap} such links take "
            "{cap_share:.0%} of a worker's stack, and a quarter of that of the serving process's compile thread "
            "(4x a worker's).",
        ),
        harness.Table(
            "cost",
            [harness.Col("path"), harness.Col("ms", "median ms", "{:.2f}"), harness.Col("max_ms", "max ms", "{:.2f}")],
            title="## What the worker adds to a typical schema",
            note="A schema of four properties (an action and its parameters), new each time. A pool's workers start "
            "at its first grammar; one killed (a crash, its deadline) is started again in the background.",
        ),
        harness.Table(
            "fairness",
            [
                harness.Col("flood"),
                harness.Col("compiles"),
                harness.Col("of"),
                harness.Col("p50_ms", "p50 ms", "{:.1f}"),
                harness.Col("max_ms", "max ms", "{:.1f}"),
                harness.Col("attacker_refused", "attacker's grammars stopped"),
            ],
            title="## A robot's new small schemas while another peer floods 40,000-alternative grammars",
        ),
    ],
    [
        harness.Plot(
            "limits",
            x="shape",
            ys={"chain at the crash": "chain"},
            xlabel="",
            ylabel="chain (structured.py's measure)",
            kind="bar",
            title="Where a {stack_mib:g} MiB stack overflows; the cap (dotted) is {cap}",
            hline=structured.MAX_REFERENCE_CHAIN,
        ),
        harness.Plot(
            "fairness",
            x="flood",
            ys={"p50 ms": "p50_ms", "max ms": "max_ms"},
            xlabel="",
            ylabel="a robot's schema compile, ms",
            kind="bar",
            title="Beside a flood of slow grammars (deadline {deadline_ms:.0f} ms)",
        ),
    ],
)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--probe"]:
        kind, shape, n, stack = args[1:5]
        probe(kind, shape, int(n), int(stack))
        return 0
    return harness.main(__doc__, REPORT, measure, add_args, argv, out="bench_results/compile_sandbox", pin_cores=False)


if __name__ == "__main__":
    sys.exit(main())
