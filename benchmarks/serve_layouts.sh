#!/usr/bin/env bash
# One workload over HTTP against each process layout of `trio-llm serve`, in turn.
#   SERVE_FLAGS="--model tiny" BENCH_FLAGS="--num-prompts 200 ..." \
#     bash benchmarks/serve_layouts.sh OUT_DIR "0 1 2"
# For each --api-server-count N in the list: start the server (port 8100 + N), wait
# for /health, run `trio-llm bench serve` with BENCH_FLAGS (BENCH_FLAGS_N instead, if
# set), then, if EXTRA_BENCH_FLAGS is set, a second workload on the same server;
# stop the server by its pid (SIGTERM; SIGKILL 30 s later). Writes
# OUT_DIR/serve-layout-N[-extra].json and OUT_DIR/server-layout-N.log. A bench that
# runs past BENCH_SECONDS gets `top`, `nvidia-smi` and the server's processes' Python
# stacks (py-spy dump, if installed) into the log before it is stopped. Loopback only.
set -u
out=$1; layouts=$2
mkdir -p "$out"
python=${PYTHON:-python3}
bench() {  # bench PORT NAME FLAGS...
  local port=$1 name=$2; shift 2
  echo "=== $name: bench serve $* ($(date -u +%T))"
  timeout "${BENCH_SECONDS:-300}" $python -m trio_llm.api.cli bench serve \
    --base-url "http://127.0.0.1:$port" "$@" --disable-tqdm --json "$out/$name.json" \
    > "$out/$name.txt" 2>&1
  local status=$?
  grep -E "throughput|TTFT|TPOT|requests|duration|processes" "$out/$name.txt"
  return $status
}
for count in $layouts; do
  port=$((8100 + count)); log="$out/server-layout-$count.log"
  $python -m trio_llm.api.cli serve $SERVE_FLAGS --host 127.0.0.1 --port $port \
    --api-server-count "$count" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do
    $python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" \
      2>/dev/null && break
    sleep 1
  done
  flags_name="BENCH_FLAGS_$count"
  bench $port "serve-layout-$count" ${!flags_name:-$BENCH_FLAGS} \
    && { [ -z "${EXTRA_BENCH_FLAGS:-}" ] || bench $port "serve-layout-$count-extra" $EXTRA_BENCH_FLAGS; }
  if [ $? -eq 124 ]; then  # what every process was doing when the bench gave up
    { echo "=== top"; top -b -n 1 | head -40; echo "=== nvidia-smi"; nvidia-smi; } >> "$log" 2>&1
    if command -v py-spy >/dev/null; then
      for child in $pid $(grep -oE "pid [0-9]+" "$log" | cut -d' ' -f2); do
        echo "=== py-spy dump --pid $child" >> "$log"; py-spy dump --pid "$child" >> "$log" 2>&1
      done
    fi
  fi
  kill -TERM $pid 2>/dev/null
  for _ in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -KILL $pid 2>/dev/null
  wait $pid; echo "layout $count exited $?"
done
