"""The per-connection exit outbox: bounded under a flood, ordered by its policy, purged per round (fast)."""

import asyncio
import random

import pytest

from protocol.wire import Exit
from server_bridge.outbox import Outbox


def _exit(confidence, sid="s", round=0, layer=12):
    return Exit(sid, round, layer, [1, 2], confidence)


async def _drain(box: Outbox) -> list:
    return [await box.get() for _ in range(len(box))]


@pytest.mark.parametrize("policy", ["priority", "fifo", "random"])
def test_a_flood_stays_bounded_and_every_drop_is_counted(policy):
    box = Outbox(64, policy, random.Random(1))
    rng = random.Random(2)
    dropped = sum(box.put(_exit(rng.random(), round=i)) for i in range(10_000))
    assert len(box) == 64
    assert dropped == box.dropped == 10_000 - 64


def test_a_full_priority_outbox_keeps_the_most_confident():
    box = Outbox(8, "priority")
    confidences = [i / 1000 for i in range(1000)]
    random.Random(3).shuffle(confidences)
    for c in confidences:
        box.put(_exit(c))
    kept = [m.confidence for m in asyncio.run(_drain(box))]
    assert kept == sorted(confidences, reverse=True)[:8]  # and sent highest first


def test_priority_sends_the_most_confident_first_and_equals_oldest_first():
    box = Outbox(16, "priority")
    for i, c in enumerate([0.2, 0.9, 0.5, 0.9, 0.1]):
        box.put(_exit(c, layer=10 + i))
    got = [(m.confidence, m.layer) for m in asyncio.run(_drain(box))]
    assert got == [(0.9, 11), (0.9, 13), (0.5, 12), (0.2, 10), (0.1, 14)]


def test_fifo_sends_in_arrival_order_and_drops_the_oldest():
    box = Outbox(3, "fifo")
    for i in range(5):
        assert box.put(_exit(0.5, round=i)) == (1 if i >= 3 else 0)
    assert [m.round for m in asyncio.run(_drain(box))] == [2, 3, 4]


def test_purge_removes_only_the_answered_round():
    box = Outbox(16, "priority")
    for sid, rnd in [("a", 0), ("a", 1), ("a", 1), ("b", 1), ("a", 2)]:
        box.put(_exit(0.5, sid, rnd))
    assert box.purge("a", 1) == 2
    assert sorted((m.sid, m.round) for m in asyncio.run(_drain(box))) == [("a", 0), ("a", 2), ("b", 1)]
    for rnd in range(3):
        box.put(_exit(0.5, "a", rnd))
    box.put(_exit(0.5, "b", 0))
    assert box.purge("a") == 3 and len(box) == 1 and box.purged == 5


def test_get_waits_for_a_put_and_a_closed_outbox_takes_nothing():
    async def scenario():
        box = Outbox(4, "fifo")
        getter = asyncio.create_task(box.get())
        await asyncio.sleep(0.01)
        assert not getter.done()
        box.put(_exit(0.3))
        assert (await asyncio.wait_for(getter, 1)).confidence == 0.3
        box.put(_exit(0.4))
        box.close()
        assert len(box) == 0 and box.put(_exit(0.5)) == 0 and len(box) == 0

    asyncio.run(scenario())


def test_bad_outbox_settings_are_refused():
    with pytest.raises(ValueError):
        Outbox(0)
    with pytest.raises(ValueError, match="policy"):
        Outbox(4, "lifo")
