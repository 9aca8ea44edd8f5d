#!/usr/bin/env bash
# Builds here (no GPU needed, nvcc 13.0 and cmake >= 3.18 are) what scripts/gpu_check.sh needs on the device machine,
# where nothing can be fetched and a call carries at most 64 MiB. Every output is in an ignored folder:
#
#   $WORK (default /tmp/gpu-prep): the llama-cpp-python 0.3.36 sdist (its vendored llama.cpp), cuBLAS 13.0 headers and
#       libraries from the nvidia-cublas wheel (for linking only: the device has its own), a link-time stand-in for
#       the driver's libcuda.so.1, the builds (build-cuda/), a Python 3.12 venv for the dry run (venv312/)
#   $DEST (default .gpu in the repository root, ignored by .gitignore): what a device call carries
#       llama.tar.xz    llama_cpp/ (llama-cpp-python's Python files) with lib/: libllama, libggml* (CUDA), and
#                       llama-server only where LLAMA_SERVER names one (built by its user: this repository builds none
#                       of llama.cpp's tools)
#       llama-src.tar.xz  (cuda, src) llama.cpp's source and llama_cpp/'s Python files, for a build on the device
#       whl/            cp312 wheels of everything ggufspec, its server and gguf import, but numpy (the device has it)
#       bench/          the first 24 lines of ../shared/bench's two sets (bench_parallel.py reads them there)
#       prompts.jsonl   `ggufspec bench`'s prompts: 4 HumanEval and 4 Spec-Bench
#       widen_gguf.py   ../shared/tools/widen_gguf.py (scripts/gpu_pair.py imports its `widen`)
#       MANIFEST.txt    what was built, how, and the sizes
#
# Usage: scripts/build_gpu_artifacts.sh [cuda|src|cpu]   (default cuda)
#   cuda  configure and build llama.cpp with CUDA for sm_90 (H100/H200) into $WORK/build-cuda, pack it into $DEST.
#         Hours at nice 19 on 2 busy cores (docs/gpu.md); a rerun goes on from what is built.
#   src   no build here: $DEST holds the source, and scripts/gpu_check.sh builds it on the device (minutes of the
#         device's time: docs/gpu.md).
#   cpu   pack an existing CPU build ($CPU_BUILD, default /tmp/lcpp-build, else built here) into $DEST (default
#         $WORK/payload-cpu): the payload of the CPU dry run (docs/gpu.md).
# Env: WORK, DEST, JOBS (default 2), CPU_BUILD, LLAMA_FROM (cuda: take libllama from this folder of a build of the
# same source, e.g. a CPU one's bin/, and build only ggml's libraries here), LLAMA_SERVER (a llama-server binary of
# the same llama.cpp to carry for the check's comparison; the device's CUDA libraries must be what it links).
set -euo pipefail
MODE=${1:-cuda}
REPO=$(cd "$(dirname "$0")/.." && pwd)
SHARED=${SHARED:-$REPO/../shared}
[ -d "$SHARED/bench" ] || SHARED=/work/shared
WORK=${WORK:-/tmp/gpu-prep}
JOBS=${JOBS:-2}
LCPP_VERSION=0.3.36
CUBLAS_VERSION=13.0.2.14  # cuBLAS of CUDA 13.0, the device's toolkit and driver (580)
if [ "$MODE" = cpu ]; then DEST=${DEST:-$WORK/payload-cpu}; else DEST=${DEST:-$REPO/.gpu}; fi
PY=${PY:-python3}
mkdir -p "$WORK" "$DEST"
say() { echo "[build_gpu_artifacts $(date +%H:%M:%S)] $*"; }

sdist() {  # llama-cpp-python's sdist: its Python package and the llama.cpp it vendors
    SDIST=$WORK/src/llama_cpp_python-$LCPP_VERSION
    [ -d "$SDIST" ] && return
    mkdir -p "$WORK/src"
    local tgz=/tmp/sdist/llama_cpp_python-$LCPP_VERSION.tar.gz
    if [ ! -f "$tgz" ]; then
        $PY -m pip download -q --no-binary :all: --no-deps -d "$WORK/src" "llama-cpp-python==$LCPP_VERSION"
        tgz=$WORK/src/llama_cpp_python-$LCPP_VERSION.tar.gz
    fi
    tar -xzf "$tgz" -C "$WORK/src"
}

