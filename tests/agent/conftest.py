"""The vision tests' pair fixtures (tests/agent/vlm_pairs.py): a module that names its test pair `vlm` and its
target `vtarget` gets the pair's draft and a verifier server for that target; a module's own fixture of the
same name wins."""

import pytest

from server_bridge.verifier import Verifier
from tests.agent import vlm_pairs
from tests.conftest import ThreadedServer


@pytest.fixture(scope="module")
def vdrafter(vlm):
    return vlm_pairs.drafter(vlm)


@pytest.fixture(scope="module")
def vserver(vtarget):
    with ThreadedServer(lambda cfg: Verifier(vtarget, cfg), max_context=1024) as server:
        yield server


@pytest.fixture(autouse=True)
def _close_safety_layers(monkeypatch):
    """Every SafetyLayer a test makes is closed after it (its e-stop and driver lanes are two threads each): a test
    that forgets leaves no lane thread behind (42 pairs of them piled up over a whole run)."""
    from agent.robot.safety import SafetyLayer

    made: list[SafetyLayer] = []
    init = SafetyLayer.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(SafetyLayer, "__init__", tracked)
    yield
    for layer in made:
        layer.close(timeout_s=0.5)
