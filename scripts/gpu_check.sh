#!/usr/bin/env bash
# The GPU check in one command (issue 64, item 7): on the device machine, from the repository root,
#
#   bash scripts/gpu_check.sh [scripts/gpu_check.py options]
#
# with .gpu carried (scripts/build_gpu_artifacts.sh makes it here; docs/gpu.md has the exact device call). It installs
# the carried wheels and llama.cpp build under $GPU_CHECK_WORK (default /tmp/gpucheck), finds the CUDA libraries the
# build needs (cuBLAS 13, the CUDA runtime), then runs scripts/gpu_check.py's steps, which write gpu.md, results.json,
# bench.json, parallel.jsonl and log.txt into $OUT. Everything ends inside GPU_CHECK_DEADLINE seconds (default 300)
# from this script's start. Where no build was carried, or the carried one sees no CUDA device, it builds llama.cpp
# from the carried source first (below). The CPU dry run is the same script with small sizes (docs/gpu.md).
# llama-server, for the comparison: $LLAMA_SERVER, else one carried in llama.tar.xz's lib/ (built by its user: this
# repository builds none of llama.cpp's tools); without one, the check measures ggufspec alone.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PAYLOAD=${GPU_CHECK_PAYLOAD:-$REPO/.gpu}
WORK=${GPU_CHECK_WORK:-/tmp/gpucheck}
OUT=${OUT:-$REPO/.gpu-out}
PY=${GPU_CHECK_PYTHON:-python3}
DEADLINE=${GPU_CHECK_DEADLINE:-300}
SITE=$WORK/site
mkdir -p "$WORK" "$OUT"
say() { echo "[gpu_check.sh ${SECONDS}s] $*" | tee -a "$OUT/log.txt"; }

say "python: $($PY --version 2>&1) at $(command -v "$PY"); payload $PAYLOAD: $(du -sh "$PAYLOAD" 2>/dev/null | cut -f1)"
LIB=$SITE/llama_cpp/lib
if [ ! -f "$SITE/.wheels" ]; then  # (a rerun on a machine still warm finds them installed)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$PAYLOAD"/whl/*.whl \
        && touch "$SITE/.wheels" || { say "installing the carried wheels failed"; exit 2; }
fi
if [ ! -d "$LIB" ] && [ -f "$PAYLOAD/llama.tar.xz" ]; then
    $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$PAYLOAD/llama.tar.xz" "$SITE" \
        || { say "unpacking $PAYLOAD/llama.tar.xz failed"; exit 2; }
fi
say "installed: $(ls "$SITE" | grep -c dist-info) wheels, $(ls "$LIB" 2>/dev/null | wc -l) files in llama_cpp/lib"

# cuBLAS and the CUDA runtime: the toolkit's, else the ones PyTorch's wheels brought (nvidia/cu13/lib)
cuda_dirs=$LIB
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64 \
         $($PY -c "import glob, site; print(' '.join(glob.glob(site.getsitepackages()[0] + '/nvidia/cu13/lib')))" 2>/dev/null); do
    if [ -e "$d/libcublas.so.13" ] || [ -e "$d/libcudart.so.13" ]; then cuda_dirs=$cuda_dirs:$d; fi
done
if [ "$cuda_dirs" = "$LIB" ]; then  # none of the usual places: look wider (a few seconds)
    for f in $(find /usr /opt -maxdepth 8 \( -name libcublas.so.13 -o -name libcudart.so.13 \) 2>/dev/null | head -4); do
        cuda_dirs=$cuda_dirs:$(dirname "$f")
    done
