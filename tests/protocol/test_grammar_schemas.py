"""JSON schemas -> grammars (protocol/grammar.py's schema_gbnf, agent.client.schema_grammar): bounded on the
schema before llama.cpp's converter runs, anything the converter cannot take refused naming the keyword, never
an AssertionError, an AttributeError or a hang; the conversion off the model's lock."""

from __future__ import annotations

import threading
import time
import tracemalloc
import types

import pytest

pytest.importorskip("llama_cpp")

HUGE = [
    ({"type": "array", "items": {"type": "integer"}, "minItems": 30_000_000}, "minItems"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 30_000_000}, "maxItems"),
    ({"type": "string", "minLength": 10**8}, "minLength"),
    ({"type": "string", "maxLength": 10**8}, "maxLength"),
    ({"type": "string", "pattern": "^a{100000000}$"}, "pattern"),
    ({"type": "string", "pattern": "^(ab){2,100000000}$"}, "pattern"),
    # under each count's own bound, over the expansion budget: 4000 copies of a long rule name
    (
        {"type": "object", "properties": {"x" * 300: {"type": "array", "items": {"type": "object"}, "maxItems": 4000}}},
        "maxItems",
    ),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 4000} for i in range(4)}}, "maxLength"),
    ({"type": "string", "enum": [str(i) for i in range(1000)]}, "enum"),
]


@pytest.mark.parametrize("schema, keyword", HUGE, ids=[k for _, k in HUGE])
def test_a_huge_expansion_is_refused_on_the_schema_in_milliseconds(schema, keyword):
    """70 bytes of `minItems: 30000000` took 10 s and 1.75 GB in the converter before the 400."""
    from agent.client import RequestError, schema_grammar

    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(RequestError) as e:
        schema_grammar(schema)
    took, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert took < 0.5 and peak < 4 << 20, (took, peak)
    assert e.value.param == "schema" and keyword in str(e.value)
    from protocol.grammar import SchemaError, schema_gbnf

    with pytest.raises(SchemaError) as s:
        schema_gbnf(schema)
    assert s.value.keyword == keyword


UNCONVERTIBLE = [
    ({"type": "string", "pattern": "[a-z]+"}, "pattern"),  # unanchored: AssertionError
    ({"type": "string", "pattern": "^(?:ab)+$"}, "pattern"),  # AssertionError
    ({"type": "string", "pattern": "^(?=a)b$"}, "pattern"),
    ({"type": "string", "pattern": "^*a$"}, "pattern"),  # IndexError
    ({"type": "string", "pattern": "^a{1,2,3}$"}, "pattern"),  # AssertionError
    ({"type": "string", "pattern": "^a]$"}, "pattern"),  # the converter loops forever on a bare ] or }
    ({"type": "string", "pattern": "^a}b$"}, "pattern"),
    ({"type": "string", "pattern": "^a[bc$"}, "pattern"),
    ({"type": "string", "pattern": "^\\bx$"}, "pattern"),  # (\\d and \\. were grammars llama.cpp cannot parse)
    ({"type": "string", "pattern": "^(a)\\1$"}, "pattern"),
    ({"type": "string", "pattern": "^[\\D]$"}, "pattern"),
    ({"type": "string", "pattern": "^\\x4$"}, "pattern"),
    ({"type": "string", "pattern": "^a$|^b$"}, "pattern"),
    ({"type": "string", "pattern": "^a+?$"}, "pattern"),
    ({"oneOf": [{"required": ["a"]}, {"required": ["b"]}]}, "oneOf"),  # AssertionError
    ({"type": "object", "properties": {"a": {"description": "anything"}}}, "properties"),
    ({"type": "object", "properties": {"a": True}}, "properties"),  # AttributeError
    ({"type": "object", "properties": {"a": False}}, "properties"),
    ({"anyOf": [True, {"type": "null"}]}, "anyOf"),
    ({"type": "array", "items": False}, "items"),
    ({"type": "array", "items": {"type": "array", "items": "x"}}, "items"),
    ({"type": "object", "additionalProperties": {"type": "bogus"}}, "type"),
    ({"type": []}, "type"),
    ({"type": "uuid"}, "type"),
    ({"$ref": "https://example.com/schema.json"}, "$ref"),  # AssertionError (no fetching)
    ({"$ref": "#/$defs/missing"}, "$ref"),
    ({"$ref": "#/anyOf/0", "anyOf": [{"type": "null"}]}, "$ref"),
    ({"enum": []}, "enum"),
    ({"type": "object", "properties": {"*": {"type": "string"}}}, "properties"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 2}, "maxItems"),
    ({"type": "string", "minLength": -1}, "minLength"),
    ({"type": "string", "format": 5}, "format"),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"not": {}}]}, "allOf"),
]


