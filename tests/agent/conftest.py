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
