"""What the early exits cost inside one verify pass (FSD), on the real target.

    python -m tools.exit_cost [--draft 4] [--cands 8] [--iters 40] [--threads 1]

The same verify pass (a k-token draft on a warm KV cache, rewound after each
run) is timed three ways, interleaved so a busy machine hurts all alike:
without exits, with every trained exit scoring only candidates (the draft's
top-K stand-ins plus the draft token), and with every exit over the full
vocabulary. Separately: the one full-vocabulary row of the bonus position
(what the first exit reaching it pays once per pass) and the candidate
scoring of one exit. Medians in ms; the figures quoted in
server_bridge/exits.py come from this tool.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from protocol import modelfiles
from server_bridge.exits import ExitHeads, ExitPass
from server_bridge.target import load_target


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", type=int, default=4, help="draft tokens per verify pass")
    ap.add_argument("--cands", type=int, default=8, help="candidates per draft position (K)")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)

    target = load_target(engine="torch", threads=args.threads, max_sequences=4, max_len=1024)   # exits: torch
    torch.set_num_threads(args.threads)
    heads = ExitHeads.load(modelfiles.models_dir() / "exits" / target.name)
    prompt = target.tokenizer.encode("The robot walked to the kitchen door, stopped, and looked around for")
    state = target.new_state(prompt)
    # A draft the target accepts in full, with its own top-K as the candidates: what a good draft
    # model sends. Exits that agree with it reach the bonus row and pay its full head once per pass.
    draft, rows = [], []
    for _ in range(args.draft):
        logits = target.score(state, [])[0]                                       # [vocab]
        rows.append(np.argpartition(logits, -args.cands)[-args.cands:])
        draft.append(int(logits.argmax()))
        target.commit(state, draft[-1:], len(state.ids))
    target.rewind(state, prompt)
    cands = np.stack(rows).astype(np.int32)                                        # [k, K]

    wrong = [(draft[0] + 1) % target.vocab_size] + draft[1:]     # rejected at row 0: no exit reaches the bonus
    bonus: list[bool] = []                  # did an exit reach the bonus row (and pay one full-head row)?

    def verify(exits: bool, cands_or_none: np.ndarray | None = None, tokens: list[int] = draft) -> tuple[float, float]:
        """(ms of the whole pass, ms of its exits)."""
        probe = ExitPass(heads, target.engine.model, heads.layers, tokens, cands_or_none) if exits else None
        t0 = time.perf_counter()
        target.score(state, tokens, taps=probe.taps if probe else None)
        ms = (time.perf_counter() - t0) * 1e3
        target.rewind(state, prompt)
        assert probe is None or not probe.failed
        if probe is not None and tokens is draft:
            bonus.append(probe.reached_bonus)
        return ms, probe.ms if probe else 0.0

    hidden = torch.randn(args.draft + 1, target.engine.hidden_size)        # [k + 1, hidden]
    cand_rows = torch.from_numpy(cands.astype(np.int64))                          # [k, K]
    runs: dict[str, list[float]] = {}
    with torch.inference_mode():
        for i in range(args.iters + 3):                         # the first 3 warm up
            t = {"pass_off": verify(False)[0]}
            t["pass_exits_cands"], t["exits_cands"] = verify(True, cands)
            t["exits_cands_rejected_at_0"] = verify(True, cands, wrong)[1]
            t["pass_exits_full"], t["exits_full"] = verify(True, None)
            t["bonus_full_row"] = _ms(lambda: heads.logits(target.engine.model, heads.layers[-1], hidden[-1:]))
            t["one_exit_cands"] = _ms(lambda: heads.logits(target.engine.model, heads.layers[-1], hidden[:-1], cand_rows))
            if i >= 3:
                for k, v in t.items():
                    runs.setdefault(k, []).append(v)
    med = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    report = {"draft": args.draft, "cands": args.cands, "exit_layers": heads.layers, "threads": args.threads,
              "iters": args.iters, "median_ms": med,
              "passes_reaching_bonus_row": round(sum(bonus) / max(1, len(bonus)), 2)}
    print(json.dumps(report, indent=1))
    print(f"verify pass of {args.draft} draft tokens: {med['pass_off']} ms without exits, "
          f"{med['pass_exits_cands']} ms with {len(heads.layers)} exits on K={args.cands} candidates "
          f"(exits {med['exits_cands']} ms; {med['exits_cands_rejected_at_0']} ms when they reject at once), "
          f"{med['pass_exits_full']} ms with full-vocabulary exits "
          f"(exits {med['exits_full']} ms); bonus row full head {med['bonus_full_row']} ms; "
          f"one exit on candidates {med['one_exit_cands']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
