"""The Python API of the decoder on the robot: `Client` (connect, generate, stream) without the CLI.

    from agent import Client

    with Client("ws://127.0.0.1:8765") as client:
        answer = client.generate("The capital of France is", max_tokens=8)
        print(answer.text, answer.verified, answer.metrics.tau)
        for piece in client.stream(messages=[{"role": "user", "content": "Say hi."}]):
            print(piece, end="")

Every token of a verified answer is the verifier's (SD, FSD or AR underneath, agent/decoding/decoder.py). When the
verifier cannot be reached the client either refuses (`VerifierUnavailable`, offline="refuse") or answers with
the draft alone and says so (`verified=False`, offline="local"), as the client or the call chooses.
Structured output (`schema`: a JSON schema; `grammar`: GBNF, or {"lark": text}) is decoded under it on both
sides (LLGuidance, protocol/structured.py), as the navigation answer is. docs/guide/python.md is the page; the
OpenAI-compatible endpoint (agent/app/openai_api.py) is built on this class.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import queue
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.decoder import MODES
from agent.decoding.link import LinkLost
from agent.decoding.metrics import Generation, Metrics
from protocol import structured, wire
from protocol.grammar import GrammarError, SchemaError
from protocol.images import MAX_IMAGE_BYTES, MAX_IMAGES, PromptImage, check_bytes
from protocol.sampling import SamplingParams

__all__ = ["Client", "Completion", "Piece", "RequestError", "Stream", "VerifierUnavailable", "schema_grammar"]

OFFLINE = ("refuse", "local")  # what a request does when the verifier cannot be reached
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 64  # characters per stop string
MAX_MESSAGES = 64  # messages per chat request
MAX_PEER = 200  # characters of a peer's name (generate(peer=...))
MAX_IMAGE_URI = 32 + (MAX_IMAGE_BYTES * 4 + 2) // 3 + 4  # a data: URI of the largest image


class RequestError(ValueError):
    """A request the client will not run (a bad parameter, an unreadable image); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class VerifierUnavailable(RuntimeError):
    """The verifier cannot be reached and the request's offline policy is "refuse"."""


@dataclass
class Completion:
    """One answer: its text and ids, whether every token is the verifier's, why it ended, and the figures."""

    text: str
    token_ids: list[int]  # generated ids (a final stop id included)
    verified: bool  # every token came from the verifier; False: the draft alone answered (the link was down)
    mode: str  # the decoding mode that produced the last token: ar | sd | fsd | local
    finish_reason: str  # stop (a stop id or stop string) | length (max_tokens)
    prompt_tokens: int
    metrics: Metrics = field(default_factory=Metrics)  # summed over the verified and local parts
    verified_tokens: int = 0  # how many of token_ids the verifier committed

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def json(self) -> Any:
        """The text parsed as JSON (for a `schema` answer)."""
        return json.loads(self.text)


# JSON's whitespace between tokens in an answer: one optional space, as llama.cpp's converter wrote it. LLGuidance's
# default admits any run of whitespace, and a small model can spend its whole budget on newlines.
COMPACT_JSON = {"whitespace_pattern": " ?"}


def compact(schema: Any) -> Any:
    """The schema with LLGuidance's whitespace option COMPACT_JSON, unless it sets its own (`x-guidance`)."""
    return {**schema, "x-guidance": COMPACT_JSON} if isinstance(schema, dict) and "x-guidance" not in schema else schema


def schema_grammar(schema: dict[str, Any] | str) -> dict[str, str]:
    """A JSON schema (a dict or its JSON text) -> the grammar an open sends ({"json_schema": text}): the schema
    itself (compact: COMPACT_JSON), which both sides compile with LLGuidance (protocol/structured.py), once it is
    within bounds (structured.check_schema: size, nesting, enums, patterns); RequestError naming the keyword
    otherwise."""
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as e:
        raise RequestError(f"the schema is not JSON: {e}", "schema") from None
    try:
        parsed = structured.check_schema(text)
    except SchemaError as e:
        raise RequestError(f"the schema cannot be used ({e.keyword or 'schema'}): {e}", "schema") from None
    return {"json_schema": json.dumps(compact(parsed), separators=(",", ":"))}


