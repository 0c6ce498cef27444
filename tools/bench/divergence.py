"""Where a verify pass and a one-token pass round differently, per engine and dtype, and whether each
divergence is a near-tie.

    python -m tools.bench.divergence --out docs/divergence \
        [--configs llamacpp,torch:float32,torch:bfloat16:plain,torch:bfloat16,torch:float16:plain,torch:float16]
                               [--prompts 6] [--tokens 48] [--gamma 4] [--device cpu]

Exactness at T = 0 means SD commits the target's own greedy ids. But "the target's greedy
id" is computed by floating-point passes whose rounding depends on the batch: a one-token
AR pass, a verify pass of gamma + 1 rows, and a pass shared with other sessions sum in
different orders (and on a GPU pick different kernels). Where the top two logits are
closer than that rounding, AR and SD may pick different ids. A torch config `torch:<dtype>` runs
the engine's default (batch-invariant wherever the dtype is not float32:
server_bridge/engines/invariant_torch.py), `torch:<dtype>:plain` with that mode off and
`torch:<dtype>:invariant` with it on: a row per mode. For each configuration this tool runs, on
the benchmark prompts (the loadgen trace's chat-templated ids):

- AR: one token per pass, greedy: the reference ids and every row's logits;
- SD solo: verify passes whose draft is AR's own next gamma ids (so every pass is a full
  gamma + 1 rows), one session per pass;
- SD batched: the same with every prompt's session in one pass per round.

At each position both compute, it records how far the rows are apart (max |logit
difference|: the rounding noise of that configuration) and, at the first position where
the argmax differs (a divergence; that prompt stops there), the margin between the top two
logits in both rows and the dtype's resolution at that logit (one ulp). A divergence is a
near-tie when the AR row's top-two margin is within the rounding noise measured in the
same run. Writes divergence.json, divergence.md and divergence.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from server_bridge.target import Extension, load_target
from tools.logit_margin import top2

MANTISSA = {"float32": 23, "bfloat16": 7, "float16": 10}


def ulp(x: float, dtype: str) -> float:
    """One unit in the last place of |x| in dtype (the spacing of representable numbers there)."""
    x = abs(float(x))
    if x == 0.0:
        return 0.0
    return 2.0 ** (math.floor(math.log2(x)) - MANTISSA[dtype])


def ar_reference(target, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[np.ndarray]]]:
    """Per prompt: the greedy ids of one-token passes and each pass's logits row [vocab]."""
    out = []
    for ids in prompts:
        state = target.new_state(ids)
        toks, rows = [], []
        for _ in range(n):
            row = np.asarray(target.score(state, [])[0], np.float64)
            toks.append(int(row.argmax()))
            rows.append(row)
            target.commit(state, toks[-1:], len(state.ids))
        out.append((toks, rows))
    return out


def sd_against(target, prompts: list[list[int]], ref, n: int, gamma: int, batched: bool, dtype: str) -> dict:
    """Verify passes whose drafts are AR's own ids; the rounding noise and every divergence from AR."""
    states = [target.new_state(ids) for ids in prompts]
    pos = [0] * len(prompts)
    live = set(range(len(prompts)))
    noise: list[float] = []
    divergences, compared = [], 0
    while live:
        order = sorted(live)
        groups = [order] if batched else [[i] for i in order]
        for group in groups:
            drafts = {i: ref[i][0][pos[i] : min(pos[i] + gamma, n - 1)] for i in group}
            exts = [
                Extension(states[i], states[i].ids[states[i].cached :] + drafts[i], len(drafts[i]) + 1) for i in group
            ]
            rows_all = target.extend(exts)
            for i, rows in zip(group, rows_all, strict=True):
                rows = np.asarray(target.to_numpy(rows), np.float64)  # [k + 1, vocab]
                d = drafts[i]
                for j in range(len(d) + 1):
                    at = pos[i] + j
                    if at >= n:
                        break
                    ar_row = ref[i][1][at]
                    compared += 1
                    noise.append(float(np.abs(rows[j] - ar_row).max()))
                    if int(rows[j].argmax()) != ref[i][0][at]:
                        a_best, a_second, a_logit, a_margin = top2(ar_row)
                        s_best, s_second, _, s_margin = top2(rows[j])
                        divergences.append(
                            {
                                "prompt": i,
                                "position": at,
                                "ar_id": a_best,
                                "sd_id": int(rows[j].argmax()),
                                "ar_top2": [a_best, a_second],
                                "ar_margin": a_margin,
                                "sd_top2": [s_best, s_second],
                                "sd_margin": s_margin,
                                "row_noise": noise[-1],
                                "logit": a_logit,
                                "ulp": ulp(a_logit, dtype),
                                "margin_ulps": a_margin / ulp(a_logit, dtype),
                            }
                        )
                        live.discard(i)
                        break
                if i not in live:
                    continue
                k = len(d)
                bonus = int(rows[k].argmax())
                target.commit(states[i], d + [bonus], len(states[i].ids) + k)
                pos[i] += k + 1
                if pos[i] >= n:
                    live.discard(i)
    noise_arr = np.array(noise) if noise else np.zeros(1)
    for dv in divergences:
        dv["near_tie"] = dv["ar_margin"] <= float(noise_arr.max())
    return {
        "compared": compared,
        "divergences": divergences,
        "noise_max": float(noise_arr.max()),
        "noise_median": float(np.median(noise_arr)),
        "noise_p99": float(np.quantile(noise_arr, 0.99)),
    }