@pytest.mark.parametrize("schema, keyword", UNCONVERTIBLE, ids=[str(s)[:40] for s, _ in UNCONVERTIBLE])
def test_a_schema_the_converter_cannot_take_is_refused_naming_the_keyword(schema, keyword):
    from agent.client import RequestError, schema_grammar

    with pytest.raises(RequestError) as e:
        schema_grammar(schema)
    assert e.value.param == "schema" and keyword in str(e.value), str(e.value)
    from protocol.grammar import SchemaError, schema_gbnf

    with pytest.raises(SchemaError) as s:
        schema_gbnf(schema)
    assert s.value.keyword == keyword, str(s.value)


def test_a_schema_that_is_no_object_is_refused():
    from agent.client import RequestError, schema_grammar

    for schema in (True, False, [], "null", "[1, 2]", '{"type": "array", "items": true, "minItems": NaN}'):
        with pytest.raises(RequestError) as e:
            schema_grammar(schema)
        assert e.value.param == "schema"


CONVERTIBLE = [
    {"type": "array", "items": True, "minItems": 1},  # items: true was an AttributeError
    {"type": "array", "items": {}, "maxItems": 3},  # items: {} was a KeyError
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    {"type": "string", "pattern": "^[a-z]{1,64}@[a-z]{2,8}\\.(com|org)?$"},
    {"type": "string", "pattern": '^[^"\\\\]{0,16}\\[x\\]$'},
    {"type": ["string", "null"], "enum": ["a", "b", None]},
    {"type": "object", "properties": {"tags": {"type": ["array", "null"], "items": {"type": "string"}}}},
    {  # a recursive definition behind a $ref at the root (was a KeyError in the converter)
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}}}
        },
    },
    {
        "definitions": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}}},
        "allOf": [{"$ref": "#/definitions/base"}, {"properties": {"name": {"type": "string", "maxLength": 8}}}],
    },
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}, "u": {"format": "uuid"}}},
    {  # pydantic v1's field of a model or enum type
        "properties": {"c": {"allOf": [{"$ref": "#/definitions/Colour"}], "description": "which", "default": "red"}},
        "definitions": {"Colour": {"enum": ["red", "blue"]}},
    },
]


@pytest.mark.parametrize("schema", CONVERTIBLE, ids=[str(s)[:40] for s in CONVERTIBLE])
def test_schemas_the_converter_takes_still_convert(schema):
    from agent.client import schema_grammar

    gbnf = schema_grammar(schema)
    assert "root ::=" in gbnf


def test_a_type_list_keeps_each_types_keywords():
    """["array", "null"] with items: the converter alone wrote `array | null` (any array); each branch now keeps
    the schema's keywords, so the array branch is the items' rule."""
    from protocol.grammar import prepare_schema

    schema = {"type": ["array", "null"], "items": {"type": "string"}, "maxItems": 2}
    assert prepare_schema(schema) == {
        "anyOf": [{"items": {"type": "string"}, "minItems": 0, "maxItems": 2}, {"type": "null"}]
    }


