"""Record replayable draft traces for the load generator (tools/bench/loadgen.py).

    python -m tools.train.record_traces [--drafts smollm2-q4_1,smollm2-q2_k] [--prompts 10]
                                  [--max-tokens 64] [--gamma-max 8] [--out tools/traces]

For every bench prompt (tools/prompts/bench.jsonl, chat-templated by the draft's
own GGUF template as tools/bench/decoding.py does) this records the TARGET's greedy
continuation (T = 0, up to --max-tokens, ending early at an EOS, which is kept)
and, at every position i of it, the DRAFT's greedy chain of --gamma-max tokens
after prompt + target[:i]. At T = 0 that is all a simulated robot needs: as long
as its committed text is the target's, its next draft is chains[i][:gamma],
without loading a model.

One file per pair, tools/traces/<draft>__<target>.json, ints only:

    {"format": "edgespec-trace/1", "draft", "target", "vocab_hash", "vocab_size",
     "eos_ids", "gamma_max", "max_tokens", "prompts_file",
     "prompts": [{"index", "category",
                  "prompt_ids": [...],           # the chat-templated prompt
                  "target_ids": [...],           # [n] the target's greedy continuation
                  "chains": [[...] * n]}]}       # [n, gamma_max] the draft's greedy chain at each position

The target runs here directly (server_bridge.target.Target on the default engine, one token per
forward pass on a warm KV cache), the draft through agent.decoding.drafter.Drafter.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.drafter import Drafter
from protocol.sampling import SamplingParams
from tools.bench.decoding import load_prompts

FORMAT = "edgespec-trace/1"
TARGET = "smollm2-f32"
TRACES = Path(__file__).resolve().parents[1] / "traces"
GREEDY = SamplingParams(0.0)


def trace_path(out: Path, draft: str, target: str = TARGET) -> Path:
    return Path(out) / f"{draft}__{target}.json"


def target_greedy(target, prompt_ids: list[int], n: int, eos: set[int]) -> list[int]:
    """Up to n greedy target tokens after prompt_ids; an EOS ends it (and is kept)."""
    state = target.new_state(prompt_ids)
    out: list[int] = []
    for _ in range(n):
        token = int(np.argmax(target.score(state, [])[0]))  # logits [1, V] -> the argmax
        target.commit(state, [token], len(state.ids))
        out.append(token)
        if token in eos:
            break
    return out


def draft_chains(drafter: Drafter, prompt_ids: list[int], target_ids: list[int], gamma: int) -> list[list[int]]:
    """[len(target_ids), gamma]: the draft's greedy chain after prompt + target[:i], for every i."""
    rng = np.random.default_rng(0)  # unused at T = 0
    return [drafter.propose(prompt_ids + target_ids[:i], gamma, GREEDY, rng).ids for i in range(len(target_ids))]


def agreement(target_ids: list[int], chains: list[list[int]]) -> float:
    """Share of positions whose first draft token is the target's (the greedy acceptance of one token)."""
    return float(np.mean([c[0] == t for c, t in zip(chains, target_ids, strict=True)])) if chains else 0.0


def dump(trace: dict) -> str:
    """JSON with one prompt per line: small, and a diff shows which prompt changed."""
    head = {k: v for k, v in trace.items() if k != "prompts"}
    lines = [json.dumps(p, separators=(",", ":")) for p in trace["prompts"]]
    return json.dumps(head, indent=1)[:-2] + ',\n "prompts": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", default="smollm2-q4_1,smollm2-q2_k")
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--prompts", type=int, default=10, help="the first N bench prompts")
    ap.add_argument("--max-tokens", type=int, default=64, help="target tokens per prompt")
    ap.add_argument("--gamma-max", type=int, default=8, help="draft chain length recorded at each position")
    ap.add_argument("--threads", type=int, default=1, help="torch threads and llama.cpp threads")
    ap.add_argument("--out", default=str(TRACES))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from server_bridge.target import load_target

    drafts = args.drafts.split(",")
    prompts = load_prompts(args.prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    target = load_target(args.target, threads=args.threads, max_sequences=4, kv_tokens=8192)
    drafters = {d: open_decoder(DecoderSettings(draft=d, threads=args.threads)).drafter for d in drafts}
    first = drafters[drafts[0]]
    for d, dr in drafters.items():
        if dr.vocab_hash != target.vocab_hash or dr.vocab_size != target.vocab_size:
            raise SystemExit(f"draft {d}'s vocabulary differs from the target {target.name}'s")
    print(
        f"record: {len(prompts)} prompts x {args.max_tokens} target tokens, chains of {args.gamma_max} from "
        f"{drafts}; models loaded in {time.perf_counter() - t0:.0f}s",
        flush=True,
    )

    eos = set(target.eos_ids) | first.eos_ids
    rows = []
    for i, p in enumerate(prompts):
        ids = first.tokenize(p["prompt"], chat=p["chat"] and bool(first.chat_template))
        t1 = time.perf_counter()
        tgt = target_greedy(target, ids, args.max_tokens, eos)
        rows.append({"index": i, "category": p["category"], "prompt_ids": ids, "target_ids": tgt})
        print(
            f"[{i + 1}/{len(prompts)}] target: prompt of {len(ids)} tokens -> {len(tgt)} tokens in "
            f"{time.perf_counter() - t1:.1f}s",
            flush=True,
        )

    for d, dr in drafters.items():
        trace = {
            "format": FORMAT,
            "draft": d,
            "target": target.name,
            "vocab_hash": target.vocab_hash,
            "vocab_size": target.vocab_size,
            "eos_ids": sorted(eos),
            "gamma_max": args.gamma_max,
            "max_tokens": args.max_tokens,
            "prompts_file": "tools/prompts/bench.jsonl",
            "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
            "prompts": [],
        }
        for row in rows:
            t1 = time.perf_counter()
            chains = draft_chains(dr, row["prompt_ids"], row["target_ids"], args.gamma_max)
            trace["prompts"].append({**row, "chains": chains})
            print(
                f"{d} [{row['index'] + 1}/{len(rows)}] {len(chains)} chains in {time.perf_counter() - t1:.1f}s, "
                f"first-token agreement {agreement(row['target_ids'], chains):.2f}",
                flush=True,
            )
        path = trace_path(out, d, target.name)
        path.write_text(dump(trace))
        total = agreement(
            [t for r in trace["prompts"] for t in r["target_ids"]], [c for r in trace["prompts"] for c in r["chains"]]
        )
        print(
            f"{d}: wrote {path} ({path.stat().st_size / 1024:.0f} KiB), first-token agreement {total:.3f}", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