def image_bytes(url: str, param: str = "image_url") -> bytes:
    """A `data:image/...;base64,` URI -> the image's bytes, bounded by its length before it is decoded and by
    protocol.images.check_bytes after (JPEG or PNG, size, header). Other URLs are refused: nothing is fetched."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise RequestError("an image is a data: URI (data:image/jpeg;base64,...); nothing is fetched", param)
    if len(url) > MAX_IMAGE_URI:
        raise RequestError(f"an image is at most {MAX_IMAGE_BYTES} bytes", param)
    head, _, b64 = url.partition(",")
    if not head.endswith(";base64"):
        raise RequestError("an image's data: URI must be base64", param)
    try:
        return check_bytes(base64.b64decode(b64, validate=True))
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"unreadable image: {e}", param) from None


class Piece(str):
    """A piece of streamed text; `verified`: the verifier committed its tokens (False: the draft alone)."""

    verified: bool = True


class Stream:
    """The text pieces of one answer as the verifier commits them (iterate it); `completion` once it is over.
    A consumer that stops early calls close() (or leaves the `with` block): the generation ends at once."""

    _END = object()

    def __init__(self, run: Callable[[Callable[[str], bool]], Completion], max_pieces: int) -> None:
        # at most one piece per committed token and the final flush: bounded by max_tokens, never blocks
        self._q: queue.Queue[Any] = queue.Queue(max_pieces + 2)
        self._cancel = threading.Event()
        self.completion: Completion | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, args=(run,), name="client-stream", daemon=True)
        self._thread.start()

    def _emit(self, piece: str) -> bool:
        """The generation's callback: hand a piece on; True when the consumer has gone (end the generation)."""
        if piece:
            self._q.put_nowait(piece)
        return self._cancel.is_set()

    def _work(self, run: Callable[[Callable[[str], bool]], Completion]) -> None:
        try:
            self.completion = run(self._emit)
        except BaseException as e:  # handed to the consumer, raised from its next()
            self._error = e
        finally:
            self._q.put(self._END)

    def __iter__(self) -> Iterator[str]:
        while True:
            item = self._q.get()
            if item is self._END:
                self._q.put(self._END)  # a second iteration ends at once
                break
            yield item
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """End the generation at its next token, without waiting for it (close() waits)."""
        self._cancel.set()

    def close(self) -> None:
        self._cancel.set()
        self._thread.join()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Pieces:
    """Text as it grows with the committed ids, handed on in pieces: a piece never ends in half a UTF-8
    character, and the last len(longest stop) - 1 characters wait until no stop string can start in them."""

    def __init__(self, detok: Callable[[list[int]], str], stops: Sequence[str], emit: Callable[[str], bool]) -> None:
        self.detok, self.stops, self.emit = detok, list(stops), emit
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.sent = ""
        self.verified = True  # the pieces handed on now are the verifier's
        self.cut_at: int | None = None  # where a stop string begins in the text, once one has appeared

    def until(self, ids: list[int]) -> bool:
        """The decoder's `until`: True ends the generation (a stop string is out, or the consumer has gone)."""
        text = self.detok(ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.cut_at = min(hits)
            self._send(text[: self.cut_at])
            return True
        safe = text.rstrip("\ufffd")
        return self._send(safe[: max(len(self.sent), len(safe) - self.hold)])

    def _send(self, text: str) -> bool:
        if text.startswith(self.sent) and len(text) > len(self.sent):
            piece, self.sent = Piece(text[len(self.sent) :]), text
            piece.verified = self.verified
            return self.emit(piece)
        return self.emit("")

    def final(self, text: str) -> str:
        """The answer's text (cut before a stop string), its unsent rest handed on."""
        if self.cut_at is None:
            hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
            text = text[: min(hits)] if hits else text
        else:
            text = text[: self.cut_at]
        self._send(text)
        return text


class Client:
    """The decoder on the robot: a draft model and the verifier's link, one generation at a time (thread-safe:
    calls from several threads queue on a lock). A context manager; close() drops the link."""

    def __init__(
        self,
        settings: DecoderSettings | str | None = None,
        *,
        offline: str = "refuse",
        drafter: Any = None,
        lock: AbstractContextManager[Any] | None = None,
        **fields: Any,
    ) -> None:
        """`settings`: the decoder's DecoderSettings, or only the verifier's ws:// or wss:// URL (None: the
        draft alone, every answer unverified). `fields` replace settings by name: draft="PATH.gguf",
        token=..., mode="ar", gamma=8, threads=4, ... (agent/decoding/settings.py).
        `drafter`: an already loaded agent.decoding.drafter.Drafter to share (then draft* and threads are unused).
        `lock`: held around every generation; pass the one other users of a shared `drafter` hold."""
        if not isinstance(settings, DecoderSettings):
            settings = DecoderSettings(verifier=settings)
        try:
            settings = dataclasses.replace(settings, **fields)
        except TypeError as e:  # a keyword that is no setting
            raise RequestError(f"Client: {e}") from None
        if settings.mode not in MODES or settings.mode == "local":
            raise RequestError(f"mode must be one of ar, sd, fsd, got {settings.mode!r}", "mode")
        if offline not in OFFLINE:
            raise RequestError(f"offline must be one of {OFFLINE}, got {offline!r}", "offline")
        self.settings, self.offline = settings, offline
        self.decoder = open_decoder(settings, drafter)
        self.drafter = self.decoder.drafter
        self.lock: AbstractContextManager[Any] = lock or threading.Lock()  # one generation at a time

    @property
    def model(self) -> str:
        """The draft's name (a verified answer's tokens are the verifier's target's)."""
        return str(self.drafter.name)

    def connect(self) -> bool:
        """Bring the verifier link up now; False when it cannot be (or no verifier is configured)."""
        with self.lock:
            return self.settings.url is not None and self.decoder.connect()

    def close(self) -> None:
        with self.lock:
            self.decoder.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ requests

    def generate(self, prompt: str | None = None, **kw: Any) -> Completion:
        """One answer. `prompt` (text, raw unless chat=True) or `messages` (OpenAI chat messages through the
        model's chat template; content parts may hold image_url data URIs), and optionally: max_tokens (64),
        temperature (0: greedy), top_p (nucleus, exact on both sides; 1: off), top_k,
        seed, stop (strings), images (bytes, with `prompt`), schema (a JSON schema) or grammar (GBNF),
        offline ("refuse" | "local": overrides the client's), mode, peer (who asks, for a service answering
        several callers: a schema's first compile takes turns between peers, so one caller's slow grammars never
        hold up another's)."""
        return self._run(prompt, kw, lambda piece: False)

    def stream(self, prompt: str | None = None, **kw: Any) -> Stream:
        """generate()'s answer as text pieces while the verifier commits its tokens: iterate the Stream; its
        `completion` holds the whole answer once the iteration is over."""
        max_tokens = kw.get("max_tokens", 64)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 1 << 16:
            raise RequestError("max_tokens must be an integer from 1 to 65536", "max_tokens")
        return Stream(lambda emit: self._run(prompt, kw, emit), max_tokens)

    def _run(self, prompt: str | None, kw: dict[str, Any], emit: Callable[[str], bool]) -> Completion:
        req = _Request.of(prompt, kw, self.settings.mode, self.offline)
        grammar = self._grammar(req)  # before the model's lock: a schema's conversion never holds it
        with self.lock:
            ids, images = self._prompt(req)
            self._check_context(len(ids), req.max_tokens)
            pieces = _Pieces(lambda out: self.drafter.detokenize(out, skip=self.decoder.stop_ids()), req.stop, emit)
            try:
                return self._decode(req, ids, images, grammar, pieces)
            except GrammarError as e:  # LLGuidance's own bounds met midway (a row of 2,000 items: wide anyOfs)
                param = "schema" if req.schema is not None else "grammar"
                reason = str(e).splitlines()[0]
                raise RequestError(f"the {param} cannot be enforced past what was generated: {reason}", param) from None

    def _grammar(self, req: _Request) -> dict[str, str] | None:
        """The request's grammar as an open sends it, compiled over the draft's vocabulary once here (off the
        model's lock) so that one LLGuidance refuses is a RequestError naming the keyword, not a failure midway
        (the compiled grammar is cached: the generation finds it)."""
        if req.schema is None and req.grammar is None:
            return None
        grammar = schema_grammar(req.schema) if req.schema is not None else req.grammar
        assert grammar is not None
        vocab = getattr(self.drafter, "grammars", None)
        if vocab is not None:
            param = "schema" if req.schema is not None else "grammar"
            try:
                vocab.for_wire(grammar, req.peer)
            except SchemaError as e:
                raise RequestError(f"the schema cannot be enforced ({e.keyword or 'schema'}): {e}", param) from None
            except GrammarError as e:
                raise RequestError(f"the {param} cannot be used: {e}", param) from None
        return grammar

    def _check_context(self, n_prompt: int, max_tokens: int) -> None:
        """The prompt and max_tokens must fit the draft's context (the verifier's is at least as large)."""
        llm = getattr(self.drafter, "llm", None)
        if llm is None:
            return
        cells = self.drafter.kv_cells(n_prompt) if hasattr(self.drafter, "kv_cells") else n_prompt
        if cells + max_tokens >= llm.n_ctx():
            raise RequestError(
                f"the prompt ({cells} positions) and max_tokens ({max_tokens}) exceed the draft's context of "
                f"{llm.n_ctx()}: ask for fewer tokens or send a shorter prompt",
                "max_tokens",
            )

    def _prompt(self, req: _Request) -> tuple[list[int], list[PromptImage]]:
        """The prompt's ids and its images on their markers."""
        d = self.drafter
        try:
            if req.messages is None:
                assert req.prompt is not None
                if req.images:
                    return d.image_prompt(req.prompt, req.images, chat=req.chat)
                return d.tokenize(req.prompt, chat=req.chat), []
            messages, images = _chat_messages(req.messages)
            if images and getattr(d, "image_marker", None) is None:  # (its chat template would fail on them)
                raise RequestError(
                    f"draft {d.name} reads text only: load it with its mmproj to send images", "messages"
                )
            ids = d.tokenize(d.apply_chat_template(messages))
        except RequestError:
            raise
        except ValueError as e:  # no chat template, a text-only draft given images, marker counts
            raise RequestError(str(e), "messages" if req.messages is not None else "prompt") from None
        if not images:
            return ids, []
        at = [i for i, t in enumerate(ids) if t == getattr(d, "image_marker", None)]
        if getattr(d, "image_marker", None) is None or len(at) != len(images):
            raise RequestError(f"draft {d.name} reads text only: load it with its mmproj to send images", "messages")
        return ids, [PromptImage.of(data, i) for data, i in zip(images, at, strict=True)]

    def _decode(
        self,
        req: _Request,
        ids: list[int],
        images: list[PromptImage],
        grammar: dict[str, str] | None,
        pieces: _Pieces,
    ) -> Completion:
        """Verified when the link is up; else, or when it drops midway, the draft alone (offline "local") from
        what the verifier committed, or VerifierUnavailable (offline "refuse")."""
        dec = self.decoder
        args = dict(max_tokens=req.max_tokens, params=req.params, gamma=self.settings.gamma, images=images)
        gen: Generation | None = None
        done: list[int] = []
        if self.settings.url is not None and dec.connect():
            try:
                gen = dec.generate(ids, mode=req.mode, grammar=grammar, until=self._at_rounds(pieces.until), **args)  # type: ignore[arg-type]
            except LinkLost as e:
                done = list(getattr(e, "token_ids", []) or [])
                if req.offline == "refuse":
                    raise VerifierUnavailable(f"the verifier's link dropped: {e}") from None
        elif req.offline == "refuse":
            where = self.settings.url or "none configured"
            raise VerifierUnavailable(f"the verifier cannot be reached ({where})")
        if gen is not None:
            return self._completion(gen.token_ids, gen, [gen.metrics], len(ids), req, pieces, len(gen.token_ids))
        args["max_tokens"] = req.max_tokens - len(done)
        pieces.verified = False
        local = dec.generate(
            ids + done,
            mode="local",
            grammar=grammar,
            grammar_from=len(ids) if grammar is not None else None,
            until=self._at_rounds(lambda out: pieces.until(done + out)),
            **args,  # type: ignore[arg-type]
        )
        return self._completion(done + local.token_ids, local, [local.metrics], len(ids), req, pieces, len(done))

    def _at_rounds(self, until: Callable[[list[int]], bool]) -> Callable[[list[int]], bool]:
        """`until`, asked by the decoder between two rounds, with the model's turn given up there first when the
        lock says someone goes first (agent/app/drafting.py's ModelTurns: the robot's navigation step)."""
        give_way = getattr(self.lock, "yield_turn", None)
        if give_way is None:
            return until

        def at_round(ids: list[int]) -> bool:
            give_way(self.drafter)
            return until(ids)

        return at_round

    def _completion(
        self,
        out: list[int],
        gen: Generation,
        parts: list[Metrics],
        n_prompt: int,
        req: _Request,
        pieces: _Pieces,
        verified: int,
    ) -> Completion:
        text = pieces.final(self.drafter.detokenize(out, skip=self.decoder.stop_ids()))
        stopped = pieces.cut_at is not None or bool(out and out[-1] in self.decoder.stop_ids())
        finish = "stop" if stopped or len(out) < req.max_tokens else "length"
        return Completion(
            text, out, verified == len(out), gen.mode, finish, n_prompt, parts[-1], verified_tokens=verified
        )


@dataclass
class _Request:
    """One generate()/stream() call's arguments, checked."""

    prompt: str | None
    messages: list[Any] | None
    chat: bool
    images: list[bytes]
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    schema: dict[str, Any] | str | None
    grammar: dict[str, str] | None  # {"gbnf": text} or {"lark": text}
    offline: str
    mode: str
    peer: str  # who asks: grammar compiles take turns between peers (protocol/sandbox.py)

    @classmethod
    def of(cls, prompt: str | None, kw: dict[str, Any], mode: str, offline: str) -> _Request:
        known = {"messages", "chat", "images", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
        bad = set(kw) - known - {"schema", "grammar", "offline", "mode", "peer"}
        if bad:
            raise TypeError(f"unknown argument(s): {', '.join(sorted(bad))}")
        messages = kw.get("messages")
        if (prompt is None) == (messages is None):
            raise RequestError("give a prompt or messages (one of them)", "messages")
        if prompt is not None and not isinstance(prompt, str):
            raise RequestError("prompt must be a string", "prompt")
        if messages is not None and (not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES):
            raise RequestError(f"messages must be a list of 1 to {MAX_MESSAGES} messages", "messages")
        max_tokens = _int(kw.get("max_tokens", 64), "max_tokens", 1, 1 << 16)
        params = _params(kw)
        stop = _stops(kw.get("stop"))
        images = [check_image(b) for b in kw.get("images") or []]
        if len(images) > MAX_IMAGES:
            raise RequestError(f"at most {MAX_IMAGES} images", "images")
        schema, grammar = kw.get("schema"), kw.get("grammar")
        if schema is not None and grammar is not None:
            raise RequestError("give a schema or a grammar, not both", "schema")
        if isinstance(grammar, str):
            grammar = {"gbnf": grammar}
        if grammar is not None and not (
            isinstance(grammar, dict)
            and len(grammar) == 1
            and set(grammar) <= {"gbnf", "lark"}
            and all(isinstance(t, str) and len(t) <= wire.GRAMMAR_KINDS[k] for k, t in grammar.items())
        ):
            raise RequestError(
                f"grammar is GBNF text or {{'lark': text}}, of at most {wire.MAX_GBNF_CHARS} characters (lark: "
                f"{wire.GRAMMAR_KINDS['lark']})",
                "grammar",
            )
        off = kw.get("offline") or offline
        if off not in OFFLINE:
            raise RequestError(f"offline must be one of {OFFLINE}, got {off!r}", "offline")
        m = kw.get("mode") or mode
        if m not in ("ar", "sd", "fsd"):
            raise RequestError(f"mode must be one of ar, sd, fsd, got {m!r}", "mode")
        chat = bool(kw.get("chat", False))
        peer = kw.get("peer", "")
        if not isinstance(peer, str) or len(peer) > MAX_PEER:
            raise RequestError(f"peer must be a string of at most {MAX_PEER} characters", "peer")
        return cls(prompt, messages, chat, images, max_tokens, params, stop, schema, grammar, off, m, peer)


def check_image(data: Any) -> bytes:
    try:
        return check_bytes(data)
    except ValueError as e:
        raise RequestError(str(e), "images") from None


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise RequestError(f"{name} must be an integer from {lo} to {hi}, got {value!r}", name)
    return value


def _params(kw: dict[str, Any]) -> SamplingParams:
    """temperature, top_p, top_k, seed -> SamplingParams (each checked: a RequestError naming it)."""
    t = kw.get("temperature", 0.0)
    if t is None:
        t = 0.0
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 <= t <= 2.0:
        raise RequestError(f"temperature must be a number from 0 to 2, got {t!r}", "temperature")
    top_p = kw.get("top_p")
    if top_p is None:
        top_p = 1.0
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be a number in (0, 1], got {top_p!r}", "top_p")
    top_k = _int(kw.get("top_k") or 0, "top_k", 0, 1 << 20)
    seed = kw.get("seed")
    seed = 0 if seed is None else _int(seed, "seed", -(1 << 63), (1 << 64) - 1) % (1 << 32)
    return SamplingParams(temperature=float(t), top_k=top_k, seed=seed, top_p=float(top_p))


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise RequestError(f"stop is a string or a list of at most {MAX_STOPS} strings", "stop")
    if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise RequestError(f"each stop string has 1 to {MAX_STOP_CHARS} characters", "stop")
    return list(stops)


def _chat_messages(messages: list[Any]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """OpenAI chat messages -> the chat template's messages and the images in order. A content list's text
    parts join into one string, or, with images, stay parts beside {"type": "image"} (the templates' layout)."""
    out: list[dict[str, Any]] = []
    images: list[bytes] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise RequestError(f"messages[{i}] is an object with a role (system, user, assistant, tool)", "messages")
        role = "system" if msg["role"] == "developer" else msg["role"]
        content = msg.get("content")
        if content is None and msg.get("tool_calls"):
            content = json.dumps([c.get("function") for c in msg["tool_calls"] if isinstance(c, dict)])
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"messages[{i}].content is a string or a list of parts", "messages")
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url" and isinstance(part.get("image_url"), dict):
                if len(images) == MAX_IMAGES:  # before decoding one more
                    raise RequestError(f"at most {MAX_IMAGES} images in one request", "messages")
                images.append(image_bytes(part["image_url"].get("url"), f"messages[{i}].content[{j}].image_url"))
                parts.append({"type": "image"})
            else:
                raise RequestError(f"messages[{i}].content[{j}] is a text or image_url part", "messages")
        has_image = any(p["type"] == "image" for p in parts)
        out.append({"role": role, "content": parts if has_image else "".join(p["text"] for p in parts)})
    return out, images
