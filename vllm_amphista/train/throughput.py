"""How close a pipeline stage runs to this machine's GEMM roofline.

A stage's FLOP/s is its tokens/s times the target's FLOPs per token; the roofline is
what a float32 GEMM reaches here at the target's own shapes, measured in the same
command (so the ratio holds on any CPU, whatever its ISA).
"""

from __future__ import annotations

import time

import torch
from transformers import PretrainedConfig


def target_flops_per_token(config: PretrainedConfig, with_logits: bool = True) -> float:
    """Forward FLOPs per token of a Llama-like target (2 per multiply-add; attention scores left
    out: at these context lengths they are a few percent)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * config.intermediate_size
    return 2.0 * (layers * per_layer + (hidden * config.vocab_size if with_logits else 0))


def _flops_per_second(run, flops: float, seconds: float) -> float:
    run()  # warm-up
    runs, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        run()
        runs += 1
    return flops * runs / elapsed


def matmul_flops_per_second(config: PretrainedConfig, tokens: int = 512, seconds: float = 1.5,
                            dtype: torch.dtype = torch.float32) -> float:
    """GEMM throughput in `dtype` here at the target's MLP shapes ([tokens, H] x [H, I]): the better
    of torch.matmul (MKL's sgemm, which takes slow paths on some AMD CPUs; oneDNN for bf16) and a
    oneDNN linear (the library vLLM-CPU's linears call), where torch was built with oneDNN."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    activations = torch.randn(tokens, hidden, dtype=dtype)
    linear = torch.nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
    flops = 2.0 * tokens * hidden * intermediate
    with torch.no_grad():
        best = _flops_per_second(lambda: torch.matmul(activations, linear.weight.t()), flops, seconds)
        if dtype == torch.float32 and torch.backends.mkldnn.is_available():
            from torch.utils import mkldnn

            onednn_linear, onednn_activations = mkldnn.to_mkldnn(linear), activations.to_mkldnn()
            best = max(best, _flops_per_second(lambda: onednn_linear(onednn_activations), flops, seconds))
    return best


def roofline_line(stage: str, tokens_per_second: float, flops_per_token: float, roofline: float,
                  dtype_name: str = "float32") -> str:
    achieved = tokens_per_second * flops_per_token
    return (f"{stage}: {tokens_per_second:.0f} tokens/s x {flops_per_token / 1e6:.0f} MFLOP/token = "
            f"{achieved / 1e9:.1f} GFLOP/s, {100 * achieved / roofline:.0f}% of this machine's {dtype_name} "
            f"GEMM roofline ({roofline / 1e9:.1f} GFLOP/s at the target's shapes, {torch.get_num_threads()} threads)")
