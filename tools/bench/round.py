"""What our round adds to the engine's pass: streamed AR through the real server against a bare llama.cpp loop.

On one pinned core with one thread, one after the other and repeated alternately:

  raw   llama.cpp alone, in a child process: the prompt but its last token decoded, then one
        `llama_decode` of one token per step and the argmax of its logits row (read in place), the
        loop any program on llama-cpp-python would run at the least;
  ours  `server-bridge serve` on the same core and thread (server_bridge/ops/fleet.py:LocalVerifier), the robot's
        client (agent.decoding.decoder, mode ar) on the other core: after the session's open (which
        prefills the same prompt but its last token), the `ar` request and its streamed tokens.

Both time the same steps: from the first decode of the prompt's last token to the last token out
(for ours, received by the robot). Each repeat gives both; the best of --repeats is kept for each
(and the medians set against each other beside it), and the ids are checked equal. ours/raw is the fraction of the
engine's speed the server keeps
(issue 26 aims at >= 0.9).

    python -m tools.bench.round --out bench_results/round      # ~2 min on the 2-core development machine

Writes round.json, round.md and round.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from tools.bench import harness

PROMPTS = ["Walk forward two meters and look around for a person wearing a hat.", "Describe the room in one sentence."]


def raw_child(model: str, prompt: list[int], tokens: int, core: int) -> dict:
    """Runs in its own process (pinned): the bare loop. Returns ids and the decode loop's seconds."""
    os.sched_setaffinity(0, {core})
    import ctypes

    import llama_cpp as L
    import numpy as np

    from server_bridge.engines.llamacpp import _quiet_llama

    _quiet_llama()
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = 0
    lm = L.llama_model_load_from_file(model.encode(), mparams)
    vocab = L.llama_model_get_vocab(lm)
    n_vocab = int(L.llama_vocab_n_tokens(vocab))
    cparams = L.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch = 4096, 2048
    cparams.n_threads = cparams.n_threads_batch = 1
    ctx = L.llama_init_from_model(lm, cparams)
    batch = L.llama_batch_init(2048, 0, 1)

    def decode(ids: list[int], start: int) -> None:
        batch.n_tokens = len(ids)
        for i, t in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(ids) - 1
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    seconds, out = 0.0, []
    for _ in range(2):  # a warm-up run, then the timed one (the last)
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        decode(prompt[:-1], 0)
        out, last, pos = [], prompt[-1], len(prompt) - 1
        t0 = time.perf_counter()
        for _ in range(tokens):
            decode([last], pos)
            row = np.ctypeslib.as_array(
                ctypes.cast(L.llama_get_logits_ith(ctx, -1), ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)
            )
            last, pos = int(row.argmax()), pos + 1
            out.append(last)
            if L.llama_vocab_is_eog(vocab, last):  # where the server's stream stops too
                break
        seconds = time.perf_counter() - t0
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(lm)
    return {"ids": out, "seconds": seconds, "ms_per_token": 1e3 * seconds / len(out)}


def raw(model: str, prompt: list[int], tokens: int, core: int) -> dict:
    code = (
        "import json, sys; from tools.bench.round import raw_child; "
        f"print(json.dumps(raw_child({model!r}, {prompt!r}, {tokens}, {core})))"
    )
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ours(decoder, prompt: list[int], tokens: int) -> dict:
    gen = decoder.generate(prompt, mode="ar", max_tokens=tokens)
    m = gen.metrics
    n = len(gen.token_ids)
    return {
        "ids": list(gen.token_ids),
        "seconds": (m.verify_ms + m.network_ms) / 1e3,
        "ms_per_token": (m.verify_ms + m.network_ms) / n,
        "pass_ms_per_token": m.verify_ms / n,
    }


def _median(runs: list[dict]) -> float:
    return statistics.median(x["ms_per_token"] for x in runs)


