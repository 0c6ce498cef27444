"""A hostile verifier: the robot trusts nothing it receives (DESIGN.md, Trust; agent/decoding/replies.py).

A fake verifier, a real websocket server on 127.0.0.1:0 speaking the real wire, does a correct
handshake with the shipped draft's vocabulary and then answers one request with a malformed reply.
The robot's decoder must not crash: it raises ProtocolViolation (a LinkLost, after which the robot
goes to its offline mode), commits nothing of the bad reply, and on a reconnect to an honest server
re-opens with the prefix it had and loses nothing.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import serve

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.link import LinkLost, ProtocolViolation
from protocol import wire
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[3]
BIG = 10**9  # the attack: llama.cpp's detokenize threw std::out_of_range on it and aborted the process
LAYER = 12  # the one early exit the fake offers
PROMPT = "The robot sees a red box ahead and"
SECRET = "k" * 22  # the session's resume secret, in every `opened`


class FakeVerifier:
    """Honest answers (every draft accepted, then the end-of-sequence id) from a real websocket server;
    `tamper(msg, honest) -> frames` rewrites the answer to each request of the first connection."""

    def __init__(self, drafter, tamper=None):
        self.vocab, self.vocab_hash, self.eos = drafter.vocab_size, drafter.vocab_hash, min(drafter.eos_ids)
        self.tamper = tamper or (lambda msg, honest: honest)
        self.opens: list[list[int]] = []  # prompt_ids of every open, in order
        self.resumes: list[str] = []  # and the resume secret each sent
        self.connections = 0
        self.server = serve(self.handle, "127.0.0.1", 0)
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-verifier", daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}"

    def honest(self, msg) -> list[wire.Message]:
        if isinstance(msg, wire.Hello):
            limits = {"max_frame_bytes": wire.DEFAULT_MAX_FRAME_BYTES, "max_draft_len": 8, "max_context": 2048}
            return [wire.Welcome("fake", self.vocab, self.vocab_hash, [self.eos], [LAYER], {**limits, "grammar": True})]
        if isinstance(msg, wire.Open):
            self.opens.append(list(msg.prompt_ids))
            self.resumes.append(msg.resume)
            return [wire.Opened(msg.sid, len(msg.prompt_ids), {"prefill_ms": 1.0, "passes": 1}, resume=SECRET)]
        if isinstance(msg, wire.Verify):
            k = len(msg.draft_ids)
            hint = (
                [wire.Exit(msg.sid, msg.round, LAYER, msg.draft_ids + [self.eos], 0.9)] if msg.cands is not None else []
            )
            return hint + [wire.Result(msg.sid, msg.round, k, self.eos, msg.n_committed + k + 1, {"verify_ms": 1.0})]
        if isinstance(msg, wire.Ar):
            return [wire.Token(msg.sid, 0, self.eos, True, {"verify_ms": 1.0, "passes": 1}, 1.0)]
        return []  # close

    def handle(self, ws) -> None:
        first = self.connections == 0
        self.connections += 1
        try:
            for frame in ws:
                msg = wire.decode(frame)
                answer = self.honest(msg)
                if first and answer:
                    answer = self.tamper(msg, answer)
                for m in answer:
                    ws.send(m if isinstance(m, bytes) else wire.encode(m))
        except ConnectionClosed:
            pass


def on(kind, change):
    """A tamper that replaces the honest answer's messages of `kind` by change(msg, message) (one or a list)."""

    def tamper(msg, honest):
        out = []
        for m in honest:
            new = change(msg, m) if isinstance(m, kind) else m
            out += new if isinstance(new, list) else [new]
        return out

    return tamper


def residual(logits, ids=None):
    return lambda msg, r: replace(
        r, accepted=0, token=-1, n_committed=msg.n_committed, residual={"logits": logits, "ids": ids}
    )


V = 49152  # the shipped draft's vocabulary (checked in test_the_fake_speaks_the_shipped_vocabulary)
NAN = float("nan")
GREEDY, SPLIT = SamplingParams(), SamplingParams(temperature=1.0, seed=3)

