"""llama.cpp's grammar sampler and JSON-schema converter: the structured-output path both sides ran before
LLGuidance (protocol/structured.py), kept only as tools/bench/schemas.py's `gbnf` comparison engine. The
product does not import it.

Each side built a `Grammar` from the same GBNF text over its own GGUF's vocabulary and asked llama.cpp's
grammar sampler (`llama_sampler_init_grammar`) which tokens may come next: 4-11 ms a whole-vocabulary mask, where
LLGuidance takes microseconds. llama.cpp aborts the process when a token the grammar forbids is accepted, so
`GrammarState.accept` checks first and raises `GrammarError` instead. A schema was checked by `prepare_schema`
and converted to GBNF by `schema_gbnf` (llama.cpp's converter, bounded).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from protocol.grammar import GrammarError, SchemaError

if TYPE_CHECKING:  # typing only: llama_cpp is imported when a grammar is first built
    from llama_cpp import llama_sampler_p, llama_vocab_p

TokenIds = Sequence[int] | np.ndarray  # [n] token ids, a list or an int array

MAX_GBNF_BYTES = 16 * 1024  # a grammar on the wire: at most this much GBNF text
MAX_COMPILED = 16  # grammars compiled per vocabulary, least recently used out
# llama_token_data {int32 id; float logit; float p}: 12 bytes, no padding
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Grammar:
    """One compiled GBNF grammar over one vocabulary. `start()` gives a state at its root.

    `vocab` is a llama_vocab pointer (llama_model_get_vocab) whose model outlives this object
    (`owner` is kept to make sure).
    """

    def __init__(
        self, gbnf: str, vocab: llama_vocab_p | None, n_vocab: int, owner: object = None, root: str = "root"
    ) -> None:
        import llama_cpp as L

        if not isinstance(gbnf, str) or not gbnf.strip():
            raise GrammarError("the grammar is empty")
        if not vocab:
            raise GrammarError("no vocabulary to compile the grammar over (a null llama_vocab pointer)")
        if len(gbnf.encode("utf-8")) > MAX_GBNF_BYTES:
            raise GrammarError(f"the grammar is {len(gbnf.encode('utf-8'))} bytes; at most {MAX_GBNF_BYTES}")
        self.L = L
        self.gbnf = gbnf
        self.digest = digest(gbnf)
        self.n_vocab = n_vocab
        self._owner = owner
        self._root = L.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), root.encode("utf-8"))
        if not self._root:
            raise GrammarError(f"llama.cpp could not parse the grammar (GBNF, root {root!r})")
        self._all = _token_table(np.arange(n_vocab, dtype=np.int32))  # every token, for whole masks

    def start(self) -> GrammarState:
        return GrammarState(self, self.L.llama_sampler_clone(self._root))

    def walk(self, ids: TokenIds) -> GrammarState:
        """The state after `ids` from the root; GrammarError at the first id it forbids."""
        state = self.start()
        n = state.advance(ids)
        if n < len(ids):
            raise GrammarError(
                f"token {int(ids[n])} at position {n} of the constrained part is not allowed by the grammar"
            )
        return state

    def __del__(self) -> None:
        if getattr(self, "_root", None):
            self.L.llama_sampler_free(self._root)
            del self._root  # freed: a second call finds nothing to free


class GrammarState:
    """Where a generation stands in its grammar. Not thread-safe; `clone()` for a branch."""

    def __init__(self, grammar: Grammar, sampler: llama_sampler_p) -> None:
        self.grammar = grammar
        self._smpl = sampler
        self.n_accepted = 0

    def clone(self) -> GrammarState:
        other = GrammarState(self.grammar, self.grammar.L.llama_sampler_clone(self._smpl))
        other.n_accepted = self.n_accepted
        return other

    def _apply(self, table: np.ndarray) -> np.ndarray:
        """llama.cpp's grammar sampler over `table` (TOKEN_DATA rows): True where allowed."""
        L = self.grammar.L
        table["logit"] = 0.0
        cur = L.llama_token_data_array(
            data=table.ctypes.data_as(L.llama_token_data_p), size=len(table), selected=-1, sorted=False
        )
        L.llama_sampler_apply(self._smpl, ctypes.byref(cur))
        allowed: np.ndarray = np.isfinite(table["logit"])
        return allowed

    def mask(self) -> np.ndarray:
        """[vocab] bool: the tokens that may come next."""
        return self._apply(self.grammar._all)

    def allows(self, token: int) -> bool:
        if not 0 <= token < self.grammar.n_vocab:
            return False
        return bool(self._apply(_token_table(np.array([token], dtype=np.int32)))[0])

    def argmax(self, logits: np.ndarray) -> int:
        """The highest-scoring allowed token of logits [vocab] (the masked greedy choice).

        Checks candidates best first, a few at a time, so the usual case (the best token is
        allowed) costs one check instead of a whole-vocabulary mask. Ties go to the lowest id,
        as np.argmax does.
        """
        best = int(np.argmax(logits))
        if self.allows(best):
            return best
        order = np.argsort(-np.asarray(logits, dtype=np.float64), kind="stable")  # ties: lowest id first
        start = 1
        for size in (31, 992, len(order)):
            ids = order[start : start + size].astype(np.int32)
            if not len(ids):
                break
            ok = self._apply(_token_table(ids))
            if ok.any():
                return int(ids[int(np.argmax(ok))])
            start += size
        raise GrammarError("the grammar allows no token here")

    def accept(self, token: int) -> None:
        """Advance past `token`; GrammarError (state unchanged) if the grammar forbids it."""
        if self.advance([token]) == 0:
            raise GrammarError(f"token {token} is not allowed by the grammar here")

    def advance(self, ids: TokenIds) -> int:
        """Advance past the ids the grammar allows in a row; returns how many (it stops at the first one
        forbidden, which llama.cpp would abort the process on)."""
        for n, t in enumerate(ids):
            if not self.allows(int(t)):
                return n
            self.grammar.L.llama_sampler_accept(self._smpl, int(t))
            self.n_accepted += 1
        return len(ids)

    def __del__(self) -> None:
        if getattr(self, "_smpl", None):
            self.grammar.L.llama_sampler_free(self._smpl)
            del self._smpl  # freed: a second call finds nothing to free


