"""JSON schemas through the Python API (agent.client: schema_grammar, Client._grammar): the schema itself travels
({"json_schema": text}) and LLGuidance compiles it on both sides (protocol/structured.py). Bounded on the schema
before anything compiles, anything LLGuidance cannot enforce refused as a RequestError naming the keyword, never
an AssertionError, an AttributeError or a hang; all of it off the model's lock.

The schemas below broke llama.cpp's converter (the path before LLGuidance, docs/benchmarks/schemas.md) one
way or another: a huge expansion, an assertion, a loop."""

from __future__ import annotations

import json
import threading
import time
import types

import pytest

from protocol import grammar, modelfiles, structured

COMPACT = {"whitespace_pattern": " ?"}

pytest.importorskip("llama_cpp")

HUGE = [  # 70 bytes of `minItems: 30000000` took the converter 10 s and 1.75 GB; LLGuidance counts lazily
    {"type": "array", "items": {"type": "integer"}, "minItems": 30_000_000},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 30_000_000},
    {"type": "string", "minLength": 10**8},
    {"type": "string", "maxLength": 10**8},
    {"type": "string", "pattern": "^a{100000000}$"},
    {"type": "string", "pattern": "^(ab){2,100000000}$"},
    {"type": "object", "properties": {"x" * 300: {"type": "array", "items": {"type": "object"}, "maxItems": 4000}}},
    {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 4000} for i in range(4)}},
    {"type": "string", "enum": [str(i) for i in range(1000)]},
]
REFUSED = [  # (schema, the keyword the refusal names, or None: a reason alone)
    ({"type": "string", "pattern": "^(?=a)b$"}, "pattern"),  # look-around
    ({"type": "string", "pattern": "^a{100000000}$"}, "pattern"),  # over check_schema's bound
    ({"oneOf": [{"required": ["a"]}, {"required": ["b"]}]}, "oneOf"),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"not": {}}]}, "not"),
    ({"type": "string", "pattern": "^a[bc$"}, None),
    ({"type": "object", "additionalProperties": {"type": "bogus"}}, None),
    ({"$ref": "https://example.com/schema.json"}, None),  # no fetching
    ({"$ref": "#/$defs/missing"}, None),
    ({"enum": []}, None),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 2}, None),
    ({"type": "string", "minLength": -1}, None),
]
ENFORCED = [  # the converter refused or broke on these; LLGuidance enforces them
    {"type": "string", "pattern": "[a-z]+"},
    {"type": "string", "pattern": "^a$|^b$"},
    {"type": "object", "properties": {"a": True, "b": {"description": "anything"}}},
    {"type": "array", "items": True, "minItems": 1},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}}},
    {
        "definitions": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}}},
        "allOf": [{"$ref": "#/definitions/base"}, {"properties": {"name": {"type": "string", "maxLength": 8}}}],
    },
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}, "u": {"format": "uuid"}}},
]


@pytest.fixture(scope="module")
def vocab():
    v = structured.Vocabulary.from_gguf(modelfiles.shipped_gguf())
    v.schema({"type": "boolean"})  # its compile workers started (~0.5 s, once): the timings below are compiles
    return v


@pytest.fixture
def client(vocab):
    """A Client whose draft is the shipped vocabulary alone: enough to check and compile, never to generate."""
    from agent.client import Client

    return Client(None, drafter=types.SimpleNamespace(name="fake", grammars=vocab), offline="local")


def refusal(client, schema):
    from agent.client import RequestError

    with pytest.raises(RequestError) as e:
        client._grammar(client_request(schema))
    return e.value


def client_request(schema):
    from agent.client import _Request

    return _Request.of("hi", {"schema": schema}, "sd", "local")


def test_a_schema_travels_as_itself():
    from agent.client import schema_grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    sent = schema_grammar(schema)
    assert list(sent) == ["json_schema"] and json.loads(sent["json_schema"]) == {**schema, "x-guidance": COMPACT}
    own = {**schema, "x-guidance": {"whitespace_flexible": False}}
    assert json.loads(schema_grammar(own)["json_schema"]) == own  # a schema's own whitespace option stands


@pytest.mark.parametrize("schema", HUGE, ids=[json.dumps(s)[:40] for s in HUGE])
def test_a_huge_count_compiles_or_is_refused_in_milliseconds(client, schema):
    t0 = time.perf_counter()
    try:
        assert client._grammar(client_request(schema)) is not None
    except Exception as e:  # a refusal: typed, naming the keyword
        from agent.client import RequestError

        assert isinstance(e, RequestError) and e.param == "schema" and "pattern" in str(e), e
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.parametrize("schema, keyword", REFUSED, ids=[json.dumps(s)[:40] for s, _ in REFUSED])
def test_a_schema_llguidance_cannot_enforce_is_refused_naming_the_keyword(client, schema, keyword):
    e = refusal(client, schema)
    assert e.param == "schema" and (keyword is None or f"({keyword})" in str(e)), str(e)


