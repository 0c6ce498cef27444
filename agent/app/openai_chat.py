"""OpenAI chat completions <-> agent.client: a request body to Client arguments, an answer to the response,
its stream chunks and tool calls (the HTTP side is agent/app/openai_api.py; docs/guide/openai.md)."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from agent.client import OFFLINE, Completion, RequestError, compact
from protocol import structured

JSON_OBJECT_SCHEMA = {"type": "object"}  # any JSON object (response_format json_object), LLGuidance's own JSON
MAX_TOOLS = 16
UNSUPPORTED = ("logprobs", "top_logprobs", "logit_bias", "audio", "prediction")  # refused when set
PENALTIES = ("presence_penalty", "frequency_penalty")  # accepted only as 0


@dataclass
class ChatRequest:
    """A /v1/chat/completions body, checked: what the Client is called with and how the answer is shaped."""

    model: str
    kwargs: dict[str, Any]  # Client.generate's arguments
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    tools: dict[str, dict] = field(default_factory=dict)  # name -> its function object, when calls are possible
    # the parameter a schema or grammar the Client refuses came from (response_format or tools), else None
    structure: str | None = None


def parse_chat(body: Any, default_offline: str) -> ChatRequest:
    """The request object -> ChatRequest; RequestError (-> 400) names the parameter that is wrong."""
    if not isinstance(body, dict):
        raise RequestError("the body is a JSON object", None)
    model = body.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= 256:
        raise RequestError("model is required (GET /v1/models lists it)", "model")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False):
            raise RequestError(f"{name} is not supported by this endpoint", name)
    for name in PENALTIES:
        if body.get(name) not in (None, 0, 0.0):
            raise RequestError(f"{name} must be 0: the target's own distribution is what is verified", name)
    if body.get("n") not in (None, 1):
        raise RequestError("n must be 1", "n")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages is a non-empty list", "messages")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    kwargs: dict[str, Any] = {
        "messages": messages,
        "max_tokens": 256 if max_tokens is None else max_tokens,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "seed": body.get("seed"),
        "stop": body.get("stop"),
        "offline": _offline(body, default_offline),
    }
    req = ChatRequest(model, kwargs, stream=_flag(body, "stream"))
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError("stream_options is an object", "stream_options")
        req.include_usage = bool(options.get("include_usage"))
    _structure(body, req)
    return req


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool) and value is not None:
        raise RequestError(f"{name} is true or false", name)
    return bool(value)


def _offline(body: dict, default: str) -> str:
    """`offline` ("refuse" | "local"): what the request does without the verifier; the config's by default."""
    value = body.get("offline", default)
    if value not in OFFLINE:
        raise RequestError(f"offline is one of {', '.join(OFFLINE)}", "offline")
    return str(value)


def _structure(body: dict, req: ChatRequest) -> None:
    """response_format and tools -> the grammar both sides decode under (and the tools' prompt)."""
    fmt = body.get("response_format")
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice is None:  # absent or null: OpenAI's default
        choice = "auto" if tools else "none"
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise RequestError("response_format.json_schema.schema is a JSON schema object", "response_format")
            req.kwargs["schema"] = _checked(schema, "response_format")
            req.structure = "response_format"
        elif kind == "json_object":
            req.kwargs["schema"] = JSON_OBJECT_SCHEMA
            req.structure = "response_format"
        elif kind != "text":
            raise RequestError("response_format.type is text, json_object or json_schema", "response_format")
    if not (isinstance(choice, str) and choice in ("none", "auto", "required")) and not isinstance(choice, dict):
        raise RequestError("tool_choice is none, auto, required or a function of tools by name", "tool_choice")
    if not tools and (choice == "required" or isinstance(choice, dict)):
        raise RequestError("tool_choice names a tool or requires one: give tools", "tool_choice")
    if not tools or choice == "none":
        return
    if "schema" in req.kwargs or "grammar" in req.kwargs:
        raise RequestError("tools and a JSON response_format cannot be combined", "tools")
    req.tools = _tools(tools)
    req.structure = "tools"
    named = _choice(choice, req.tools)
    calls = {n: f for n, f in req.tools.items() if named is None or n == named}
    schema = {"anyOf": [_call_schema(n, f) for n, f in calls.items()]}
    if choice == "auto":  # a call, or text that does not start like one (LLGuidance's Lark embeds the schema)
        call = json.dumps(compact(schema), separators=(",", ":"))
        req.kwargs["grammar"] = {"lark": f"start: call | text\ncall: %json {call}\ntext: /[^{{ \\t\\n](.|\\n)*/\n"}
    else:
        req.kwargs["schema"] = schema
    req.kwargs["messages"] = _with_tools_prompt(req.kwargs["messages"], calls, choice == "auto")