def _token_table(ids: np.ndarray) -> np.ndarray:
    table = np.zeros(len(ids), TOKEN_DATA)
    table["id"] = ids
    return table


def digest(gbnf: str) -> str:
    return hashlib.sha256(gbnf.encode("utf-8")).hexdigest()[:16]


class GrammarCache:
    """Compiled grammars of one vocabulary by their text; bounded (MAX_COMPILED, least recently used out)."""

    def __init__(
        self, vocab: llama_vocab_p | None, n_vocab: int, owner: object = None, size: int = MAX_COMPILED
    ) -> None:
        self.vocab, self.n_vocab, self.owner, self.size = vocab, n_vocab, owner, size
        self._compiled: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, gbnf: str) -> Grammar:
        key = digest(gbnf) if isinstance(gbnf, str) else ""
        with self._lock:
            grammar = self._compiled.get(key)
            if grammar is not None and grammar.gbnf == gbnf:
                self._compiled.move_to_end(key)
                return grammar
        grammar = Grammar(gbnf, self.vocab, self.n_vocab, self.owner)
        with self._lock:
            self._compiled[key] = grammar
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        return grammar


# ---------------------------------------------------------------------------------------------- JSON schemas
#
# A JSON schema becomes GBNF through llama.cpp's own converter (llama_cpp.llama_grammar, the one llama-server's
# `json_schema` uses). The converter writes every repetition out in full (minItems 30000000 is thirty million
# copies of a rule's name: 10 s and 1.75 GB) and asserts on what it cannot take, so a schema is checked first,
# on itself, in one linear walk (`prepare_schema`): its size and expansion are bounded, and every sub-schema
# must be one the converter turns into a grammar at least as strict as the schema, else SchemaError names the
# keyword. The walk hands the converter a copy holding only the keywords it reads. `schema_gbnf` then converts
# in one worker thread (never the model's), a deadline on the wait.

