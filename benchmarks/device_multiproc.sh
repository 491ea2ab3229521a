#!/usr/bin/env bash
# One device call for the process layouts (docs/performance.md, "Process layouts"):
# the in-process engine, then `trio-llm serve` with --api-server-count 0, 1, 2, 4 (one
# at a time) on the 2000 x (128 in, 128 out) workload at concurrency 256 over 8 client
# processes, and a single stream through each; then qwen3-8b, 512 x (1024 in, 128 out)
# at concurrency 64, through the API-server count that served the first workload
# fastest. Carry .whl (see benchmarks/device_setup.sh). About 5 minutes.
. benchmarks/device_setup.sh >/dev/null 2>&1 || { echo "setup failed"; exit 1; }
export TOKENIZERS_PARALLELISM=false PATH="/tmp/site/bin:$PATH"  # py-spy, from the wheelhouse
echo "cpus: $(nproc)"; nvidia-smi -L
echo "=== in-process ($(date -u +%T))"
timeout 120 python3 -m trio_llm.api.cli bench throughput --model qwen3-0.6b --load-format dummy \
  --num-kv-blocks 8192 --num-prompts 2000 --min-prompt-len 128 --max-prompt-len 128 \
  --min-output-len 128 --max-output-len 128 --no-progress --json "$OUT/inprocess.json" \
  2>&1 | grep -E "tokens_per_second|elapsed|per_step"
summary() {  # one line per bench JSON in $1
  python3 - "$1" <<'EOF'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("serve-layout-*.json")):
    r = json.loads(path.read_text())["report"]
    print(f"{path.stem:26} done {r['num_completed']:5} failed {r['num_failed']:3} "
          f"out {r['output_throughput']:9.1f} tok/s  TPOT med {r['tpot_ms']['median']:6.2f} "
          f"p99 {r['tpot_ms']['p99']:6.2f}  TTFT med {r['ttft_ms']['median']:7.1f} "
          f"p99 {r['ttft_ms']['p99']:7.1f} ms")
EOF
}
SERVE_FLAGS="--model qwen3-0.6b --load-format dummy --num-kv-blocks 8192" \
BENCH_FLAGS="--num-prompts 2000 --random-input-len 128 --random-output-len 128 --max-concurrency 256 --num-client-processes 8" \
BENCH_FLAGS_0="--num-prompts 600 --random-input-len 128 --random-output-len 128 --max-concurrency 256 --num-client-processes 8" \
EXTRA_BENCH_FLAGS="--num-prompts 10 --random-input-len 128 --random-output-len 256 --max-concurrency 1" \
BENCH_SECONDS=${BENCH_SECONDS:-50} bash benchmarks/serve_layouts.sh "$OUT/layouts" "${LAYOUTS:-0 1 2 4}"
summary "$OUT/layouts"
best=$(python3 - "$OUT/layouts" <<'EOF'
import json, pathlib, sys
rates = {}
for path in pathlib.Path(sys.argv[1]).glob("serve-layout-[1-9].json"):
    report = json.loads(path.read_text())["report"]
    if report["num_failed"] == 0:
        rates[int(path.stem.rsplit("-", 1)[1])] = report["output_throughput"]
print(max(rates, key=rates.get) if rates else 1)
EOF
)
# each part's files come back, even if a later part overruns the call
tar czf "$OUT/layouts.tgz" -C "$OUT" layouts && rm -rf "$OUT/layouts"
echo "=== qwen3-8b through --api-server-count $best"
SERVE_FLAGS="--model qwen3-8b --load-format dummy" \
BENCH_FLAGS="--num-prompts 512 --random-input-len 1024 --random-output-len 128 --max-concurrency 64 --num-client-processes 2" \
BENCH_SECONDS=${BENCH_SECONDS:-50} bash benchmarks/serve_layouts.sh "$OUT/layouts-8b" "$best"
summary "$OUT/layouts-8b"
tar czf "$OUT/layouts-8b.tgz" -C "$OUT" layouts-8b && rm -rf "$OUT/layouts-8b"
