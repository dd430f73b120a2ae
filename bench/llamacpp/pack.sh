#!/usr/bin/env bash
# Pack llama.cpp's source (as vendored in the llama-cpp-python 0.3.36 sdist) into
# bench/llamacpp/llama.cpp.tar.gz, trimmed to what a CUDA build of `llama-bench`, `llama-batched-bench` and
# `llama-server` needs.
# Run here (the CPU machine, with internet); the tarball is git-ignored and travels to the GPU
# machine with run's `carry` option. Set LCP_SDIST=/path/to/llama_cpp_python-0.3.36.tar.gz to reuse
# an already downloaded sdist (pip download spends ~1.5 min preparing its metadata).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version=0.3.36
out="$here/llama.cpp.tar.gz"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

if [[ -n "${LCP_SDIST:-}" ]]; then
    sdist="$LCP_SDIST"
else
    pip download "llama-cpp-python==$version" --no-binary :all: --no-deps -d "$tmp/dl" >&2
    sdist="$tmp/dl/llama_cpp_python-$version.tar.gz"
fi
tar -xzf "$sdist" -C "$tmp"
src="$tmp/llama_cpp_python-$version/vendor/llama.cpp"

# Not needed to build llama-bench or llama-server (LLAMA_BUILD_{TESTS,EXAMPLES,APP}=OFF; only the CPU and CUDA
# ggml backends are enabled; tools/* stay because tools/CMakeLists.txt adds most of them unconditionally).
# tools/server stays for llama-server (bench/serve_load.py's peer) without its tests; of tools/ui (the web
# UI's Svelte sources, 8.5 MiB) only the CMake files and templates stay: llama-server links the llama-ui
# library, which is built without embedded assets (LLAMA_BUILD_UI=OFF, LLAMA_USE_PREBUILT_UI=OFF).
# scripts/ stays: ggml-cuda/CMakeLists.txt does not use it, but it is small; the remaining
# source stays untouched so the build is llama.cpp's own.
cd "$src"
rm -rf models docs tests benches media examples pocs app gguf-py conversion skills ci .github .devops \
       tools/server/tests tools/server/bench \
       ggml/src/ggml-{cann,et,hexagon,metal,opencl,openvino,sycl,virtgpu,vulkan,webgpu,zdnn,zendnn,rpc,blas} \
       convert_*.py .git .gemini .pi requirements requirements.txt
find tools/ui -mindepth 1 -maxdepth 1 ! -name CMakeLists.txt ! -name sources.cmake ! -name '*.in' -exec rm -rf {} +
# .git is a submodule gitlink to nowhere (git commands in the build would complain); record what this is
echo "llama.cpp from llama-cpp-python $version sdist (vendor/llama.cpp), trimmed by jitllm bench/llamacpp/pack.sh" > JITLLM_SOURCE.txt
cd "$tmp/llama_cpp_python-$version/vendor"
tar -czf "$out" --owner=0 --group=0 --sort=name llama.cpp
echo "$out: $(du -h "$out" | cut -f1) ($(stat -c %s "$out") bytes)"