MAX_SCHEMA_DEPTH = 32  # sub-schemas nested in one another (through $ref too)
MAX_SCHEMA_NODES = 2048  # sub-schemas in all
MAX_PROPERTIES = 256  # properties of one object (the converter recurses once per optional one)
MAX_REPEAT = 4096  # any repetition: minItems, maxItems, minLength, maxLength, a pattern's {m,n}
MAX_ENUM = 256  # values of one enum
MAX_PATTERN = 1024  # characters of one pattern
MAX_PATTERN_GROUPS = 16  # a pattern's groups nested in one another
# the grammar text the schema's rule names and repetitions are estimated to write (each count times what one
# copy writes, from above): past it the grammar could not fit MAX_GBNF_BYTES anyway (a 4x margin)
MAX_EXPANSION = 4 * MAX_GBNF_BYTES
CONVERT_TIMEOUT_S = 2.0  # the wait for the converter (bounded work: it takes milliseconds under the budget)
MAX_CACHED_SCHEMAS = 32  # converted schemas kept, least recently used out (tools are sent again and again)

JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
STRING_FORMATS = ("date", "time", "date-time")  # and uuid, uuid1..uuid5: formats the converter writes
# keywords that constrain nothing (and $defs, read through $refs from the root)
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
ANNOTATIONS |= {"$schema", "$id", "$defs", "definitions"}


