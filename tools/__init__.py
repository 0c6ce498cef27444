"""The tools around the product, grouped by what each is for; run as `python -m tools.GROUP.NAME`.

    bench/    benchmarks: decoding modes, draft policies, payloads, engines, the round, fleets, vision
    train/    training and fitting: early exits, the rejection predictor, the verifier's estimator, traces
    models/   made here from what ships: the weaker drafts, the test VLM, random targets of a real shape
    robot/    evaluation of the robot: navigation over scenes, the prompt, its memory
    cluster/  replicas behind HAProxy on loopback, the chaos soak, the network emulator, a local verifier

At the top: the two demos (`tools.demo`, `tools.demo_decoding`), and what several tools share
(`plots`, `logit_margin`, `build_llama_server.sh`, the prompts, scenes and traces they read).
"""

from runtime.native import load_llama_first

load_llama_first()  # llama.cpp's native libraries before numpy's: see runtime/native.py
