"""What a verification pass costs on each engine, side by side in one run, pinned to one core.

  1. The grid: pass time against new tokens per session (1, 2, 4, 8) and sessions per pass
     (1, 2, 4, 8, 16), each session on a warm cache of --cache tokens, for llamacpp and torch.
     The engines alternate point by point, so machine noise falls on both alike.
  2. Our whole round on llamacpp (verify frames decoded, Verifier.run_batch, result frames encoded)
     against a bare `llama_decode` of the same batch: the overhead the verifier adds.
  3. Early exits on llamacpp: the same pass without an eval callback, with the callback installed
     but nothing tapped, and with four exits tapped (rows read out each pass).

    python -m tools.bench.engine --out docs/engine      # ~3 min on the 2-core development machine

Writes engine.json, engine.md and engine.png. Timings are medians of --repeats passes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from protocol import wire
from server_bridge.config import ServerConfig
from server_bridge.requests import VerifyRequest
from server_bridge.target import Extension, load_target
from server_bridge.verifier import Verifier
from tools.bench import harness

TOKENS = (1, 2, 4, 8)
SESSIONS = (1, 2, 4, 8, 16)
EXITS = [12, 18, 22, 26]


class Warm:
    """n sessions of one target, each with a cache of `cache` tokens, ready for k-token passes."""

    def __init__(self, target, n: int, cache: int, rng: np.random.Generator):
        self.target = target
        prompt = [int(t) for t in rng.integers(100, 40_000, cache + 1)]
        self.states = [target.new_state(prompt) for _ in range(n)]

    def batch(self, sessions: int, k: int, taps=None) -> list[Extension]:
        # one pending committed token and k - 1 draft tokens: k new rows, all kept (a verify pass)
        return [
            Extension(s, s.ids[s.cached :] + [300 + j for j in range(k - 1)], k, taps) for s in self.states[:sessions]
        ]

    def pass_ms(self, sessions: int, k: int, iters: int, taps=None) -> float:
        return harness.median_ms(lambda: self.target.extend(self.batch(sessions, k, taps)), iters)


def grid(targets: dict, cache: int, iters: int, rng) -> list[dict]:
    warm = {name: Warm(t, max(SESSIONS), cache, rng) for name, t in targets.items()}
    rows = []
    for n in SESSIONS:
        for k in TOKENS:
            row = {"sessions": n, "tokens": k}
            for name in targets:  # alternate engines point by point
                row[name] = round(warm[name].pass_ms(n, k, iters), 2)
            row["torch_over_llamacpp"] = row["torch"] / row["llamacpp"]
            rows.append(row)
            print(f"  {n:2d} sessions x {k} tokens: " + ", ".join(f"{e} {row[e]:.1f} ms" for e in targets), flush=True)
    return rows


def bare_decode_ms(target, batch: list[Extension], iters: int) -> float:
    """The same batch as one llama_decode, filled in advance; only the call is timed."""
    from server_bridge.engines import Pass

    engine = target.engine
    passes = [Pass(e.state.seq, e.state.cached, list(e.new_ids), e.keep) for e in batch]
    flat = [(p, j) for p in passes for j in range(len(p.new_ids))]
    times = []
    for _ in range(iters + 1):
        for e in batch:
            engine.truncate(e.state.seq, e.state.cached)
        engine.fill_batch(flat)  # the engine's own batch filling, untimed
        t0 = time.perf_counter()
        if engine.L.llama_decode(engine.ctx, engine.batch) != 0:
            raise RuntimeError("llama_decode failed")
        times.append(time.perf_counter() - t0)
        for e in batch:  # the engine did not see this pass: undo it
            engine.L.llama_memory_seq_rm(engine.mem, e.state.seq.id, e.state.cached, -1)
    return 1e3 * statistics.median(times[1:])


def round_overhead(target, cache: int, iters: int, rng) -> list[dict]:
    """Whole verify rounds (frames in, verdicts, frames out) against a bare llama_decode of the batch."""
    verifier = Verifier(target, ServerConfig(exits=""))
    prompt = [int(t) for t in rng.integers(100, 40_000, cache + 1)]
    rows = []
    for n in (1, 4, 16):
        sessions = [
            verifier.open(
                wire.Open(
                    f"s{i}", prompt, {"temperature": 0.0, "top_k": 0, "seed": 0}, payload={"kind": "none", "k": 0}
                ),
                1,
                None,
            )[0]
            for i in range(n)
        ]
        k = 4
        greedy = [
            int(x)
            for x in target.argmax(
                target.extend([Extension(sessions[0].state, prompt[sessions[0].state.cached :], 1)])[0]
            )
        ]
        draft = [greedy[0]] * k  # a draft the target mostly rejects: a short commit

        def one_round(sessions: list = sessions, draft: list[int] = draft) -> None:
            frames = [wire.encode(wire.Verify(s.sid, 0, len(s.state.ids), draft, {"kind": "none"})) for s in sessions]
            jobs = [VerifyRequest(s, wire.decode(f)) for f, s in zip(frames, sessions, strict=True)]
            results, _, _ = verifier.run_batch(jobs)
            for s, out in zip(sessions, results, strict=True):
                wire.encode(
                    wire.Result(s.sid, 0, out.verdict.accepted, out.verdict.token, len(s.state.ids), out.timing())
                )
            for s in sessions:  # back to the same prefix for the next repetition
                target.rewind(s.state, prompt)

        ours = harness.median_ms(one_round, iters)
        batch = [Extension(s.state, s.state.ids[s.state.cached :] + draft, k + 1) for s in sessions]
        bare = bare_decode_ms(target, batch, iters)
        rows.append(
            {
                "sessions": n,
                "draft": k,
                "round_ms": round(ours, 2),
                "bare_decode_ms": round(bare, 2),
                "overhead_pct": round(100 * (ours / bare - 1), 1),
            }
        )
        print(
            f"  round of {n} sessions x {k}: ours {ours:.1f} ms, bare llama_decode {bare:.1f} ms "
            f"({rows[-1]['overhead_pct']:+.1f} %)",
            flush=True,
        )
        sessions.clear()
    return rows


def callback_cost(cache: int, iters: int, rng) -> list[dict]:
    plain = load_target(threads=1, max_sequences=4, kv_tokens=4096)
    hooked = load_target(threads=1, max_sequences=4, kv_tokens=4096, tap_layers=EXITS)
    w_plain, w_hooked = Warm(plain, 1, cache, rng), Warm(hooked, 1, cache, rng)
    read = {l: (lambda h: None) for l in EXITS}
    rows = []
    for k in (1, 5):
        row = {
            "tokens": k,
            "no_callback": w_plain.pass_ms(1, k, iters),
            "callback_untapped": w_hooked.pass_ms(1, k, iters),
            "callback_4_exits": w_hooked.pass_ms(1, k, iters, taps=read),
        }
        rows.append({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()})
        print(
            f"  {k}-token pass: no callback {row['no_callback']:.1f} ms, callback installed "
            f"{row['callback_untapped']:.1f} ms, 4 exits read {row['callback_4_exits']:.1f} ms",
            flush=True,
        )
    return rows


REPORT = harness.Report(
    "engine",
    "# Verification pass cost per engine ({target}, 1 thread, cores {cores})",
    [
        harness.Table(
            "grid",
            [
                harness.Col("sessions"),
                harness.Col("tokens", "new tokens each"),
                harness.Col("llamacpp", fmt="{:.1f}"),
                harness.Col("torch", fmt="{:.1f}"),
                harness.Col("torch_over_llamacpp", "torch / llamacpp", "{:.2f}x"),
            ],
            "## Pass time (ms, median), warm caches of {cache} tokens",
        ),
        harness.Table(
            "round_overhead",
            [
                harness.Col("sessions"),
                harness.Col("draft"),
                harness.Col("round_ms", "round ms", "{:.1f}"),
                harness.Col("bare_decode_ms", "bare llama_decode ms", "{:.1f}"),
                harness.Col("overhead_pct", "overhead", "{:+.1f} %"),
            ],
            "## Our whole round against a bare llama_decode of the same batch (llamacpp)",
        ),
        harness.Table(
            "callback",
            [
                harness.Col("tokens", "new tokens"),
                harness.Col("no_callback", "no callback ms", "{:.1f}"),
                harness.Col("callback_untapped", "callback, nothing tapped ms", "{:.1f}"),
                harness.Col("callback_4_exits", "callback, 4 exits read ms", "{:.1f}"),
            ],
            "## The eval callback that early exits would need on llamacpp (one session)",
        ),
    ],
    harness.Plot(
        "grid",
        x="sessions",
        ys={"llamacpp": "llamacpp", "torch": "torch"},
        group="tokens",
        xlabel="sessions per pass",
        ylabel="pass time (ms)",
        title="{target}: one pass, 1 thread, warm caches of {cache}",
        where=lambda r: r["tokens"] in (1, 4),
    ),
)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--cache", type=int, default=45, help="cached tokens per session")


def measure(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    print("loading both engines (1 thread each)", flush=True)
    targets = {
        "llamacpp": load_target(threads=1, max_sequences=24, kv_tokens=8192),
        "torch": load_target(engine="torch", threads=1, max_sequences=24, max_len=256),
    }
    print("pass time against sessions and tokens", flush=True)
    result = {
        "target": targets["llamacpp"].name,
        "cores": args.cores,
        "cache": args.cache,
        "engines": {n: t.engine.info.as_dict() for n, t in targets.items()},
        "grid": grid(targets, args.cache, args.repeats, rng),
    }
    print("our round against a bare llama_decode", flush=True)
    result["round_overhead"] = round_overhead(targets["llamacpp"], args.cache, args.repeats, rng)
    del targets
    print("the eval callback's cost", flush=True)
    result["callback"] = callback_cost(args.cache, args.repeats, rng)
    return result


def main(argv: list[str] | None = None) -> int:
    return harness.main(
        __doc__, REPORT, measure, add_args, argv, out="bench_results/engine", repeats=15, cores_default="1"
    )


if __name__ == "__main__":
    sys.exit(main())
