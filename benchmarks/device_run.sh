#!/usr/bin/env bash
# One device call: set up, then run the named parts, each bounded, logs under $OUT.
#   bash benchmarks/device_run.sh tests decode-0.6b decode-8b throughput-0.6b transformers-0.6b
#   bash benchmarks/device_run.sh gpu-tests decode-30b-a3b throughput-30b-a3b serve-30b-a3b  # MoE
#   bash benchmarks/device_run.sh serve-twice-8b cli-throughput-0.6b throughput-0.6b  # first request
# The hybrid family (issue 26; a part's model is qwen3-<suffix>, or the suffix itself when
# it names a qwen model), a call each (docs/performance.md):
#   bash benchmarks/device_run.sh hybrid-tests hybrid-kernels decode-qwen3.5-35b-a3b
#   bash benchmarks/device_run.sh decode-qwen3.5-27b context-qwen3.5-35b-a3b
#   bash benchmarks/device_run.sh context-qwen3.5-27b long-qwen3.5-27b
#   bash benchmarks/device_run.sh throughput-qwen3.5-35b-a3b serve-qwen3.5-35b-a3b
#   bash benchmarks/device_run.sh throughput-qwen3.5-27b serve-qwen3.5-27b
#   prefix caching with state snapshots (prefix_repetition, caching on then off), beside dense:
#   bash benchmarks/device_run.sh prefix-serve-qwen3.5-35b-a3b prefix-serve-qwen3.5-27b prefix-serve-8b
#   the same on CUDA in tests (prompt and decode snapshots, multi-turn; greedy match printed):
#   bash benchmarks/device_run.sh hybrid-prefix-tests
# Tensor parallelism 2 (kind nvidia-h200-x2), one part per call (each fits the 10 minutes):
#   bash benchmarks/device_run.sh tp2-tests tp2-match-0.6b
#   bash benchmarks/device_run.sh tp2-decode-8b
#   bash benchmarks/device_run.sh tp2-throughput-8b
# The MoE single stream, tuned then measured in one call (moe-tune's table is read by
# every later part of the call through TRIO_LLM_MOE_CONFIGS; it comes back as
# $OUT/moe_table_*.json: commit it to gpu/kernels/moe_configs/ under its own name):
#   bash benchmarks/device_run.sh moe-tests moe-tune decode-30b-a3b graph-profile-30b-a3b
#   bash benchmarks/device_run.sh moe-tune-batched moe-kernel  # 64-8192 tokens, then the table
#   bash benchmarks/device_run.sh pdl-tests decode-nopdl-30b-a3b decode-30b-a3b  # PDL off, A/B
# FP8 (issue 27), bf16 beside FP8 in each part; each part fits one call with the others
# of its line (about 500 s each line, the setup included):
#   bash benchmarks/device_run.sh fp8-tests fp8-decode-8b fp8-throughput-8b
#   bash benchmarks/device_run.sh fp8-serve-8b
#   bash benchmarks/device_run.sh fp8-decode-30b-a3b fp8-throughput-30b-a3b fp8-gemm
# The FP8 GEMV for decode rows (issue 27): the kernels alone at 1-2 rows, then end to end
# (bf16 and FP8); the tests in a call of their own:
#   bash benchmarks/device_run.sh fp8-gemv fp8-decode-8b
#   bash benchmarks/device_run.sh fp8-tests
#   bash benchmarks/device_run.sh fp8-gemv-sweep fp8-decode-8b   # the FP8 GEMV's launch in the graph
#   bash benchmarks/device_run.sh fp8-rowwise fp8-throughput-8b   # the row-wise GEMM of batched steps
#   bash benchmarks/device_run.sh fp8-gemm-tune-8b fp8-throughput-8b  # its tuned tables, then used
# FP8 experts: the MoE kernel beside bf16 at 1-8192 tokens, one FP8 server, and the
# FP8 experts' own tuned table (a call of its own):
#   bash benchmarks/device_run.sh moe-kernel-fp8 serve-fp8-30b-a3b
#   bash benchmarks/device_run.sh moe-tune-fp8
#   bash benchmarks/device_run.sh moe-tune-fp8-blocks moe-kernel-fp8  # block scales' table, then timed
# Carry .whl (see benchmarks/device_setup.sh).
. benchmarks/device_setup.sh >/dev/null 2>&1 || { echo "setup failed"; exit 1; }
export TOKENIZERS_PARALLELISM=false
log="$OUT/device.log"
# Tuned MoE and FP8 GEMM tables written by moe-tune* and fp8-gemm-tune-* in this call are
# read by the parts after it.
export TRIO_LLM_MOE_CONFIGS="$OUT/moe_configs"
export TRIO_LLM_FP8_GEMM_CONFIGS="$OUT/fp8_gemm_configs"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$log"
run() {  # run NAME SECONDS COMMAND... (the hybrid family's large models get twice the time)
  local name=$1 seconds=$2; shift 2
  case $name in *qwen3.5*) seconds=$((2 * seconds)) ;; esac
  echo "=== $name: $* ($(date -u +%FT%TZ))" | tee -a "$log"
  timeout "$seconds" "$@" 2>&1 | tee -a "$log" | grep -vE '^(INFO|DEBUG)' | tail -n 40
  echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$log"
}
model_of() {  # model_of SUFFIX: a part's model (qwen3-SUFFIX, or SUFFIX if it names one)
  case $1 in qwen*) echo "$1" ;; *) echo "qwen3-$1" ;; esac
}
wait_healthy() {  # wait_healthy PORT PID: until the server there answers /health (420 s at
  # most), or its process PID is gone (it failed to start: its log says why)
  for _ in $(seq 1 420); do
    kill -0 "$2" 2>/dev/null || { echo "the server on port $1 exited before it was ready"; return 1; }
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
  wait_healthy $port $pid
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
  # The repeat draws other prompts (--seed 1): with the same ones every prompt would be
  # a prefix-cache hit, and the repeat would measure the cache, not a warm engine.
  local model=$1 port=8013 round seed
  python3 -m trio_llm.api.cli serve --model "$model" --load-format dummy --port $port --api-server-count 0 \
    > "$OUT/server-twice-$model.log" 2>&1 &
  local pid=$!
  wait_healthy $port $pid
  for round in first repeated; do
    seed=0; [ $round = repeated ] && seed=1
    run "serve-$round-$model" 300 python3 -m trio_llm.api.cli bench serve --port $port \
      --num-prompts 512 --random-input-len 1024 --random-output-len 128 --max-concurrency 64 \
      --seed $seed --json "$OUT/serve-$round-$model.json" --disable-tqdm
  done
  kill $pid; wait $pid
}
ready_time() {  # issue 24: seconds from `trio-llm serve` to /health 200 (warmed up, ready)
  local model=$1 port=8014 start
  start=$(date +%s.%N)
  python3 -m trio_llm.api.cli serve --model "$model" --load-format dummy --port $port --api-server-count 0 \
    > "$OUT/server-ready-$model.log" 2>&1 &
  local pid=$!
  wait_healthy $port $pid
  echo "=== ready-$model: $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s to ready" | tee -a "$log"
  grep -E "KV cache|warmed|captured" "$OUT/server-ready-$model.log" | tee -a "$log"
  kill $pid; wait $pid
}
prefix_serve_bench() {  # shared prefixes (vLLM's prefix_repetition), caching on then off
  # (PREFIX_PROMPTS: fewer than 512 prompts, where a large model's two servers must fit a call;
  # PREFIX_SERVER_FLAGS: more flags for both servers, e.g. --max-num-seqs 64 for qwen3.5-27b
  # on an H100)
  local model=$1 port=8012 caching
  for caching in enable no-enable; do
    # shellcheck disable=SC2086  # the flags split into words
    python3 -m trio_llm.api.cli serve --model "$model" --load-format dummy --port $port --api-server-count 0 \
      --$caching-prefix-caching ${PREFIX_SERVER_FLAGS:-} > "$OUT/server-prefix-$caching-$model.log" 2>&1 &
    local pid=$!
    wait_healthy $port $pid
    run "prefix-serve-$caching-$model" 300 python3 -m trio_llm.api.cli bench serve --port $port \
      --dataset-name prefix_repetition --num-prompts "${PREFIX_PROMPTS:-512}" --prefix-repetition-num-prefixes 10 \
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
    # PDL on (TRIO_LLM_PDL=1): the decode chain's kernels give the bits of plain launches
    pdl-tests) run pdl-tests 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_pdl.py \
             tests/test_fused_moe.py::test_a_pdl_decode_chain_gives_the_same_bits_inside_a_graph \
             "tests/test_cuda_hybrid.py::test_gpu_pdl_launches_give_the_plain_launches_tokens" \
             tests/test_triton_gemv.py::test_a_pdl_launch_gives_the_same_bits_inside_a_graph ;;
    moe-tests) run moe-tests 300 python3 -m pytest -q -p no:cacheprovider -rs \
             tests/test_moe_routing.py tests/test_fused_moe.py ;;
    # qwen3-30b-a3b's layer at 1-8 tokens (row-wise and grouped), bounded to 5 minutes
    moe-tune) run moe-tune 300 python3 benchmarks/moe_kernel_bench.py --tune \
             --tokens 1 2 4 8 --budget-s 210 --repeats 10 ;;
    moe-tune-batched) run moe-tune-batched 560 python3 benchmarks/moe_kernel_bench.py --tune \
             --tokens 64 256 1024 8192 --budget-s 480 --repeats 10 ;;
    # the hybrid MoE's layer (256 experts of 512) at 1-8 tokens, bounded to 2 minutes
    moe-tune-qwen3.5-35b-a3b) run moe-tune-35b 150 python3 benchmarks/moe_kernel_bench.py --tune \
             --model qwen3.5-35b-a3b --tokens 1 2 4 8 --budget-s 100 --repeats 10 ;;
    moe-kernel) run moe-kernel 300 python3 benchmarks/moe_kernel_bench.py --graph ;;
    # FP8 experts (per-row scales) tuned at 1-8192 tokens (their own table), served sizes
    # first (a count reached past the budget is left out), bounded to leave a serve room
    moe-tune-fp8) run moe-tune-fp8 400 python3 benchmarks/moe_kernel_bench.py --tune --fp8 \
             --tokens 64 8192 1024 256 1 2 4 8 --budget-s 320 --repeats 10 --layers 8 ;;
    # FP8 experts with 128x128 block scales (Qwen's FP8 releases), their own table
    moe-tune-fp8-blocks) run moe-tune-fp8-blocks 400 python3 benchmarks/moe_kernel_bench.py \
             --tune --fp8 --fp8-block 128 128 --tokens 64 8192 1024 256 1 2 4 8 \
             --budget-s 320 --repeats 10 --layers 8 ;;
    # FP8 experts (per-row and 128x128 block scales) beside bf16, in graphs
    moe-kernel-fp8) run moe-kernel-fp8 300 python3 benchmarks/moe_kernel_bench.py --graph --fp8 ;;
    graph-profile-*) run "$part" 300 python3 benchmarks/graph_profile.py --model "$(model_of "${part#graph-profile-}")" ;;
    # one sequence's decode graph by kernel and launch grid, PDL off, at the last step of
    # a real decode (a 128-token prompt's 256th token; a hybrid model's real state)
    single-profile-fp8-*) TRIO_LLM_PDL=0 run "$part" 240 python3 benchmarks/graph_profile.py \
             --model "$(model_of "${part#single-profile-fp8-}")" --quantization fp8 --num-seqs 1 --after-decode ;;
    single-profile-*) TRIO_LLM_PDL=0 run "$part" 240 python3 benchmarks/graph_profile.py \
             --model "$(model_of "${part#single-profile-}")" --num-seqs 1 --after-decode ;;
    profile-*) run "$part" 200 python3 benchmarks/step_profile.py --model "$(model_of "${part#profile-}")" ;;
    # the varlen kernel at head_dim 256 across tiles (the sweep that chose its tile)
    varlen-wide) run varlen-wide 200 python3 benchmarks/varlen_wide_heads.py ;;
    # the decode kernel alone over bf16 and FP8 caches, 256 sequences and single ones, across
    # tiles (and an earlier kernel file beside the current one:
    # DECODE_BASELINE=path/triton_attention.py; some cases and tiles only: DECODE_CASES=batch
    # DECODE_TILES="64,4,3,128 32,1,3")
    decode-tiles) run decode-tiles 200 python3 benchmarks/decode_tiles_bench.py \
             ${DECODE_BASELINE:+--baseline "$DECODE_BASELINE"} \
             ${DECODE_CASES:+--cases $DECODE_CASES} ${DECODE_TILES:+--tiles $DECODE_TILES} ;;
    # programmatic dependent launch (gpu/kernels/pdl.py, on by default) off: beside decode-*
    decode-nopdl-*) TRIO_LLM_PDL=0 run "$part" 240 python3 benchmarks/gpu_bench.py decode --model "$(model_of "${part#decode-nopdl-}")" ;;
    decode-*) run "$part" 240 python3 benchmarks/gpu_bench.py decode --model "$(model_of "${part#decode-}")" ;;
    mixed-*) run "$part" 300 python3 benchmarks/gpu_bench.py mixed --model "$(model_of "${part#mixed-}")" ;;
    long-*) run "$part" 200 python3 benchmarks/gpu_bench.py long --model "$(model_of "${part#long-}")" ;;
    # the hybrid family's large models: depth 2 only (the call's ten minutes)
    throughput-qwen3.5-*) run "$part" 300 python3 benchmarks/gpu_bench.py throughput \
             --model "${part#throughput-}" --depths 2 ;;
    throughput-*) run "$part" 300 python3 benchmarks/gpu_bench.py throughput --model "$(model_of "${part#throughput-}")" ;;
    structured-*) run "$part" 420 python3 benchmarks/gpu_bench.py structured --model "$(model_of "${part#structured-}")" ;;
    transformers-*) run "$part" 240 python3 benchmarks/gpu_bench.py transformers --model "$(model_of "${part#transformers-}")" --time-limit 120 ;;
    kernels) run kernels 300 python3 benchmarks/kernel_bench.py ;;
    # the hybrid family: kernels against references, the model on CUDA against the CPU
    hybrid-tests) run hybrid-tests 420 python3 -m pytest -q -s -p no:cacheprovider -rs \
             tests/test_triton_linear_attention.py tests/test_cuda_hybrid.py \
             tests/test_state_store.py ;;
    hybrid-kernels) run hybrid-kernels 240 python3 benchmarks/hybrid_kernel_bench.py ;;
    # hybrid prefix caching on CUDA (state snapshots, decode snapshots): caching on against off
    hybrid-prefix-tests) run hybrid-prefix-tests 480 python3 -m pytest -q -s -p no:cacheprovider \
             -rs -m gpu tests/test_hybrid_exactness.py ;;
    context-*) run "$part" 270 python3 benchmarks/gpu_bench.py context --model "$(model_of "${part#context-}")" ;;
    gemv) run gemv 240 python3 benchmarks/gemv_bench.py ;;
    # the gate/up GEMV with its SwiGLU in the launch and without, bf16 and FP8 qwen3-8b
    swiglu-ab) run swiglu-ab 120 python3 benchmarks/swiglu_graph_ab.py
             run swiglu-ab-fp8 120 python3 benchmarks/swiglu_graph_ab.py --quantization fp8 ;;
    gemv-sweep-*) run "$part" 540 python3 benchmarks/gemv_sweep.py --model "$(model_of "${part#gemv-sweep-}")" ;;
    ready-*) ready_time "$(model_of "${part#ready-}")" ;;
    serve-twice-*) serve_twice_bench "$(model_of "${part#serve-twice-}")" ;;
    cli-throughput-*) run "$part" 300 python3 -m trio_llm.api.cli bench throughput \
             --model "$(model_of "${part#cli-throughput-}")" --load-format dummy ;;
    gpu-tests) run gpu-tests 300 python3 -m pytest -q -p no:cacheprovider -rs -m gpu \
             --ignore tests/test_http_schema.py tests/ ;;
    # FP8 (issue 27): bf16 and FP8 weights (dummy weights rounded to e4m3 per row) side by
    # side; the serve part adds FP8 weights + the FP8 KV cache
    fp8-tests) run fp8-tests 200 python3 -m pytest -q -p no:cacheprovider -rs \
             tests/test_fp8_gemm.py tests/test_fp8_gemv.py tests/test_triton_kv_fp8.py \
             tests/test_fp8_weights.py tests/test_kv_cache_fp8.py ;;
    # the GEMV (bf16, FP8, with its SwiGLU) against its references, compiled
    gemv-tests) run gemv-tests 150 python3 -m pytest -q -p no:cacheprovider -rs \
             tests/test_triton_gemv.py tests/test_fp8_gemv.py ;;
    # the FP8 cache's attention alone (the float16 dots of a bf16 query over e4m3)
    fp8-kv-tests) run fp8-kv-tests 100 python3 -m pytest -q -p no:cacheprovider -rs \
             tests/test_triton_kv_fp8.py ;;
    fp8-gemm) run fp8-gemm 200 python3 benchmarks/fp8_gemm_bench.py ;;
    fp8-gemv) run fp8-gemv 150 python3 benchmarks/fp8_gemm_bench.py --decode ;;
    # the row-wise FP8 GEMM of batched steps: cuBLAS beside the Triton GEMM's tiles
    fp8-rowwise) run fp8-rowwise 200 python3 benchmarks/fp8_rowwise_bench.py ;;
    # the row-wise GEMM's tuned tables of a model's projections (commit $OUT/fp8_table_*)
    fp8-gemm-tune-*) run "$part" 300 python3 benchmarks/fp8_rowwise_bench.py --tune \
             --model "$(model_of "${part#fp8-gemm-tune-}")" ;;
    # the FP8 GEMV's launch swept inside qwen3-8b's captured decode graph (one row)
    fp8-gemv-sweep) run fp8-gemv-sweep 300 python3 benchmarks/gemv_sweep.py --model qwen3-8b \
             --quantization fp8 ;;
    fp8-decode-*) fp8_pair decode "$(model_of "${part#fp8-decode-}")" 120 --engine-only ;;
    fp8-throughput-*) fp8_pair throughput "$(model_of "${part#fp8-throughput-}")" 150 --depths 2
             run "$part-fp8kv" 150 python3 benchmarks/gpu_bench.py throughput --depths 2 \
               --model "$(model_of "${part#fp8-throughput-}")" --quantization fp8 --kv-cache-dtype fp8 ;;
    fp8-serve-*) SERVE_SECONDS=120 serve_bench "$(model_of "${part#fp8-serve-}")" bf16
             SERVE_SECONDS=120 serve_bench "$(model_of "${part#fp8-serve-}")" fp8 --quantization fp8
             SERVE_SECONDS=120 serve_bench "$(model_of "${part#fp8-serve-}")" fp8-fp8kv \
               --quantization fp8 --kv-cache-dtype fp8 ;;
    serve-fp8-*) serve_bench "$(model_of "${part#serve-fp8-}")" fp8 --quantization fp8 ;;
    serve-*) serve_bench "$(model_of "${part#serve-}")" ;;
    prefix-serve-*) prefix_serve_bench "$(model_of "${part#prefix-serve-}")" ;;
    # tensor parallelism 2: needs the nvidia-h200-x2 kind (NCCL; NVLS multicast off)
    tp2-tests) NCCL_NVLS_ENABLE=0 run tp2-tests 400 python3 -m pytest -q -s -p no:cacheprovider -rs \
             tests/test_tensor_parallel.py ;;
    tp2-match-*) NCCL_NVLS_ENABLE=0 run "$part" 400 python3 benchmarks/tp_match.py \
             --model "$(model_of "${part#tp2-match-}")" --load-format dummy --device cuda ;;
    tp2-decode-*) NCCL_NVLS_ENABLE=0 run "$part" 480 python3 benchmarks/gpu_bench.py decode \
             --model "$(model_of "${part#tp2-decode-}")" --tensor-parallel-size 2 ;;
    tp2-throughput-*) NCCL_NVLS_ENABLE=0 run "$part" 540 python3 benchmarks/gpu_bench.py \
             throughput --model "$(model_of "${part#tp2-throughput-}")" --tensor-parallel-size 2 --depths 2 ;;
    prefix-match-*) run "$part" 300 python3 benchmarks/prefix_match.py --model "$(model_of "${part#prefix-match-}")" --load-format dummy ;;
    *) echo "unknown part $part" ;;
  esac
done
# A tuned table's name holds ',' and '=', which do not come back from $OUT: a copy does,
# named with '_' (rename it to fused_moe.tuned_table_name's form to commit it).
for table in "$OUT"/moe_configs/*.json; do
  if [ -e "$table" ]; then cp "$table" "$OUT/moe_table_$(basename "$table" | tr ',=' '__')"; fi
done
for table in "$OUT"/fp8_gemm_configs/*.json; do
  if [ -e "$table" ]; then cp "$table" "$OUT/fp8_table_$(basename "$table" | tr ',=' '__')"; fi
done
