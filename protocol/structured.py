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
import logging
import os
import re
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import sandbox
from .grammar import GrammarError, SchemaError, vocab_only

if TYPE_CHECKING:  # typing only: llguidance and llama_cpp are imported when a vocabulary is first built
    import llguidance
    from llama_cpp import llama_vocab_p

log = logging.getLogger(__name__)
TokenIds = Sequence[int] | np.ndarray  # [n] token ids, a list or an int array

# The caps on a schema, checked on its JSON before anything compiles (tools/bench/schema_caps.py measures each: what it
# refuses of JSONSchemaBench, and what the engine costs past it). Each bounds what LLGuidance cannot serve in bounded
# time or memory; what it serves cheaply (an enum's length, a pattern's) is bounded only by the schema's bytes.
MAX_SCHEMA_BYTES = 1 << 20  # JSON text: 893 KiB (kb_1161) compiles in 0.12 s; 1.1 MB of properties takes 1.06 s
MAX_SCHEMA_DEPTH = 128  # JSON values nested: LLGuidance's own recursion limit refuses deeper schemas anyway
MAX_SCHEMA_NODES = 100_000  # JSON values, an enum's included: 51 ms of walk here at the cap; compiles meet the deadline
MAX_OPTIONAL_PROPERTIES = 480  # of one object: each adds ~4 items to a parser row, and LLGuidance stops at 2,000
MAX_PATTERN_REPEAT = 1000  # a pattern's {m,n}: ^a{1000}$ costs 0.27 ms a mask at p99 here, ^a{4000}$ 1.1 ms
# The longest chain a compile follows, in JSON values nested plus `$ref`s followed (a schema), or rules referenced
# plus groups nested (a Lark or GBNF grammar): LLGuidance's compile recurses along it, 3.8 KiB of stack a link at
# worst (tools/bench/compile_sandbox.py: an `items`-`$ref` chain overflows a 4 MiB stack at 1,079; Lark rules at
# 1,320). 256 such links take a quarter of a worker's stack (protocol/sandbox.py), 6 % of this process's compile
# thread; JSONSchemaBench's longest chain is under 64.
MAX_REFERENCE_CHAIN = 256
MAX_GBNF_BYTES = 16 * 1024  # protocol.wire's bound: its conversion to Lark is Python, and 85 KB took 4 s here
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

    def __init__(
        self, vocab: llama_vocab_p, n_vocab: int, owner: object = None, *, gguf: str | os.PathLike[str]
    ) -> None:
        if not vocab:
            raise GrammarError("no vocabulary to compile the grammar over (a null llama_vocab pointer)")
        self.tokenizer = tokenizer_of(vocab, n_vocab)
        self.n_vocab = n_vocab
        self.gguf = str(gguf)  # where a compile worker reads the same vocabulary (protocol/sandbox.py)
        self._owner = owner
        self._compiled: OrderedDict[str, Constraint] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_gguf(cls, gguf: str | os.PathLike[str], n_vocab: int | None = None) -> Vocabulary:
        """The vocabulary of a GGUF read alone (no weights), kept for this object's life."""
        model, vocab, n = vocab_only(gguf)
        return cls(vocab, n if n_vocab is None else n_vocab, model, gguf=gguf)

    def compile(self, kind: str, text: str, timeout_s: float | None = None, peer: str = "") -> Constraint:
        """The grammar `text` of `kind` (json_schema: a schema's JSON text; lark; gbnf; regex) compiled over this
        vocabulary, from the cache where it was compiled before; SchemaError or GrammarError saying why not.

        Not cached: checked on itself (`check_grammar`: bytes, reference chains, nesting), then compiled in a worker
        process (protocol/sandbox.py: a crash or a runaway there is this request's refusal, and `peer`'s compile
        work waits its turn with other peers'), and only then here. `timeout_s`: the worker's deadline (default
        COMPILE_TIMEOUT_S)."""
        found = self._cached(f"{kind}\0{text}")
        if found is not None:
            return found
        check_grammar(kind, text)
        return self._compile_checked(kind, text, COMPILE_TIMEOUT_S if timeout_s is None else timeout_s, peer)

    def _compile_checked(self, kind: str, text: str, timeout_s: float, peer: str) -> Constraint:
        """compile() once the text has passed check_grammar: a worker first, then here, then kept."""
        sandbox.pool_for(self.gguf, self.n_vocab).check(kind, text, peer, timeout_s)
        constraint = Constraint(self, kind, text, _compile_here(self.tokenizer, kind, text))
        self._keep(f"{kind}\0{text}", constraint)
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

    def for_wire(self, grammar: dict[str, Any], peer: str = "") -> Constraint:
        """The constraint of an open's grammar (protocol.wire: {KIND: text, "from": ...}), as both sides build it;
        `peer`: who sent it (compile work is shared between peers in turns)."""
        if "json_schema" in grammar:
            return self.schema(grammar["json_schema"], peer)
        kind = next((k for k in ("lark", "gbnf") if k in grammar), None)
        if kind is None:
            raise GrammarError(f"a grammar holds json_schema, lark or gbnf, not {sorted(grammar)}")
        return self.compile(kind, grammar[kind], peer=peer)

    def schema(self, schema: Any, peer: str = "") -> Constraint:
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
            try:  # checked above (dropping formats keeps it within every bound); a cached one is found here too
                constraint = self._cached(f"json_schema\0{text}") or self._compile_checked(
                    "json_schema", text, max(0.0, deadline - time.monotonic()), peer
                )
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
    """One compiled grammar over one vocabulary (Vocabulary.compile builds it). `start()` gives a state at its root."""

    def __init__(self, vocab: Vocabulary, kind: str, text: str, root: llguidance.LLMatcher) -> None:
        self.vocab, self.kind, self.text = vocab, kind, text
        self._root = root

    def start(self) -> ConstraintState:
        return ConstraintState(self, self._root.deep_copy())

    def walk(self, ids: TokenIds) -> ConstraintState:
        """The state after `ids` from the root; GrammarError at the first id it forbids."""
        state = self.start()
        n = state.advance(ids)
        if n < len(ids):
            raise GrammarError(f"token {int(ids[n])} at position {n} of the constrained part is not allowed")
        return state