# (mode, params, tamper, what the robot must say[, the good tokens committed before]): every reply kind and
# field it checks
CASES = {
    # result
    "result token 10^9": ("sd", GREEDY, on(wire.Result, lambda q, r: replace(r, token=BIG)), "outside the vocab"),
    "result token = vocab": ("sd", GREEDY, on(wire.Result, lambda q, r: replace(r, token=V)), "outside the vocab"),
    "result accepted > drafted": (
        "sd",
        GREEDY,
        on(wire.Result, lambda q, r: replace(r, accepted=r.accepted + 1, n_committed=r.n_committed + 1)),
        "accepts",
    ),
    "result of another round": ("sd", GREEDY, on(wire.Result, lambda q, r: replace(r, round=r.round + 1)), "round"),
    "result n_committed": (
        "sd",
        GREEDY,
        on(wire.Result, lambda q, r: replace(r, n_committed=r.n_committed + 5)),
        "holds",
    ),
    "result timing < 0": ("sd", GREEDY, on(wire.Result, lambda q, r: replace(r, timing={"verify_ms": -5.0})), "timing"),
    "result passes 10^9": ("sd", GREEDY, on(wire.Result, lambda q, r: replace(r, timing={"passes": BIG})), "timing"),
    "result instead a token": (
        "sd",
        GREEDY,
        on(wire.Result, lambda q, r: wire.Token(r.sid, 0, 1, True, {})),
        "expected the result",
    ),
    "residual when greedy": ("sd", GREEDY, on(wire.Result, residual(np.zeros(V, np.float32))), "residual"),
    # split residuals (temperature > 0)
    "residual -inf": ("sd", SPLIT, on(wire.Result, residual(np.array([0.0] * (V - 1) + [-np.inf], np.float32))), "NaN"),
    "residual shape": ("sd", SPLIT, on(wire.Result, residual(np.zeros(V - 1, np.float32))), "cover"),
    "residual ids 10^9": (
        "sd",
        SPLIT,
        on(wire.Result, residual(np.zeros(2, np.float32), np.array([0, BIG], np.int32))),
        "leave the vocab",
    ),
    "residual ids repeat": (
        "sd",
        SPLIT,
        on(wire.Result, residual(np.zeros(2, np.float32), np.array([5, 5], np.int32))),
        "repeat",
    ),
    "residual all accepted": (
        "sd",
        SPLIT,
        on(
            wire.Result,
            lambda q, r: replace(
                r, token=-1, n_committed=r.n_committed - 1, residual={"logits": np.zeros(V, np.float32), "ids": None}
            ),
        ),
        "residual",
    ),
    # handshake and open
    "welcome vocab_size": ("sd", GREEDY, on(wire.Welcome, lambda q, w: replace(w, vocab_size=V + 1)), "welcomed"),
    "welcome eos 10^9": ("sd", GREEDY, on(wire.Welcome, lambda q, w: replace(w, eos_ids=[BIG])), "stop id"),
    "opened timing < 0": (
        "sd",
        GREEDY,
        on(wire.Opened, lambda q, o: replace(o, timing={"prefill_ms": -1.0})),
        "timing",
    ),
    "opened count": ("sd", GREEDY, on(wire.Opened, lambda q, o: replace(o, n_committed=o.n_committed + 1)), "opened"),
    "opened instead a result": (
        "sd",
        GREEDY,
        on(wire.Opened, lambda q, o: wire.Result(o.sid, 0, 0, 1, o.n_committed + 1, {})),
        "expected opened",
    ),
    # ar streams
    "ar token 10^9": ("ar", GREEDY, on(wire.Token, lambda q, t: replace(t, token=BIG)), "outside the vocab"),
    "ar seq": ("ar", GREEDY, on(wire.Token, lambda q, t: replace(t, seq=3)), "seq"),
    "ar done early": ("ar", GREEDY, on(wire.Token, lambda q, t: replace(t, token=5)), "early"),
    "ar more than asked": (
        "ar",
        GREEDY,
        on(wire.Token, lambda q, t: [replace(t, seq=i, token=5, done=False) for i in range(9)]),
        "last",
        [5] * 5,  # the good tokens before it were each committed as they came
    ),
    "ar timing": ("ar", GREEDY, on(wire.Token, lambda q, t: replace(t, timing={"verify_ms": -1})), "timing"),
    # early-exit hints (fsd)
    "exit token 10^9": ("fsd", GREEDY, on(wire.Exit, lambda q, e: replace(e, tokens=[BIG])), "outside the vocab"),
    "exit of another round": ("fsd", GREEDY, on(wire.Exit, lambda q, e: replace(e, round=e.round + 7)), "waits"),
    "exit layer not asked": ("fsd", GREEDY, on(wire.Exit, lambda q, e: replace(e, layer=LAYER + 1)), "asked for"),
    "exit longer than the draft": (
        "fsd",
        GREEDY,
        on(wire.Exit, lambda q, e: replace(e, tokens=e.tokens + [5])),
        "not a prefix",
    ),
    "exit not the draft": (
        "fsd",
        GREEDY,
        on(wire.Exit, lambda q, e: replace(e, tokens=[(e.tokens[0] + 1) % V] + e.tokens[1:])),
        "not a prefix",
    ),
}