def configure(spec: str, device: str, sessions: int, target: str | None = None, torch_target: str | None = None):
    """'llamacpp' or 'torch:<dtype>' -> (label, target, the logits' working dtype). `target`: the llamacpp
    engine's GGUF (default the shipped target); `torch_target`: the torch engine's (default `target`)."""
    if spec in ("llamacpp", "llamacpp:invariant"):
        invariant = spec.endswith("invariant")  # one token a micro-batch: the one-token pass's kernels, every row
        return (
            "llamacpp float32 (f16 KV)" + (", batch-invariant" if invariant else ""),
            load_target(
                target,
                threads=1,
                max_sequences=2 * sessions,
                kv_tokens=8192,
                batch_invariant="on" if invariant else "off",
            ),
            "float32",
        )
    _, dtype, *mode = spec.split(":")
    invariant = {"plain": "off", "invariant": "on"}[mode[0]] if mode else "auto"
    loaded = load_target(
        torch_target or target,
        engine="torch",
        device=device,
        dtype=dtype,
        threads=1,
        max_sequences=2 * sessions,
        max_len=1024,
        batch_invariant=invariant,
    )
    how = "batch-invariant" if loaded.engine.info.extra.get("batch_invariant") else "plain"
    return f"torch {dtype} {how} ({loaded.engine.info.device})", loaded, dtype


def one_config(spec: str, args, prompts: list[list[int]]) -> dict:
    """AR reference, then SD solo and batched against it, for one engine and dtype."""
    label, target, dtype = configure(spec, args.device, len(prompts), args.target, args.torch_target)
    print(f"{label}: AR reference", flush=True)
    t0 = time.perf_counter()
    ref = ar_reference(target, prompts, args.tokens)
    ar_ms = (time.perf_counter() - t0) * 1e3 / (len(prompts) * args.tokens)
    c = {"spec": spec, "label": label, "dtype": dtype, "ar_ms_per_token": ar_ms, "engine": target.engine.info.as_dict()}
    for mode in ("solo", "batched"):
        c[mode] = sd_against(target, prompts, ref, args.tokens, args.gamma, mode == "batched", dtype)
        r = c[mode]
        print(
            f"  SD {mode}: {len(r['divergences'])} divergences in {r['compared']} positions, rounding noise "
            f"max {r['noise_max']:.3g}"
            + "".join(
                f"; at prompt {d['prompt']} pos {d['position']}: top-2 margin "
                f"{d['ar_margin']:.3g} ({d['margin_ulps']:.2g} ulp)"
                for d in r["divergences"]
            ),
            flush=True,
        )
    return c


