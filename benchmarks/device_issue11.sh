#!/usr/bin/env bash
# Issue 11's measurements in one device call, most wanted first, each part bounded:
#   bash benchmarks/device_issue11.sh
# The GPU tests of the attention kernels and the executor, the kernel sweeps, then
# every target's workload (gpu_bench.py). Results go to /tmp/issue11 and are bundled
# after every part into $OUT/results.tar (what a call brings back is few files), with
# the whole log in $OUT/device.log. Carry .whl (see benchmarks/device_setup.sh).
. benchmarks/device_setup.sh >/dev/null 2>&1 || { echo "setup failed"; exit 1; }
export TOKENIZERS_PARALLELISM=false
results=/tmp/issue11
mkdir -p "$results"
log="$OUT/device.log"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$log"
part() {  # part NAME SECONDS COMMAND...: run it bounded, then bundle what is there
  local name=$1 seconds=$2; shift 2
  echo "=== $name: $* ($(date -u +%FT%TZ))" | tee -a "$log"
  OUT=$results timeout "$seconds" "$@" 2>&1 | tee -a "$log" | grep -vE '^(INFO|DEBUG|[0-9-]+ [0-9:,]+ )' | tail -n 25
  echo "=== $name: exit ${PIPESTATUS[0]} ($(date -u +%FT%TZ))" | tee -a "$log"
  tar -cf "$OUT/results.tar" -C "$results" .
}
bench="python3 benchmarks/gpu_bench.py"
[ -z "$SKIP_KERNEL_PARTS" ] && part tests 110 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/test_triton_attention.py tests/test_gpu_executor.py
[ -z "$SKIP_KERNEL_PARTS" ] && part kernels 90 python3 benchmarks/kernel_bench.py
part mixed-0.6b 90 $bench mixed --model qwen3-0.6b
part long-8b 90 $bench long --model qwen3-8b
part long-0.6b 60 $bench long --model qwen3-0.6b
part decode-0.6b 60 $bench decode --model qwen3-0.6b
part throughput-0.6b 75 $bench throughput --model qwen3-0.6b
part decode-8b 90 $bench decode --model qwen3-8b
part throughput-8b 100 $bench throughput --model qwen3-8b
