"""Structured output with LLGuidance, identical on both sides: a JSON schema or a grammar over a model's vocabulary.

LLGuidance (github.com/guidance-ai/llguidance) compiles a JSON schema, a Lark grammar or a regex into a matcher
over one tokenizer and computes the set of tokens that may come next in microseconds: on JSONSchemaBench's
MaskBench it passes the most schemas of the public engines, and here a mask over the shipped vocabulary
(49,152 tokens) costs ~6 us at the median (`tools/bench/schemas.py`). The robot and the server each build a
`Vocabulary` from their own GGUF (the handshake has checked the two are the same), compile the same grammar and
walk it through the same ids, so both see the same mask at every position: the draft drafts under it and the
target's p is masked by it, p'(x) = p(x) 1[x allowed] / sum_y p(y) 1[y allowed].

A schema is checked on itself before it is compiled (`check_schema`, one linear walk): its size, nesting, the
values of one enum and a pattern's repetition counts are bounded, since LLGuidance writes a pattern's `{m,n}`
into its lexer (`"^a{1000000}$"` took 0.6 s for its first mask) and enumerates an enum before its own limits
refuse it (100,000 values: 0.3 s). Whatever LLGuidance does not support is refused with its own reason (oneOf,
uniqueItems, look-around in a pattern: `SchemaError` naming the keyword), never approximated: a grammar that
admits what the schema forbids would break the promise that the answer validates.

Both sides' decoding code asks a `ConstraintState` (mask, allows, argmax, accept, advance, rollback, clone); the
typed refusals (GrammarError, SchemaError) are protocol/grammar.py's.
"""

from __future__ import annotations

import json
import re
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import numpy as np

from .grammar import GrammarError, SchemaError

if TYPE_CHECKING:  # typing only: llguidance and llama_cpp are imported when a vocabulary is first built
    import llguidance
    from llama_cpp import llama_vocab_p

TokenIds = Sequence[int] | np.ndarray  # [n] token ids, a list or an int array

# The caps on a schema, checked on its JSON before anything compiles (tools/bench/schema_caps.py measures each: what it
# refuses of JSONSchemaBench, and what the engine costs past it). Each bounds what LLGuidance cannot serve in bounded
# time or memory; what it serves cheaply (an enum's length, a pattern's) is bounded only by the schema's bytes.
MAX_SCHEMA_BYTES = 1 << 20  # JSON text: 893 KiB (kb_1161) compiles in 0.12 s; 1.1 MB of properties takes 1.06 s
MAX_SCHEMA_DEPTH = 128  # JSON values nested: LLGuidance's own recursion limit refuses deeper schemas anyway
MAX_SCHEMA_NODES = 100_000  # JSON values, an enum's included: 51 ms of walk here at the cap; compiles meet the deadline
MAX_OPTIONAL_PROPERTIES = 480  # of one object: each adds ~4 items to a parser row, and LLGuidance stops at 2,000
MAX_PATTERN_REPEAT = 1000  # a pattern's {m,n}: ^a{1000}$ costs 0.27 ms a mask at p99 here, ^a{4000}$ 1.1 ms
MAX_COMPILED = 32  # compiled grammars kept per vocabulary, least recently used out
COMPILE_TIMEOUT_S = 0.9  # one compile's wait: a refusal costs under 1 s (JSONSchemaBench: 0.7 ms p50, 0.3 s max)
MAX_DROPPED_FORMATS = 8  # unknown formats dropped from one schema (each costs a compile)
KINDS = ("json_schema", "lark", "gbnf", "regex")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _limits() -> llguidance.LLParserLimits:
    """LLGuidance's own bounds on the work of one compile and one mask (its defaults, stated here)."""
    import llguidance

    return llguidance.LLParserLimits(
        max_items_in_row=2000,
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=250_000,
        max_grammar_size=500_000,
    )


