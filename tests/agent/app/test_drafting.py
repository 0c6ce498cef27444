"""The draft model as one service (agent/app/drafting.py): navigation first, chat generations yield at their next
round. Two clients stream chat completions from the robot's OpenAI endpoint while navigation generations run on
the same draft model: every navigation generation gets the model while both chat answers are still under way
(it does not wait for a whole answer), gives the target's own answer, and the chat answers stay exactly what they
are alone. Timings are the benchmark's (tools/bench/overlap.py), not asserted here.
"""

from __future__ import annotations

import threading

import pytest

from agent.app.drafting import DraftService, ModelTurns
from agent.decoding import DecoderSettings, open_decoder

from .test_openai_api import KEY, Endpoint

openai = pytest.importorskip("openai")

ASK = [{"role": "user", "content": "Write a long story about a robot dog walking in a park."}]
NAV = "The robot sees a red box to the left. The next action is"


def test_a_waiting_navigation_step_goes_before_chat_and_a_chat_generation_yields_to_it_between_rounds():
    turns, order = ModelTurns(), []
    assert turns.acquire()  # a chat generation holds the model
    assert not turns.yield_turn()  # between two rounds, nobody waiting: it goes on

    def step() -> None:
        with turns.navigation():
            order.append("step")

    nav = threading.Thread(target=step)
    nav.start()
    while not turns.navigation_waiting:
        threading.Event().wait(0.001)
    assert not turns.acquire(blocking=False)  # another chat generation does not start while a step waits
    assert turns.yield_turn()  # at its next round the chat generation lets the step run, then goes on
    order.append("chat round")
    turns.release()
    nav.join(5)
    assert order == ["step", "chat round"] and turns.chat_yields == 1
    assert turns.acquire(blocking=False)  # free again
    turns.release()


@pytest.mark.real
def test_two_streaming_chat_clients_yield_to_navigation_at_their_next_round(verifier, drafter):
    from agent import Client

    settings = DecoderSettings(verifier=verifier.url)
    alone = Client(settings, drafter=drafter)
    solo = alone.generate(messages=ASK, max_tokens=40).text
    nav_ids = drafter.tokenize(NAV)
    nav_alone = alone.decoder.generate(nav_ids, mode="sd", max_tokens=8).token_ids
    alone.close()

    service = DraftService(open_decoder(settings, drafter), "refuse")
    endpoint = Endpoint(service.chat_client(), api_key=KEY)
    answers: list[str] = []
    progress = [0, 0]  # pieces each stream has received

    def stream(i: int) -> None:
        oc = endpoint.openai()
        text = ""
        for chunk in oc.chat.completions.create(model="edge", messages=ASK, max_tokens=40, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                progress[i] += 1
        answers.append(text)

    clients = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    try:
        for c in clients:
            c.start()
        while max(progress) == 0:  # a chat answer under way (the other waits for the model behind it)
            threading.Event().wait(0.01)
        navs, mid = [], []
        for _ in range(3):
            with service.navigation():
                mid.append(len(answers))  # chat answers finished when the step got the model
                navs.append(service.decoder.generate(nav_ids, mode="sd", max_tokens=8).token_ids)
        for c in clients:
            c.join(120)
    finally:
        endpoint.close()
        service.close()
    assert navs == [nav_alone] * 3  # the target's own answer, with the chat drafting between the steps
    # the chat drafted in a context of its own over the same weights: the navigation's context still holds the
    # step's prompt (a step after a chat answer re-prefills nothing of it)
    chat_drafter = service._chat_drafter
    assert chat_drafter is not None and chat_drafter.llm.ctx != drafter.llm.ctx
    assert chat_drafter.llm.model == drafter.llm.model
    assert drafter.llm.input_ids[: len(nav_ids)].tolist() == nav_ids
    assert mid[0] == 0 and service.turns.chat_yields >= 1  # the first step did not wait for a whole chat answer
    assert answers == [solo, solo]  # a chat answer that yielded between rounds is exactly its answer alone