def decoder_for(drafter, url, mode, attempts=0):
    return open_decoder(
        DecoderSettings(
            verifier=url,
            reconnect_attempts=attempts,
            reconnect_backoff_s=0.01,
            verify_timeout_s=10.0,
            guesses=False,
            payload="split",
        ),
        drafter,
    )


def test_the_fake_speaks_the_shipped_vocabulary(drafter):
    assert drafter.vocab_size == V


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_reply_is_a_protocol_violation_and_commits_nothing(drafter, case, caplog):
    mode, params, tamper, says, *good = CASES[case]
    prompt = drafter.tokenize(PROMPT)
    with FakeVerifier(drafter, tamper) as fake:
        decoder = decoder_for(drafter, fake.url, mode)
        try:
            with caplog.at_level(logging.ERROR, "agent.decoding.session"):
                with pytest.raises(ProtocolViolation, match=says) as lost:
                    decoder.generate(prompt, mode=mode, max_tokens=6, params=params, gamma=3)
        finally:
            decoder.close()
    assert isinstance(lost.value, LinkLost)  # what the navigation loop takes for a lost link: offline mode
    assert lost.value.token_ids == (good[0] if good else [])  # nothing of the bad reply was committed
    assert "broke the protocol" in caplog.text
    drafter.detokenize(prompt)  # the draft (and this process) is fine


UNDECODABLE = {
    "result token -1": (GREEDY, on(wire.Result, lambda q, r: replace(r, token=-1))),  # only with a residual
    "result timing NaN": (GREEDY, on(wire.Result, lambda q, r: replace(r, timing={"verify_ms": NAN}))),
    "result timing text": (GREEDY, on(wire.Result, lambda q, r: replace(r, timing={"passes": "9"}))),
    "residual NaN": (SPLIT, on(wire.Result, residual(np.full(V, NAN, np.float32)))),
    "opened timing text": (GREEDY, on(wire.Opened, lambda q, o: replace(o, timing={"prefill_ms": "x"}))),
}


@pytest.mark.parametrize("case", list(UNDECODABLE))
def test_what_the_wire_refuses_is_a_lost_link(drafter, case):
    """protocol/wire.py refuses these before the decoder sees them: a lost link too, nothing committed."""
    params, tamper = UNDECODABLE[case]
    with FakeVerifier(drafter, tamper) as fake:
        decoder = decoder_for(drafter, fake.url, "sd")
        try:
            with pytest.raises(LinkLost, match="undecodable") as lost:
                decoder.generate(drafter.tokenize(PROMPT), mode="sd", max_tokens=6, params=params, gamma=3)
        finally:
            decoder.close()
    assert lost.value.token_ids == []


