"""agent.Client, the Python API: docs/guide/python.md's examples run against a real verifier, and its answers
are `edge-agent generate`'s."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "python.md"


@pytest.fixture(scope="module")
def client(verifier, drafter):
    from agent import Client

    with Client(verifier.url, drafter=drafter) as c:
        yield c


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def test_the_pages_examples_run(verifier, drafter, monkeypatch, capsys):
    import agent.decoding.drafter

    monkeypatch.setenv("EDGESPEC_VERIFIER", verifier.url)
    monkeypatch.setattr(agent.decoding.drafter, "Drafter", lambda *a, **kw: drafter)  # the session's loaded draft
    blocks = code_blocks(PAGE.read_text())
    assert len(blocks) >= 4
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{PAGE.name} block {i}", "exec"), namespace)  # noqa: S102 (the page's own examples)
    out = capsys.readouterr().out
    assert "refused:" in out and "False" in out
    assert namespace["answer"].verified and namespace["stream"].completion.verified


def test_ids_equal_edge_agent_generate(verifier, client, capsys):
    from agent.app import cli

    prompt = "Name three colours."
    rc = cli.main(
        ["generate", "--verifier", verifier.url, "--prompt", prompt, "--chat", "--max-tokens", "12"]
        + ["--threads", "1", "--json"]
    )
    assert rc == 0
    cli_ids = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]
    assert client.generate(prompt, chat=True, max_tokens=12).token_ids == cli_ids
    messages = [{"role": "user", "content": prompt}]
    assert client.generate(messages=messages, max_tokens=12).token_ids == cli_ids
    streamed = client.stream(messages=messages, max_tokens=12)
    assert "".join(streamed) == streamed.completion.text
    assert streamed.completion.token_ids == cli_ids


def test_stop_strings_and_sampling(client):
    full = client.generate("Count: one, two,", max_tokens=16)
    cut = client.generate("Count: one, two,", max_tokens=16, stop=["four"])
    assert "four" in full.text and cut.text == full.text[: full.text.index("four")]
    assert cut.finish_reason == "stop" and cut.token_ids == full.token_ids[: len(cut.token_ids)]
    a = client.generate("Once upon a time", max_tokens=10, temperature=0.8, top_k=40, seed=7)
    b = client.generate("Once upon a time", max_tokens=10, temperature=0.8, top_k=40, seed=7)
    assert a.token_ids == b.token_ids and a.verified


def test_bad_arguments_are_request_errors(client):
    from agent.client import RequestError

    cases = [
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"stop": ["a"] * 5}, "stop"),
        ({"schema": {"type": "object"}, "grammar": "root ::= [a]"}, "schema"),
        ({"images": [b"not an image"]}, "images"),
        ({"offline": "maybe"}, "offline"),
    ]
    for kw, param in cases:
        with pytest.raises(RequestError) as e:
            client.generate("hi", **kw)
        assert e.value.param == param, kw
    with pytest.raises(RequestError, match="data: URI"):
        client.generate(
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
        )
    with pytest.raises(TypeError):
        client.generate("hi", max_new_tokens=3)


def test_a_consumer_that_leaves_ends_the_generation(client):
    with client.stream("Once upon a time", max_tokens=200) as stream:
        first = next(iter(stream))
    assert first and stream.completion is not None and len(stream.completion.token_ids) < 200


def test_issue_50s_grammars_are_request_errors_and_the_next_answer_comes(client, monkeypatch):
    """A schema chain of 4,000 anyOfs and a Lark chain of 4,000 rules (each killed this process with SIGSEGV), and a
    Lark grammar of 40,000 alternatives (2.4 s to compile): each a RequestError naming what is wrong, and a normal
    answer right after. With the chain bound lifted, the chain reaches a compile worker and kills it instead."""
    from agent.client import RequestError
    from protocol import structured
    from tools.schemas.hostile import lark_alternatives, lark_chain, schema_chain

    cases = [
        ({"schema": json.loads(schema_chain(4000))}, "schema", "chain of nested values and \\$refs"),
        ({"grammar": {"lark": lark_chain(4000)}}, "grammar", "chain of rules"),
        ({"grammar": {"lark": lark_alternatives(40000)}}, "grammar", "to compile and was stopped"),
    ]
    for kw, param, words in cases:
        with pytest.raises(RequestError, match=words) as e:
            client.generate("hi", max_tokens=4, **kw)
        assert e.value.param == param
        assert len(client.generate("hi", max_tokens=3).token_ids) == 3
    monkeypatch.setattr(structured, "MAX_REFERENCE_CHAIN", 10**6)
    with pytest.raises(RequestError, match="crashed the compiler"):
        client.generate("hi", max_tokens=4, schema=json.loads(schema_chain(4000)), peer="caller 2")
    assert len(client.generate("hi", max_tokens=3).token_ids) == 3
