"""The draft model on llama-cpp: same tokenizer as the target, KV rollback, q kept for every token."""

import numpy as np
import pytest

from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.real

TEXTS = [
    "Go to the kitchen, turn left 30 degrees and stop.",
    "def f(x):\n    return x ** 2  # ünïcödé 😀",
    "  multiple   spaces\n\n\ttabs and 12345.678",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def test_both_sides_tokenize_identically(drafter, target, torch_target):
    """llama.cpp (the draft, and the llamacpp engine) and the Hugging Face tokenizer of the torch engine."""
    assert drafter.vocab_size == target.vocab_size == torch_target.vocab_size
    assert drafter.vocab_hash == target.vocab_hash == torch_target.vocab_hash
    target = torch_target
    for text in TEXTS:
        assert drafter.tokenize(text) == target.tokenizer.encode(text, add_special_tokens=False), text
    chat = drafter.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_rollback_gives_the_same_draft_as_a_fresh_context(drafter):
    ids = drafter.tokenize(TEXTS[0], chat=True)
    greedy = SamplingParams()
    rng = np.random.default_rng(0)
    fresh = drafter.propose(ids, 5, greedy, rng).ids
    drafter.propose(ids + [1, 2, 3, 4], 5, greedy, rng)  # pollute the KV with a rejected path
    assert drafter.propose(ids, 5, greedy, rng).ids == fresh
    # the draft's own greedy continuation: drafting k after accepting j reproduces it
    assert drafter.propose(ids + fresh[:2], 3, greedy, rng).ids == fresh[2:5]


def test_a_sibling_drafts_in_a_context_of_its_own_over_the_same_weights(drafter):
    """Two users of one draft model taking turns (the navigation and the chat endpoint, agent/app/drafting.py):
    each keeps its own prompt's KV, so neither re-prefills after the other, and each drafts what it drafts alone."""
    nav, chat = drafter.tokenize(TEXTS[0], chat=True), drafter.tokenize(TEXTS[2], chat=True)
    greedy, rng = SamplingParams(), np.random.default_rng(0)
    nav_alone, chat_alone = drafter.propose(nav, 5, greedy, rng).ids, drafter.propose(chat, 5, greedy, rng).ids
    twin = drafter.sibling()
    assert twin.llm.ctx != drafter.llm.ctx and twin.llm.model == drafter.llm.model  # one model, two contexts
    for _ in range(2):  # turns: the navigation, then the chat, then the navigation again ...
        assert drafter.propose(nav, 5, greedy, rng).ids == nav_alone
        assert twin.propose(chat, 5, greedy, rng).ids == chat_alone
    held = drafter.llm.input_ids[: len(nav)].tolist()
    assert held == nav and twin.llm.input_ids[: len(chat)].tolist() == chat  # each context kept its prompt
    assert drafter.llm.n_tokens >= len(nav) and twin.llm.n_tokens >= len(chat)
    del twin  # its context goes; the model stays the drafter's
    assert drafter.propose(nav, 5, greedy, rng).ids == nav_alone


def test_sampled_draft_keeps_q_for_every_token(drafter):
    ids = drafter.tokenize(TEXTS[0], chat=True)
    d = drafter.propose(
        ids, 4, SamplingParams(temperature=1.0, top_k=20, seed=1), np.random.default_rng(1), payload=PayloadSpec("full")
    )
    q = d.q.probs
    assert d.q.kind == "full" and q.shape == (4, drafter.vocab_size) and q.dtype == np.float16
    assert all(q[i, t] > 0 for i, t in enumerate(d.ids))
    assert all(np.count_nonzero(row) <= 20 for row in q)  # top-k applied before sampling
    assert d.ms > 0


@pytest.mark.parametrize("spec", [PayloadSpec("topk", 4), PayloadSpec("split")], ids=str)
def test_sampled_draft_keeps_what_its_payload_sends(drafter, spec):
    ids = drafter.tokenize(TEXTS[0], chat=True)
    d = drafter.propose(ids, 4, SamplingParams(temperature=1.0, seed=1), np.random.default_rng(1), payload=spec)
    assert d.q.kind == spec.kind
    if spec.kind == "topk":
        assert d.q.ids.shape == d.q.probs.shape == (4, 4)
        assert all(t in row for t, row in zip(d.ids, d.q.ids, strict=True))  # drawn from its own top 4
    else:
        assert d.q.counts.shape == (4, drafter.vocab_size) and (d.q.counts.sum(axis=1) == 1 << 23).all()
        assert list(d.q.px) == [d.q.counts[i, t] for i, t in enumerate(d.ids)] and d.q.px.min() > 0
    assert d.head(2).wire_q()["kind"] == spec.kind


def test_zero_length_draft(drafter):
    d = drafter.propose(drafter.tokenize("hello"), 0, SamplingParams(), np.random.default_rng(0))
    assert d.ids == [] and d.q is None
