"""The robot <-> server wire: versioned msgpack messages, validated on receipt.

One binary websocket frame carries one message, a msgpack map with `type` and
`v`. The per-round messages (`verify`, `result`) are "packed": a msgpack array
[v, type, field, field, ...] in the dataclass's field order, trailing absent
fields left off, so a round pays no key names (a split round at gamma 4 is
~56 bytes). `decode` accepts either form of any message and validates both the
same way. Arrays travel as {"dtype", "shape", "data"} with raw little-endian
bytes, or inside packed messages as bare bytes whose shape the message
implies; nothing is ever pickled. `decode()` checks the frame size, the version, the
type and every field, and raises `WireError` with a code the server sends
back in an `error` message. Nothing a peer sends reaches numpy unbounded (an
array's shape is checked against its bytes and the frame first), and an error
repeats no more of a bad value than MAX_SHOWN characters and never a sid its
own decoder would refuse: the `error` is always a message its receiver reads.

Where a message is decoded: `decode()`. Where it is built: the dataclasses
below, each with `to_wire()` and a `make_dummy()` for tests.
"""

from __future__ import annotations

import logging
import math
import re
import reprlib
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack
import numpy as np

from . import images as image_wire

log = logging.getLogger(__name__)
PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 4 * 2**20  # a full fp16 q for 16 positions is ~1.5 MiB
_ARRAY_DTYPES = {"<f2": np.float16, "<f4": np.float32, "<i4": np.int32}
MAX_ID_LIST = 1 << 16  # longest token-id list any message may carry
MAX_STR = 4096
MAX_RETRY_AFTER_MS = 3_600_000  # an error's retry_after_ms: at most an hour
MAX_GBNF_CHARS = 16 * 1024  # a grammar's GBNF text (protocol/structured.py); Lark's may embed schemas (%json)
MAX_SCHEMA_CHARS = 1 << 20  # a JSON schema's text (protocol/structured.py: MAX_SCHEMA_BYTES)
# a grammar on the wire is one of these, by its key: GBNF (llama.cpp's, what older robots send), Lark or a JSON
# schema (LLGuidance's own formats: a schema is compiled as it is, not through a converter)
GRAMMAR_KINDS = {"gbnf": MAX_GBNF_CHARS, "lark": MAX_SCHEMA_CHARS, "json_schema": MAX_SCHEMA_CHARS}
MAX_CANDIDATES = 64  # candidate ids per draft position for early exits
MAX_SECRET = 64  # a session's resume secret (the server mints 22 characters)
MAX_ARRAY_NDIM = 2  # the wire's arrays are at most [k, K] (Verify.cands)
MAX_SHOWN = 64  # characters of a received value an error message repeats
# A connection's first frame, before its hello is checked: a hello is under 1 KiB (its strings are bounded), and a
# stranger's frame at the full cap could make msgpack build 4.2 M objects (1.8 s on the server's event loop)
MAX_HELLO_BYTES = 4096


