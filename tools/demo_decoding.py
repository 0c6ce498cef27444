"""The demo: one robot instruction answered by the server alone (AR), by speculative decoding with a
fixed draft length (SD) and with the draft lengths chosen per round (SD+, `predictor+optimal`).

A local verifier runs in its own process on its own core, behind the network
emulator (a Wi-Fi-like 20 ms RTT); the draft model runs here on another core.
The answers and their metrics are printed side by side; at temperature 0
they must be token-for-token identical.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from agent.decoding import DecoderSettings, open_decoder
from tools.bench.link import served
from tools.cluster.netem import LinkProfile

PROMPT = (
    "You are a quadruped robot in a hallway. The kitchen door is 2 metres ahead on your left. "
    "Explain in two sentences how you will get into the kitchen."
)
ROWS = [
    ("tokens", lambda g: len(g.token_ids), "{}"),
    ("wall_s", lambda g: g.metrics.wall_s, "{:.2f}"),
    ("tokens_per_s", lambda g: g.metrics.tokens_per_s, "{:.2f}"),
    ("rounds", lambda g: g.metrics.rounds, "{}"),
    ("tau", lambda g: g.metrics.tau, "{:.2f}"),
    ("acceptance_rate", lambda g: g.metrics.acceptance_rate, "{:.3f}"),
    ("target_forward_passes", lambda g: g.metrics.target_forward_passes, "{}"),
    ("draft_ms", lambda g: g.metrics.draft_ms, "{:.0f}"),
    ("verify_ms", lambda g: g.metrics.verify_ms, "{:.0f}"),
    ("network_ms", lambda g: g.metrics.network_ms, "{:.0f}"),
    ("bytes_up", lambda g: g.metrics.bytes_up, "{}"),
    ("bytes_down", lambda g: g.metrics.bytes_down, "{}"),
]


def _fmt(fmt, value):
    return "-" if value is None else fmt.format(value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--draft", default="smollm2-q4_1")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    print(f"starting the verifier (target smollm2-f32) behind a {args.rtt_ms:.0f} ms RTT link ...", flush=True)
    t0 = time.perf_counter()
    with served(None, LinkProfile.from_rtt(args.rtt_ms, jitter_ms=2)) as s:
        link = s.link
        print(
            f"verifier ready on cores {sorted(s.server_cpus)} in {time.perf_counter() - t0:.1f}s at {s.server.url}, "
            f"link at {link.url()}; the robot drafts on cores {sorted(s.agent_cpus)}",
            flush=True,
        )
        drafter = s.drafter(args.draft)
        decoder = open_decoder(DecoderSettings(verifier=link.url()), drafter)
        smart = open_decoder(DecoderSettings(verifier=link.url(), draft_policy="predictor+optimal"), drafter)
        ids = drafter.tokenize(args.prompt, chat=True)
        print(f"\nprompt ({len(ids)} tokens): {args.prompt}\n", flush=True)
        runs = []
        for dec, mode, label in ((decoder, "ar", "ar"), (decoder, "sd", "sd"), (smart, "sd", "sd, predictor+optimal")):
            print(f"generating in {label} mode ...", flush=True)
            runs.append(dec.generate(ids, mode=mode, max_tokens=args.max_tokens, gamma=args.gamma))
        decoder.close()
        smart.close()

    ar, sd, sdp = runs
    print("\n=== AR (the server's model alone, streamed) ===\n" + ar.text.strip())
    print(
        f"\n=== SD (draft {drafter.name} on the robot, gamma {args.gamma}, verified by the server) ===\n"
        + sd.text.strip()
    )
    print(f"\n{'metric':<24}{'AR':>12}{'SD':>12}{'SD+':>12}")
    for name, get, fmt in ROWS:
        print(f"{name:<24}{_fmt(fmt, get(ar)):>12}{_fmt(fmt, get(sd)):>12}{_fmt(fmt, get(sdp)):>12}")
    m = sdp.metrics
    lengths = ", ".join(f"{k} tokens x{n}" for k, n in sorted(m.draft_lengths.items(), key=lambda kv: int(kv[0])))
    print(
        f"\nSD+ chose its draft lengths ({lengths}): the rejection predictor stopped {m.predictor_stops} "
        f"drafts early; by the estimates (acceptance {m.estimates.get('alpha')}, L {m.estimates.get('L')}, "
        f"round trip {m.estimates.get('network_ms_0')} ms) the best length is {m.gamma_star} and speculation "
        f"should be {m.expected_speedup:.2f}x the target alone"
        + (f"; AS2 switched: {[s['reason'] for s in m.as2_switches]}" if m.as2_switches else "")
    )
    same = ar.token_ids == sd.token_ids == sdp.token_ids
    print(
        f"\nidentical token ids: {'yes' if same else 'NO'}; SD is {ar.metrics.wall_s / sd.metrics.wall_s:.2f}x "
        f"AR's speed with {sd.metrics.target_forward_passes} target passes instead of "
        f"{ar.metrics.target_forward_passes}; SD+ is {ar.metrics.wall_s / sdp.metrics.wall_s:.2f}x with "
        f"{sdp.metrics.target_forward_passes}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