def test_a_token_outside_the_grammar_is_a_protocol_violation(drafter):
    """Under a grammar the verifier masks the target with it: a token it forbids is not the target's."""
    outside = drafter.tokenize(" zebra")[0]
    with FakeVerifier(drafter, on(wire.Result, lambda q, r: replace(r, token=outside))) as fake:
        decoder = decoder_for(drafter, fake.url, "sd")
        try:
            with pytest.raises(ProtocolViolation, match="grammar") as lost:
                decoder.generate(drafter.tokenize(PROMPT), max_tokens=6, gamma=2, grammar='root ::= "a"+')
        finally:
            decoder.close()
    assert lost.value.token_ids == []


@pytest.mark.parametrize("mode", ["sd", "fsd", "ar"])
def test_honest_replies_pass_every_check(drafter, mode):
    """The fake's own answers (with an exit hint in fsd) are accepted: the checks refuse only what is wrong."""
    prompt = drafter.tokenize(PROMPT)
    with FakeVerifier(drafter) as fake:
        decoder = decoder_for(drafter, fake.url, mode)
        try:
            gen = decoder.generate(prompt, mode=mode, max_tokens=6, gamma=3)
        finally:
            decoder.close()
    assert gen.token_ids[-1] == fake.eos and gen.metrics.protocol_violations == 0
    assert gen.metrics.exits_received == (1 if mode == "fsd" else 0)


def test_after_a_violation_the_robot_reconnects_and_loses_nothing(drafter):
    """Exactly as after a lost link: a new connection, the session re-opened with the committed prefix (without
    anything of the bad reply), the round redone."""
    prompt = drafter.tokenize(PROMPT)
    with FakeVerifier(drafter, on(wire.Result, lambda q, r: replace(r, token=BIG))) as fake:
        decoder = decoder_for(drafter, fake.url, "sd", attempts=2)
        try:
            gen = decoder.generate(prompt, mode="sd", max_tokens=6, gamma=3)
        finally:
            decoder.close()
    assert fake.opens == [prompt, prompt] and fake.resumes == ["", SECRET]  # the secret of its first open
    assert BIG not in gen.token_ids and gen.token_ids[-1] == fake.eos
    assert gen.metrics.protocol_violations == 1 and gen.metrics.reconnects == 1


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_detokenize_refuses_an_id_outside_the_vocabulary_instead_of_aborting():
    """Defence in depth: whatever hands it the id, the draft refuses it before llama.cpp can abort."""
    r = run_python(
        "from agent.decoding.drafter import Drafter\n"
        "d = Drafter(threads=1)\n"
        "for ids in ([10**9], [-1], [d.vocab_size]):\n"
        "    try:\n"
        "        d.detokenize(ids)\n"
        "    except ValueError as e:\n"
        "        print('refused:', e)\n"
        "try:\n"
        "    d.next_logits([1, 2, 10**9])\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.count("refused:") == 4 and "outside the draft's vocabulary" in r.stdout


def test_edge_agent_survives_a_result_token_of_10_to_the_9(drafter):
    """The original attack on the real `edge-agent generate`: it aborted (SIGABRT) in llama.cpp's detokenize.
    Now the process lives, drops the link, re-opens with its prompt alone and finishes on the honest reply."""
    with FakeVerifier(drafter, on(wire.Result, lambda q, r: replace(r, token=BIG))) as fake:
        r = run_python(
            "import sys; from agent.app.cli import main; sys.exit(main(["
            f"'generate', '--verifier', '{fake.url}', '--prompt', {PROMPT!r}, '--mode', 'sd', "
            "'--gamma', '2', '--max-tokens', '3', '--threads', '1', '--robot-id', 'hostile-test']))"
        )
    assert r.returncode >= 0, f"edge-agent died of signal {-r.returncode}: {r.stderr[-2000:]}"
    assert r.returncode == 0, r.stderr[-2000:]
    assert "broke the protocol" in r.stderr and str(BIG) in r.stderr
    prompt = drafter.tokenize(PROMPT)
    assert fake.opens == [prompt, prompt]  # the re-open carried nothing of the bad reply
