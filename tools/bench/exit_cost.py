"""What the early exits cost inside one verify pass (FSD), on the real target, on each engine.

    python -m tools.bench.exit_cost --out docs/exits [--engines llamacpp,torch] [--draft 4] [--cands 8] [--repeats 40]

The same verify pass (a k-token draft on a warm KV cache, rewound after each
run) is timed, interleaved so a busy machine hurts all alike:
- without exits (llamacpp: on an engine with no eval callback installed at all);
- llamacpp only: on the tapped engine with no exits asked for (what the callback
  costs a session that does not use exits);
- with every trained exit scoring only candidates (the draft's top-K plus the
  draft token), the draft accepted in full (the first exit that agrees pays one
  full-vocabulary row at the bonus position) and rejected at row 0;
- with every exit over the full vocabulary.
Separately: the bonus row's full head and one exit's candidate scoring.
The process is pinned to --cores with one thread. Medians in ms into
exit_cost.json, exit_cost.md and exit_cost.png.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from protocol import modelfiles
from server_bridge.exits import ExitConfig, ExitPass, NumpyExitHeads
from server_bridge.target import load_target
from tools.bench import harness


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _engine(name: str, layers: list[int], threads: int):
    """(plain target, tapped target, exit scorer, hidden [k + 1, H] maker) for one engine."""
    path = modelfiles.models_dir() / "exits" / modelfiles.DEFAULT_TARGET
    if name == "llamacpp":
        plain = load_target(threads=threads, max_sequences=4, kv_tokens=4096)
        tapped = load_target(threads=threads, max_sequences=4, kv_tokens=4096, tap_layers=layers)
        heads = NumpyExitHeads.load(path, tapped.engine.path, layers)
        return plain, tapped, heads, lambda n, h: np.random.default_rng(0).standard_normal((n, h)).astype(np.float32)
    import torch

    from server_bridge.engines.exits_torch import ExitHeads, TorchExitScorer

    torch.set_num_threads(threads)
    target = load_target(engine="torch", threads=threads, max_sequences=4, max_len=1024)
    heads = TorchExitScorer(
        ExitHeads.load(path, layers).to(target.engine.device, target.engine.dtype), target.engine.model
    )
    return target, target, heads, lambda n, h: torch.randn(n, h)


def measure(name: str, layers: list[int], args) -> dict:
    plain, target, heads, randn = _engine(name, layers, args.threads)
    prompt = target.tokenizer.encode("The robot walked to the kitchen door, stopped, and looked around for")
    states = {id(t): t.new_state(prompt) for t in {id(plain): plain, id(target): target}.values()}
    state = states[id(target)]
    # A draft the target accepts in full, with its own top-K as the candidates: what a good draft
    # model sends. Exits that agree with it reach the bonus row and pay its full head once per pass.
    draft, rows = [], []
    for _ in range(args.draft):
        logits = target.score(state, [])[0]  # [vocab]
        rows.append(np.argpartition(logits, -args.cands)[-args.cands :])
        draft.append(int(logits.argmax()))
        target.commit(state, draft[-1:], len(state.ids))
    target.rewind(state, prompt)
    cands = np.stack(rows).astype(np.int32)  # [k, K]
    wrong = [(draft[0] + 1) % target.vocab_size] + draft[1:]  # rejected at row 0: no exit reaches the bonus
    bonus: list[bool] = []  # did an exit reach the bonus row (and pay one full-head row)?

    def verify(on, exits: bool, cands_or_none: np.ndarray | None = None, tokens: list[int] = draft):
        """(ms of the whole pass, ms of its exits)."""
        s = states[id(on)]
        probe = ExitPass(heads, layers, tokens, cands_or_none) if exits else None
        t0 = time.perf_counter()
        on.score(s, tokens, taps=probe.taps if probe else None)
        ms = (time.perf_counter() - t0) * 1e3
        on.rewind(s, prompt)
        assert probe is None or not probe.failed
        if probe is not None and tokens is draft:
            bonus.append(probe.reached_bonus)
        return ms, probe.ms if probe else 0.0

    hidden = randn(args.draft + 1, heads.config.hidden)  # [k + 1, H]
    runs: dict[str, list[float]] = {}
    for i in range(args.repeats + 3):  # the first 3 warm up
        t = {"pass_off": verify(plain, False)[0]}
        if plain is not target:
            t["pass_callback_idle"] = verify(target, False)[0]
        t["pass_exits_cands"], t["exits_cands"] = verify(target, True, cands)
        t["pass_exits_cands_rejected_at_0"], t["exits_cands_rejected_at_0"] = verify(target, True, cands, wrong)
        t["pass_exits_full"], t["exits_full"] = verify(target, True, None)
        t["bonus_full_row"] = _ms(lambda: heads.logits(layers[-1], hidden[-1:]))
        t["one_exit_cands"] = _ms(lambda: heads.logits(layers[-1], hidden[:-1], cands.astype(np.int64)))
        if i >= 3:
            for k, v in t.items():
                runs.setdefault(k, []).append(v)
        if (i + 1) % 10 == 0:
            print(f"  {name}: {i + 1}/{args.repeats + 3} iterations", flush=True)
    med = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    med["passes_reaching_bonus_row"] = round(sum(bonus) / max(1, len(bonus)), 2)
    med["engine"] = target.engine.info.as_dict()
    return med


def labels(args: argparse.Namespace, n_exits: int) -> dict[str, tuple[str, str]]:
    """Each timed key: (its line in the table, its short label in the plot, or "" for none)."""
    return {
        "pass_off": ("pass without exits", "off"),
        "pass_callback_idle": ("pass, eval callback installed, no exits asked", "callback idle"),
        "pass_exits_cands": (
            f"pass with {n_exits} exits on K={args.cands} candidates, draft accepted",
            "exits (accepted)",
        ),
        "pass_exits_cands_rejected_at_0": ("same, draft rejected at row 0", "exits (rejected)"),
        "pass_exits_full": ("pass with the exits on the full vocabulary", "exits full vocab"),
        "exits_cands": ("  of it in the exits (accepted: one bonus full row)", ""),
        "exits_cands_rejected_at_0": ("  of it in the exits (rejected at row 0)", ""),
        "exits_full": ("  of it in the exits (full vocabulary)", ""),
        "bonus_full_row": ("the bonus row's full head (once per pass)", ""),
        "one_exit_cands": (f"one exit's candidate scoring, {args.draft} rows x {args.cands + 1}", ""),
    }


def summary(report: dict) -> list[str]:
    lines = []
    for e, r in report["engines"].items():
        lines += [
            f"- {e}: exits add {r['pass_exits_cands'] - r['pass_off']:+.1f} ms to a pass of "
            f"{r['pass_off']:.1f} ms when the draft is accepted, "
            f"{r['pass_exits_cands_rejected_at_0'] - r['pass_off']:+.1f} ms when it is rejected at once.",
            "",
        ]
    return lines


REPORT = harness.Report(
    "exit_cost",
    "# Early exits inside a verify pass ({target}, {draft}-token draft, exits at {exit_layers}, "
    "{threads} thread, cores {cores})",
    [
        harness.Table(
            "rows",
            [
                harness.Col("what", "ms (median)"),
                harness.Col("llamacpp", fmt="{:.1f}"),
                harness.Col("torch", fmt="{:.1f}"),
            ],
            note="Medians of {repeats} interleaved passes.",
        )
    ],
    harness.Plot(
        "rows",
        x="short",
        ys={"llamacpp": "llamacpp", "torch": "torch"},
        xlabel="",
        ylabel="verify pass ms (median)",
        title="Early exits in a {draft}-token verify pass, {threads} thread",
        kind="bar",
        where=lambda r: bool(r["short"]),
    ),
    extra=summary,
)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--engines", type=harness.names, default=["llamacpp", "torch"])
    ap.add_argument("--draft", type=int, default=4, help="draft tokens per verify pass")
    ap.add_argument("--cands", type=int, default=8, help="candidates per draft position (K)")
    ap.add_argument("--threads", type=int, default=1)


def measure_all(args: argparse.Namespace) -> dict:
    layers = ExitConfig.load(modelfiles.models_dir() / "exits" / modelfiles.DEFAULT_TARGET).layers
    report: dict = {
        "target": modelfiles.DEFAULT_TARGET,
        "draft": args.draft,
        "cands": args.cands,
        "exit_layers": layers,
        "threads": args.threads,
        "cores": args.cores,
        "repeats": args.repeats,
        "engines": {},
    }
    for name in args.engines:
        print(f"{name}: timing {args.repeats} interleaved passes of each kind", flush=True)
        r = report["engines"][name] = measure(name, layers, args)
        print(f"  {name}: pass {r['pass_off']} ms without exits, {r['pass_exits_cands']} ms with exits", flush=True)
    report["rows"] = [
        {"what": line, "short": short, **{e: r.get(key) for e, r in report["engines"].items()}}
        for key, (line, short) in labels(args, len(layers)).items()
    ]
    return report


def main(argv: list[str] | None = None) -> int:
    return harness.main(
        __doc__, REPORT, measure_all, add_args, argv, out="bench_results/exits", repeats=40, cores_default="1"
    )


if __name__ == "__main__":
    raise SystemExit(main())
