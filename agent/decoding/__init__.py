"""The decoding client: a draft model on the robot and the verifier's link, nothing of the robot.

    drafter     the draft model (llama.cpp): tokens, logits, top-K candidates, images
    decoder     EdgeDecoder: open, rounds of draft -> verify -> commit (SD, FSD, AR stream), close
    run         one generation's state (committed ids, grammar walk, images, payload), made per generate()
    metrics     what a generation returns: Generation and its Metrics
    session     the link's sessions: connect, reconnect with backoff, sids, session_taken, resume, re-open
    link        the websocket to the verifier: TLS, hello/welcome, send and receive messages
    replies     every verifier reply checked before anything commits it
    policy      how many tokens to draft next: plan() / observe() (draftlen: the optimal length; predictor: stop early)
    predraft    drafting the next round while the verifier checks this one (FSD)
    branches    the pre-drafted branches

It imports only `protocol/` and `runtime/` (tests/test_import_graph.py).
"""