def _in_child(spec: str, args) -> dict:
    """one_config in a fresh interpreter (`--only SPEC --result FILE`); its JSON back."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "config.json"
        cmd = [
            sys.executable,
            "-m",
            "tools.bench.divergence",
            "--only",
            spec,
            "--result",
            str(result),
            "--prompts",
            str(args.prompts),
            "--tokens",
            str(args.tokens),
            "--gamma",
            str(args.gamma),
            "--device",
            args.device,
            *(["--target", args.target] if args.target else []),
            *(["--torch-target", args.torch_target] if args.torch_target else []),
            "--core",
            str(args.core),
        ]
        rc = subprocess.run(cmd).returncode
        if rc != 0 or not result.exists():
            raise RuntimeError(f"the {spec} run failed (exit code {rc}): {' '.join(cmd)}")
        return json.loads(result.read_text())


def markdown(report: dict) -> str:
    lines = [
        f"# Verify passes against one-token passes at T = 0 ({report['target']})",
        "",
        f"`{report['command']}`",
        "",
        f"{report['prompts']} benchmark prompts x {report['tokens']} tokens, drafts of gamma {report['gamma']} "
        "taken from AR's own ids (every verify pass is full); 1 thread.",
        "",
        "| engine, dtype | SD | positions compared | divergences | all near-ties | rounding noise: median / "
        "p99 / max abs logit diff | divergence margins (top-2, logits; ulps) | AR ms/token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in report["configs"]:
        for mode in ("solo", "batched"):
            r = c[mode]
            margins = ", ".join(f"{d['ar_margin']:.3g} ({d['margin_ulps']:.2g})" for d in r["divergences"]) or "-"
            ties = "yes" if all(d["near_tie"] for d in r["divergences"]) else "NO"
            lines.append(
                f"| {c['label']} | {mode} | {r['compared']} | {len(r['divergences'])} | {ties} | "
                f"{r['noise_median']:.2g} / {r['noise_p99']:.2g} / {r['noise_max']:.2g} | {margins} | "
                f"{c['ar_ms_per_token']:.1f} |"
            )
    lines += [
        "",
        "A divergence is a near-tie when the top two logits of the AR row are closer than the largest "
        "difference between a verify row and the one-token row at the same position measured in the same "
        "run; a ulp is the dtype's spacing at the top logit.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--configs",
        default="llamacpp,torch:float32,torch:bfloat16:plain,torch:bfloat16,torch:float16:plain,torch:float16",
    )
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--device", default="cpu", help="the torch engine's device")
    ap.add_argument("--core", type=int, default=1, help="pin to this core (-1: no pinning)")
    ap.add_argument("--target", default=None, help="the target (default the shipped smollm2-f32)")
    ap.add_argument("--torch-target", default=None, help="the torch engine's target (default --target)")
    ap.add_argument("--out", default="bench_results/divergence")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # a child: one config, its JSON to --result
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.core >= 0:
        os.sched_setaffinity(0, {args.core})
    from tools.bench.peer import load_prompts

    prompts = [p.prompt_ids for p in load_prompts(n=args.prompts).prompts]
    if args.only:
        Path(args.result).write_text(json.dumps(one_config(args.only, args, prompts)))
        return 0
    report = {
        "command": "python -m tools.bench.divergence " + " ".join(argv if argv is not None else sys.argv[1:]),
        "target": args.target or "smollm2-f32",
        "prompts": len(prompts),
        "tokens": args.tokens,
        "gamma": args.gamma,
        "machine": platform.processor() or platform.machine(),
        "configs": [],
    }
    for spec in args.configs.split(","):
        # each engine in its own process: a CUDA llama.cpp and a CUDA torch in one process crash together
        report["configs"].append(_in_child(spec, args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "divergence.json").write_text(json.dumps(report, indent=1))
    (out / "divergence.md").write_text(markdown(report))
    from tools.plots import bar_plot

    bar_plot(
        out / "divergence.png",
        [c["label"] for c in report["configs"]],
        {f"SD {m}: max rounding noise": [c[m]["noise_max"] for c in report["configs"]] for m in ("solo", "batched")}
        | {
            "smallest top-2 margin at a divergence": [
                min((d["ar_margin"] for m in ("solo", "batched") for d in c[m]["divergences"]), default=0.0)
                for c in report["configs"]
            ]
        },
        ylabel="logits",
        title="Verify pass vs one-token pass: rounding noise and divergence margins",
    )
    print(markdown(report))
    return (
        0
        if all(d["near_tie"] for c in report["configs"] for m in ("solo", "batched") for d in c[m]["divergences"])
        else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
