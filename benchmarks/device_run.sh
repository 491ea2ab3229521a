#!/usr/bin/env bash
# One device call: set up, then run the named parts, each bounded, logs under $OUT.
#   bash benchmarks/device_run.sh tests decode-0.6b decode-8b throughput-0.6b transformers-0.6b
#   bash benchmarks/device_run.sh gpu-tests decode-30b-a3b throughput-30b-a3b serve-30b-a3b  # MoE
#   bash benchmarks/device_run.sh serve-twice-8b cli-throughput-0.6b throughput-0.6b  # first request
# Tensor parallelism 2 (kind nvidia-h200-x2), one part per call (each fits the 10 minutes):
#   bash benchmarks/device_run.sh tp2-tests tp2-match-0.6b
#   bash benchmarks/device_run.sh tp2-decode-8b
#   bash benchmarks/device_run.sh tp2-throughput-8b
# FP8 (issue 27), bf16 beside FP8 in each part; each part fits one call with the others
# of its line (about 500 s each line, the setup included):
#   bash benchmarks/device_run.sh fp8-tests fp8-decode-8b fp8-throughput-8b
#   bash benchmarks/device_run.sh fp8-serve-8b
#   bash benchmarks/device_run.sh fp8-decode-30b-a3b fp8-throughput-30b-a3b fp8-gemm
# Carry .whl (see benchmarks/device_setup.sh).
. benchmarks/device_setup.sh >/dev/null 2>&1 || { echo "setup failed"; exit 1; }
export TOKENIZERS_PARALLELISM=false
log="$OUT/device.log"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$log"
run() {  # run NAME SECONDS COMMAND...
  local name=$1 seconds=$2; shift 2
  echo "=== $name: $* ($(date -u +%FT%TZ))" | tee -a "$log"
  timeout "$seconds" "$@" 2>&1 | tee -a "$log" | grep -vE '^(INFO|DEBUG)' | tail -n 40
  echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$log"
}
wait_healthy() {  # wait_healthy PORT: until the server there answers /health (180 s at most)
  for _ in $(seq 1 180); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health')" \
      2>/dev/null && return
    sleep 1
  done
}
serve_bench() {  # (d): the server in the background, `trio-llm bench serve` against it
  # serve_bench MODEL [TAG SERVER-FLAGS...] (TAG names the logs, e.g. fp8)
  local model=$1 tag=${2:+-$2} port=8011 seconds=${SERVE_SECONDS:-300}
  shift; shift
  python3 -m trio_llm.api.cli serve --model "$model" --load-format dummy --port $port --api-server-count 0 \
    "$@" > "$OUT/server-$model$tag.log" 2>&1 &
  local pid=$!
  wait_healthy $port
  run "serve-$model$tag" "$seconds" python3 -m trio_llm.api.cli bench serve --port $port \
    --num-prompts 512 --random-input-len 1024 --random-output-len 128 --max-concurrency 64 \
    --json "$OUT/serve-$model$tag.json" --disable-tqdm
  kill $pid; wait $pid
}
fp8_pair() {  # fp8_pair COMMAND MODEL SECONDS [FLAGS...]: gpu_bench.py in bf16, then FP8 weights
  local command=$1 model=$2 seconds=$3
  shift 3
  run "$command-$model" "$seconds" python3 benchmarks/gpu_bench.py "$command" --model "$model" "$@"
  run "$command-$model-fp8" "$seconds" python3 benchmarks/gpu_bench.py "$command" \
    --model "$model" --quantization fp8 "$@"
}
serve_twice_bench() {  # issue 24: the first run after start against the same run repeated
  local model=$1 port=8013 round
  python3 -m trio_llm.api.cli serve --model "$model" --load-format dummy --port $port --api-server-count 0 \
    > "$OUT/server-twice-$model.log" 2>&1 &
  local pid=$!
  wait_healthy $port
  for round in first repeated; do
    run "serve-$round-$model" 300 python3 -m trio_llm.api.cli bench serve --port $port \
      --num-prompts 512 --random-input-len 1024 --random-output-len 128 --max-concurrency 64 \
      --json "$OUT/serve-$round-$model.json" --disable-tqdm
  done
  kill $pid; wait $pid
}
prefix_serve_bench() {  # shared prefixes (vLLM's prefix_repetition), caching on then off
  local model=$1 port=8012 caching
  for caching in enable no-enable; do
    python3 -m trio_llm.api.cli serve --model "$model" --load-format dummy --port $port --api-server-count 0 \
      --$caching-prefix-caching > "$OUT/server-prefix-$caching-$model.log" 2>&1 &
    local pid=$!
    wait_healthy $port
    run "prefix-serve-$caching-$model" 300 python3 -m trio_llm.api.cli bench serve --port $port \
      --dataset-name prefix_repetition --num-prompts 512 --prefix-repetition-num-prefixes 10 \
      --prefix-repetition-prefix-len 2000 --prefix-repetition-suffix-len 128 \
      --prefix-repetition-output-len 128 --max-concurrency 64 \
      --json "$OUT/prefix-serve-$caching-$model.json" --disable-tqdm
    kill $pid; wait $pid
  done
}
for part in "$@"; do
  case $part in
    tests) run tests 300 python3 -m pytest -q -s -p no:cacheprovider -rs \
             tests/test_triton_attention.py tests/test_triton_layers.py tests/test_triton_sampling.py tests/test_triton_gemv.py \
             tests/test_gpu_executor.py tests/test_token_bitmask.py \
             tests/test_prefix_caching.py::test_gpu_executor_continues_after_a_cached_prefix ;;
    profile-*) run "$part" 200 python3 benchmarks/step_profile.py --model "qwen3-${part#profile-}" ;;
    decode-*) run "$part" 240 python3 benchmarks/gpu_bench.py decode --model "qwen3-${part#decode-}" ;;
    mixed-*) run "$part" 300 python3 benchmarks/gpu_bench.py mixed --model "qwen3-${part#mixed-}" ;;
    long-*) run "$part" 200 python3 benchmarks/gpu_bench.py long --model "qwen3-${part#long-}" ;;
    throughput-*) run "$part" 300 python3 benchmarks/gpu_bench.py throughput --model "qwen3-${part#throughput-}" ;;
    structured-*) run "$part" 420 python3 benchmarks/gpu_bench.py structured --model "qwen3-${part#structured-}" ;;
    transformers-*) run "$part" 240 python3 benchmarks/gpu_bench.py transformers --model "qwen3-${part#transformers-}" --time-limit 120 ;;
    kernels) run kernels 300 python3 benchmarks/kernel_bench.py ;;
    gemv) run gemv 240 python3 benchmarks/gemv_bench.py ;;
    serve-twice-*) serve_twice_bench "qwen3-${part#serve-twice-}" ;;
    cli-throughput-*) run "$part" 300 python3 -m trio_llm.api.cli bench throughput \
             --model "qwen3-${part#cli-throughput-}" --load-format dummy ;;
    gpu-tests) run gpu-tests 300 python3 -m pytest -q -p no:cacheprovider -rs -m gpu \
             --ignore tests/test_http_schema.py tests/ ;;
    # FP8 (issue 27): bf16 and FP8 weights (dummy weights rounded to e4m3 per row) side by
    # side; the serve part adds FP8 weights + the FP8 KV cache
    fp8-tests) run fp8-tests 200 python3 -m pytest -q -p no:cacheprovider -rs \
             tests/test_fp8_gemm.py tests/test_triton_kv_fp8.py tests/test_fp8_weights.py \
             tests/test_kv_cache_fp8.py ;;
    fp8-gemm) run fp8-gemm 200 python3 benchmarks/fp8_gemm_bench.py ;;
    fp8-decode-*) fp8_pair decode "qwen3-${part#fp8-decode-}" 120 --engine-only ;;
    fp8-throughput-*) fp8_pair throughput "qwen3-${part#fp8-throughput-}" 150 --depths 2 ;;
    fp8-serve-*) SERVE_SECONDS=120 serve_bench "qwen3-${part#fp8-serve-}" bf16
             SERVE_SECONDS=120 serve_bench "qwen3-${part#fp8-serve-}" fp8 --quantization fp8
             SERVE_SECONDS=120 serve_bench "qwen3-${part#fp8-serve-}" fp8-fp8kv --quantization fp8 \
               --kv-cache-dtype fp8 ;;
    serve-*) serve_bench "qwen3-${part#serve-}" ;;
    prefix-serve-*) prefix_serve_bench "qwen3-${part#prefix-serve-}" ;;
    # tensor parallelism 2: needs the nvidia-h200-x2 kind (NCCL; NVLS multicast off)
    tp2-tests) NCCL_NVLS_ENABLE=0 run tp2-tests 400 python3 -m pytest -q -s -p no:cacheprovider -rs \
             tests/test_tensor_parallel.py ;;
    tp2-match-*) NCCL_NVLS_ENABLE=0 run "$part" 400 python3 benchmarks/tp_match.py \
             --model "qwen3-${part#tp2-match-}" --load-format dummy --device cuda ;;
    tp2-decode-*) NCCL_NVLS_ENABLE=0 run "$part" 480 python3 benchmarks/gpu_bench.py decode \
             --model "qwen3-${part#tp2-decode-}" --tensor-parallel-size 2 ;;
    tp2-throughput-*) NCCL_NVLS_ENABLE=0 run "$part" 540 python3 benchmarks/gpu_bench.py \
             throughput --model "qwen3-${part#tp2-throughput-}" --tensor-parallel-size 2 --depths 2 ;;
    prefix-match-*) run "$part" 300 python3 benchmarks/prefix_match.py --model "qwen3-${part#prefix-match-}" --load-format dummy ;;
    *) echo "unknown part $part" ;;
  esac
done
