#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (and `llama-batched-bench`, the engine benchmark it ships) from the llama.cpp vendored in the llama-cpp-python sdist we
# already build (so the peer and our engine run the same llama.cpp), once per machine, into
#   $HOME/.cache/edgespec/llama-server-<version>-<flavour>-<hash of cmake args>/llama-server
# like the Makefile caches the wheel. A second run finds the binary and returns at once.
# Used only by the peer benchmark (tools/bench/peer.py) and tools/bench/gpu_engine.py (llama-batched-bench, beside
# llama-server in the same folder); `make setup` and `make test` never call it.
#
# Environment (the Makefile passes the first three):
#   LLAMA_CPP_VERSION  default 0.3.36
#   LLAMA_FLAVOUR      default avx2 on x86-64, native elsewhere
#   LLAMA_CMAKE_ARGS   default: the Makefile's (portable AVX2 on x86-64, empty elsewhere)
#   LLAMA_SDIST        optional: an sdist .tar.gz or an extracted sdist directory to build from
#                      instead of `pip download` (for offline machines)
#   PIP                pip command (default: .venv/bin/pip, else python3 -m pip)
#   JOBS               parallel compile jobs (default: nproc)
# Prints the binary's path as its last line.
set -euo pipefail

VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
if [[ "$(uname -m)" == "x86_64" ]]; then
  FLAVOUR="${LLAMA_FLAVOUR:-avx2}"
  ARCH_ARGS="${LLAMA_CMAKE_ARGS--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON}"
else
  FLAVOUR="${LLAMA_FLAVOUR:-native}"
  ARCH_ARGS="${LLAMA_CMAKE_ARGS-}"
fi
# Offline and minimal: no curl/openssl, no web UI download, no tests/examples; one static binary.
SERVER_ARGS="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
-DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
ALL_ARGS="$ARCH_ARGS $SERVER_ARGS"
HASH="$(printf '%s' "$VERSION $ALL_ARGS" | sha256sum | cut -c1-12)"
CACHE="${HOME}/.cache/edgespec/llama-server-${VERSION}-${FLAVOUR}-${HASH}"
BIN="$CACHE/llama-server"

if [[ -x "$BIN" && -x "$CACHE/llama-batched-bench" ]] && "$BIN" --version >/dev/null 2>&1; then
  echo "llama-server: cached" >&2
  echo "$BIN"
  exit 0
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PIP:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/pip" ]]; then PIP="$ROOT/.venv/bin/pip"; else PIP="python3 -m pip"; fi
fi
JOBS="${JOBS:-$(nproc)}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
t0=$(date +%s)

# 1. the sdist
if [[ -n "${LLAMA_SDIST:-}" && -d "$LLAMA_SDIST" ]]; then
  SRC="$LLAMA_SDIST"
else
  if [[ -n "${LLAMA_SDIST:-}" ]]; then
    TARBALL="$LLAMA_SDIST"
  else
    echo "llama-server: downloading the llama-cpp-python $VERSION sdist" >&2
    $PIP download --quiet --no-deps --no-binary :all: -d "$WORK/dl" "llama-cpp-python==$VERSION" >&2
    TARBALL="$(ls "$WORK"/dl/llama_cpp_python-"$VERSION".tar.gz)"
  fi
  mkdir -p "$WORK/src"
  tar -xzf "$TARBALL" -C "$WORK/src"
  SRC="$WORK/src/llama_cpp_python-$VERSION"
fi
LLAMA_SRC="$SRC/vendor/llama.cpp"
[[ -f "$LLAMA_SRC/CMakeLists.txt" ]] || { echo "llama-server: no $LLAMA_SRC/CMakeLists.txt" >&2; exit 1; }

# 2. configure and build only the llama-server and llama-batched-bench targets
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
echo "llama-server: configuring ($ALL_ARGS)" >&2
# shellcheck disable=SC2086
cmake -S "$LLAMA_SRC" -B "$WORK/build" "${GEN[@]}" $ALL_ARGS >"$WORK/configure.log" 2>&1 \
  || { tail -40 "$WORK/configure.log" >&2; exit 1; }
echo "llama-server: building with $JOBS jobs (several minutes on 2 cores)" >&2
cmake --build "$WORK/build" --target llama-server llama-batched-bench -j "$JOBS" >"$WORK/build.log" 2>&1 \
  || { tail -60 "$WORK/build.log" >&2; exit 1; }

# 3. cache it atomically; check it runs
BUILT="$(find "$WORK/build" -type f -name llama-server -perm -u+x | head -1)"
[[ -n "$BUILT" ]] || { echo "llama-server: build produced no binary" >&2; exit 1; }
mkdir -p "$CACHE"
BENCH="$(find "$WORK/build" -type f -name llama-batched-bench -perm -u+x | head -1)"
[[ -n "$BENCH" ]] && cp "$BENCH" "$CACHE/llama-batched-bench"
cp "$BUILT" "$CACHE/llama-server.tmp"
printf '%s\n' "version=$VERSION" "flavour=$FLAVOUR" "cmake_args=$ALL_ARGS" > "$CACHE/BUILD_INFO"
mv "$CACHE/llama-server.tmp" "$BIN"
"$BIN" --version >&2
echo "llama-server: built in $(( $(date +%s) - t0 )) s" >&2
echo "$BIN"
