"""Target-only streams: the AR mode's one stream, and AS2's streaming phase of an SD or FSD generation.

Both ask the server for tokens (wire.Ar) and commit each as it arrives, checked (replies.StreamCheck), and
return what the stream cost (report.StreamReport), which the generation's Run applies;
the EdgeDecoder hands them the link, the session and what the handshake agreed (stop ids, vocabulary).
"""

from __future__ import annotations

import time

import numpy as np

from protocol import sampling, wire
from protocol.sampling import SamplingParams

from . import replies
from .drafter import Drafter
from .link import LinkLost, ServerError, VerifierLink
from .policy import DraftController
from .report import StreamReport
from .run import Run


def ar_stream(run: Run, link: VerifierLink, sid: str, stops: list[int], vocab: int) -> StreamReport:
    """Target-only tokens streamed by the server: each is committed as it arrives (each one a round); the
    stream's cost is reported when it ends (when it fails, applied here, its timing unknown)."""
    t0 = time.perf_counter()
    n, passes, verify_ms = 0, 0, 0.0
    stream = replies.StreamCheck(vocab, stops)
    remaining = run.remaining()
    try:
        link.send(wire.Ar(sid, remaining, stops))
        stream.asked(remaining)
        while True:
            reply = stream.check(link.recv(sid=sid))
            run.commit([reply.token], set(stops), f"streamed token seq {reply.seq}")
            n += 1
            verify_ms += reply.timing.get("verify_ms", 0.0)
            passes += reply.timing.get("passes", 1)
            if reply.done:
                break
    except (LinkLost, ServerError):
        run.apply_stream(StreamReport(rounds=n, passes=passes))  # what came is committed; the rest is redone
        raise
    network_ms = max(0.0, (time.perf_counter() - t0) * 1e3 - verify_ms)
    return StreamReport(rounds=n, passes=passes, verify_ms=verify_ms, network_ms=network_ms)


def stream_phase(
    run: Run,
    ctl: DraftController,
    link: VerifierLink,
    sid: str,
    stops: list[int],
    vocab: int,
    drafter: Drafter,
    chunk: int,
) -> StreamReport:
    """AS2 has speculation off: the target streams alone until speculation would win again.

    Tokens come in chunks of `chunk` (the policy's stream_chunk); the next chunk is asked for when
    the current one starts arriving, so no round trip opens between chunks. The
    robot is idle meanwhile, so its draft follows along: its agreement with each
    streamed token (min(1, q/p) at T > 0, the chance the token would have been
    accepted) keeps acceptance estimated, and a ping per chunk keeps the round trip.
    Each token is committed as it arrives; the phase's cost is reported when it ends (applied here when it fails).
    """
    remaining = run.remaining()
    stream = replies.StreamCheck(vocab, stops)
    asked = min(chunk, remaining)
    n, passes, verify_sum = 0, 0, 0.0
    try:
        link.send(wire.Ar(sid, asked, stops, fix=run.owed))
        stream.asked(asked)
        run.owed = None
        chunks = 1  # asked for and not finished
        back = False
        latency = link.latency_ms
        link.ping()
        t0 = time.perf_counter()
        while chunks:
            reply = stream.check(link.recv(sid=sid))
            run.check([reply.token], set(stops), f"streamed token seq {reply.seq}")
            t1 = time.perf_counter()
            logits = drafter.next_logits(run.committed)
            draft_ms = (time.perf_counter() - t1) * 1e3
            run.committed.append(reply.token)
            verify_ms = reply.timing.get("verify_ms", 0.0)
            n += 1
            verify_sum += verify_ms
            passes += reply.timing.get("passes", 1)
            ctl.after_streamed(_agreement(logits, reply, run.params), draft_ms, verify_ms)
            if reply.seq == 0:  # a chunk starts: decide whether to ask for another
                if link.latency_ms != latency:
                    latency = link.latency_ms
                    ctl.after_latency(latency)
                    link.ping()
                back = back or ctl.decide_streaming()
                if not back and chunks == 1 and asked < remaining:
                    k = min(chunk, remaining - asked)
                    link.send(wire.Ar(sid, k, stops))
                    stream.asked(k)
                    asked += k
                    chunks += 1
            if reply.done:
                chunks -= 1
                if reply.token in stops:
                    break
    except (LinkLost, ServerError):
        run.apply_stream(StreamReport(streamed=n, passes=passes))  # what came is committed; the rest is redone
        raise
    network_ms = max(0.0, (time.perf_counter() - t0) * 1e3 - verify_sum)
    return StreamReport(streamed=n, passes=passes, verify_ms=verify_sum, network_ms=network_ms, speculate=back)


def _agreement(logits: np.ndarray, reply: wire.Token, params: SamplingParams) -> float:
    """P(accept) had the draft proposed here: 1[argmax q = x] when greedy, min(1, q(x)/p(x)) for x ~ p.

    For x drawn from the target's p, E[min(1, q(x)/p(x))] = sum_x min(p, q), the acceptance rate.
    """
    if params.greedy:
        return float(int(np.argmax(logits)) == reply.token)
    q = float(sampling.probs_from_logits(logits, params)[reply.token])
    p = reply.p if reply.p else 1.0
    return min(1.0, q / p)