class Vocabulary:
    """One model's vocabulary as LLGuidance reads it, from a llama_vocab pointer (~0.2 s: build it once).

    `vocab` belongs to a model that outlives this object (`owner` is kept to make sure); `n_vocab` is the width of
    the model's logits, which may be more than the tokenizer's tokens (a padded vocabulary: the rest are never
    allowed). End of sequence is the vocabulary's own EOS token, allowed where the grammar may end.
    """

    def __init__(self, vocab: llama_vocab_p, n_vocab: int, owner: object = None) -> None:
        import llguidance.llamacpp

        if not vocab:
            raise GrammarError("no vocabulary to compile the grammar over (a null llama_vocab pointer)")
        with warnings.catch_warnings():  # it reads each token's attributes through a deprecated llama_cpp call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(vocab, n_vocab=n_vocab)
        self.n_vocab = n_vocab
        self._owner = owner
        self._compiled: OrderedDict[str, Constraint] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, kind: str, text: str, timeout_s: float | None = None) -> Constraint:
        """The grammar `text` of `kind` (json_schema: a schema's JSON text; lark; regex) compiled over this
        vocabulary, from the cache where it was compiled before; SchemaError or GrammarError saying why not.
        `timeout_s`: the wait for the compile (default COMPILE_TIMEOUT_S)."""
        key = f"{kind}\0{text}"
        found = self._cached(key)
        if found is not None:
            return found
        constraint = Constraint(self, kind, text, COMPILE_TIMEOUT_S if timeout_s is None else timeout_s)
        self._keep(key, constraint)
        return constraint

    def _cached(self, key: str) -> Constraint | None:
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
            return found

    def _keep(self, key: str, constraint: Constraint) -> None:
        with self._lock:
            self._compiled[key] = constraint
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)

    def for_wire(self, grammar: dict[str, Any]) -> Constraint:
        """The constraint of an open's grammar (protocol.wire: {KIND: text, "from": ...}), as both sides build it."""
        if "json_schema" in grammar:
            return self.schema(grammar["json_schema"])
        kind = next((k for k in ("lark", "gbnf") if k in grammar), None)
        if kind is None:
            raise GrammarError(f"a grammar holds json_schema, lark or gbnf, not {sorted(grammar)}")
        return self.compile(kind, grammar[kind])

    def schema(self, schema: Any) -> Constraint:
        """A JSON schema (a dict, a bool, or its JSON text), checked (check_schema) and compiled.

        A `format` LLGuidance does not know is dropped and the schema compiled again: JSON Schema makes `format` an
        annotation unless a schema asks for format assertion, so a validator ignores it too (the answer still
        validates). Every other refusal stands."""
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        asked = f"json_schema\0{text}"
        found = self._cached(asked)  # checked and compiled before (the Client, then the generation's Run)
        if found is not None:
            return found
        parsed = check_schema(text)
        dropped: set[str] = set()
        deadline = time.monotonic() + COMPILE_TIMEOUT_S  # one wait for all the compiles of this schema
        while True:
            try:
                constraint = self.compile("json_schema", text, max(0.0, deadline - time.monotonic()))
                if dropped:  # found again by the text it was asked for, formats and all
                    self._keep(asked, constraint)
                return constraint
            except SchemaError as e:
                unknown = _UNKNOWN_FORMAT.search(str(e))
                if not unknown or unknown.group(1) in dropped or len(dropped) >= MAX_DROPPED_FORMATS:
                    raise
                dropped.add(unknown.group(1))
                text = json.dumps(_without_formats(parsed, dropped), separators=(",", ":"))


class Constraint:
    """One compiled grammar over one vocabulary. `start()` gives a state at its root."""

    def __init__(self, vocab: Vocabulary, kind: str, text: str, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        import llguidance

        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}: one of {', '.join(KINDS)}")
        if len(text.encode("utf-8")) > MAX_SCHEMA_BYTES:
            raise GrammarError(f"the grammar is {len(text.encode('utf-8'))} bytes; at most {MAX_SCHEMA_BYTES}")
        self.vocab, self.kind, self.text = vocab, kind, text
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

        try:
            if kind == "gbnf":  # llama.cpp's grammars, as older robots and callers send them
                try:
                    lark = gbnf_to_lark(text)
                except GbnfToLarkError:
                    raise
                except Exception as e:  # the converter raises a bare Exception for an undefined rule
                    raise ValueError(str(e)) from None
                spec = llguidance.grammar_from("lark", lark)
            else:
                spec = llguidance.grammar_from(kind, text)  # type: ignore[arg-type]
        except (GbnfToLarkError, ValueError, TypeError, RecursionError) as e:
            raise _refusal(kind, str(e)) from None
        self._root = _compile(vocab.tokenizer, spec, timeout_s)
        if self._root.is_error():
            raise _refusal(kind, self._root.get_error())
        try:  # the first mask, here rather than at a generation's first token: LLGuidance's parser limits (a row of
            self.start().mask()  # 2,000 items: an anyOf of two wide objects) may refuse a grammar it compiled
        except GrammarError as e:
            raise _refusal(kind, str(e).removeprefix("the grammar failed: ")) from None

    def start(self) -> ConstraintState:
        return ConstraintState(self, self._root.deep_copy())

    def walk(self, ids: TokenIds) -> ConstraintState:
        """The state after `ids` from the root; GrammarError at the first id it forbids."""
        state = self.start()
        n = state.advance(ids)
        if n < len(ids):
            raise GrammarError(f"token {int(ids[n])} at position {n} of the constrained part is not allowed")
        return state