class _Walk:
    """prepare_schema's state: the root, the budget spent, and the $ref targets prepared so far."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.nodes = 0
        self.expansion = 0
        self.names: dict[str, str] = {}  # a $ref -> its target's name under $defs (and its rule's)
        self.defs: dict[str, dict[str, Any]] = {}  # that name -> the prepared target ({} while it is being prepared)

    def spend(self, size: int, keyword: str, where: str) -> None:
        self.expansion += size
        if self.expansion > MAX_EXPANSION:
            raise SchemaError(
                f"the schema's grammar would be over {MAX_EXPANSION} bytes before its {keyword} is written out; "
                "lower the counts or simplify the schema",
                keyword,
                where,
            )


def prepare_schema(schema: Any) -> dict[str, Any]:
    """The schema as llama.cpp's converter may take it (a copy), or SchemaError naming the keyword.

    Bounded on the schema itself: nesting, sub-schemas, properties, enum values, repetition counts and the
    grammar text they would write (MAX_* above). Refused: boolean sub-schemas, sub-schemas with no type or
    construct the converter knows (`{"required": [...]}` inside oneOf), $refs other than local ones,
    patterns it cannot read (unanchored, lookarounds, `\\d`, ...). A `type` list becomes an anyOf of one copy
    per type, so each branch keeps its own keywords (the converter alone drops `items` of ["array", "null"])."""
    if not isinstance(schema, dict):
        raise SchemaError("a schema is a JSON object", "type")
    walk = _Walk(schema)
    out = _node(schema, walk, "", "", 0)
    if walk.defs:  # (a $ref at the root would hide them from the converter's resolve_refs: one anyOf around it)
        out = {**(out if "$ref" not in out else {"anyOf": [out]}), "$defs": walk.defs}
    return out


def _keyword(where: str) -> str:
    """The keyword a sub-schema sits under, from its JSON pointer: "/properties/a" -> properties, "/a/items" ->
    items."""
    parts = where.split("/")
    named = ("properties", "$defs", "definitions", "anyOf", "oneOf", "allOf", "prefixItems", "items")
    return parts[-2] if len(parts) > 2 and parts[-2] in named else parts[-1]


def _def_name(ref: str, n: int) -> str:
    """A $ref target's name in the prepared copy: one per $ref, and a rule name as it is ("#/$defs/a b" ->
    def-0-a-b): the converter names a recursive reference by it without escaping it."""
    return f"def-{n}-" + re.sub(r"[^a-zA-Z0-9-]+", "-", ref.rsplit("/", 1)[-1])[:32]


def _node(node: Any, walk: _Walk, where: str, name: str, depth: int) -> dict[str, Any]:
    """One sub-schema, checked and copied in the converter's own order of cases (SchemaConverter.visit)."""
    keyword = _keyword(where)
    if isinstance(node, bool):
        raise SchemaError(
            f"a boolean schema ({str(node).lower()}) is not supported here; write a schema object", keyword, where
        )
    if not isinstance(node, dict):
        raise SchemaError("a schema is a JSON object", keyword, where)
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaError(f"sub-schemas nest deeper than {MAX_SCHEMA_DEPTH}", keyword, where)
    walk.nodes += 1
    if walk.nodes > MAX_SCHEMA_NODES:
        raise SchemaError(f"the schema has over {MAX_SCHEMA_NODES} sub-schemas", keyword, where)
    walk.spend(2 * len(name) + 8, keyword or "schema", where)  # its rule, defined and used
    parts = node.get("allOf")
    if isinstance(parts, list) and len(parts) == 1 and set(node) - {"allOf"} <= ANNOTATIONS:
        return _node(parts[0], walk, f"{where}/allOf/0", name, depth + 1)  # pydantic's {"allOf": [{"$ref": ...}]}
    kind = node.get("type")
    if isinstance(kind, list):
        return _type_list(node, walk, where, name, depth)
    if kind is not None and kind not in JSON_TYPES:
        raise SchemaError(f"type is one of {', '.join(JSON_TYPES)} or a list of them, got {kind!r}", "type", where)
    if node.get("$ref") is not None:
        return {"$ref": _ref(node["$ref"], walk, where, depth)}
    if "oneOf" in node or "anyOf" in node:
        key = "oneOf" if node.get("oneOf") else "anyOf"
        alts = node.get(key)
        if not isinstance(alts, list) or not alts:
            raise SchemaError(f"{key} is a non-empty list of schemas", key, where)
        sub = name or "alternative"
        return {key: [_node(a, walk, f"{where}/{key}/{i}", f"{sub}-{i}", depth + 1) for i, a in enumerate(alts)]}
    if "const" in node:
        return {"const": _value(node["const"], "const", where)}
    if "enum" in node:
        return _enum(node["enum"], where)
    if kind in (None, "object") and ("properties" in node or node.get("additionalProperties", True) is not True):
        return _object(node, walk, where, name, depth)
    if kind in (None, "object") and "allOf" in node:
        return _all_of(node, walk, where, name, depth)
    if kind in (None, "array") and ("items" in node or "prefixItems" in node):
        return _array(node, walk, where, name, depth)
    return _scalar(node, walk, where, name, depth)


def _type_list(node: dict[str, Any], walk: _Walk, where: str, name: str, depth: int) -> dict[str, Any]:
    """{"type": [a, b], ...rest} -> {"anyOf": [{"type": a, ...rest}, {"type": b, ...rest}]}."""
    kinds = node["type"]
    if not kinds or any(k not in JSON_TYPES for k in kinds) or len(set(kinds)) < len(kinds):
        raise SchemaError(f"a type list holds distinct names of {', '.join(JSON_TYPES)}", "type", where)
    rest = {k: v for k, v in node.items() if k != "type"}
    if len(kinds) == 1:
        return _node({**rest, "type": kinds[0]}, walk, where, name, depth)
    if rest.get("$ref") is not None or "oneOf" in rest or "anyOf" in rest:
        return _node(rest, walk, where, name, depth)  # the converter reads these before the type
    return {"anyOf": [_node({**rest, "type": k}, walk, where, f"{name}-{i}", depth + 1) for i, k in enumerate(kinds)]}