cuda_link_deps() {  # what linking ggml-cuda needs that this machine's pip-installed CUDA 13.0 toolkit lacks
    if [ ! -f "$WORK/cublas/lib/libcublas.so" ]; then
        say "cuBLAS $CUBLAS_VERSION from its wheel (headers and libraries, for linking)"
        $PY -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_27_x86_64 --python-version 3.12 \
            -d "$WORK/cublas" "nvidia-cublas==$CUBLAS_VERSION"
        (cd "$WORK/cublas" && unzip -q -o nvidia_cublas-*.whl 'nvidia/cu13/*' && rm -rf include lib \
            && mv nvidia/cu13/include nvidia/cu13/lib . && rm -rf nvidia \
            && ln -sf libcublas.so.13 lib/libcublas.so && ln -sf libcublasLt.so.13 lib/libcublasLt.so)
    fi
    if [ ! -f "$WORK/stubs/libcuda.so" ]; then
        # ggml-cuda links the driver API (CUDA::cuda_driver); toolkits ship a stub libcuda.so for that, this one
        # does not: every function cuda.h declares, empty, under the driver's soname. The device's driver is loaded.
        say "libcuda.so.1 link-time stand-in"
        mkdir -p "$WORK/stubs"
        echo '#include <cuda.h>' | gcc -E -I"$CUDA_HOME/include" -x c - \
            | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d ' (\t' | sort -u \
            | sed 's/.*/void &(void) {}/' > "$WORK/stubs/cuda_stub.c"
        gcc -shared -fPIC -o "$WORK/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$WORK/stubs/cuda_stub.c"
    fi
    ln -sf libcuda.so "$WORK/stubs/libcuda.so.1"  # what the linker looks for behind libggml-cuda
}

. "$REPO/scripts/gpu_build_flags.sh"  # CUDA_FLAGS, CUDA_TARGETS, SRC_EXCLUDES

build_cuda() {
    CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
    cuda_link_deps
    local b=$WORK/build-cuda
    say "configure $b"
    nice -n 19 cmake -S "$SDIST/vendor/llama.cpp" -B "$b" -G Ninja "${CUDA_FLAGS[@]}" \
        -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" -DCUDA_cuda_driver_LIBRARY="$WORK/stubs/libcuda.so" \
        -DCMAKE_LIBRARY_PATH="$WORK/cublas/lib" -DCMAKE_CUDA_FLAGS="-I$WORK/cublas/include" \
        -DCMAKE_CXX_FLAGS="-I$WORK/cublas/include" > "$WORK/build-cuda.configure.log"
    local targets=("${CUDA_TARGETS[@]}")
    # LLAMA_FROM: libllama from another build of the same source (a CPU one): it holds no backend code (no
    # GGML_USE_* in src/) and loads whichever libggml sits beside it, so only ggml's libraries are built here, an hour
    # less at nice 19 on two cores
    [ -n "${LLAMA_FROM:-}" ] && targets=(ggml-cuda ggml ggml-rpc)
    say "build ${targets[*]} (nice 19, -j$JOBS): log $WORK/build-cuda.log"
    nice -n 19 ninja -C "$b" -j"$JOBS" "${targets[@]}" > "$WORK/build-cuda.log"
    BUILD_BIN=$b/bin
}

build_cpu() {
    BUILD_BIN=${CPU_BUILD:-/tmp/lcpp-build}/bin
    ls "$BUILD_BIN"/libllama.so* > /dev/null 2>&1 && return
    local b=$WORK/build-cpu
    nice -n 19 cmake -S "$SDIST/vendor/llama.cpp" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DGGML_RPC=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_MTMD=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$WORK/build-cpu.configure.log"
    nice -n 19 ninja -C "$b" -j"$JOBS" llama ggml-rpc > "$WORK/build-cpu.log"
    BUILD_BIN=$b/bin
}

pack_src() {  # llama.cpp's source and llama-cpp-python's Python files: the build on the device (scripts/gpu_check.sh)
    say "pack $DEST/llama-src.tar.xz"
    tar "${SRC_EXCLUDES[@]}" --exclude=llama_cpp/server -cf - -C "$SDIST/vendor" llama.cpp -C "$SDIST" llama_cpp \
        | nice -n 19 xz -9 -T"$JOBS" > "$DEST/llama-src.tar.xz"
}