def _tools(tools: Any) -> dict[str, dict]:
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise RequestError(f"tools is a list of 1 to {MAX_TOOLS} tools", "tools")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(fn, dict) or not isinstance(name, str) or not name or len(name) > 64:
            raise RequestError(f"tools[{i}] is {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise RequestError(f"tools[{i}].function.parameters is a JSON schema object", "tools")
        out[name] = {**fn, "parameters": _checked(params, "tools", f"tools[{i}].function.parameters: ")}
    return out


def _checked(schema: dict, param: str, what: str = "") -> dict:
    """A schema refused here, naming its keyword and the request's parameter, when it is over the bounds
    (protocol.structured.check_schema: one linear walk, no compile); the Client compiles it, off the model's
    lock, and a schema LLGuidance cannot enforce is refused there, naming its keyword too."""
    try:
        structured.check_schema(json.dumps(schema, separators=(",", ":")))
    except (TypeError, ValueError, RecursionError) as e:  # SchemaError included
        keyword = getattr(e, "keyword", None) or "schema"
        raise RequestError(f"{what}the schema cannot be used ({keyword}): {e}", param) from None
    return schema


def _choice(choice: Any, tools: dict[str, dict]) -> str | None:
    """tool_choice -> the one tool it names, or None for auto / required."""
    if choice in ("auto", "required"):
        return None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type", "function") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or name not in tools:
        raise RequestError("tool_choice is none, auto, required or a function of tools by name", "tool_choice")
    return name


def _call_schema(name: str, fn: dict) -> dict:
    props = {"name": {"const": name}, "arguments": fn["parameters"]}
    return {"type": "object", "properties": props, "required": ["name", "arguments"], "additionalProperties": False}


def _with_tools_prompt(messages: list, calls: dict[str, dict], optional: bool) -> list:
    """The tools described in a system message the chat template carries (the small drafts' templates have
    no tools section): their schemas and the call's JSON shape."""
    listed = json.dumps([{k: f.get(k) for k in ("name", "description", "parameters")} for f in calls.values()])
    how = "To call a tool, answer" + (" only" if not optional else ", when a tool is needed, only")
    text = f'You can call these tools: {listed}\n{how} with JSON: {{"name": TOOL, "arguments": {{...}}}}.'
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        first = messages[0]
        content = first.get("content")
        if isinstance(content, str):
            return [{**first, "content": content + "\n\n" + text}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def tool_calls(text: str, tools: dict[str, dict]) -> list[dict] | None:
    """The answer as OpenAI tool_calls when it is a call of one of `tools`, else None."""
    if not tools or not text.lstrip().startswith("{"):
        return None
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in tools:
        return None
    fn = {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}
    return [{"id": "call_" + secrets.token_hex(8), "type": "function", "function": fn}]


# ------------------------------------------------------------------ responses


def edge_fields(c: Completion) -> dict[str, Any]:
    """The `edge` extension: how the answer was decoded (docs/guide/openai.md)."""
    m = c.metrics
    return {
        "verified": c.verified,
        "mode": c.mode,
        "verified_tokens": c.verified_tokens,
        "token_ids": c.token_ids,
        "tau": m.tau,
        "rounds": m.rounds,
        "acceptance_rate": m.acceptance_rate,
        "bytes_up": m.bytes_up,
        "bytes_down": m.bytes_down,
        "wall_s": round(m.wall_s, 4),
    }


def usage(c: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
    }


def new_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def completion_body(req: ChatRequest, c: Completion, cid: str) -> dict[str, Any]:
    """The chat.completion object of a whole answer."""
    calls = tool_calls(c.text, req.tools)
    message: dict[str, Any] = {"role": "assistant", "content": None if calls else c.text}
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else c.finish_reason}
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [{**choice, "logprobs": None}],
        "usage": usage(c),
        "verified": c.verified,
        "edge": edge_fields(c),
    }


def chunk(req: ChatRequest, cid: str, delta: dict, verified: bool, finish: str | None = None) -> dict[str, Any]:
    """One chat.completion.chunk."""
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": req.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        "verified": verified,
    }


def last_chunks(req: ChatRequest, c: Completion, cid: str, held: str) -> list[dict[str, Any]]:
    """The stream's end: the held text (a tools request holds it all: a call is known only once whole) as
    content or as tool_calls, the finish_reason with `edge`, and usage when stream_options asked for it."""
    out = []
    calls = tool_calls(c.text, req.tools)
    if calls:
        delta = {"tool_calls": [{"index": 0, **calls[0]}]}
        out.append(chunk(req, cid, delta, c.verified))
    elif held:
        out.append(chunk(req, cid, {"content": held}, c.verified))
    end = chunk(req, cid, {}, c.verified, "tool_calls" if calls else c.finish_reason)
    end["edge"] = edge_fields(c)
    out.append(end)
    if req.include_usage:
        tail = chunk(req, cid, {}, c.verified)
        tail["choices"] = []
        tail["usage"] = usage(c)
        out.append(tail)
    return out