def test_a_refused_schema_does_not_wait_for_the_models_lock():
    """A generation holds the model's lock: a schema is checked (and converted) before the lock is taken."""
    from agent.client import Client, RequestError

    client = Client(None, drafter=types.SimpleNamespace(name="fake"), offline="local")
    out: list[BaseException] = []

    def ask() -> None:
        try:
            client.generate("hi", schema={"type": "array", "items": {"type": "integer"}, "minItems": 100_000})
        except BaseException as e:  # handed to the test
            out.append(e)

    with client.lock:  # a generation (or a navigation step) is running
        worker = threading.Thread(target=ask, daemon=True)
        worker.start()
        worker.join(5)
        refused_while_held = not worker.is_alive()
    worker.join(30)
    assert refused_while_held and isinstance(out[0], RequestError) and "minItems" in str(out[0])


def test_conversions_are_cached_and_bounded():
    from protocol import grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    first = grammar.schema_gbnf(schema)
    assert grammar.schema_gbnf(dict(schema)) is first
    for i in range(grammar.MAX_CACHED_SCHEMAS + 4):
        grammar.schema_gbnf({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
    assert len(grammar._converted) == grammar.MAX_CACHED_SCHEMAS


@pytest.mark.real
def test_the_grammar_of_a_nullable_array_enforces_its_items(drafter):
    """{"type": ["array", "null"], "items": ...} (Kubernetes schemas use it everywhere): the converter alone
    wrote `array | null`, so {"drivers": [1, 2, 3]} passed the grammar and not the schema."""
    from agent.client import schema_grammar
    from protocol.grammar import GrammarError

    schema = {
        "type": "object",
        "properties": {"drivers": {"type": ["array", "null"], "items": {"type": "string"}}},
        "required": ["drivers"],
    }
    grammar = drafter.grammars.get(schema_grammar(schema))
    for instance in ('{"drivers": ["a", "b"]}', '{"drivers": null}', '{"drivers": []}'):
        grammar.walk(drafter.tokenize(instance))
    with pytest.raises(GrammarError):
        grammar.walk(drafter.tokenize('{"drivers": [1, 2, 3]}'))


@pytest.mark.real
def test_a_patterns_escapes_are_character_classes(drafter):
    """\\d, \\. and \\* were copied into the grammar as written: GBNF knows no such escape (a 500), and a
    quantifier after one repeated the whole literal before it."""
    from agent.client import schema_grammar
    from protocol.grammar import GrammarError

    grammar = drafter.grammars.get(schema_grammar({"type": "string", "pattern": "^v\\d{1,2}\\.\\d\\*+$"}))
    for instance in ('"v1.2*"', '"v12.0***"'):
        grammar.walk(drafter.tokenize(instance))
    for instance in ('"va.2*"', '"v1x2*"', '"v1.2v1.2*"', '"v1.2"'):
        with pytest.raises(GrammarError):
            grammar.walk(drafter.tokenize(instance))


@pytest.mark.real
def test_a_grammar_llama_cpp_cannot_read_is_a_request_error(drafter):
    """It was a GrammarError from inside the generation (a 500 at the endpoint)."""
    from agent.client import Client, RequestError

    with Client(None, drafter=drafter, offline="local") as client:
        for grammar in ("root ::= [", 'root ::= "a" | undefined-rule'):
            with pytest.raises(RequestError) as e:
                client.generate("hi", grammar=grammar, max_tokens=2)
            assert e.value.param == "grammar"


def test_a_conversion_past_its_deadline_is_refused(monkeypatch):
    """The wait for the converter's worker is bounded: a conversion that takes too long (none does under the
    bounds) is a SchemaError at the deadline, and the caller goes on."""
    from protocol import grammar

    monkeypatch.setattr(grammar, "_convert", lambda text: time.sleep(1.0) or "root ::= [a]")
    t0 = time.perf_counter()
    with pytest.raises(grammar.SchemaError, match="took over"):
        grammar.schema_gbnf({"type": "object", "properties": {"slow": {"type": "null"}}}, timeout_s=0.1)
    assert time.perf_counter() - t0 < 0.5
