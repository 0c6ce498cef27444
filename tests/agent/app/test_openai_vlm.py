"""Images through the Python API and the OpenAI endpoint (the VLM path): the test vision-language pair
(tests/models/make_test_vlm.py, as tests/agent/decoding/test_vision_e2e.py uses it) answers with the target's
own ids."""

import base64

import pytest

from tests.agent import vlm_pairs as pairs
from tests.agent.app.test_openai_api import Endpoint
from tests.models import make_test_vlm as tv

pytestmark = pytest.mark.real

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def vlm():
    return tv.make(log=lambda m: None)


@pytest.fixture(scope="module")
def vtarget(vlm):
    return pairs.load(vlm, "llamacpp")


# vdrafter and vserver: tests/agent/conftest.py


def test_images_give_the_targets_ids(vdrafter, vserver, vtarget):
    from agent import Client

    frame = pairs.image_bytes(tv.random_image(0))
    ids, images = pairs.image_prompt(vdrafter, tv.PROMPT, frame)
    with Client(vserver.url, drafter=vdrafter) as client:
        answer = client.generate(tv.PROMPT, images=[frame], max_tokens=12)
        assert answer.verified and answer.token_ids == pairs.greedy(vtarget, ids, images, 12)
        uri = "data:image/png;base64," + base64.b64encode(frame).decode()
        content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "What is ahead?"}]
        messages = [{"role": "user", "content": content}]
        expected = client.generate(messages=messages, max_tokens=8)
        endpoint = Endpoint(client)
        try:
            oc = openai.OpenAI(base_url=endpoint.api.address + "/v1", api_key="none", max_retries=0, timeout=120)
            r = oc.chat.completions.create(model="edge", messages=messages, max_tokens=8)
            other = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}] * 5}]
            with pytest.raises(openai.BadRequestError):  # over MAX_IMAGES
                oc.chat.completions.create(model="edge", messages=other, max_tokens=8)
        finally:
            endpoint.close()
    assert expected.verified and r.model_extra["verified"] is True
    assert r.model_extra["edge"]["token_ids"] == expected.token_ids