def _ref(ref: Any, walk: _Walk, where: str, depth: int) -> str:
    """A local $ref ("#/$defs/x", "#/definitions/x", or any path of object keys from the root), its target
    prepared once (a recursive schema refers to itself by its rule's name)."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        raise SchemaError(f"$ref is a local reference like #/$defs/NAME, got {str(ref)[:80]!r}", "$ref", where)
    if ref not in walk.names:
        target: Any = walk.root
        for part in ref[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"$ref {ref[:80]!r} points at nothing in the schema", "$ref", where)
            target = target[part]
        name = walk.names[ref] = _def_name(ref, len(walk.names))
        walk.defs[name] = {}  # being prepared: a reference back to it is a recursive rule
        walk.defs[name] = _node(target, walk, ref[1:], name, depth + 1)
    return "#/$defs/" + walk.names[ref]


def _value(value: Any, keyword: str, where: str) -> Any:
    """A const or enum value: JSON the converter writes out literally (no "$ref" key: it would follow it)."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            if "$ref" in v:
                raise SchemaError(f'a {keyword} value holds a "$ref" key', keyword, where)
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return value


def _enum(values: Any, where: str) -> dict[str, Any]:
    if not isinstance(values, list) or not 0 < len(values) <= MAX_ENUM:
        raise SchemaError(f"enum is a list of 1 to {MAX_ENUM} values", "enum", where)
    return {"enum": [_value(v, "enum", where) for v in values]}


def _object(node: dict[str, Any], walk: _Walk, where: str, name: str, depth: int) -> dict[str, Any]:
    props = node.get("properties", {})
    required = node.get("required", [])
    extra = node.get("additionalProperties")
    if not isinstance(props, dict) or len(props) > MAX_PROPERTIES:
        raise SchemaError(f"properties is an object of at most {MAX_PROPERTIES} schemas", "properties", where)
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise SchemaError("required is a list of property names", "required", where)
    if extra is not None and not isinstance(extra, (bool, dict)):
        raise SchemaError("additionalProperties is true, false or a schema", "additionalProperties", where)
    out: dict[str, Any] = {"properties": _properties(props, walk, where, name, depth), "required": required}
    if node.get("type") is not None:
        out["type"] = node["type"]
    if isinstance(extra, dict):
        out["additionalProperties"] = _node(extra, walk, f"{where}/additionalProperties", f"{name}-add", depth + 1)
    elif extra is not None:
        out["additionalProperties"] = extra
    return out


def _properties(props: dict[str, Any], walk: _Walk, where: str, name: str, depth: int) -> dict[str, Any]:
    out = {}
    for key, sub in props.items():
        if key in ("*", "$ref"):
            raise SchemaError(f"a property named {key!r} is not supported", "properties", where)
        walk.spend(3 * len(name) + 3 * len(key) + 48, "properties", where)  # its -kv and -rest rules
        out[key] = _node(sub, walk, f"{where}/properties/{key}", f"{name}-{key}", depth + 1)
    return out


def _all_of(node: dict[str, Any], walk: _Walk, where: str, name: str, depth: int) -> dict[str, Any]:
    """allOf as the converter reads it: the properties of its parts (an anyOf part's are optional), merged."""
    parts = node["allOf"]
    if not isinstance(parts, list) or not parts:
        raise SchemaError("allOf is a non-empty list of schemas", "allOf", where)
    out = []
    for i, part in enumerate(parts):
        at = f"{where}/allOf/{i}"
        alts = part.get("anyOf") if isinstance(part, dict) else None
        if isinstance(part, dict) and "anyOf" in part:
            if not isinstance(alts, list):
                raise SchemaError("anyOf is a list of schemas", "allOf", at)
            out.append({"anyOf": [_component(a, walk, f"{at}/anyOf/{j}", name, depth) for j, a in enumerate(alts)]})
        else:
            out.append(_component(part, walk, at, name, depth))
    return {"allOf": out}


