#!/usr/bin/env bash
# One workload over HTTP against each process layout of `trio-llm serve`.
#   SERVE_FLAGS="--model tiny" BENCH_FLAGS="--num-prompts 200 ..." \
#     bash benchmarks/serve_layouts.sh OUT_DIR "0 1 2"
# Every layout's server starts at once (port 8100 + api-server-count; give each
# its own --num-kv-blocks in SERVE_FLAGS on a GPU), then `trio-llm bench serve`
# runs against each in turn with BENCH_FLAGS, writing OUT_DIR/serve-layout-N.json
# and the servers' logs. Every server is stopped by its pid at the end; loopback only.
set -u
out=$1; layouts=$2
mkdir -p "$out"
python=${PYTHON:-python3}
declare -A pids
for count in $layouts; do
  $python -m trio_llm.api.cli serve $SERVE_FLAGS --host 127.0.0.1 --port $((8100 + count)) \
    --api-server-count "$count" > "$out/server-layout-$count.log" 2>&1 &
  pids[$count]=$!
done
for count in $layouts; do
  for _ in $(seq 1 300); do
    $python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$((8100 + count))/health')" \
      2>/dev/null && break
    sleep 1
  done
done
for count in $layouts; do
  echo "=== layout --api-server-count $count: bench serve $BENCH_FLAGS ($(date -u +%T))"
  timeout "${BENCH_SECONDS:-300}" $python -m trio_llm.api.cli bench serve \
    --base-url "http://127.0.0.1:$((8100 + count))" $BENCH_FLAGS --disable-tqdm \
    --json "$out/serve-layout-$count.json" 2>&1 | grep -E "throughput|TTFT|TPOT|ITL|requests|duration|processes"
done
for count in $layouts; do kill -TERM "${pids[$count]}" 2>/dev/null; done
for count in $layouts; do wait "${pids[$count]}"; echo "layout $count exited $?"; done
