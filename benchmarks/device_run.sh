#!/usr/bin/env bash
# One device call: set up, then run the named parts, each bounded, logs under $OUT.
#   bash benchmarks/device_run.sh tests decode-0.6b decode-8b throughput-0.6b transformers-0.6b
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
for part in "$@"; do
  case $part in
    tests) run tests 300 python3 -m pytest -q -s -p no:cacheprovider -rs \
             tests/test_triton_attention.py tests/test_triton_layers.py tests/test_gpu_executor.py ;;
    decode-*) run "$part" 240 python3 benchmarks/gpu_bench.py decode --model "qwen3-${part#decode-}" ;;
    throughput-*) run "$part" 300 python3 benchmarks/gpu_bench.py throughput --model "qwen3-${part#throughput-}" ;;
    transformers-*) run "$part" 240 python3 benchmarks/gpu_bench.py transformers --model "qwen3-${part#transformers-}" --time-limit 120 ;;
    kernels) run kernels 120 python3 benchmarks/kernel_bench.py ;;
    *) echo "unknown part $part" ;;
  esac
done