@pytest.mark.parametrize("schema", ENFORCED, ids=[json.dumps(s)[:40] for s in ENFORCED])
def test_schemas_the_converter_could_not_take_are_enforced(client, schema):
    sent = client._grammar(client_request(schema))
    assert sent is not None and json.loads(sent["json_schema"]) == {**schema, "x-guidance": COMPACT}


def test_json_answers_are_compact_as_llama_cpps_were(vocab):
    """One optional space between JSON tokens, no newlines: a small model cannot spend its budget on them."""
    from llama_cpp import Llama

    from agent.client import schema_grammar

    llama = Llama(str(modelfiles.shipped_gguf()), vocab_only=True, verbose=False)
    c = vocab.for_wire(schema_grammar({"type": "object"}))
    for text, allowed in (('{"a": [1, 2]}', True), ('{ "a" : 1 }', True), ('{\n"a": 1}', False), ('{"a":  1}', False)):
        ids = llama.tokenize(text.encode(), add_bos=False, special=False)
        assert (c.start().advance(ids) == len(ids)) == allowed, text


def test_a_schema_that_is_no_schema_is_refused(client):
    for schema in ([], "null", "[1, 2]", "{", '{"type": "array", "items": true, "minItems": NaN}'):
        assert refusal(client, schema).param == "schema"


def test_a_refused_schema_does_not_wait_for_the_models_lock(client):
    """A generation holds the model's lock: a schema is checked and compiled before the lock is taken."""
    from agent.client import RequestError

    out: list[BaseException] = []

    def ask() -> None:
        one_of = {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
        for schema in ({"type": "string", "pattern": "^a{5000}$"}, one_of):
            try:
                client.generate("hi", schema=schema)
            except BaseException as e:  # handed to the test
                out.append(e)

    with client.lock:  # a generation (or a navigation step) is running
        worker = threading.Thread(target=ask, daemon=True)
        worker.start()
        worker.join(5)
        refused_while_held = not worker.is_alive()
    worker.join(30)
    assert refused_while_held and all(isinstance(e, RequestError) for e in out) and len(out) == 2
    assert "pattern" in str(out[0]) and "oneOf" in str(out[1])


def test_a_grammar_that_does_not_compile_is_a_request_error(client):
    """It was a GrammarError from inside the generation (a 500 at the endpoint)."""
    from agent.client import RequestError

    for g in ("root ::= [", 'root ::= "a" | undefined-rule', {"lark": "start: nowhere"}, {"regex": "a"}, 5):
        with pytest.raises(RequestError) as e:
            client.generate("hi", grammar=g, max_tokens=2)
        assert e.value.param == "grammar"


@pytest.mark.real
def test_the_grammar_of_a_nullable_array_enforces_its_items(drafter):
    """{"type": ["array", "null"], "items": ...} (Kubernetes schemas use it everywhere): the converter alone
    wrote `array | null`, so {"drivers": [1, 2, 3]} passed the grammar and not the schema."""
    from agent.client import schema_grammar

    schema = {
        "type": "object",
        "properties": {"drivers": {"type": ["array", "null"], "items": {"type": "string"}}},
        "required": ["drivers"],
    }
    constraint = drafter.grammars.for_wire(schema_grammar(schema))
    for instance in ('{"drivers": ["a", "b"]}', '{"drivers": null}', '{"drivers": []}'):
        constraint.walk(drafter.tokenize(instance))
    with pytest.raises(grammar.GrammarError):
        constraint.walk(drafter.tokenize('{"drivers": [1, 2, 3]}'))


@pytest.mark.real
def test_a_patterns_escapes_are_character_classes(drafter):
    from agent.client import schema_grammar

    constraint = drafter.grammars.for_wire(schema_grammar({"type": "string", "pattern": "^v\\d{1,2}\\.\\d\\*+$"}))
    for instance in ('"v1.2*"', '"v12.0***"'):
        constraint.walk(drafter.tokenize(instance))
    for instance in ('"va.2*"', '"v1x2*"', '"v1.2v1.2*"', '"v1.2"'):
        with pytest.raises(grammar.GrammarError):
            constraint.walk(drafter.tokenize(instance))


@pytest.mark.real
def test_llguidances_own_bounds_met_midway_are_a_request_error(drafter):
    """An anyOf of two objects of 480 optional properties compiles, and after its first token the parser's row
    passes LLGuidance's 2,000 items: a RequestError naming the schema, not a GrammarError from inside the
    generation (the endpoint's 500). The verifier answers the same failure with bad_field, to that session."""
    from agent.client import Client, RequestError

    def wide(prefix: str) -> dict:
        return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(480)}}

    with Client(None, drafter=drafter, offline="local") as c:
        with pytest.raises(RequestError) as e:
            c.generate("Answer in JSON.", schema={"anyOf": [wide("p"), wide("q")]}, max_tokens=8)
    assert e.value.param == "schema" and "2000" in str(e.value), str(e.value)