class WireError(ValueError):
    """A message that cannot be accepted; `code` goes back to the sender in `error`."""

    def __init__(self, code: str, message: str, sid: str | None = None, retry_after_ms: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.sid = sid
        self.retry_after_ms = retry_after_ms  # `overloaded`: come back no sooner (Error.retry_after_ms)


# --------------------------------------------------------------------------- arrays


def encode_array(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    dtype = a.dtype.newbyteorder("<").str
    if dtype not in _ARRAY_DTYPES:
        raise WireError("bad_array", f"dtype {a.dtype} cannot travel on the wire")
    return {"dtype": dtype, "shape": list(a.shape), "data": a.astype(dtype, copy=False).tobytes()}


def decode_array(obj: Any, name: str, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> np.ndarray:
    """{"dtype", "shape", "data"} -> the array; WireError bad_field for anything numpy should not be shown.

    The shape is bounded before numpy sees it: 1..MAX_ARRAY_NDIM dims, each in [0, max_bytes // itemsize],
    the product of the non-zero ones too (numpy refuses an empty array whose other dims overflow), and the
    whole must be exactly the data's length."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise WireError("bad_field", f"{name} must be an array map with dtype, shape and data")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if not isinstance(dtype, str) or dtype not in _ARRAY_DTYPES:
        raise WireError("bad_field", f"{name}.dtype {_show(dtype)} is not one of {sorted(_ARRAY_DTYPES)}")
    itemsize = np.dtype(dtype).itemsize
    most = max_bytes // itemsize  # elements that fit in the frame
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= MAX_ARRAY_NDIM
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= most for d in shape)
        or math.prod(max(d, 1) for d in shape) > most
    ):
        raise WireError(
            "bad_field", f"{name}.shape must be a list of 1-{MAX_ARRAY_NDIM} non-negative ints within the frame"
        )
    if not isinstance(data, bytes):
        raise WireError("bad_field", f"{name}.data must be bytes")
    want = math.prod(shape) * itemsize
    if want != len(data):
        raise WireError("bad_field", f"{name}: shape {shape} of {dtype} needs {want} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


# --------------------------------------------------------------------------- field checks


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, MAX_SHOWN, MAX_SHOWN


def _show(v: Any) -> str:
    """A received value as an error message repeats it: at most MAX_SHOWN characters of its repr (a field can
    be a MiB of bytes, and the error must stay a message its own decoder accepts)."""
    if isinstance(v, (bytes, bytearray)) and len(v) > MAX_SHOWN // 4:
        return f"<{len(v)} bytes>"
    shown = _REPR.repr(v)
    return shown if len(shown) <= MAX_SHOWN else shown[: MAX_SHOWN - 3] + "..."


def _int(v: Any, name: str, lo: int = 0, hi: int = 2**31 - 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise WireError("bad_field", f"{name} must be an int in [{lo}, {hi}], got {_show(v)}")
    return v


def _float(v: Any, name: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise WireError("bad_field", f"{name} must be a finite number in [{lo}, {hi}], got {_show(v)}")
    return float(v)


def _str(v: Any, name: str, max_len: int = MAX_STR) -> str:
    if not isinstance(v, str) or len(v) > max_len:
        raise WireError("bad_field", f"{name} must be a string of at most {max_len} characters")
    return v


def _grammar(g: dict[str, Any], n_ids: int) -> dict[str, Any]:
    """An open's grammar: exactly one of GRAMMAR_KINDS with its text, and where it starts."""
    kinds = [k for k in GRAMMAR_KINDS if k in g]
    if len(kinds) != 1 or set(g) - {*kinds, "from"}:
        raise WireError(
            "bad_field", f"grammar holds one of {', '.join(GRAMMAR_KINDS)} and from, got {_show(sorted(g))}"
        )
    kind = kinds[0]
    return {
        kind: _str(g[kind], f"grammar.{kind}", GRAMMAR_KINDS[kind]),
        "from": _int(g.get("from"), "grammar.from", 0, n_ids),
    }


def _ids(v: Any, name: str, max_len: int = MAX_ID_LIST) -> list[int]:
    if not isinstance(v, list) or len(v) > max_len:
        raise WireError("bad_field", f"{name} must be a list of at most {max_len} token ids")
    if all(type(t) is int for t in v) and (not v or (min(v) >= 0 and max(v) < 2**31)):  # the common case, fast
        return v
    for t in v:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**31:
            raise WireError("bad_field", f"{name} must hold non-negative int token ids, found {_show(t)}")
    return v


def _map(v: Any, name: str) -> dict[str, Any]:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise WireError("bad_field", f"{name} must be a map with string keys")
    return v


def _timing(v: Any, name: str) -> dict[str, Any]:
    """A timing map (ms, counts): string keys, finite numbers only (the robot adds them up)."""
    timing = _map(v, name)
    for key, value in timing.items():
        _float(value, f"{name}.{key[:MAX_SHOWN]}", -math.inf, math.inf)
    return timing


_ASCII_SID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _sid(v: Any) -> str:
    sid = _str(v, "sid", 64)
    if _ASCII_SID.fullmatch(sid):  # the common case, fast (every frame names its session)
        return sid
    if not sid or not all(c.isalnum() or c in "-_." for c in sid):
        raise WireError("bad_field", "sid must be 1-64 characters of [A-Za-z0-9-_.]")  # never echoed: it is bad
    return sid


def _valid_sid(v: Any) -> str | None:
    """v if `_sid` accepts it, else None: what an error may name as its session."""
    try:
        return _sid(v)
    except WireError:
        return None


# --------------------------------------------------------------------------- messages


@dataclass
class Message:
    TYPE: ClassVar[str] = ""
    PACKED: ClassVar[bool] = False  # travels as [v, type, *fields] (the per-round messages)

    def to_wire(self) -> dict[str, Any]:
        d = {"type": self.TYPE, "v": PROTOCOL_VERSION}
        d.update({name: getattr(self, name) for name in _names(type(self))})
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Message:  # overridden: each type validates its own fields
        raise NotImplementedError


@dataclass
class Hello(Message):
    """Robot -> server, first message on a connection."""

    TYPE: ClassVar[str] = "hello"
    token: str  # shared secret; "" when the server runs loopback-only
    client: str  # free text: agent name and version
    draft_vocab_hash: str  # vocab.vocab_hash of the draft's tokenizer
    vocab_size: int

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Hello:
        return cls(
            _str(d.get("token"), "token", 256),
            _str(d.get("client"), "client", 256),
            _str(d.get("draft_vocab_hash"), "draft_vocab_hash", 128),
            _int(d.get("vocab_size"), "vocab_size", 1, 1 << 24),
        )

    @classmethod
    def make_dummy(cls) -> Hello:
        return cls(token="", client="test", draft_vocab_hash="0" * 64, vocab_size=49152)


@dataclass
class Welcome(Message):
    """Server -> robot: the handshake succeeded; what the server can do."""

    TYPE: ClassVar[str] = "welcome"
    target: str
    vocab_size: int
    vocab_hash: str
    eos_ids: list[int]
    exits: list[int]  # layers with early exits (empty: none)
    limits: dict[
        str, Any
    ]  # max_frame_bytes, max_draft_len, max_context, max_sessions; grammar, top_p: what it supports
    engine: dict[str, Any] = field(default_factory=dict)  # what serves: engine, device, dtype (informational; {} from
    # servers before it was sent)
    replica: str = ""  # which replica of a fleet answered (server.replica_id); "" from older servers

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Welcome:
        limits = _map(d.get("limits"), "limits")
        for k in ("max_frame_bytes", "max_draft_len", "max_context"):
            _int(limits.get(k), f"limits.{k}", 1)
        if limits.get("images") is not None:  # a vision target: its marker and the image bounds it takes
            offered = _map(limits["images"], "limits.images")
            _int(offered.get("marker"), "limits.images.marker")
            for k in ("max_images", "max_bytes", "max_side", "max_pixels"):
                if k in offered or k in ("max_images", "max_bytes"):  # older servers do not send the other two
                    _int(offered.get(k), f"limits.images.{k}", 1)
        engine = _map(d.get("engine", {}), "engine")
        return cls(
            _str(d.get("target"), "target"),
            _int(d.get("vocab_size"), "vocab_size", 1, 1 << 24),
            _str(d.get("vocab_hash"), "vocab_hash", 128),
            _ids(d.get("eos_ids"), "eos_ids", 64),
            _ids(d.get("exits"), "exits", 256),
            limits,
            engine,
            _str(d.get("replica", ""), "replica", 64),
        )

    @classmethod
    def make_dummy(cls) -> Welcome:
        return cls(
            "dummy",
            49152,
            "0" * 64,
            [2],
            [],
            {"max_frame_bytes": DEFAULT_MAX_FRAME_BYTES, "max_draft_len": 16, "max_context": 2048},
            {"engine": "llamacpp", "device": "cpu", "dtype": "float32"},
        )


@dataclass
class Error(Message):
    TYPE: ClassVar[str] = "error"
    code: str  # machine-readable: bad_frame, bad_field, unknown_session, ...
    message: str  # for a human reading the robot's log
    sid: str | None = None  # the session it concerns, if any
    # `overloaded`: the server's hint, ms before a retry may be taken (an HTTP Retry-After); absent: the robot's own
    # backoff alone. A robot waits the longer of the two, jittered.
    retry_after_ms: int | None = None

    def to_wire(self) -> dict[str, Any]:
        # never echo what this message's own decoder would refuse: a bad sid goes as none, a long text is cut
        d = super().to_wire()
        d.update(code=str(self.code)[:64], message=str(self.message)[:MAX_STR], sid=_valid_sid(self.sid))
        if self.retry_after_ms is None:
            del d["retry_after_ms"]  # what a robot of an earlier version gets, and ignores
        else:
            d["retry_after_ms"] = min(max(int(self.retry_after_ms), 0), MAX_RETRY_AFTER_MS)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Error:
        sid, after = d.get("sid"), d.get("retry_after_ms")
        return cls(
            _str(d.get("code"), "code", 64),
            _str(d.get("message"), "message"),
            None if sid is None else _sid(sid),
            None if after is None else _int(after, "retry_after_ms", 0, MAX_RETRY_AFTER_MS),
        )

    @classmethod
    def make_dummy(cls) -> Error:
        return cls("bad_field", "round must be an int in [0, 2147483647], got -1", "s1")


@dataclass
class Open(Message):
    """Robot -> server: start (or re-open) a session whose committed prefix is prompt_ids."""

    TYPE: ClassVar[str] = "open"
    sid: str
    prompt_ids: list[int]  # the whole committed prefix: prompt plus every committed token
    sampling: dict[str, Any]  # temperature, top_k, seed; top_p only when below 1 (older servers do not know it)
    slo: dict[str, Any] = field(default_factory=dict)  # optional latency targets in ms (used by the scheduler)
    exits: list[int] = field(default_factory=list)  # early-exit layers to stream verdicts from; [] = off
    payload: dict[str, Any] = field(default_factory=lambda: {"kind": "full", "k": 0})  # protocol.payload.PayloadSpec
    # constrained decoding (protocol/structured.py): {KIND: its text, "from": the index of prompt_ids where the
    # constrained part starts (the ids from there on are already under the grammar)}, KIND one of GRAMMAR_KINDS
    # (servers say which they take in Welcome.limits["grammar_kinds"]; before it, "gbnf" alone); None: unconstrained
    grammar: dict[str, Any] | None = None
    # the prompt's images (protocol/images.py): one per image marker in prompt_ids; [] for a text prompt
    images: list[Any] = field(default_factory=list)
    # the session's resume secret from its last `opened`: lets another connection (the robot back on a new
    # link while the old one still looks open) take the session over; "" = none (left off the wire)
    resume: str = ""

    def to_wire(self) -> dict[str, Any]:
        d = super().to_wire()
        if self.images:
            d["images"] = [im.to_wire() for im in self.images]
        else:
            del d["images"]  # a text prompt's open is what it was before images
        if not self.resume:
            del d["resume"]  # an open without one is what it was before resume secrets
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Open:
        s = _map(d.get("sampling"), "sampling")
        sampling = {
            "temperature": _float(s.get("temperature"), "sampling.temperature", 0.0, 100.0),
            "top_k": _int(s.get("top_k", 0), "sampling.top_k", 0, 1 << 24),
            "seed": _int(s.get("seed", 0), "sampling.seed", 0, 2**63 - 1),
        }
        if "top_p" in s:  # absent from older opens, which mean 1
            top_p = s["top_p"]
            if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
                raise WireError("bad_field", f"sampling.top_p must be a finite number in (0, 1], got {_show(top_p)}")
            sampling["top_p"] = float(top_p)
        ids = _ids(d.get("prompt_ids"), "prompt_ids")
        if not ids:
            raise WireError("bad_field", "prompt_ids must hold at least one token")
        exits = _ids(d.get("exits", []), "exits", 256)
        if sorted(set(exits)) != exits:
            raise WireError("bad_field", "exits must be increasing layer numbers without repeats")
        pl = _map(d.get("payload", {"kind": "full", "k": 0}), "payload")
        payload = {"kind": _str(pl.get("kind"), "payload.kind", 16), "k": _int(pl.get("k", 0), "payload.k", 0, 1 << 20)}
        grammar = d.get("grammar")
        if grammar is not None:
            grammar = _grammar(_map(grammar, "grammar"), len(ids))
        sid = _sid(d.get("sid"))
        try:
            images = image_wire.from_wire(d.get("images"), len(ids))
        except image_wire.ImageError as e:
            raise WireError("bad_image", str(e), sid) from None
        resume = _str(d.get("resume", ""), "resume", MAX_SECRET)
        return cls(sid, ids, sampling, _map(d.get("slo", {}), "slo"), exits, payload, grammar, images, resume)

    @classmethod
    def make_dummy(cls) -> Open:
        return cls("s1", [1, 2, 3], {"temperature": 0.0, "top_k": 0, "seed": 0}, resume="x" * 22)


@dataclass
class Opened(Message):
    TYPE: ClassVar[str] = "opened"
    sid: str
    n_committed: int  # the server's committed length (== len(prompt_ids))
    timing: dict[str, Any]  # prefill_ms, passes
    replica: str = ""  # the replica that holds the session now ("" from older servers)
    resume: str = ""  # the session's resume secret: send it as Open.resume to take the session over from
    # another connection that is still open (minted at its first open, kept while its robot re-opens it;
    # "" from older servers)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Opened:
        return cls(
            _sid(d.get("sid")),
            _int(d.get("n_committed"), "n_committed"),
            _timing(d.get("timing"), "timing"),
            _str(d.get("replica", ""), "replica", 64),
            _str(d.get("resume", ""), "resume", MAX_SECRET),
        )

    @classmethod
    def make_dummy(cls) -> Opened:
        return cls("s1", 3, {"prefill_ms": 1.0, "passes": 1}, "replica-0", "x" * 22)


@dataclass
class Verify(Message):
    """Robot -> server: one speculation round (packed).

    q is the round's payload (protocol/payload.py), by q["kind"]:
      none   {}                                   greedy: ids only
      full   probs fp16 [k, V]
      topk   ids int32 [k, K], probs fp16 [k, K]  (K as declared at open)
      split  px int [k]: q(x_i) * 2^23, three bytes each
    On the wire q is a list [kind, bytes...] whose shapes follow from k.
    `fix` (split) is the correction the robot drew after the previous round's
    rejection; the server commits it before this round's draft.
    `cands` (optional, int32 [k, K], K <= 64) are the draft's top-K ids at each
    position: early exits score only those rows of the LM head (FSD).
    """

    TYPE: ClassVar[str] = "verify"
    PACKED: ClassVar[bool] = True
    sid: str
    round: int
    n_committed: int  # the robot's committed length (fix included); a mismatch means divergence
    draft_ids: list[int]  # [k]; k can be zero (the server then returns one target token)
    q: dict[str, Any]
    fix: int | None = None
    cands: np.ndarray | None = None

    def to_wire(self) -> dict[str, Any]:
        d = super().to_wire()
        d["q"] = _q_to_wire(self.q)
        if self.cands is not None:
            d["cands"] = encode_array(np.asarray(self.cands, dtype=np.int32))
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Verify:
        draft = _ids(d.get("draft_ids"), "draft_ids", 256)
        q = _q_from_wire(d.get("q"), len(draft))
        cands = None
        if d.get("cands") is not None:
            cands = decode_array(d["cands"], "cands")
            if (
                cands.dtype != np.int32
                or cands.ndim != 2
                or cands.shape[0] != len(draft)
                or not 1 <= cands.shape[1] <= MAX_CANDIDATES
            ):
                raise WireError(
                    "bad_field",
                    f"cands must be int32 [k={len(draft)}, 1..{MAX_CANDIDATES}], got {cands.dtype} {list(cands.shape)}",
                )
            if cands.size and cands.min() < 0:
                raise WireError("bad_field", "cands holds a negative token id")
        fix = d.get("fix")
        return cls(
            _sid(d.get("sid")),
            _int(d.get("round"), "round"),
            _int(d.get("n_committed"), "n_committed", 1),
            draft,
            q,
            None if fix is None else _int(fix, "fix"),
            cands,
        )

    @classmethod
    def make_dummy(cls) -> Verify:
        return cls("s1", 0, 3, [4, 5], {"kind": "none"})


Q_KINDS = ("none", "full", "topk", "split")


def _q_to_wire(q: dict[str, Any]) -> list[Any]:
    kind = q["kind"]
    if kind == "full":
        return [kind, np.ascontiguousarray(q["probs"], dtype="<f2").tobytes()]
    if kind == "topk":
        return [
            kind,
            np.ascontiguousarray(q["ids"], dtype="<i4").tobytes(),
            np.ascontiguousarray(q["probs"], dtype="<f2").tobytes(),
        ]
    if kind == "split":
        px = np.asarray(q["px"], dtype="<u4")
        if px.size and px.max() >= 1 << 24:
            raise WireError("bad_field", "split q(x) counts must fit in three bytes")
        return [kind, px.view(np.uint8).reshape(-1, 4)[:, :3].tobytes()]
    return [kind]


def _q_from_wire(v: Any, k: int) -> dict[str, Any]:
    """[kind, bytes...] -> the q dict; shapes follow from k, any inconsistency is `bad_field`."""
    if not isinstance(v, list) or not v or not isinstance(v[0], str):
        raise WireError("bad_field", "q must be a list [kind, payload bytes...]")
    kind, parts = v[0], v[1:]
    if kind not in Q_KINDS:
        raise WireError("unsupported", f"q kind {_show(kind)} is not one of {', '.join(Q_KINDS)}")
    want = {"none": 0, "full": 1, "topk": 2, "split": 1}[kind]
    if len(parts) != want or not all(isinstance(b, bytes) for b in parts):
        raise WireError("bad_field", f"q of kind {kind} carries {want} byte string(s)")
    if kind == "none":
        return {"kind": "none"}
    if kind == "split":
        if len(parts[0]) != 3 * k:
            raise WireError("bad_field", f"split q carries {len(parts[0])} bytes, {k} draft tokens need {3 * k}")
        raw = np.frombuffer(parts[0], np.uint8).reshape(k, 3)
        return {
            "kind": "split",
            "px": raw[:, 0].astype(np.int64) | raw[:, 1].astype(np.int64) << 8 | raw[:, 2].astype(np.int64) << 16,
        }
    if k == 0:
        if any(parts):
            raise WireError("bad_field", "q of an empty draft must be empty")
        return (
            {"kind": kind, "probs": np.zeros((0, 0), np.float16)}
            if kind == "full"
            else {"kind": kind, "ids": np.zeros((0, 0), np.int32), "probs": np.zeros((0, 0), np.float16)}
        )
    if kind == "full":
        n = len(parts[0]) // 2
        if len(parts[0]) % (2 * k) or n == 0:
            raise WireError("bad_field", f"full q of {len(parts[0])} bytes is not fp16 [k={k}, vocab]")
        return {"kind": "full", "probs": np.frombuffer(parts[0], "<f2").reshape(k, n // k)}
    ids_b, probs_b = parts
    if len(ids_b) % (4 * k) or not ids_b or len(probs_b) * 2 != len(ids_b):
        raise WireError(
            "bad_field",
            f"topk q must be int32 ids [k={k}, K] and fp16 probs [k, K], got {len(ids_b)} and {len(probs_b)} bytes",
        )
    big_k = len(ids_b) // (4 * k)
    ids = np.frombuffer(ids_b, "<i4").reshape(k, big_k)
    return {"kind": "topk", "ids": ids, "probs": np.frombuffer(probs_b, "<f2").reshape(k, big_k)}


@dataclass
class Exit(Message):
    """Server -> robot: an early exit's verdict on a round, sent before the `result` (FSD).

    A hint only: `tokens` is what this exit predicts the round will commit (the
    accepted draft prefix and the next token); the `result` decides.
    """

    TYPE: ClassVar[str] = "exit"
    sid: str
    round: int
    layer: int  # decoder block after which the exit sits (1-based)
    tokens: list[int]  # draft_ids[:accepted] + [next token]
    confidence: float  # max softmax probability at the deciding position

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Exit:
        tokens = _ids(d.get("tokens"), "tokens", 257)
        if not tokens:
            raise WireError("bad_field", "an exit verdict holds at least the next token")
        return cls(
            _sid(d.get("sid")),
            _int(d.get("round"), "round"),
            _int(d.get("layer"), "layer", 1, 1 << 12),
            tokens,
            _float(d.get("confidence"), "confidence", 0.0, 1.0),
        )

    @classmethod
    def make_dummy(cls) -> Exit:
        return cls("s1", 0, 12, [4, 7], 0.9)


@dataclass
class Result(Message):
    """Server -> robot: the verdict on one round (packed).

    Split payloads: on a rejection `token` is -1 and `residual` carries the
    target's p_j as float32 logits {"logits": [n], "ids": [n] int32 or None}
    (sparse only when the session samples with top_k or top_p, where p_j is
    zero elsewhere); the robot draws the correction and sends it as the next
    round's `fix`. `n_committed` then does not count the correction yet.
    """

    TYPE: ClassVar[str] = "result"
    PACKED: ClassVar[bool] = True
    sid: str
    round: int
    accepted: int  # draft tokens kept; can be zero
    token: int  # correction at the first rejection, or the bonus token; -1: see residual
    n_committed: int  # the server's committed length after this round
    timing: dict[str, Any]  # verify_ms, passes; with exits: exit_layer (earliest exit that agreed), exit_ms
    residual: dict[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        d = super().to_wire()
        if self.residual is not None:
            r = self.residual
            d["residual"] = [np.ascontiguousarray(r["logits"], dtype="<f4").tobytes()]
            if r.get("ids") is not None:
                d["residual"].append(np.ascontiguousarray(r["ids"], dtype="<i4").tobytes())
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Result:
        residual = d.get("residual")
        token = _int(d.get("token"), "token", -1 if residual is not None else 0)
        if residual is not None:
            if (
                not isinstance(residual, list)
                or not 1 <= len(residual) <= 2
                or not all(isinstance(b, bytes) for b in residual)
                or not residual[0]
                or any(len(b) % 4 for b in residual)
            ):
                raise WireError("bad_field", "residual must be [float32 logits bytes, optional int32 ids bytes]")
            logits = np.frombuffer(residual[0], "<f4")
            ids = np.frombuffer(residual[1], "<i4") if len(residual) == 2 else None
            if ids is not None and len(ids) != len(logits):
                raise WireError("bad_field", "residual ids and logits differ in length")
            if np.isnan(logits).any() or np.isposinf(logits).any() or not np.isfinite(logits).any():
                raise WireError("bad_field", "residual logits must be finite or -inf, at least one finite")
            if ids is not None and ids.size and ids.min() < 0:
                raise WireError("bad_field", "residual ids hold a negative token id")
            if token != -1:
                raise WireError("bad_field", "a result with a residual has token -1")
            residual = {"logits": logits, "ids": ids}
        return cls(
            _sid(d.get("sid")),
            _int(d.get("round"), "round"),
            _int(d.get("accepted"), "accepted"),
            token,
            _int(d.get("n_committed"), "n_committed"),
            _timing(d.get("timing"), "timing"),
            residual,
        )

    @classmethod
    def make_dummy(cls) -> Result:
        return cls("s1", 0, 2, 7, 6, {"verify_ms": 1.5, "passes": 1})


@dataclass
class Ar(Message):
    """Robot -> server: stream target-only tokens (the cloud-autoregressive baseline)."""

    TYPE: ClassVar[str] = "ar"
    sid: str
    max_tokens: int
    stop_ids: list[int] = field(default_factory=list)
    fix: int | None = None  # split: the correction owed from the last verify round, committed first

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Ar:
        fix = d.get("fix")
        return cls(
            _sid(d.get("sid")),
            _int(d.get("max_tokens"), "max_tokens", 1, MAX_ID_LIST),
            _ids(d.get("stop_ids", []), "stop_ids", 64),
            None if fix is None else _int(fix, "fix"),
        )

    @classmethod
    def make_dummy(cls) -> Ar:
        return cls("s1", 16, [2])


@dataclass
class Token(Message):
    """Server -> robot: one streamed target token of an `ar` request."""

    TYPE: ClassVar[str] = "token"
    sid: str
    seq: int  # 0-based index within this ar request
    token: int
    done: bool  # the last token of the request (max_tokens or a stop id)
    timing: dict[str, Any]  # verify_ms (this step's forward pass), passes
    p: float | None = None  # the target's probability of `token` under the session's sampling
    # (1.0 when greedy): lets the robot estimate its acceptance while streaming

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Token:
        done = d.get("done")
        if not isinstance(done, bool):
            raise WireError("bad_field", "done must be a bool")
        p = d.get("p")
        return cls(
            _sid(d.get("sid")),
            _int(d.get("seq"), "seq"),
            _int(d.get("token"), "token"),
            done,
            _timing(d.get("timing"), "timing"),
            None if p is None else _float(p, "p", 0.0, 1.0),
        )

    @classmethod
    def make_dummy(cls) -> Token:
        return cls("s1", 0, 42, False, {"verify_ms": 1.0, "passes": 1}, 0.25)


@dataclass
class Close(Message):
    TYPE: ClassVar[str] = "close"
    sid: str

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Close:
        return cls(_sid(d.get("sid")))

    @classmethod
    def make_dummy(cls) -> Close:
        return cls("s1")


MESSAGES: dict[str, type[Message]] = {
    m.TYPE: m for m in (Hello, Welcome, Error, Open, Opened, Verify, Exit, Result, Ar, Token, Close)
}


_NAMES: dict[type, tuple[str, ...]] = {}  # one entry per message type


def _names(cls: type[Message]) -> tuple[str, ...]:
    """A message type's field names, in order (dataclasses.fields walks the class each call: every round)."""
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def encode(msg: Message) -> bytes:
    d = msg.to_wire()
    if msg.PACKED:
        values = [d[name] for name in _names(type(msg))]
        while values and values[-1] is None:  # absent optional fields at the tail cost nothing
            values.pop()
        packed: bytes = msgpack.packb([d["v"], d["type"], *values], use_bin_type=True)
        return packed
    packed = msgpack.packb(d, use_bin_type=True)
    return packed


def _unpack(a: list[Any]) -> dict[str, Any]:
    """A packed frame [v, type, *fields] -> the same map its unpacked form would be."""
    if len(a) < 2 or not isinstance(a[1], str) or a[1] not in MESSAGES or not MESSAGES[a[1]].PACKED:
        raise WireError(
            "bad_frame",
            "an array frame must be [v, type, fields...] of a packed message "
            f"({', '.join(t for t, m in MESSAGES.items() if m.PACKED)})",
        )
    names = _names(MESSAGES[a[1]])
    if len(a) - 2 > len(names):
        raise WireError("bad_frame", f"a packed {a[1]} has at most {len(names)} fields, got {len(a) - 2}")
    return {"v": a[0], "type": a[1], **dict(zip(names, a[2:], strict=False))}  # trailing absent fields left off


def decode(frame: Any, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """One websocket frame -> a validated message; raises WireError with a code on anything else."""
    if isinstance(frame, str):
        raise WireError("bad_frame", "text frames are not accepted; send binary msgpack")
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise WireError("bad_frame", f"a frame must be bytes, got {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise WireError("too_large", f"frame of {len(frame)} bytes exceeds the cap of {max_bytes}")
    try:
        d = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bytes,
            max_str_len=MAX_SCHEMA_CHARS * 4,  # the longest string a message holds (UTF-8); each field checks its own
            max_array_len=MAX_ID_LIST,
            max_map_len=64,
        )
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError("bad_frame", f"not a msgpack message: {type(e).__name__}") from None
    if isinstance(d, list):
        d = _unpack(d)
    if not isinstance(d, dict):
        raise WireError("bad_frame", "a message must be a msgpack map or a packed array")
    v, kind = d.get("v"), d.get("type")
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise WireError(
            "bad_version", f"protocol version {_show(v)} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError("bad_type", f"unknown message type {_show(kind)}")
    try:
        return cls.from_wire(d)
    except WireError as e:
        e.sid = _valid_sid(d.get("sid"))  # an error names its session only if the sid is one
        raise
    except Exception as e:  # a check that missed a case: still the sender's bad message, never a crash
        log.warning("decoding a %s message failed unexpectedly", kind, exc_info=True)
        raise WireError(
            "bad_field", f"{kind}: a field cannot be read ({type(e).__name__})", _valid_sid(d.get("sid"))
        ) from e


__all__ = [m.__name__ for m in MESSAGES.values()] + [
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_FRAME_BYTES",
    "WireError",
    "encode",
    "decode",
    "encode_array",
    "decode_array",
]
