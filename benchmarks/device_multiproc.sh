#!/usr/bin/env bash
# One device call for the process layouts (docs/performance.md, "Process layouts"):
# the in-process engine, then `trio-llm serve` with --api-server-count 0, 1, 2, 4 on
# the 2000 x (128 in, 128 out) workload at concurrency 256 over 8 client processes,
# and a single stream through each. Carry .whl (see benchmarks/device_setup.sh).
. benchmarks/device_setup.sh >/dev/null 2>&1 || { echo "setup failed"; exit 1; }
export TOKENIZERS_PARALLELISM=false PATH="/tmp/site/bin:$PATH"  # py-spy, from the wheelhouse
echo "cpus: $(nproc)"; nvidia-smi -L
echo "=== in-process ($(date -u +%T))"
timeout 150 python3 -m trio_llm.api.cli bench throughput --model qwen3-0.6b --load-format dummy \
  --num-kv-blocks 8192 --num-prompts 2000 --min-prompt-len 128 --max-prompt-len 128 \
  --min-output-len 128 --max-output-len 128 --no-progress --json "$OUT/inprocess.json" \
  2>&1 | grep -E "tokens_per_second|elapsed|per_step"
SERVE_FLAGS="--model qwen3-0.6b --load-format dummy --num-kv-blocks 8192" \
BENCH_FLAGS="--num-prompts 2000 --random-input-len 128 --random-output-len 128 --max-concurrency 256 --num-client-processes 8" \
BENCH_FLAGS_0="--num-prompts 600 --random-input-len 128 --random-output-len 128 --max-concurrency 256 --num-client-processes 8" \
EXTRA_BENCH_FLAGS="--num-prompts 10 --random-input-len 128 --random-output-len 256 --max-concurrency 1" \
BENCH_SECONDS=90 bash benchmarks/serve_layouts.sh "$OUT/layouts" "${LAYOUTS:-0 1 2 4}"
tar czf "$OUT/layouts.tgz" -C "$OUT" layouts && rm -rf "$OUT/layouts"