REPORT = harness.Report(
    "round",
    "# Streamed AR through our server against raw llama.cpp ({target})",
    [
        harness.Table(
            "rows",
            [
                harness.Col("prompt_tokens", "prompt tokens"),
                harness.Col("tokens"),
                harness.Col("raw_ms_per_token", "raw llama.cpp ms/token", "{:.2f}"),
                harness.Col("ours_ms_per_token", "ours ms/token", "{:.2f}"),
                harness.Col("ours_pass_ms_per_token", "our pass ms/token", "{:.2f}"),
                harness.Col("ratio", "ours/raw", "{:.3f}"),
                harness.Col("ratio_of_medians", "ours/raw, medians", "{:.3f}"),
            ],
            "Best of the repeats for each; the last column sets the medians against each other.",
        )
    ],
    harness.Plot(
        "rows",
        x="label",
        ys={"raw llama.cpp": "raw_ms_per_token", "ours (streamed AR)": "ours_ms_per_token"},
        xlabel="",
        ylabel="ms per token",
        title="One token: our round against the bare loop ({target})",
        kind="bar",
    ),
)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--target", default=None, help="default: the shipped smollm2-f32")


def one_prompt(decoder, model: str, prompt: list[int], args: argparse.Namespace, core: int) -> dict:
    """--repeats of raw and ours, alternately; the best of each and the ratio of the medians."""
    runs: dict[str, list[dict]] = {"raw": [], "ours": []}
    for r in range(args.repeats):
        runs["raw"].append(raw(model, prompt, args.tokens, core))
        runs["ours"].append(ours(decoder, prompt, args.tokens))
        print(
            f"  repeat {r}: raw {runs['raw'][-1]['ms_per_token']:.2f} ms/token, "
            f"ours {runs['ours'][-1]['ms_per_token']:.2f} ms/token",
            flush=True,
        )
    for x in runs["raw"] + runs["ours"]:
        harness.check_exact("our AR against raw llama.cpp's greedy loop", x["ids"], runs["raw"][0]["ids"])
    raw_best = min(runs["raw"], key=lambda x: x["ms_per_token"])
    ours_best = min(runs["ours"], key=lambda x: x["ms_per_token"])
    return {
        "prompt_tokens": len(prompt),
        "tokens": len(raw_best["ids"]),
        "raw_ms_per_token": round(raw_best["ms_per_token"], 3),
        "ours_ms_per_token": round(ours_best["ms_per_token"], 3),
        "ours_pass_ms_per_token": round(ours_best["pass_ms_per_token"], 3),
        "ratio": round(raw_best["ms_per_token"] / ours_best["ms_per_token"], 3),
        "ratio_of_medians": round(_median(runs["raw"]) / _median(runs["ours"]), 3),
        "same_ids": True,
    }


def measure(args: argparse.Namespace) -> dict:
    from agent.decoding import DecoderSettings, open_decoder
    from protocol import modelfiles
    from server_bridge.engines.llamacpp import prepare_target
    from server_bridge.ops.fleet import LocalVerifier

    target = args.target or modelfiles.DEFAULT_TARGET
    if target in modelfiles.TARGETS:
        prepare_target(target)
    model = str(modelfiles.resolve_target(target))
    core = args.cores[0] if args.cores else 1
    robot_core = harness.other_core(core)
    drafter = open_decoder(DecoderSettings(threads=1)).drafter
    prompts = [drafter.tokenize(p, chat=True) for p in PROMPTS[: 1 if args.quick else None]]
    rows = []
    with LocalVerifier(target=args.target, cpus={core}, threads=1) as server:
        harness.pin({robot_core})
        decoder = open_decoder(DecoderSettings(verifier=server.url), drafter)
        decoder.generate(prompts[0], mode="ar", max_tokens=4)  # warm-up
        for i, prompt in enumerate(prompts):
            row = {"prompt": PROMPTS[i], "label": f"prompt {i} ({len(prompt)} tok)"}
            rows.append(row | one_prompt(decoder, model, prompt, args, core))
            print(f"prompt {i}: ours/raw {rows[-1]['ratio']:.3f}", flush=True)
    return {
        "target": target,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, engine core {core}, robot core {robot_core}, "
        "1 thread",
        "rows": rows,
        "ratio_min": min(r["ratio"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    # measure pins itself: the server to --cores, the robot to another core
    return harness.main(
        __doc__, REPORT, measure, add_args, argv, out="bench_results/round", cores_default="1", pin_cores=False
    )


if __name__ == "__main__":
    sys.exit(main())