def tokenizer_of(vocab: llama_vocab_p, n_vocab: int) -> llguidance.LLTokenizer:
    """LLGuidance's tokenizer over a llama_vocab (~0.2 s), `n_vocab` wide (the model's logits)."""
    import llguidance.llamacpp

    with warnings.catch_warnings():  # it reads each token's attributes through a deprecated llama_cpp call
        warnings.simplefilter("ignore", DeprecationWarning)
        return llguidance.llamacpp.lltokenizer_from_vocab(vocab, n_vocab=n_vocab)


def build_matcher(tokenizer: llguidance.LLTokenizer, kind: str, text: str) -> llguidance.LLMatcher:
    """LLGuidance's matcher at the root of `text` of `kind`, its first mask taken (LLGuidance's parser limits, a
    row of 2,000 items in an anyOf of two wide objects, may refuse a grammar it compiled); GrammarError or
    SchemaError with LLGuidance's reason. Native code: a peer's grammar runs it first in a worker process
    (protocol/compile_worker.py), the serving process only after (_compile_here)."""
    import llguidance
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark
    from llguidance.numpy import fill_next_token_bitmask

    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}: one of {', '.join(KINDS)}")
    if len(text.encode("utf-8")) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the grammar is {len(text.encode('utf-8'))} bytes; at most {MAX_SCHEMA_BYTES}")
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
    root = llguidance.LLMatcher(tokenizer, spec, log_level=0, limits=_limits())
    if root.is_error():
        raise _refusal(kind, root.get_error())
    first = root.deep_copy()
    fill_next_token_bitmask(first, np.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=np.int32), 0)
    if first.is_error():
        raise _refusal(kind, first.get_error().splitlines()[0])
    return root


