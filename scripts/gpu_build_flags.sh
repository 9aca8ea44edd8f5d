# llama.cpp's CMake flags for the GPU check's CUDA build, sourced by scripts/build_gpu_artifacts.sh (the build made
# here beforehand) and scripts/gpu_check.sh (its fallback build on the device). The libraries llama-cpp-python loads
# and nothing else: llama.cpp's tools (llama-server among them) are not built by this repository; a comparison
# against llama-server runs a binary its user built (docs/gpu.md). One architecture, sm_90 machine code only
# (90-real: no PTX), for the H100/H200; shared libraries; RPC, as llama-cpp-python's wheel has it; CPU code for any
# x86-64 with AVX2 (the device's CPU is not this machine's); flash attention with the default K/V type pairs (f16,
# q8_0, q4_0, bf16), fatbins compressed for size; $ORIGIN run paths so that one folder holds the libraries.
CUDA_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_FA=ON -DGGML_CUDA_FA_ALL_QUANTS=OFF
    -DGGML_CUDA_COMPRESSION_MODE=size -DGGML_CUDA_NCCL=OFF -DGGML_RPC=ON
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
    -DLLAMA_BUILD_MTMD=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN')
# what the build makes: libllama and ggml's libraries with the CUDA and RPC backends (llama-cpp-python's lib/)
CUDA_TARGETS=(llama ggml-cuda ggml-rpc)
# llama.cpp's source as the fallback carries it: everything but other backends, models, docs, tests and examples
SRC_EXCLUDES=(--exclude='*.gguf')
for d in models docs tests examples pocs media gguf-py benches conversion .github ci; do
    SRC_EXCLUDES+=(--exclude="llama.cpp/$d")
done
for b in cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn; do
    SRC_EXCLUDES+=(--exclude="llama.cpp/ggml/src/ggml-$b")
done
