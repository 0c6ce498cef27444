"""The decoding client: a draft model on the robot and the verifier's link, nothing of the robot.

    drafter     the draft model (llama.cpp): tokens, logits, top-K candidates, images
    decoder     rounds of draft -> verify -> commit against the verifier (SD, FSD, AR)
    link        the websocket session to the verifier: hello, reconnect, resume
    replies     every verifier reply checked before anything commits it
    policy      how many tokens to draft next (draftlen: the optimal length; predictor: stop early)
    predraft    drafting the next round while the verifier checks this one (FSD)
    branches    the pre-drafted branches

It imports only `protocol/` and `runtime/` (tests/test_import_graph.py).
"""