COMPILE_STACK_BYTES = 4 * sandbox.WORKER_STACK_BYTES  # this process's compile thread: 4x a worker's, for margin
_stack_lock = threading.Lock()


def _compile_here(tokenizer: llguidance.LLTokenizer, kind: str, text: str) -> llguidance.LLMatcher:
    """build_matcher in this process, once a worker has compiled the same text: in a thread of its own with 4x the
    worker's stack (LLGuidance is deterministic, so its recursion here is what it was there), never a shared
    thread another peer's compile waits on."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(build_matcher(tokenizer, kind, text))
        except GrammarError as e:
            out.append(e)

    with _stack_lock:  # threading.stack_size is the process's setting for the threads started next
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if not out:
        raise GrammarError("the grammar's compile ended without an answer")
    if isinstance(out[0], GrammarError):
        raise out[0]
    root: llguidance.LLMatcher = out[0]
    return root


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
    if '"$ref"' in text:  # without one, the chain is the nesting, bounded above
        _check_chain(schema)
    return schema


def _check_chain(schema: Any) -> None:
    """SchemaError when the schema's longest reference chain (schema_chain) is over MAX_REFERENCE_CHAIN."""
    if (n := schema_chain(schema)) > MAX_REFERENCE_CHAIN:
        raise SchemaError(
            f"the schema's chain of nested values and $refs is {n} long; at most {MAX_REFERENCE_CHAIN}", "$ref"
        )


def schema_chain(schema: Any) -> int:
    """The longest chain through a parsed schema, counting each JSON value nested and each local `$ref` followed. A
    `$ref` back to a value on the chain (a recursive schema) ends it: LLGuidance gives it a rule of its own and does
    not recurse there."""
    values: dict[int, Any] = {id(schema): schema}

    def links(key: int) -> list[int]:
        out = []
        for v in _links(schema, values[key]):
            values[id(v)] = v
            out.append(id(v))
        return out

    return _longest_chain([id(schema)], links, lambda _: 1)[0]


def _longest_chain(
    roots: Iterable[Hashable], links: Callable[[Any], list[Any]], weight: Callable[[Any], int]
) -> tuple[int, Any]:
    """(the longest chain, the node it starts from): a node's chain is its weight plus its longest link's chain. A
    depth-first walk without recursion, each node once; a link back to a node on the walk's path (a cycle) does not
    count."""
    chain: dict[Any, int] = {}
    on_path: set[Any] = set()
    longest: tuple[int, Any] = (0, None)
    for root in roots:
        if root in chain:
            continue
        on_path.add(root)
        stack = [(root, links(root), 0)]
        while stack:
            node, out, i = stack[-1]
            if i < len(out):
                stack[-1] = (node, out, i + 1)
                nxt = out[i]
                if nxt not in chain and nxt not in on_path:
                    on_path.add(nxt)
                    stack.append((nxt, links(nxt), 0))
                continue
            stack.pop()
            on_path.discard(node)
            chain[node] = weight(node) + max((chain[n] for n in out if n in chain), default=0)
            longest = max(longest, (chain[node], node), key=lambda c: c[0])
    return longest


def _links(root: Any, value: Any) -> list[Any]:
    """The dicts and lists a compile goes on to from `value`: the ones it holds, and a local `$ref`'s target."""
    if isinstance(value, list):
        return [v for v in value if isinstance(v, (dict, list))]
    if not isinstance(value, dict):
        return []
    out = [v for k, v in value.items() if k not in _VALUES and isinstance(v, (dict, list))]
    ref = value.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = _pointer(root, ref[1:])
        if isinstance(target, (dict, list)):
            out.append(target)
    return out


def _pointer(root: Any, pointer: str) -> Any:
    """The value at a JSON pointer (RFC 6901, percent-decoded as in a URI fragment); None where there is none."""
    from urllib.parse import unquote

    value = root
    for part in unquote(pointer).split("/")[1:] if pointer else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


# ---------------------------------------------------------------------------------------------- grammars


