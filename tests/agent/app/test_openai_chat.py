"""OpenAI request bodies -> Client arguments (agent/app/openai_chat.py): malformed tool_choice shapes and schemas
are RequestErrors naming the parameter (400), never an AttributeError (500)."""

from __future__ import annotations

import pytest

from agent.app.openai_chat import parse_chat
from agent.client import RequestError

TOOLS = [{"type": "function", "function": {"name": "go", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "hi"}]


def body(**kw):
    return {"model": "m", "messages": ASK, **kw}


@pytest.mark.parametrize(
    "choice",
    [
        {"function": "go"},
        {"function": None},
        {"type": "function"},
        {"function": {"name": "nope"}},
        {"function": {"name": 7}},
        {"function": {"name": ["go"]}},  # unhashable: was a TypeError (a 500)
        {"type": "tool", "function": {"name": "go"}},
        5,
        ["go"],
        "x",
    ],
    ids=str,
)
def test_a_malformed_tool_choice_is_a_request_error(choice):
    with pytest.raises(RequestError) as e:
        parse_chat(body(tools=TOOLS, tool_choice=choice), "refuse")
    assert e.value.param == "tool_choice"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "go"}}, 5], ids=str)
def test_a_tool_choice_without_tools_is_a_request_error(choice):
    with pytest.raises(RequestError) as e:
        parse_chat(body(tool_choice=choice), "refuse")
    assert e.value.param == "tool_choice"
    assert "schema" not in parse_chat(body(tool_choice="auto"), "refuse").kwargs  # auto without tools: no tools


def test_a_tool_named_by_tool_choice_is_the_answers_schema():
    req = parse_chat(body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "go"}}), "refuse")
    assert req.kwargs["schema"]["anyOf"][0]["properties"]["name"] == {"const": "go"}


def test_a_schema_over_the_bounds_names_its_parameter_and_keyword():
    """check_schema's bounds, on the schema alone (what LLGuidance cannot enforce is refused when the Client
    compiles it: tests/agent/app/test_openai_api.py)."""
    huge = {"type": "string", "pattern": "^a{100000000}$"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": huge}}
    with pytest.raises(RequestError) as e:
        parse_chat(body(response_format=fmt), "refuse")
    assert e.value.param == "response_format" and "pattern" in str(e.value)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    tools = [{"type": "function", "function": {"name": "go", "parameters": wide}}]
    for choice in ("auto", "required"):
        with pytest.raises(RequestError) as e:
            parse_chat(body(tools=tools, tool_choice=choice), "refuse")
        assert e.value.param == "tools" and "properties" in str(e.value)


def test_structured_requests_send_the_schema_itself():
    """json_schema and json_object as a JSON schema, a named tool as its call's schema, auto as Lark embedding it
    (a call, or text that does not start like one): LLGuidance's formats, no conversion."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_chat(body(response_format={"type": "json_schema", "json_schema": {"schema": schema}}), "refuse")
    assert req.kwargs["schema"] == schema and req.structure == "response_format"
    assert parse_chat(body(response_format={"type": "json_object"}), "refuse").kwargs["schema"] == {"type": "object"}
    auto = parse_chat(body(tools=TOOLS), "refuse")
    assert auto.structure == "tools" and auto.kwargs["grammar"]["lark"].startswith("start: call | text\ncall: %json {")
