#!/usr/bin/env bash
# llama.cpp CUDA llama-bench on the GPU machine (no internet), from the repo root, with
# bench/llamacpp/llama.cpp.tar.gz sent along (run's carry option; make it with pack.sh).
#
#   bench/llamacpp/run_cuda.sh all          # build, write the GGUFs, bench (~5 min on 16 cores)
#   bench/llamacpp/run_cuda.sh prep &       # build + GGUFs in the background (niced) ...
#   ... your own benchmark ...
#   bench/llamacpp/run_cuda.sh bench        # ... waits for prep, then runs llama-bench
#
# Steps: build (extract to $WORK/src, cmake + ninja, only the llama-bench target), ggufs (random-weight
# GGUFs in $WORK), prep (build then ggufs), bench (waits for a running build/ggufs, does any missing
# step itself, then runs llama-bench -p 512 -n 128 -r 3 -fa 1 -ngl 99 -o json on each model, prints one
# line per model and writes all results to $OUT/llamacpp.json when $OUT is set).
# Environment: WORK (default /tmp/llamacpp), JOBS (build/GGUF processes, default nproc), MODELS (default
# "llama-3.2-3b:f16 llama-3.2-3b:q4_0 smollm2-135m:f16 smollm2-135m:q4_0"), REPS (3), NICE (10, for the
# background steps), FILL (normal: N(0, s) values quantized with gguf.quants.quantize, like jitllm's
# random models, ~5 s per 3B model on 16 cores; fast: values straight from random bits, ~3x faster),
# LLAMACPP_CUBLAS_DIR / LLAMACPP_LIBCUDA (only if the toolkit lacks cuBLAS / libcuda), GGML_CUDA=OFF (a CPU-only build, to test this script without a GPU).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
here="$repo/bench/llamacpp"
WORK="${WORK:-/tmp/llamacpp}"
JOBS="${JOBS:-$(nproc)}"
MODELS="${MODELS:-llama-3.2-3b:f16 llama-3.2-3b:q4_0 smollm2-135m:f16 smollm2-135m:q4_0}"
REPS="${REPS:-3}"
FILL="${FILL:-normal}"
NICE="${NICE:-10}"
bin="$WORK/build/bin/llama-bench"
mkdir -p "$WORK"
command -v nvcc >/dev/null || export PATH="$PATH:/usr/local/cuda/bin"

log() { echo "[llamacpp $(date +%T)] $*" >&2; }

# A step's state lives in $WORK/<step>.status: "running PID", ok or failed.
run_step() {  # run_step NAME FUNCTION
    local name=$1 fn=$2 start=$SECONDS
    echo "running $$" > "$WORK/$name.status"
    if "$fn"; then
        echo ok > "$WORK/$name.status"
        log "$name done in $((SECONDS - start))s"
    else
        echo failed > "$WORK/$name.status"
        log "$name FAILED after $((SECONDS - start))s"
        return 1
    fi
}

wait_step() {  # wait_step NAME: wait while another process runs it; 0 if it ended ok
    local s
    while read -r s pid < "$WORK/$1.status" 2>/dev/null && [[ "$s" == running ]] && kill -0 "$pid" 2>/dev/null; do
        sleep 2
    done
    [[ "$(cat "$WORK/$1.status" 2>/dev/null || true)" == ok ]]
}

cuda_extra_flags() {  # cuBLAS / libcuda hints, only where the CUDA toolkit lacks them
    local nvcc root inc dir lib
    nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
    root="$(cd "$(dirname "$(readlink -f "$nvcc")")/.." && pwd)"
    if [[ -z "${LLAMACPP_CUBLAS_DIR:-}" ]] && ! ls "$root"/include/cublas_v2.h "$root"/targets/*/include/cublas_v2.h >/dev/null 2>&1; then
        # pip's nvidia-cublas(-cuXX) wheels (PyTorch's dependencies) ship headers and libraries
        for dir in $(python3 -c 'import nvidia, os; [print(os.path.join(p, d)) for p in nvidia.__path__ for d in ("cublas", "cu13", "cu12")]' 2>/dev/null); do
            if [[ -e "$dir/include/cublas_v2.h" ]]; then LLAMACPP_CUBLAS_DIR="$dir"; break; fi
        done
    fi
    if [[ -n "${LLAMACPP_CUBLAS_DIR:-}" ]]; then
        dir="$LLAMACPP_CUBLAS_DIR"
        log "cuBLAS from $dir"
        echo "-DCUDA_cublas_LIBRARY=$(ls "$dir"/lib/libcublas.so* | head -1)"
        echo "-DCUDA_cublasLt_LIBRARY=$(ls "$dir"/lib/libcublasLt.so* | head -1)"
        echo "-DCMAKE_CUDA_FLAGS=-I$dir/include"
        echo "-DCMAKE_CXX_FLAGS=-I$dir/include"
    fi
    lib="${LLAMACPP_LIBCUDA:-}"
    if [[ -z "$lib" ]] && ! ls "$root"/lib64/stubs/libcuda.so "$root"/targets/*/lib/stubs/libcuda.so "$root"/lib64/libcuda.so >/dev/null 2>&1; then
        lib="$( (ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? /{print $NF; exit}') || true)"
    fi
    if [[ -n "$lib" ]]; then
        log "libcuda from $lib"
        echo "-DCUDA_cuda_driver_LIBRARY=$lib"
    fi
}