def check_grammar(kind: str, text: str) -> None:
    """GrammarError (SchemaError for a schema) when a grammar's text is past the bounds its compile is known to
    serve: its bytes; a schema's check_schema; a Lark or GBNF grammar's longest chain of rules referenced and
    groups nested (MAX_REFERENCE_CHAIN), and each JSON schema it embeds (`%json`). Pure Python, linear, no
    recursion: it runs before any native code sees the text."""
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}: one of {', '.join(KINDS)}")
    size = len(text.encode("utf-8"))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the grammar is {size} bytes; at most {MAX_SCHEMA_BYTES}")
    if kind == "json_schema":
        check_schema(text)
    elif kind == "gbnf":
        if size > MAX_GBNF_BYTES:
            raise GrammarError(f"the gbnf grammar is {size} bytes; at most {MAX_GBNF_BYTES}")
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:  # Python: a RecursionError at worst, caught
            lark = gbnf_to_lark(text)
        except Exception as e:  # what does not convert is refused by the compile, with the converter's reason
            log.debug("gbnf not converted before its compile: %s", e)
            return
        _check_lark(lark, "gbnf")
    elif kind == "lark":
        _check_lark(text, "lark")


_LARK_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?[ \t]*:", re.M)
_LARK_TOKEN = re.compile(
    r'"(?:[^"\\\n]|\\.)*"i?'  # a string
    r"|/(?![/*])(?:[^/\\\n]|\\.)*/[imslux]*"  # a regex
    r"|//[^\n]*"  # a comment
    r"|%json\b"  # an embedded JSON schema follows
    r"|[A-Za-z_][A-Za-z0-9_]*"  # a name
    r"|[()\[\]{}]"  # a group
)


def _check_lark(text: str, kind: str) -> None:
    """GrammarError when a Lark grammar's longest chain (lark_chain) is over MAX_REFERENCE_CHAIN."""
    n, rule = lark_chain(text)
    if n > MAX_REFERENCE_CHAIN:
        raise GrammarError(
            f"the {kind} grammar's chain of rules and nested groups is {n} long (from rule {rule}); "
            f"at most {MAX_REFERENCE_CHAIN}"
        )


def lark_chain(text: str) -> tuple[int, str]:
    """(the longest chain of a Lark grammar, the rule it starts from): each rule counts 1 plus its deepest group,
    through the rules it names (a rule met again on the chain ends it: recursion is a rule, not a deeper compile).
    Each `%json` schema in it is checked (check_schema) on the way."""
    starts = [(m.start(), m.group(1)) for m in _LARK_RULE.finditer(text)]
    weight: dict[str, int] = {}  # rule -> 1 + its deepest group
    names: dict[str, set[str]] = {}  # rule -> the names it uses
    bounds = [*(start for start, _ in starts), len(text)]
    decoder = json.JSONDecoder()
    for (start, rule), end in zip(starts, bounds[1:], strict=True):
        body_at = text.index(":", start) + 1
        depth = deepest = 0
        used: set[str] = set()
        pos = body_at
        while (m := _LARK_TOKEN.search(text, pos, end)) is not None:
            token, pos = m.group(0), m.end()
            if token == "%json":
                brace = text.find("{", pos, end)
                if brace >= 0:
                    try:
                        schema, stop = decoder.raw_decode(text, brace)
                    except ValueError:
                        continue  # the compile refuses it with its reason
                    check_schema(json.dumps(schema, separators=(",", ":")))
                    pos = stop
            elif token in "([{":
                depth += 1
                deepest = max(deepest, depth)
            elif token in ")]}":
                depth -= 1
            elif token[0].isalpha() or token[0] == "_":
                used.add(token)
        weight[rule] = max(weight.get(rule, 0), 1 + deepest)
        names.setdefault(rule, set()).update(used)
    n, rule = _longest_chain(list(names), lambda r: [n for n in names[r] if n in names and n != r], weight.__getitem__)
    return n, str(rule)


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