def _component(part: Any, walk: _Walk, where: str, name: str, depth: int) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise SchemaError("an allOf part is a schema object", "allOf", where)
    if part.get("$ref") is not None:
        ref = _ref(part["$ref"], walk, where, depth)
        if not isinstance(walk.defs[walk.names[part["$ref"]]].get("properties"), dict):
            raise SchemaError("an allOf part's $ref points at an object schema with properties", "allOf", where)
        return {"$ref": ref}
    if set(part) - {"properties", "required", "type", "title", "description"}:
        raise SchemaError(f"an allOf part holds properties only, not {sorted(part)}", "allOf", where)
    props = part.get("properties", {})
    if not isinstance(props, dict) or len(props) > MAX_PROPERTIES:
        raise SchemaError(f"properties is an object of at most {MAX_PROPERTIES} schemas", "properties", where)
    return {"properties": _properties(props, walk, where, name, depth)}


def _count(node: dict[str, Any], key: str, where: str) -> int | None:
    value = node.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_REPEAT:
        raise SchemaError(f"{key} is an integer from 0 to {MAX_REPEAT} here, got {str(value)[:40]}", key, where)
    return value


def _counts(node: dict[str, Any], low: str, high: str, where: str) -> tuple[int, int | None]:
    lo, hi = _count(node, low, where) or 0, _count(node, high, where)
    if hi is not None and hi < lo:
        raise SchemaError(f"{high} {hi} is below {low} {lo}", high, where)
    return lo, hi


ANY_VALUE = {"anyOf": [{"type": t} for t in JSON_TYPES]}  # any JSON value, as the converter writes it


def _array(node: dict[str, Any], walk: _Walk, where: str, name: str, depth: int) -> dict[str, Any]:
    """items (one schema, `minItems` to `maxItems` of it) or a tuple (prefixItems, or a list of items)."""
    items, prefix = node.get("items"), node.get("prefixItems")
    lo, hi = _counts(node, "minItems", "maxItems", where)
    if items is True or items == {} or (items is None and prefix is None):  # any items
        if prefix is None and lo == 0 and hi is None:
            return {"type": "array"}
        items = ANY_VALUE if prefix is None else None
    if isinstance(items, dict):
        item = _node(items, walk, f"{where}/items", f"{name}-item", depth + 1)
        walk.spend(max(lo, hi or 0) * (len(name) + 17), "maxItems" if hi else "minItems", where)  # a copy each
        return {"items": item, "minItems": lo, **({} if hi is None else {"maxItems": hi})}
    tuple_, key = (items, "items") if isinstance(items, list) and items else (prefix, "prefixItems")
    if not isinstance(tuple_, list):
        what = "items: false (no items at all)" if items is False else f"{key} of {type(tuple_).__name__}"
        raise SchemaError(f"{what} is not supported; items is a schema and prefixItems a list", "items", where)
    subs = [_node(s, walk, f"{where}/{key}/{i}", f"{name}-tuple-{i}", depth + 1) for i, s in enumerate(tuple_)]
    return {"prefixItems": subs}


def _scalar(node: dict[str, Any], walk: _Walk, where: str, name: str, depth: int) -> dict[str, Any]:
    """The converter's last cases: a pattern, a format, a string's lengths, an object or a type alone."""
    kind, fmt = node.get("type"), node.get("format")
    typed = {} if kind is None else {"type": kind}
    if kind in (None, "string") and "pattern" in node:
        return {**typed, "pattern": _pattern(node["pattern"], walk, where, name)}
    if fmt is not None and not isinstance(fmt, str):
        raise SchemaError("format is a string", "format", where)
    if kind in (None, "string") and fmt is not None and (re.match(r"^uuid[1-5]?$", fmt) or fmt in STRING_FORMATS):
        return {**typed, "format": fmt}
    if kind == "array" and ("minItems" in node or "maxItems" in node):
        return _array(node, walk, where, name, depth)
    if kind == "string" and ("minLength" in node or "maxLength" in node):
        lo, hi = _counts(node, "minLength", "maxLength", where)
        walk.spend(max(lo, hi or 0) * 6, "maxLength" if hi else "minLength", where)  # "char " a character
        return {"type": "string", "minLength": lo, **({} if hi is None else {"maxLength": hi})}
    if kind is None and node:
        raise SchemaError(
            f"a sub-schema with no type and nothing the converter turns into a grammar (it has {sorted(node)[:8]})",
            _keyword(where) or "type",
            where,
        )
    return typed  # {} and {"type": "object"}: any object; else the type's own rule