do_configure() {
    local tarball="$here/llama.cpp.tar.gz" extra=()
    [[ -f "$tarball" ]] || { log "missing $tarball (make it with bench/llamacpp/pack.sh, send it with carry)"; return 1; }
    local sum; sum="$(sha256sum < "$tarball")"
    if [[ "$(cat "$WORK/src.sha256" 2>/dev/null)" != "$sum" ]]; then  # else: a rerun, ninja redoes nothing
        rm -rf "$WORK/src" "$WORK/src.sha256" && mkdir -p "$WORK/src"
        tar -xzf "$tarball" -C "$WORK/src"
        echo "$sum" > "$WORK/src.sha256"
    fi
    mapfile -t extra < <(cuda_extra_flags)
    cmake -S "$WORK/src/llama.cpp" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA="${GGML_CUDA:-ON}" -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DGGML_CUDA_FA_ALL_QUANTS=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON "${extra[@]}" \
        > "$WORK/cmake.log" 2>&1 || { tail -30 "$WORK/cmake.log" >&2; return 1; }
}

do_build() {
    do_configure || return 1
    cmake --build "$WORK/build" --target llama-bench -j "$JOBS" > "$WORK/ninja.log" 2>&1 \
        || { grep -B2 -A20 -m3 "error" "$WORK/ninja.log" >&2 || tail -40 "$WORK/ninja.log" >&2; return 1; }
    [[ -x "$bin" ]]
}

gguf_path() { echo "$WORK/${1/:/-}.gguf"; }

ensure_gguf() {  # the gguf package: installed, or straight from the bundle's pure-Python wheel
    python3 -c "import gguf" 2>/dev/null && return 0
    local whl
    whl="$(ls "$repo"/.device/wheels/gguf-*.whl 2>/dev/null | head -1)"
    [[ -n "$whl" ]] || { log "no gguf package: source .device/setup.sh or send .device/ along"; return 1; }
    export PYTHONPATH="$whl${PYTHONPATH:+:$PYTHONPATH}"
    python3 -c "import gguf" && log "gguf from $whl"
}

do_ggufs() {
    local m
    ensure_gguf || return 1
    for m in $MODELS; do
        local p; p="$(gguf_path "$m")"
        [[ -s "$p" && -e "$p.done" ]] && continue
        rm -f "$p.done"
        python3 "$here/random_gguf.py" -preset "${m%%:*}" -wtype "${m##*:}" -out "$p" -jobs "$JOBS" \
            $([[ "$FILL" == fast ]] && echo -fast) || return 1
        touch "$p.done"
    done
}

do_bench() {
    local m p all=() out
    for m in $MODELS; do
        p="$(gguf_path "$m")"
        out="$WORK/bench-${m/:/-}.json"
        log "llama-bench $m"
        if "$bin" -m "$p" -p 512 -n 128 -r "$REPS" -fa 1 -ngl 99 -o json > "$out" 2> "$out.err"; then
            all+=("$m=$out")
        else
            log "llama-bench failed on $m:"; tail -20 "$out.err" >&2
        fi
    done
    python3 - "${all[@]}" <<'EOF'
import json, os, sys
results = []
for arg in sys.argv[1:]:
    name, path = arg.split("=", 1)
    for r in json.load(open(path)):
        r["jitllm_model"] = name
        results.append(r)
by = {}
for r in results:
    test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
    by.setdefault(r["jitllm_model"], {})[test] = r
for name, tests in by.items():
    any_r = next(iter(tests.values()))
    parts = [f"{t} {r['avg_ts']:.1f} ± {r['stddev_ts']:.1f} t/s" for t, r in tests.items()]
    print(f"llama.cpp {any_r.get('backends', '?')} {name} ({any_r['model_type']}, {any_r['model_size'] / 2**20:.0f} MiB, "
          f"{any_r['model_n_params'] / 1e6:.1f} M params, fa {any_r.get('flash_attn')}): " + ", ".join(parts)
          + f" [{any_r.get('gpu_info') or any_r.get('cpu_info')}, llama.cpp of llama-cpp-python 0.3.36]")
out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "llamacpp.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {os.path.join(out, 'llamacpp.json')} ({len(results)} results)")
EOF
}

prep() {
    run_step build do_build && run_step ggufs do_ggufs
}

case "${1:-all}" in
    configure) do_configure && log "configured $WORK/build" ;;
    build|ggufs|prep)
        # background steps are niced so a benchmark running meanwhile keeps priority on the cores
        renice -n "$NICE" $$ >/dev/null 2>&1 || true
        case "$1" in
            build) run_step build do_build ;;
            ggufs) run_step ggufs do_ggufs ;;
            prep) run_step prep prep ;;
        esac ;;
    bench)
        wait_step prep || true  # a background prep (its ggufs step must not run twice at once)
        wait_step build || run_step build do_build
        wait_step ggufs || true
        run_step ggufs do_ggufs  # writes only the GGUFs not written yet
        do_bench ;;
    all)
        prep
        do_bench ;;
    *) echo "usage: $0 [build|ggufs|prep|bench|all|configure]" >&2; exit 2 ;;
esac
