#!/usr/bin/env bash
# One workload over HTTP against each process layout of `trio-llm serve`.
#   SERVE_FLAGS="--model tiny" BENCH_FLAGS="--num-prompts 200 ..." \
#     bash benchmarks/serve_layouts.sh OUT_DIR "0 1 2"
# Every layout's server starts at once (port 8100 + api-server-count; give each
# its own --num-kv-blocks in SERVE_FLAGS on a GPU), then `trio-llm bench serve`
# runs against each in turn with BENCH_FLAGS (BENCH_FLAGS_N instead, if set, for
# layout N), then, if EXTRA_BENCH_FLAGS is set, once more with those (a second
# workload on the same server), writing OUT_DIR/serve-layout-N[-extra].json and the
# servers' logs. Every server is stopped by its pid at the end; loopback only.
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
bench() {  # bench COUNT NAME FLAGS...
  local count=$1 name=$2; shift 2
  echo "=== layout --api-server-count $count: bench serve $* ($(date -u +%T))"
  timeout "${BENCH_SECONDS:-300}" $python -m trio_llm.api.cli bench serve \
    --base-url "http://127.0.0.1:$((8100 + count))" "$@" --disable-tqdm \
    --json "$out/$name.json" 2>&1 | grep -E "throughput|TTFT|TPOT|requests|duration|processes"
}
for count in $layouts; do
  flags_name="BENCH_FLAGS_$count"
  bench "$count" "serve-layout-$count" ${!flags_name:-$BENCH_FLAGS}
  if [ -n "${EXTRA_BENCH_FLAGS:-}" ]; then
    bench "$count" "serve-layout-$count-extra" $EXTRA_BENCH_FLAGS
  fi
done
for count in $layouts; do kill -TERM "${pids[$count]}" 2>/dev/null; done
for count in $layouts; do  # a server that has not stopped 30 s after SIGTERM is killed
  for _ in $(seq 1 30); do kill -0 "${pids[$count]}" 2>/dev/null || break; sleep 1; done
  kill -KILL "${pids[$count]}" 2>/dev/null
  wait "${pids[$count]}"; echo "layout $count exited $?"
done
