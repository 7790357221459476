#!/bin/bash
# Adapting the heads to served traffic, on a domain they never saw (this Python's standard library,
# "complete this function", split by module into a served half and a test half):
#   1. serve the served half with `vllm serve` + recording on, driven by `vllm bench serve`;
#   2. `train adapt` the shipped heads on the recording (timed);
#   3. the test half in float32, concurrency 1: shipped against adapted heads, amphista and the hybrid;
#   4. Spec-Bench first turns by replay: what the adapted heads forgot.
#
#   scripts/adapt_proof.sh [WORK_DIR]     (default .cache/adapt-proof)
#
# Each step is skipped when its output exists, and `adapt` resumes, so a stopped run goes on.
# Heavy: run it alone on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-.cache/adapt-proof}
py=.venv/bin/python
vllm=.venv/bin/vllm
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
target=$($py -c "from vllm_amphista.assets import DEMO_TARGET; print(DEMO_TARGET)")
heads=$($py -c "from vllm_amphista.assets import SHIPPED_HEADS; print(SHIPPED_HEADS)")
dtype=$($py -c "from vllm_amphista.cpu_dtype import choose_cpu_dtype; print(choose_cpu_dtype().dtype)")
spec_bench=$($py -c "from vllm_amphista.assets import SPEC_BENCH_QUESTIONS; print(SPEC_BENCH_QUESTIONS)")
answers=data/answers/smollm2-135m-instruct/first
mkdir -p "$work"
log() { echo "[$(date -u +%H:%M:%S)] $*"; }

[ -f "$work/prompts/served.jsonl" ] || $py -m vllm_amphista.train stdlib-prompts --out-dir "$work/prompts"
served=$(wc -l < "$work/prompts/served.jsonl")

if [ ! -f "$work/served.json" ]; then
    log "1. serving $served prompts with recording on"
    rm -rf "$work/recording"
    port=$($py -c "from vllm_amphista.bench.serve import free_port; print(free_port())")
    config="{\"method\": \"amphista\", \"model\": \"$heads\", \"num_speculative_tokens\": 4, \"record_traffic\": \"$work/recording\"}"
    $vllm serve "$target" --host 127.0.0.1 --port "$port" --dtype "$dtype" --max-model-len 2048 --max-num-seqs 8 \
        --speculative-config "$config" > "$work/serve.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
        kill -0 $server || { log "the server died: $work/serve.log"; exit 1; }
        sleep 3
    done
    $vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --host 127.0.0.1 --port "$port" \
        --model "$target" --dataset-name spec_bench --dataset-path "$work/prompts/served.jsonl" \
        --spec-bench-output-len 256 --num-prompts "$served" --max-concurrency 8 --temperature 0 --seed 0 \
        --save-result --result-dir "$work" --result-filename served.json.partial
    kill $server; wait $server || true
    trap - EXIT
    mv "$work/served.json.partial" "$work/served.json"
fi
log "recorded: $(cat "$work"/recording/traffic-*.jsonl | wc -l) requests"

# The data the shipped heads learned from (the first 2,048 answers), mixed in so they keep it.
if [ ! -f "$work/original/shard_00007.jsonl" ]; then
    log "features of the original data"
    mkdir -p "$work/original-answers"
    for shard in 0 1 2 3 4 5 6 7; do
        name=$(printf "shard_%05d.npz" $shard)
        ln -sf "$PWD/$answers/$name" "$work/original-answers/$name"
    done
    $py -m vllm_amphista.train features --target "$target" --answers "$work/original-answers" \
        --out "$work/original" --dtype "$dtype"
fi

if [ ! -f "$work/adapted-heads/config.json" ]; then
    log "2. adapt"
    started=$(date +%s)
    $py -m vllm_amphista.train adapt --target "$target" --recording "$work/recording" --heads "$heads" \
        --original-data "$work/original" --out "$work/adapted-heads" --work-dir "$work/adapt"
    log "adapt took $(( $(date +%s) - started )) s (this run; a resumed one took more in total)"
fi

test_bench() {  # $1: name, $2: heads dir
    [ -f "$work/test-$1/results.json" ] && return 0
    log "3. test half, float32, concurrency 1, $1 heads"
    $py -m vllm_amphista.bench --target "$target" --heads "$2" --questions "$work/prompts/test.jsonl" \
        --methods vanilla,amphista,amphista_anpd --per-category 30 --max-tokens 128 --concurrency 1 \
        --repeats 1 --dtype float32 --out "$work/test-$1"
}
test_bench shipped "$heads"
test_bench adapted "$work/adapted-heads"

if [ ! -f "$work/spec-bench-replay.log" ]; then
    log "4. Spec-Bench replay"
    $py -m vllm_amphista.train eval --target "$target" --heads "$heads" "$work/adapted-heads" \
        --questions "$spec_bench" --max-tokens 128 > "$work/spec-bench-replay.log.partial" 2>&1
    mv "$work/spec-bench-replay.log.partial" "$work/spec-bench-replay.log"
fi
log "done: $work/test-shipped/results.md, $work/test-adapted/results.md, $work/spec-bench-replay.log"
