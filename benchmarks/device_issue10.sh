#!/usr/bin/env bash
# Issue 10's two open targets in one device call (docs/performance.md, (g), second pass):
#   bash benchmarks/device_issue10.sh
# 1. qwen3-0.6b single stream (8 x (128 in, 256 out), concurrency 1): the in-process
#    engine three times, then `trio-llm serve --api-server-count N` for each N in
#    COUNTS (default "1 4"), REPS runs each, with the CPU time every process of the
#    server spent per output token over the runs.
# 2. qwen3-8b, 512 x (1024 in, 128 out), concurrency 64, in-process, under several
#    prefill budgets on one loaded executor (benchmarks/scheduling_sweep.py), after
#    the first wave's prefill alone (the floor of TTFT).
# Every part is bounded and writes under $OUT as it ends. Carry .whl.
. benchmarks/device_setup.sh >/dev/null 2>&1 || { echo "setup failed"; exit 1; }
export TOKENIZERS_PARALLELISM=false
echo "cpus: $(nproc)"; nvidia-smi -L
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
echo "=== in-process single stream ($(date -u +%T))"
timeout 70 python3 - <<'EOF' 2>&1 | grep -E "^single|Error|error" | tee "$OUT/inprocess-single.txt"
import sys, trio
sys.path.insert(0, "benchmarks")
import gpu_bench
from gpu_bench import create_executor, engine_config, engine_decode_ms_per_token
config = engine_config("qwen3-0.6b", depth=2, num_kv_blocks=8192)
executor = create_executor(config)
for run in range(3):
    print(f"single in-process run {run}: {trio.run(engine_decode_ms_per_token, config, executor):.3f} ms/token", flush=True)
EOF
for count in ${COUNTS:-1 4}; do
  port=$((8200 + count)); log="$OUT/server-$count.log"
  python3 -m trio_llm.api.cli serve --model qwen3-0.6b --load-format dummy --num-kv-blocks 8192 \
    --host 127.0.0.1 --port $port --api-server-count "$count" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 90); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" 2>/dev/null && break
    sleep 1
  done
  echo "=== single stream, --api-server-count $count ($(date -u +%T))"
  children=$(grep -oE "pid [0-9]+" "$log" | cut -d' ' -f2)
  declare -A before=(); for child in $children; do before[$child]=$(cpu_ticks "$child"); done
  for rep in $(seq 1 "${REPS:-3}"); do
    timeout 40 python3 -m trio_llm.api.cli bench serve --base-url "http://127.0.0.1:$port" \
      --num-prompts 8 --random-input-len 128 --random-output-len 256 --max-concurrency 1 \
      --disable-tqdm --json "$OUT/single-$count-$rep.json" > /dev/null 2>&1
    python3 -c "import json; r = json.load(open('$OUT/single-$count-$rep.json'))['report']; print('single count $count run $rep: TPOT median %.3f mean %.3f ms, failed %d' % (r['tpot_ms']['median'], r['tpot_ms']['mean'], r['num_failed']))"
  done
  for child in $children; do
    name=$(grep -E "pid $child\$" "$log" | grep -oE "(engine core|API server [0-9]+)")
    echo "cpu count $count $name: $(( ($(cpu_ticks "$child") - ${before[$child]}) * 10 )) ms over $(( ${REPS:-3} * 8 * 256 )) tokens"
  done
  kill -TERM $pid; for _ in $(seq 1 20); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -KILL $pid 2>/dev/null; wait $pid 2>/dev/null
done
tar czf "$OUT/single.tgz" -C "$OUT" $(cd "$OUT" && ls single-*.json server-*.log) && rm -f "$OUT"/single-*.json "$OUT"/server-*.log
echo "=== qwen3-8b scheduling sweep ($(date -u +%T))"
timeout "${SWEEP_SECONDS:-230}" python3 benchmarks/scheduling_sweep.py --model qwen3-8b \
  --budgets ${BUDGETS:-8192 16384 4096 2048} 2>&1 | grep -vE "^(INFO|DEBUG|[0-9-]+ [0-9:,]+ )"
echo "=== done ($(date -u +%T))"
