"""A connection's first frame: a hello this verifier serves, there within hello_timeout_s of the TCP accept, or
the connection is closed (1008, after an `error` saying why); then the welcome (what this verifier serves and
its limits). Frames are decoded here too: whatever the decoder raises besides WireError is a bad frame."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from protocol import images, wire

from .admission import Admission, Replica
from .config import ServerConfig
from .metrics import ServerMetrics
from .verifier import Verifier


def decode(frame: str | bytes, max_frame_bytes: int) -> wire.Message:
    """wire.decode, with anything it raises besides WireError turned into bad_frame: a decoder bug must not
    end the connection with 1011 and a traceback."""
    try:
        return wire.decode(frame, max_frame_bytes)
    except wire.WireError:
        raise
    except Exception as e:
        raise wire.WireError("bad_frame", f"undecodable message ({type(e).__name__})") from e


async def send(ws: ServerConnection, msg: wire.Message, metrics: ServerMetrics) -> bool:
    """Send one message; False when the connection is already gone."""
    frame = wire.encode(msg)
    try:
        await ws.send(frame)
    except ConnectionClosed:
        return False
    metrics.bytes_out += len(frame)
    return True


class Handshake:
    """hello in, welcome out, for every connection of one server."""

    def __init__(self, config: ServerConfig, verifier: Verifier, admission: Admission, replica: Replica):
        self.config = config
        self.verifier = verifier
        self.admission = admission
        self.metrics = admission.metrics
        self.replica = replica

    async def hello(self, ws: ServerConnection, conn_id: int, peer: str) -> wire.Hello | None:
        """The hello once it passed (the welcome is the caller's); anything else closes the connection and is
        counted."""
        timeout = self.config.hello_timeout_s
        left = timeout - (time.monotonic() - getattr(ws, "accepted_at", time.monotonic()))
        stranger = self.admission.log_stranger
        try:
            frame = await asyncio.wait_for(ws.recv(), max(left, 0.0))  # recv is safe to cancel
        except asyncio.TimeoutError:
            self.metrics.refused["hello_timeout"] += 1
            stranger(logging.INFO, "conn %d %s: no hello within %gs: closed", conn_id, peer, timeout)
            self.admission.gate.release(ws)  # its slot is free now, while the close handshake waits for the peer
            await ws.close(1008, f"no hello within {timeout:g}s")
            return None
        self.metrics.bytes_in += len(frame)
        try:
            return self.check(ws, decode(frame, min(self.config.max_frame_bytes, wire.MAX_HELLO_BYTES)))
        except wire.WireError as e:
            error = e
        except Exception:  # a bug in a check must not close with 1011 and a traceback for any stranger to trigger
            stranger(logging.WARNING, "conn %d %s: hello raised", conn_id, peer, exc_info=True)
            error = wire.WireError("bad_frame", "the first message could not be checked")
        self.metrics.errors[error.code] += 1
        self.metrics.refused["error_before_hello"] += 1
        stranger(logging.INFO, "conn %d %s: closed before hello: %s", conn_id, peer, error)
        self.admission.gate.release(ws)
        await send(ws, wire.Error(error.code, error.message, error.sid), self.metrics)
        await ws.close(1008, error.code)
        return None

    def check(self, ws: ServerConnection, msg: wire.Message) -> wire.Hello:
        """`msg`, or WireError unless it is a hello this verifier serves: the token (unless loopback is trusted
        and this is loopback), the draft's vocabulary."""
        if not isinstance(msg, wire.Hello):
            raise wire.WireError("not_authenticated", f"the first message must be hello, got {msg.TYPE}")
        client = getattr(ws, "client", None)
        trusted = self.config.loopback_trusted and client is not None and client.loopback
        if (
            self.config.token
            and not trusted
            and not hmac.compare_digest(msg.token.encode(), self.config.token.encode())
        ):
            raise wire.WireError("bad_token", "the token in hello does not match this verifier's")
        target = self.verifier.target
        # Both hashes cover the real part only (modelfiles.vocab_hash), its size included: equal hashes are equal
        # vocabularies up to a tail of padding ids on either side. hello's vocab_size is the draft's full size, so
        # it holds at least the real part; the agreed vocabulary is the real part (target.vocab_size, welcome's).
        if msg.draft_vocab_hash != target.vocab_hash or msg.vocab_size < target.vocab_size:
            raise wire.WireError(
                "vocab_mismatch",
                f"the draft's vocabulary (size {msg.vocab_size}, hash "
                f"{msg.draft_vocab_hash[:12]}) differs from the target {target.name}'s (size "
                f"{target.vocab_size} without padding, hash {target.vocab_hash[:12]}); speculative decoding "
                "needs identical tokenizers",
            )
        return msg

    def welcome(self) -> wire.Welcome:
        target = self.verifier.target
        return wire.Welcome(
            target=target.name,
            vocab_size=target.vocab_size,
            vocab_hash=target.vocab_hash,
            eos_ids=target.eos_ids,
            exits=self.verifier.exit_layers,
            limits={
                "max_frame_bytes": self.config.max_frame_bytes,
                "max_draft_len": self.config.max_draft_len,
                "max_context": self.config.max_context,
                "max_sessions": self.config.max_sessions,
                "grammar": target.grammars_supported,
                "grammar_kinds": target.grammar_kinds,  # an open's grammar kinds (older servers: gbnf alone)
                "top_p": True,  # open.sampling.top_p is understood (older servers would ignore it)
                **self._image_limits(),
            },
            engine=target.engine.info.as_dict(),
            replica=self.replica.id,
        )

    def _image_limits(self) -> dict:
        """welcome.limits.images where the target reads images: its marker id and the wire's bounds."""
        marker = self.verifier.target.image_marker
        if marker is None:
            return {}
        return {"images": {"marker": marker, **images.limits()}}
