#!/usr/bin/env bash
# Issue 11's measurements in one device call, each part bounded, in the order named:
#   bash benchmarks/device_issue11.sh [PART...]
# Parts: tests (the GPU tests of the attention kernels and the executor), host-tests (the
# GPU tests of everything the executor's launch touches: graphs, sampling plans,
# penalties, bitmasks, prompt logprobs), host-launch (benchmarks/host_launch_bench.py on
# the GPU: the host's launch per kind of step, profiled), kernels (the kernel sweeps),
# then each target's workload: mixed-0.6b, long-8b, long-0.6b, decode-0.6b,
# throughput-0.6b, decode-8b, throughput-8b (gpu_bench.py). With no part named, all but
# host-tests and host-launch, in that order. Results go to /tmp/issue11 and are bundled
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
pytest="python3 -m pytest -q -s -p no:cacheprovider -rs"
[ $# -eq 0 ] && set -- tests kernels mixed-0.6b long-8b long-0.6b decode-0.6b throughput-0.6b \
  decode-8b throughput-8b
for name in "$@"; do
  case $name in
    tests) part tests 110 $pytest tests/test_triton_attention.py tests/test_gpu_executor.py ;;
    host-tests) part host-tests 150 $pytest tests/test_gpu_executor.py \
      tests/test_gpu_sampler.py tests/test_penalties.py tests/test_token_bitmask.py \
      tests/test_prompt_logprobs.py tests/test_triton_sampling.py \
      tests/test_prefix_caching.py::test_gpu_executor_continues_after_a_cached_prefix \
      tests/test_structured_outputs.py::test_on_cuda_twenty_schemas_yield_valid_documents_through_graphs_and_kernels ;;
    host-launch) part host-launch 60 python3 benchmarks/host_launch_bench.py --device cuda --profile ;;
    kernels) part kernels 90 python3 benchmarks/kernel_bench.py ;;
    mixed-0.6b) part mixed-0.6b 90 $bench mixed --model qwen3-0.6b ;;
    long-8b) part long-8b 90 $bench long --model qwen3-8b ;;
    long-0.6b) part long-0.6b 60 $bench long --model qwen3-0.6b ;;
    decode-0.6b) part decode-0.6b 60 $bench decode --model qwen3-0.6b ;;
    throughput-0.6b) part throughput-0.6b 75 $bench throughput --model qwen3-0.6b ;;
    decode-8b) part decode-8b 90 $bench decode --model qwen3-8b ;;
    throughput-8b) part throughput-8b 100 $bench throughput --model qwen3-8b ;;
    *) echo "unknown part: $name" | tee -a "$log" ;;
  esac
done
