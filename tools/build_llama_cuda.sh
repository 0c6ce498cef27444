#!/usr/bin/env bash
# One CUDA build of llama.cpp for the lent GPU machine (an H100 or H200: compute capability 9.0), made here on a
# CPU-only machine, so that the device's 15 minutes are not spent compiling. From the llama.cpp vendored in the
# llama-cpp-python sdist the project already builds (the peer and our engine run the same llama.cpp), one tree:
#
#   <tree>/python/llama_cpp/          the sdist's Python package (ctypes bindings of exactly these libraries)
#   <tree>/python/llama_cpp/lib/      libllama, libggml, libggml-base, libggml-cpu, libggml-cuda, libmtmd
#   <tree>/bin/                       llama-server, llama-batched-bench
#   <tree>/BUILD_INFO                 version, flags, toolkit wheels, build seconds
#
# and that tree packed as <tree>.tar.xz (at most 48 MiB, so it travels in one call's `carry`). On the device:
# `tar -xJf TREE.tar.xz`, PYTHONPATH=<tree>/python (or `python -m tools.gpu_run --prebuilt TREE.tar.xz`).
#
# The CUDA toolkit is PyPI's wheels of CUDA 13.0 (the device's driver and torch are 13.0), installed into a cache
# folder and arranged as the toolkit root CMake's FindCUDAToolkit expects. The libraries link the CUDA runtime and
# cuBLAS by soname, and their RUNPATH names $ORIGIN and the device's torch copy of them
# (/opt/torch/.venv/lib/python3.*/site-packages/nvidia/cu13/lib): none of CUDA's libraries is carried. No VMM pool
# (GGML_CUDA_NO_VMM): the driver library libcuda.so is then loaded by the runtime at run time, never linked, so every
# library's `ldd` resolves here against the pip libraries, and on a machine without a GPU the CUDA backend reports
# no device and llama.cpp runs on its CPU backend.
#
# Cached like tools/build_llama_server.sh: a second run finds the tarball and prints its path at once. The build
# folder ($OUT_DIR/<name>.build) is kept until the tree is packed, so a build that stopped (a failure, a session's
# end) goes on where it stopped when run again. About an hour on 2 cores (ggml-cuda's 144 CUDA files for one
# architecture, then llama-server's C++).
#
# Environment:
#   LLAMA_CPP_VERSION  default 0.3.36
#   LLAMA_SDIST        optional: an sdist .tar.gz or an extracted sdist folder (else `pip download`)
#   CUDA_ARCHS         default 90-real (the H100/H200's machine code, no PTX to JIT for other GPUs)
#   DEVICE_CUDA_LIB    default /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib (RUNPATH on the device)
#   PIP                pip command (default: .venv/bin/pip, else python3 -m pip)
#   JOBS               parallel compile jobs (default: nproc)
#   OUT_DIR            where the tree and tarball go (default: $HOME/.cache/edgespec)
# Prints the tarball's path as its last line.
set -euo pipefail

VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
ARCHS="${CUDA_ARCHS:-90-real}"
DEVICE_CUDA_LIB="${DEVICE_CUDA_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib}"
OUT_DIR="${OUT_DIR:-$HOME/.cache/edgespec}"
# The toolkit, pinned to CUDA 13.0 (the device's major and minor version): nvcc and its compiler parts, the
# runtime's headers and library, cuBLAS, and CCCL's headers (CUB, Thrust, libcu++).
TOOLKIT_WHEELS="nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14"
# x86-64: the Makefile's portable AVX2 CPU backend (the device's CPU is another one; native would build for this).
CPU_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
# Offline and minimal, as tools/build_llama_server.sh, but shared: llama-cpp-python loads the same libraries.
LLAMA_ARGS="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_CURL=OFF \
-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
-DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
CUDA_ARGS="-DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES=$ARCHS"
KEY="$(printf '%s' "$VERSION $TOOLKIT_WHEELS $CPU_ARGS $LLAMA_ARGS $CUDA_ARGS $DEVICE_CUDA_LIB" | sha256sum | cut -c1-12)"
NAME="llama-cuda-${VERSION}-sm${ARCHS%%-*}-${KEY}"
TREE="$OUT_DIR/$NAME"
TARBALL="$OUT_DIR/$NAME.tar.xz"
TARGETS=(llama ggml ggml-base ggml-cpu ggml-cuda mtmd llama-server llama-batched-bench)