def _pattern(pattern: Any, walk: _Walk, where: str, name: str) -> str:
    """A pattern the converter reads whole (anchored, no lookarounds), its quantifiers bounded and counted, and
    its escapes rewritten as character classes llama.cpp's GBNF reads (\\d -> [0-9], \\. -> [\\x2E]): the
    converter copies an escape into a literal as it is (GBNF knows no \\d or \\.) and lets a quantifier after
    one repeat the whole literal before it."""

    def bad(why: str) -> NoReturn:
        raise SchemaError(f"pattern {str(pattern)[:80]!r}: {why}", "pattern", where)

    if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN:
        bad(f"a pattern is a string of at most {MAX_PATTERN} characters")
    if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$" or pattern[-2:] == "\\$":
        bad("it must start with ^ and end with $ (patterns match whole strings here)")
    body, i, depth, atom = pattern[1:-1], 0, 0, False  # atom: a quantifier may follow
    out: list[str] = []
    while i < len(body):
        c, start = body[i], i
        if c == "\\":
            inside, i = _escape(body, i, False, bad)
            out.append(f"[{inside}]")
            atom = True
            continue
        if c == "(":
            if body[i + 1 : i + 2] == "?":
                bad("(?...) groups (lookarounds, non-capturing, named) are not supported")
            depth += 1
            if depth > MAX_PATTERN_GROUPS:
                bad(f"groups nest deeper than {MAX_PATTERN_GROUPS}")
            i, atom = i + 1, False
        elif c == ")":
            if not depth:
                bad("unbalanced parentheses")
            i, depth, atom = i + 1, depth - 1, True
        elif c == "[":
            inside, i = _char_class(body, i, bad)
            out.append(inside)
            atom = True
            continue
        elif c in "*+?{" and not atom:
            bad(f"nothing to repeat before {c!r} (lazy and possessive quantifiers are not supported)")
        elif c == "{":
            i, atom = _quantifier(body, i, walk, where, name, bad), False
        elif c in "*+?|":
            i, atom = i + 1, False
        elif c in "^$]}":
            bad(f"{c!r} is supported only escaped (an anchor inside a pattern, or unbalanced)")
        else:
            i, atom = i + 1, True
        out.append(body[start:i])
    if depth:
        bad("unbalanced parentheses")
    return "^" + "".join(out) + "$"


SHORTHANDS = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r\\x0C\\x0B"}  # inside a class, as GBNF reads it
CONTROLS = {"t": "\\t", "n": "\\n", "r": "\\r", "f": "\\x0C", "v": "\\x0B"}


def _escape(body: str, i: int, in_class: bool, bad: Callable[[str], NoReturn]) -> tuple[str, int]:
    """The escape at body[i] (a backslash) as the inside of a GBNF character class, and where it ends. Refused:
    back-references, word boundaries, \\p{...} and other escapes that are no character."""
    e = body[i + 1 : i + 2]
    if not e:
        bad("it ends in a lone backslash")
    if e in SHORTHANDS:
        return SHORTHANDS[e], i + 2
    if e.lower() in SHORTHANDS and not in_class:
        return "^" + SHORTHANDS[e.lower()], i + 2
    if e in CONTROLS:
        return CONTROLS[e], i + 2
    if e in ("x", "u"):
        digits = body[i + 2 : i + (4 if e == "x" else 6)]
        if not re.fullmatch(r"[0-9a-fA-F]{2}" if e == "x" else r"[0-9a-fA-F]{4}", digits):
            bad(f"\\{e} takes {2 if e == 'x' else 4} hex digits")
        return f"\\{e}{digits}", i + 2 + len(digits)
    if e.isalnum() or not e.isprintable():
        bad(f"the escape \\{e} is not supported" + (" inside a character class" if e.lower() in SHORTHANDS else ""))
    return (f"\\x{ord(e):02X}" if ord(e) < 256 else f"\\u{ord(e):04X}"), i + 2