fi
export LD_LIBRARY_PATH=$cuda_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}
say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# The build here: where no build was carried (a payload of `build_gpu_artifacts.sh src`), or the carried one does not
# load or sees no CUDA device, build llama.cpp from the carried source (llama-src.tar.xz) on every core, with
# GPU_CHECK_BUILD_FLAGS added (default: no flash attention, whose kernels' bodies are then compiled out), and use its
# libraries. Only where nvidia-smi sees a GPU: a build cannot mend a machine without one. It takes
# minutes of the deadline: give such a call GPU_CHECK_DEADLINE=560 and timeout_s=600 (docs/gpu.md).
# GPU_CHECK_EXPECT=CPU (the dry run) skips this.
probe=$($PY scripts/gpu_check.py devices 2>&1)
say "devices: $(echo "$probe" | tail -4 | tr '\n' ';')"
command -v nvcc > /dev/null || export PATH=$PATH:/usr/local/cuda/bin
if [ "${GPU_CHECK_EXPECT:-CUDA}" = CUDA ] && ! grep -q "^device CUDA" <<< "$probe"; then
    if [ -f "$PAYLOAD/llama-src.tar.xz" ] && command -v nvcc > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
        . scripts/gpu_build_flags.sh
        say "no CUDA device through a carried build: building llama.cpp here ($(nproc) cores), log $WORK/build.log"
        mkdir -p "$WORK/src" "$LIB" && tar -xJf "$PAYLOAD/llama-src.tar.xz" -C "$WORK/src" \
            && cp -n "$WORK/src/llama_cpp"/*.py "$SITE/llama_cpp/"
        hints=()  # a toolkit without cuBLAS or the driver stub (as pip lays CUDA out): point CMake at what there is
        cublas=$(for d in ${cuda_dirs//:/ }; do [ -e "$d/libcublas.so.13" ] && echo "$d" && break; done)
        if [ -n "$cublas" ] && [ ! -e "$(dirname "$(command -v nvcc)")/../lib64/libcublas.so" ]; then
            mkdir -p "$WORK/link" && ln -sf "$cublas/libcublas.so.13" "$WORK/link/libcublas.so" \
                && ln -sf "$cublas/libcublasLt.so.13" "$WORK/link/libcublasLt.so"
            hints+=("-DCMAKE_LIBRARY_PATH=$WORK/link" "-DCMAKE_CUDA_FLAGS=-I$cublas/../include"
                    "-DCMAKE_CXX_FLAGS=-I$cublas/../include")
        fi
        driver=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
        [ -z "$driver" ] && driver=$(ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null | head -1)
        [ -n "$driver" ] && [ ! -e "$(dirname "$(command -v nvcc)")/../lib64/stubs/libcuda.so" ] \
            && hints+=("-DCUDA_cuda_driver_LIBRARY=$driver")
        say "build hints: ${hints[*]:-none}"
        # shellcheck disable=SC2086
        cmake -S "$WORK/src/llama.cpp" -B "$WORK/build" -G Ninja "${CUDA_FLAGS[@]}" "${hints[@]}" \
            ${GPU_CHECK_BUILD_FLAGS--DGGML_CUDA_FA=OFF} \
            > "$WORK/build.log" 2>&1 && ninja -C "$WORK/build" -j"$(nproc)" "${CUDA_TARGETS[@]}" >> "$WORK/build.log" 2>&1 \
            && cp -a "$WORK/build/bin"/lib*.so* "$LIB/" \
            || { tail -30 "$WORK/build.log" | tee -a "$OUT/log.txt"; say "the build here failed"; }
        say "after the build, devices: $($PY scripts/gpu_check.py devices 2>&1 | tail -4 | tr '\n' ';')"
    else
        say "no CUDA device, and no GPU, source or nvcc to build for one: the check runs on what it has"
    fi
fi
server=${LLAMA_SERVER:-}
[ -z "$server" ] && [ -x "$LIB/llama-server" ] && server=$LIB/llama-server
say "llama-server: ${server:-none given (the check measures ggufspec alone)}"
missing=$(ldd "$LIB"/libggml*.so ${server:+"$server"} 2>&1 | grep "not found" | sort -u)
[ -n "$missing" ] && say "unresolved libraries: $missing"

exec $PY scripts/gpu_check.py --out "$OUT" --work "$WORK" --payload "$PAYLOAD" --llama-server "$server" \
    --deadline $((DEADLINE - SECONDS)) "$@"