if [[ -f "$TARBALL" && -f "$TREE/BUILD_INFO" ]]; then
  echo "llama-cuda: cached" >&2
  echo "$TARBALL"
  exit 0
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PIP:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/pip" ]]; then PIP="$ROOT/.venv/bin/pip"; else PIP="python3 -m pip"; fi
fi
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$OUT_DIR"
WORK="$OUT_DIR/$NAME.build"  # kept until the end: a second run resumes the build
mkdir -p "$WORK"
t0=$(date +%s)
say() { echo "llama-cuda: [$(( $(date +%s) - t0 )) s] $*" >&2; }

# 1. The toolkit: the wheels unpacked into one prefix (they share nvidia/cu13/), arranged as a toolkit root.
TK_KEY="$(printf '%s' "$TOOLKIT_WHEELS" | sha256sum | cut -c1-12)"
TK_STAGE="$OUT_DIR/cuda-toolkit-13.0-$TK_KEY"
CUDA_ROOT="$TK_STAGE/nvidia/cu13"
if [[ ! -x "$CUDA_ROOT/bin/nvcc" || ! -f "$TK_STAGE/.ready" ]]; then
  say "installing the CUDA 13.0 toolkit wheels into $TK_STAGE"
  rm -rf "$TK_STAGE.tmp.$$"
  # shellcheck disable=SC2086
  $PIP install --quiet --no-deps --no-compile --target "$TK_STAGE.tmp.$$" $TOOLKIT_WHEELS >&2
  rm -rf "$TK_STAGE" && mv "$TK_STAGE.tmp.$$" "$TK_STAGE"
  touch "$TK_STAGE/.ready"
fi
(
  cd "$CUDA_ROOT"
  [[ -e lib64 ]] || ln -s lib lib64
  mkdir -p targets/x86_64-linux
  [[ -e targets/x86_64-linux/include ]] || ln -s ../../include targets/x86_64-linux/include
  [[ -e targets/x86_64-linux/lib ]] || ln -s ../../lib targets/x86_64-linux/lib
  # the wheels ship only the sonames; the linker wants the plain names
  for l in cudart cublas cublasLt; do
    [[ -e "lib/lib$l.so" ]] || ln -s "$(basename "$(ls lib/lib$l.so.[0-9]* | head -1)")" "lib/lib$l.so"
  done
)
NVCC="$CUDA_ROOT/bin/nvcc"
"$NVCC" --version | tail -2 >&2

# 2. The sdist.
if [[ -n "${LLAMA_SDIST:-}" && -d "$LLAMA_SDIST" ]]; then
  SRC="$LLAMA_SDIST"
else
  if [[ -n "${LLAMA_SDIST:-}" ]]; then
    SDIST="$LLAMA_SDIST"
  else
    say "downloading the llama-cpp-python $VERSION sdist"
    [[ -f "$WORK/dl/llama_cpp_python-$VERSION.tar.gz" ]] ||
      $PIP download --quiet --no-deps --no-binary :all: -d "$WORK/dl" "llama-cpp-python==$VERSION" >&2
    SDIST="$WORK/dl/llama_cpp_python-$VERSION.tar.gz"
  fi
  SRC="$WORK/src/llama_cpp_python-$VERSION"
  if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
    rm -rf "$WORK/src" && mkdir -p "$WORK/src"
    tar -xzf "$SDIST" -C "$WORK/src"
  fi
fi
LLAMA_SRC="$SRC/vendor/llama.cpp"
[[ -f "$LLAMA_SRC/CMakeLists.txt" ]] || { echo "llama-cuda: no $LLAMA_SRC/CMakeLists.txt" >&2; exit 1; }

# 3. Configure and build the libraries and the two tools. RUNPATH: the tree itself, then the device's CUDA libraries;
# the linker meanwhile finds cuBLAS (a library's own dependency when a tool links it) in the toolkit (-rpath-link).
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
RPATH="\$ORIGIN;\$ORIGIN/../python/llama_cpp/lib;$DEVICE_CUDA_LIB"
LINK="-Wl,-rpath-link,$CUDA_ROOT/lib"
say "configuring ($CUDA_ARGS) in $WORK/build"
# shellcheck disable=SC2086
PATH="$CUDA_ROOT/bin:$PATH" cmake -S "$LLAMA_SRC" -B "$WORK/build" "${GEN[@]}" $CPU_ARGS $LLAMA_ARGS $CUDA_ARGS \
  -DCUDAToolkit_ROOT="$CUDA_ROOT" -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH="$RPATH" \
  -DCMAKE_EXE_LINKER_FLAGS="$LINK" -DCMAKE_SHARED_LINKER_FLAGS="$LINK" \
  >"$WORK/configure.log" 2>&1 || { tail -40 "$WORK/configure.log" >&2; exit 1; }