pack_llama() {  # llama_cpp/ with lib/ (stripped; symlinks kept), and LLAMA_SERVER's binary beside it where given
    local t=$WORK/pack
    rm -rf "$t" && mkdir -p "$t/llama_cpp/lib"
    cp "$SDIST"/llama_cpp/*.py "$SDIST/llama_cpp/py.typed" "$t/llama_cpp/"
    local llama=${LLAMA_FROM:-$BUILD_BIN}
    cp -a "$BUILD_BIN"/libggml*.so* "$llama"/libllama.so* "$t/llama_cpp/lib/"
    [ -n "${LLAMA_SERVER:-}" ] && cp "$LLAMA_SERVER" "$t/llama_cpp/lib/llama-server"
    find "$t/llama_cpp/lib" -type f \( -name '*.so*' -o -name llama-server \) -exec strip --strip-unneeded {} +
    say "pack $DEST/llama.tar.xz ($(du -sb "$t/llama_cpp/lib" | cut -f1) bytes unpacked)"
    tar -C "$t" -cf - llama_cpp | nice -n 19 xz -9e -T"$JOBS" > "$DEST/llama.tar.xz"
}

wheels() {  # cp312 manylinux wheels, pinned to the versions ggufspec is tested with here
    mkdir -p "$DEST/whl"
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST/whl" \
        annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 click==8.5.1 diskcache==5.6.3 fastapi==0.165.0 \
        gguf==0.19.0 h11==0.16.0 idna==3.20 jinja2==3.1.6 markupsafe==3.0.4 opentelemetry-api==1.45.2 \
        pydantic==2.14.4 pydantic-core==2.50.5 pyyaml==6.0.4 starlette==1.10.0 tqdm==4.70.1 \
        typing-extensions==4.16.0 typing-inspection==0.4.5 uvicorn==0.54.0
}

prompts() {
    mkdir -p "$DEST/bench"
    head -n 24 "$SHARED/bench/humaneval_dev.jsonl" > "$DEST/bench/humaneval_dev.jsonl"
    head -n 24 "$SHARED/bench/spec_bench_dev.jsonl" > "$DEST/bench/spec_bench_dev.jsonl"
    # bench: HumanEval's first 4 and Spec-Bench's first of 4 categories (writing, roleplay, math, coding), alternating
    paste -d '\n' <(head -n 4 "$SHARED/bench/humaneval_dev.jsonl") \
        <(for cat in writing roleplay math coding; do
              grep -m1 "\"category\": \"$cat\"" "$SHARED/bench/spec_bench_dev.jsonl"; done) > "$DEST/prompts.jsonl"
    install -m 644 "$SHARED/tools/widen_gguf.py" "$DEST/"
}

manifest() {
    {
        echo "made $(date -u +%Y-%m-%dT%H:%MZ) by scripts/build_gpu_artifacts.sh $MODE at $(git -C "$REPO" rev-parse --short HEAD)"
        echo "llama.cpp: vendored in llama-cpp-python $LCPP_VERSION's sdist; lib/ from ${BUILD_BIN:-nowhere: built on the device}"
        [ -n "${LLAMA_FROM:-}" ] && echo "libllama from $LLAMA_FROM"
        [ -n "${LLAMA_SERVER:-}" ] && echo "llama-server: $LLAMA_SERVER (its user's build)"
        [ "$MODE" = cuda ] && echo "cmake: ${CUDA_FLAGS[*]}" && echo "nvcc: $("$CUDA_HOME/bin/nvcc" --version | tail -1)"
        (cd "$DEST" && find . -type f | sort | xargs du -b | awk '{s += $1; print} END {print s, "bytes in all"}')
    } > "$DEST/MANIFEST.txt"
    cat "$DEST/MANIFEST.txt"
    # a device call carries the checkout's tracked (and untracked, not ignored) files too: 64 MiB in all
    local tracked payload
    tracked=$(git -C "$REPO" ls-files -z --cached --others --exclude-standard | (cd "$REPO" && xargs -0 du -cb) \
        | tail -1 | cut -f1)
    payload=$(du -sb "$DEST" | cut -f1)
    say "a call carrying $DEST from $REPO sends $((tracked + payload)) bytes ($tracked of the checkout's files):" \
        "$(( (67108864 - tracked - payload) / 1024 )) KiB under the 64 MiB limit"
}

sdist
case $MODE in
    cuda) build_cuda; pack_llama; pack_src ;;
    src) rm -f "$DEST/llama.tar.xz"; pack_src ;;
    cpu) build_cpu; pack_llama ;;
    *) echo "usage: $0 [cuda|src|cpu]" >&2; exit 2 ;;
esac
wheels
prompts
manifest