_worker: list[ThreadPoolExecutor] = []  # the compiler's one thread, started at the first grammar
_starting = threading.Lock()


def _compile(tokenizer: llguidance.LLTokenizer, spec: str, timeout_s: float) -> llguidance.LLMatcher:
    """LLGuidance's matcher for `spec`, built in one worker thread (it releases the GIL) with the caller waiting at
    most COMPILE_TIMEOUT_S: a 99 KB JsonSchemaStore schema takes 1.4 s here, and no request waits that long."""
    import llguidance

    with _starting:
        if not _worker:
            _worker.append(ThreadPoolExecutor(1, thread_name_prefix="grammar-compile"))
    future = _worker[0].submit(llguidance.LLMatcher, tokenizer, spec, log_level=0, limits=_limits())
    try:
        return future.result(timeout_s)
    except FutureTimeout:
        future.cancel()  # still queued: never runs; running: finishes in the worker, its result dropped
        raise SchemaError(f"the grammar took over {COMPILE_TIMEOUT_S:g} s to compile; simplify the schema") from None


class ConstraintState:
    """Where a generation stands in its grammar. Not thread-safe; `clone()` for a branch.

    Every question (mask, allows, argmax, advance) is answered from the one mask of the position, computed once:
    LLGuidance's `validate_tokens` admits tokenizations its mask does not (a forced key's bytes split otherwise),
    and a greedy step, a sampled step and the verifier's check must agree on what is allowed.
    """

    def __init__(self, constraint: Constraint, matcher: llguidance.LLMatcher) -> None:
        self.constraint = constraint
        self._m = matcher
        self.n_accepted = 0
        self._bits = np.zeros((1, (constraint.vocab.tokenizer.vocab_size + 31) // 32), dtype=np.int32)
        self._fresh = False  # whether _bits is this position's mask

    def clone(self) -> ConstraintState:
        other = ConstraintState(self.constraint, self._m.deep_copy())
        other.n_accepted = self.n_accepted
        return other

    def _fill(self) -> np.ndarray:
        if not self._fresh:
            from llguidance.numpy import fill_next_token_bitmask

            fill_next_token_bitmask(self._m, self._bits, 0)
            self._raise_if_error()
            self._fresh = True
        return self._bits

    def mask(self) -> np.ndarray:
        """[n_vocab] bool: the tokens that may come next."""
        bits = np.unpackbits(self._fill().view(np.uint8), bitorder="little").astype(bool)
        n = self.constraint.vocab.n_vocab
        out: np.ndarray = bits[:n] if len(bits) >= n else np.concatenate([bits, np.zeros(n - len(bits), bool)])
        return out

    def allows(self, token: int) -> bool:
        if not 0 <= token < self.constraint.vocab.tokenizer.vocab_size:
            return False  # a padded vocabulary's extra ids are never allowed
        return bool((int(self._fill()[0, token >> 5]) >> (token & 31)) & 1)

    def argmax(self, logits: np.ndarray) -> int:
        """The highest-scoring allowed token of logits [n_vocab] (the masked greedy choice); ties go to the lowest
        id, as np.argmax does. The usual case (the best token is allowed) reads one bit of the mask."""
        best = int(np.argmax(logits))
        if self.allows(best):
            return best
        allowed = self.mask()
        if not allowed.any():
            raise GrammarError("the grammar allows no token here")
        return int(np.argmax(np.where(allowed, np.asarray(logits, dtype=np.float64), -np.inf)))

    def accept(self, token: int) -> None:
        """Advance past `token`; GrammarError (state unchanged) if the grammar forbids it."""
        if self.advance([token]) == 0:
            raise GrammarError(f"token {token} is not allowed by the grammar here")

    def advance(self, ids: TokenIds) -> int:
        """Advance past the ids the grammar allows in a row; returns how many."""
        for n, t in enumerate(ids):
            if not self.allows(int(t)):
                return n
            if not self._m.consume_token(int(t)):
                self._raise_if_error()
            self._fresh = False
            self.n_accepted += 1
        return len(ids)

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (a verifier's rejected draft)."""
        if not 0 <= n <= self.n_accepted:
            raise GrammarError(f"cannot roll back {n} tokens of {self.n_accepted}")
        if n and not self._m.rollback(n):
            self._raise_if_error()
        self._fresh = False
        self.n_accepted -= n

    def is_accepting(self) -> bool:
        """Whether the grammar may end here."""
        return bool(self._m.is_accepting())

    def _raise_if_error(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"the grammar failed: {self._m.get_error().splitlines()[0][:300]}")


# ---------------------------------------------------------------------------------------------- schemas


def check_schema(text: str) -> Any:
    """The schema parsed from `text` once its size and expansion are within bounds; SchemaError naming the
    keyword otherwise. One walk over the JSON values, no recursion (a deep schema cannot exhaust the stack)."""
    if len(text.encode("utf-8")) > MAX_SCHEMA_BYTES:
        raise SchemaError(f"the schema is {len(text.encode('utf-8'))} bytes; at most {MAX_SCHEMA_BYTES}")
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise SchemaError(f"the schema is not JSON: {str(e)[:200]}") from None
    if not isinstance(schema, (dict, bool)):
        raise SchemaError(f"a schema is an object or a boolean, not {type(schema).__name__}")
    nodes = 0
    for value, where, depth in _values(schema):
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise SchemaError(f"the schema has over {MAX_SCHEMA_NODES} values", None, where)
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH}", None, where)
        if not isinstance(value, dict):
            continue
        if isinstance(props := value.get("properties"), dict) and len(props) > MAX_OPTIONAL_PROPERTIES:
            required = value.get("required")
            named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
            optional = len(set(props) - named)
            if optional > MAX_OPTIONAL_PROPERTIES:
                raise SchemaError(
                    f"an object of {optional} optional properties; at most {MAX_OPTIONAL_PROPERTIES}",
                    "properties",
                    where,
                )
        if isinstance(pattern := value.get("pattern"), str):
            _check_pattern(pattern, "pattern", f"{where}/pattern")
        if isinstance(props := value.get("patternProperties"), dict):
            for key in props:
                _check_pattern(key, "patternProperties", f"{where}/patternProperties")
    return schema


def _values(schema: Any) -> Iterator[tuple[Any, str, int]]:
    """(value, its JSON pointer, its depth) of every JSON value in the schema, depth first."""
    stack: list[tuple[Any, str, int]] = [(schema, "#", 0)]
    while stack:
        value, where, depth = stack.pop()
        yield value, where, depth
        if isinstance(value, dict):
            stack.extend((v, f"{where}/{k}", depth + 1) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}/{i}", depth + 1) for i, v in enumerate(value))


def _check_pattern(pattern: str, keyword: str, where: str) -> None:
    for m in _QUANTIFIER.finditer(pattern):
        count = max(int(m.group(1)), int(m.group(2) or 0))
        if count > MAX_PATTERN_REPEAT:
            raise SchemaError(
                f"a pattern repeats {count} times ({m.group(0)}); at most {MAX_PATTERN_REPEAT}", keyword, where
            )


def _without_formats(schema: Any, formats: set[str]) -> Any:
    """A copy of the schema with every `format` whose value is in `formats` removed (values, such as an enum's or
    a const's, are left as they are)."""
    if isinstance(schema, dict):
        return {
            k: v if k in _VALUES else _without_formats(v, formats)
            for k, v in schema.items()
            if not (k == "format" and isinstance(v, str) and v in formats)
        }
    if isinstance(schema, list):
        return [_without_formats(v, formats) for v in schema]
    return schema


_VALUES = {"enum", "const", "default", "examples"}  # keywords whose values are data, not schemas
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_UNSUPPORTED = re.compile(r'Unimplemented keys: \["([^"]+)"|(oneOf)|(look-around)|Unknown format: (\S+)')


def _refusal(kind: str, message: str) -> GrammarError:
    """LLGuidance's reason as a typed error, naming the keyword where its message does."""
    if kind != "json_schema":
        return GrammarError(f"the {kind} grammar does not compile: {message[:300]}")
    m = _UNSUPPORTED.search(message)
    keyword = None
    if m:
        keyword = m.group(1) or m.group(2) or ("pattern" if m.group(3) else "format")
    return SchemaError(f"the schema cannot be enforced: {message.splitlines()[0][:300]}", keyword)
