"""JSON schemas end to end: each one sent as `response_format` to the robot's OpenAI endpoint, answered by the
shipped pair (the draft on the robot, the verifier in its own process), and the answer judged. The prompt asks for
a short example and shows the schema (its first ASK_SCHEMA_CHARS characters): the 135M pair, asked with no
schema, fills lists until max_tokens.

What each answer is:
    valid       finish_reason "stop" and the content validates against the schema (jsonschema)
    invalid     finish_reason "stop" but the content does not parse or does not validate: a defect
    truncated   finish_reason "length": cut by max_tokens (the 135M model repeats list items), never called complete
    refused     a 400 naming the keyword or feature the engine cannot serve
    broken      any other status (a 500): a defect

    rows = run(schemas, max_tokens=256)      # schemas: (category, id, schema) triples
"""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

OUTCOMES = ("valid", "invalid", "truncated", "refused", "broken")
ASK = "Give one short example of a JSON document that follows this JSON schema: {schema}"
ASK_SCHEMA_CHARS = 3000  # of the schema's text in the prompt (a Kubernetes schema would pass the draft's context)


def _judge(status: int, body: dict[str, Any], schema: Any) -> tuple[str, str]:
    """(outcome, detail) of one answer."""
    if status == 400:
        return "refused", str(body.get("error", {}).get("message", ""))[:160]
    if status != 200:
        return "broken", f"{status}: {str(body)[:160]}"
    choice = body["choices"][0]
    if choice["finish_reason"] == "length":
        return "truncated", ""
    text = choice["message"]["content"] or ""
    try:
        value = json.loads(text)
    except ValueError as e:
        return "invalid", f"not JSON: {e}"[:160]
    try:
        import jsonschema

        jsonschema.validate(value, schema)
    except ImportError:  # jsonschema is a test extra: then parsing is the check
        return "valid", "parsed (jsonschema not installed)"
    except jsonschema.ValidationError as e:
        return "invalid", e.message[:160]
    except jsonschema.SchemaError as e:  # the schema itself is not valid JSON Schema: jsonschema cannot judge
        return "valid", f"not judged: {e.message[:120]}"
    return "valid", ""


def _post(port: int, schema: Any, max_tokens: int) -> tuple[int, dict[str, Any]]:
    body = {
        "model": "edge-agent",
        "messages": [{"role": "user", "content": ASK.format(schema=json.dumps(schema)[:ASK_SCHEMA_CHARS])}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, {"raw": data[:200].decode(errors="replace")}


def run(schemas: Iterable[tuple[str, str, Any]], max_tokens: int = 256) -> list[dict[str, Any]]:
    """One row per schema: category, id, outcome, detail, seconds. The verifier is pinned to the last core and
    the draft to the others, so the two do not compete for one."""
    import os

    from agent import Client
    from agent.app.openai_api import OpenAiApi
    from server_bridge.ops.fleet import LocalVerifier

    cores = sorted(os.sched_getaffinity(0))
    rows: list[dict[str, Any]] = []
    with LocalVerifier(cpus={cores[-1]}, threads=1) as server, Client(server.url, threads=1) as client:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="bench-openai", daemon=True)
        thread.start()
        api = OpenAiApi(client, "127.0.0.1:0")
        asyncio.run_coroutine_threadsafe(api.start(), loop).result(30)
        port = api.server.sockets[0].getsockname()[1]
        try:
            for i, (category, sid, schema) in enumerate(schemas):
                t0 = time.perf_counter()
                status, body = _post(port, schema, max_tokens)
                outcome, detail = _judge(status, body, schema)
                rows.append(
                    {
                        "category": category,
                        "id": sid,
                        "outcome": outcome,
                        "detail": detail,
                        "s": time.perf_counter() - t0,
                    }
                )
                print(f"  endpoint {i + 1}: {category}/{sid}: {outcome} {detail[:60]}", file=sys.stderr, flush=True)
        finally:
            asyncio.run_coroutine_threadsafe(api.close(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per category and for all: how many of each outcome."""
    out = []
    for category in [*sorted({r["category"] for r in rows}), "all"]:
        got = [r for r in rows if category in ("all", r["category"])]
        out.append(
            {"category": category, "schemas": len(got), **{o: sum(r["outcome"] == o for r in got) for o in OUTCOMES}}
        )
    return out