grep -E "CUDA Toolkit found|Using CUDA architectures|CUDA host compiler" "$WORK/configure.log" >&2 || true
say "building ${TARGETS[*]} with $JOBS jobs (about an hour on 2 cores)"
# Progress: ninja's [done/total] line every minute, so a long build shows it is alive.
PATH="$CUDA_ROOT/bin:$PATH" cmake --build "$WORK/build" --target "${TARGETS[@]}" -j "$JOBS" >"$WORK/build.log" 2>&1 &
BUILD_PID=$!
while kill -0 "$BUILD_PID" 2>/dev/null; do
  sleep 60
  say "$(grep -o '^\[[0-9]*/[0-9]*\]' "$WORK/build.log" | tail -1)"
done
wait "$BUILD_PID" || {
  tail -60 "$WORK/build.log" >&2
  echo "llama-cuda: the build stopped; $WORK is kept: run again to go on from there" >&2
  exit 1
}

# 4. The tree: the sdist's Python package with these libraries in its lib/, the tools in bin/; stripped. The tools
# link llama.cpp's own shared helpers (libllama-common, libllama-server-impl, ...): every shared library the build
# made goes to lib/, and every file is checked to resolve against the tree and the toolkit before it is packed.
rm -rf "$TREE.tmp.$$" && mkdir -p "$TREE.tmp.$$/bin" "$TREE.tmp.$$/python"
cp -r "$SRC/llama_cpp" "$TREE.tmp.$$/python/"
LIB="$TREE.tmp.$$/python/llama_cpp/lib"
rm -rf "$LIB" && mkdir -p "$LIB"
for t in llama ggml ggml-base ggml-cpu ggml-cuda mtmd; do
  [[ -n "$(find "$WORK/build" -name "lib$t.so" | head -1)" ]] || { echo "llama-cuda: the build made no lib$t.so" >&2; exit 1; }
done
find "$WORK/build" -name 'lib*.so' \( -type f -o -type l \) -print0 | while IFS= read -r -d '' f; do
  cp -L "$f" "$LIB/$(basename "$f")"
done
for t in llama-server llama-batched-bench; do
  f="$(find "$WORK/build" -type f -name "$t" -perm -u+x | head -1)"
  [[ -n "$f" ]] || { echo "llama-cuda: the build made no $t" >&2; exit 1; }
  cp "$f" "$TREE.tmp.$$/bin/$t"
done
strip --strip-unneeded "$LIB"/*.so "$TREE.tmp.$$"/bin/*
# The libraries find each other by their sonames (libllama.so.0 and the like): each soname names the plain file.
(
  cd "$LIB"
  for f in *.so; do
    s="$(objdump -p "$f" | awk '/SONAME/ {print $2}')"
    if [[ -n "$s" && "$s" != "$f" ]]; then ln -sf "$f" "$s"; fi
  done
)
missing="$(for f in "$LIB"/*.so "$TREE.tmp.$$"/bin/*; do
  LD_LIBRARY_PATH="$CUDA_ROOT/lib" ldd "$f" | sed -n "s|^\s*\(.*\) => not found|$(basename "$f"): \1|p"
done)"
if [[ -n "$missing" ]]; then
  echo "llama-cuda: unresolved in the tree (the build is kept in $WORK):" >&2
  echo "$missing" >&2
  exit 1
fi
built_s=$(( $(date +%s) - t0 ))  # this run's: a resumed build's earlier runs are not in it
printf '%s\n' "version=$VERSION" "cuda_archs=$ARCHS" "toolkit_wheels=$TOOLKIT_WHEELS" \
  "cmake_args=$CPU_ARGS $LLAMA_ARGS $CUDA_ARGS" "runpath=$RPATH" "build_s=$built_s" "jobs=$JOBS" \
  "built_on=$(uname -m) $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ)" > "$TREE.tmp.$$/BUILD_INFO"
rm -rf "$TREE" && mv "$TREE.tmp.$$" "$TREE"

# 5. Packed: xz -9 (the limit is 48 MiB, so that it travels in one call's carry beside the wheels).
say "packing $TREE"
tar -C "$OUT_DIR" -cf - "$NAME" | xz -9 -T"$JOBS" > "$TARBALL.tmp.$$"
mv "$TARBALL.tmp.$$" "$TARBALL"
rm -rf "$WORK"
size=$(stat -c %s "$TARBALL")
say "built in $built_s s; $(du -sh "$TREE" | cut -f1) unpacked, $(( size / 1048576 )) MiB packed"
if (( size > 48 * 1048576 )); then
  echo "llama-cuda: $TARBALL is over 48 MiB" >&2
  exit 1
fi
echo "$TARBALL"