def _char_class(body: str, i: int, bad: Callable[[str], NoReturn]) -> tuple[str, int]:
    """The character class at body[i] ("[") as GBNF reads it (escapes rewritten), and where it ends."""
    j = i + 1 + (body[i + 1 : i + 2] == "^")
    out = [body[i:j]]
    while j < len(body) and body[j] != "]":
        if body[j] == "\\":
            inside, j = _escape(body, j, True, bad)
            out.append(inside)
        else:
            out.append(body[j])
            j += 1
    if j >= len(body):
        bad("unbalanced [")
    if len(out) == 1:
        bad("an empty character class")
    return "".join(out) + "]", j + 1


def _quantifier(body: str, i: int, walk: _Walk, where: str, name: str, bad: Callable[[str], NoReturn]) -> int:
    """{m}, {m,} or {m,n} at body[i], bounded (MAX_REPEAT) and counted: the converter writes m (or n) copies."""
    end = body.find("}", i)
    m = re.fullmatch(r"(\d*)(,(\d*))?", body[i + 1 : end]) if end > 0 else None
    if m is None or not (m.group(1) or m.group(2)):
        bad("a quantifier is {m}, {m,} or {m,n}")
    lo = int(m.group(1) or 0)
    hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
    if max(lo, hi or 0) > MAX_REPEAT or (hi is not None and hi < lo):
        bad(f"{body[i : end + 1]}: at most {MAX_REPEAT} repetitions, m <= n")
    walk.spend(max(lo, hi or 0) * (len(name) + 8), "pattern", where)
    return end + 1


# ---------------------------------------------------------------------------------------------- conversion


_converting = threading.Lock()  # guards the two below
_worker: list[ThreadPoolExecutor] = []  # the converter's one thread, started at the first schema
_converted: OrderedDict[str, str] = OrderedDict()  # a prepared schema's JSON -> its GBNF (MAX_CACHED_SCHEMAS)


def schema_gbnf(schema: Any, timeout_s: float = CONVERT_TIMEOUT_S) -> str:
    """A JSON schema (a dict) -> GBNF that only its instances satisfy, or SchemaError naming the keyword.

    Checked and bounded first (prepare_schema), then converted by llama.cpp's converter in one worker thread
    (callers wait at most `timeout_s`; a wait that ran out cancels its turn), the GBNF at most MAX_GBNF_BYTES.
    Conversions are cached by the prepared schema."""
    prepared = prepare_schema(schema)
    try:
        text = json.dumps(prepared, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise SchemaError(f"the schema is not JSON: {e}") from None
    with _converting:
        if text in _converted:
            _converted.move_to_end(text)
            return _converted[text]
        if not _worker:
            _worker.append(ThreadPoolExecutor(1, thread_name_prefix="schema-grammar"))
        future = _worker[0].submit(_convert, text)
    try:
        gbnf = future.result(timeout_s)
    except FutureTimeout:
        future.cancel()
        raise SchemaError(f"the schema's grammar took over {timeout_s:g} s to build; simplify the schema") from None
    if len(gbnf.encode("utf-8")) > MAX_GBNF_BYTES:
        raise SchemaError(f"the schema's grammar is over {MAX_GBNF_BYTES} bytes; simplify the schema")
    with _converting:
        _converted[text] = gbnf
        while len(_converted) > MAX_CACHED_SCHEMAS:
            _converted.popitem(last=False)
    return gbnf


def _convert(text: str) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        gbnf: str = json_schema_to_gbnf(text)
        return gbnf
    except (AssertionError, AttributeError, IndexError, KeyError, TypeError, ValueError, RecursionError) as e:
        # prepare_schema refuses what is known to end here; this is the net under it
        raise SchemaError(f"llama.cpp's converter cannot take the schema: {type(e).__name__}: {str(e)[:200]}") from None
