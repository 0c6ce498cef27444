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
    [{"function": "go"}, {"function": None}, {"type": "function"}, {"function": {"name": "nope"}}, 5, ["go"], "x"],
    ids=str,
)
def test_a_malformed_tool_choice_is_a_request_error(choice):
    with pytest.raises(RequestError) as e:
        parse_chat(body(tools=TOOLS, tool_choice=choice), "refuse")
    assert e.value.param == "tool_choice"


def test_a_tool_named_by_tool_choice_is_the_answers_schema():
    req = parse_chat(body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "go"}}), "refuse")
    assert req.kwargs["schema"]["anyOf"][0]["properties"]["name"] == {"const": "go"}


def test_a_schema_over_the_bounds_or_unconvertible_names_its_parameter_and_keyword():
    huge = {"type": "array", "items": {"type": "integer"}, "minItems": 30_000_000}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": huge}}
    with pytest.raises(RequestError) as e:
        parse_chat(body(response_format=fmt), "refuse")
    assert e.value.param == "response_format" and "minItems" in str(e.value)
    tools = [{"type": "function", "function": {"name": "go", "parameters": {"oneOf": [{"required": ["a"]}]}}}]
    for choice in ("auto", "required"):
        with pytest.raises(RequestError) as e:
            parse_chat(body(tools=tools, tool_choice=choice), "refuse")
        assert e.value.param == "tools" and "oneOf" in str(e.value)
