"""Shared fixtures: the real models (loaded once per test run) and a real verifier on port 0."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server_bridge.config import ServerConfig


class ThreadedServer:
    """A real BridgeServer on 127.0.0.1:0, its event loop in a daemon thread."""

    def __init__(self, verifier_factory, **config):
        from server_bridge.server import BridgeServer

        self.config = ServerConfig(host="127.0.0.1", port=0, **config)
        self.loop = asyncio.new_event_loop()
        self.server = BridgeServer(verifier_factory(self.config), self.config)
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)

    def __enter__(self):
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"


@pytest.fixture(scope="session")
def target():
    """The default target on the default engine (llamacpp), tapped at the exits' layers as
    `serve --exits models/exits/smollm2-f32` does, so the exits run on both engines in the tests."""
    from server_bridge.target import load_target

    return load_target(threads=1, max_sequences=32, kv_tokens=16384, tap_layers=[12, 18, 22, 26])


@pytest.fixture(scope="session")
def drafter():
    from agent.decoding import DecoderSettings, open_decoder

    return open_decoder(DecoderSettings(threads=1)).drafter


@pytest.fixture(scope="session")
def weak_drafter():
    from agent.decoding import DecoderSettings, open_decoder

    return open_decoder(DecoderSettings(draft="smollm2-q2_k", threads=1)).drafter


@pytest.fixture(scope="module")
def verifier(target):
    """A verifier with the default config on the session's target, one per test module (its sessions go with it);
    a module that needs a config of its own uses make_server."""
    from server_bridge.verifier import Verifier

    with ThreadedServer(lambda cfg: Verifier(target, cfg)) as server:
        yield server


@pytest.fixture
def make_server(target):
    """make_server(**config) -> a started ThreadedServer sharing the session's target model."""
    from server_bridge.verifier import Verifier

    started = []

    def make(**config):
        s = ThreadedServer(lambda cfg: Verifier(target, cfg), **config).__enter__()
        started.append(s)
        return s

    yield make
    for s in started:
        s.__exit__(None, None, None)


@pytest.fixture(scope="session")
def torch_target():
    """The same target on the torch engine (CPU, float32): early exits and transformers internals."""
    from server_bridge.target import load_target

    return load_target(engine="torch", threads=1, max_sequences=16, max_len=1024)


@pytest.fixture(scope="session")
def compiled_torch_target():
    """The tiny random target (tools/models/random_target.py: 2 layers, the shipped vocabulary, a planted greedy
    path; its recipe directory, the one the GPU run's rehearsal makes) on the torch engine with its pass compiled
    (`torch_compile = "on"`; compiled once per test run: 20-50 s on this busy 2-core machine)."""
    from server_bridge.target import load_target
    from tools.models import random_target

    recipe = random_target.make(random_target.TINY, "q4_0", log=lambda m: None).hf_dir
    target = load_target(str(recipe), "torch", threads=1, max_sequences=16, max_len=1024, torch_compile="on")
    target.engine.warm()  # as `serve` does
    return target


@pytest.fixture(scope="session")
def qwen_vlm():
    """qwen_vlm(family) -> the family's tiny test VLM (tests/models/qwen_vlm.py: .hf_dir, .target, .target_mmproj,
    .draft, .draft_mmproj, .vocab, .image_token_id, .family), made once into models/build/ (~20 s) and found in
    the cache after; one object per family for the whole run. Families: qwen2vl, qwen2.5vl, qwen3vl, and
    smolvlm (make_test_vlm.make's TinyVLM)."""
    from tests.models import make_test_vlm

    made = {}

    def get(family: str):
        if family not in made:
            made[family] = make_test_vlm.make_family(family, log=lambda m: None)
        return made[family]

    return get
