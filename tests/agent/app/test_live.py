"""The live view's rules without a socket: who is let in (admit), what a viewer may send (Subscriptions)."""

from __future__ import annotations

import json
import struct
from http import HTTPStatus

from agent.app.live import MAX_SUBSCRIPTIONS, Subscriptions, admit, presented_token

TOKEN = "live-view-credential-0123456789"
FOXGLOVE_APP = frozenset({"https://app.foxglove.dev"})


def verdict(origins=(), host="127.0.0.1:8765", token=TOKEN, allowed=FOXGLOVE_APP, listen="127.0.0.1"):
    got = admit(list(origins), host, token, allowed, listen, TOKEN)
    return None if got is None else got[0]


def test_who_is_let_in():
    assert verdict() is None  # the desktop app or a script: no Origin, the credential
    assert verdict(origins=["https://app.foxglove.dev"]) is None
    assert verdict(origins=["https://evil.example"]) == HTTPStatus.FORBIDDEN
    assert verdict(origins=["https://evil.example"], allowed=frozenset()) == HTTPStatus.FORBIDDEN
    assert verdict(origins=["https://app.foxglove.dev"], allowed=frozenset()) == HTTPStatus.FORBIDDEN  # none listed
    assert verdict(origins=["https://app.foxglove.dev", "https://evil.example"]) == HTTPStatus.FORBIDDEN
    assert verdict(token=None) == HTTPStatus.UNAUTHORIZED
    assert verdict(token=TOKEN[:-1]) == HTTPStatus.UNAUTHORIZED
    assert verdict(host="evil.example:8765") == HTTPStatus.FORBIDDEN  # DNS rebinding
    assert verdict(host=None) == HTTPStatus.FORBIDDEN
    assert verdict(host="localhost:8765") is None and verdict(host="[::1]:8765", listen="::1") is None
    assert verdict(host="robot.lan:8765", listen="0.0.0.0") is None  # allow_remote: the name is the operator's


def test_the_credential_comes_in_the_url_or_a_bearer_header():
    assert presented_token(f"/?token={TOKEN}", None) == TOKEN
    assert presented_token("/", f"Bearer {TOKEN}") == TOKEN
    assert presented_token("/", None) is None and presented_token("/", f"Basic {TOKEN}") is None
    assert presented_token(f"/?token={TOKEN}&token=x", None) is None  # two: neither


def test_a_viewer_only_subscribes_and_unsubscribes():
    subs = Subscriptions(frozenset({1, 2}))
    assert subs.apply(json.dumps({"op": "subscribe", "subscriptions": [{"id": 7, "channelId": 2}]})) is None
    frames = subs.frames(2, 123, b"cdr")
    assert frames == [struct.pack("<BIQ", 1, 7, 123) + b"cdr"] and subs.frames(1, 123, b"x") == []
    for bad in (
        b"\x01binary",
        "not json",
        json.dumps({"op": "advertise", "channels": []}),  # client publish: not offered
        json.dumps({"op": "setParameters", "parameters": []}),
        json.dumps({"op": "subscribe", "subscriptions": [{"id": 8, "channelId": 99}]}),
        json.dumps({"op": "subscribe", "subscriptions": [{"id": -1, "channelId": 1}]}),
        json.dumps({"op": "subscribe", "subscriptions": [{"id": 9, "channelId": True}]}),
    ):
        assert subs.apply(bad) is not None
    assert subs.by_id == {7: 2}
    assert subs.apply(json.dumps({"op": "unsubscribe", "subscriptionIds": [7, "x"]})) is None and not subs.by_id
    many = [{"id": i, "channelId": 1} for i in range(MAX_SUBSCRIPTIONS + 5)]
    assert subs.apply(json.dumps({"op": "subscribe", "subscriptions": many})) == "too many subscriptions"
    assert len(subs.by_id) == MAX_SUBSCRIPTIONS
