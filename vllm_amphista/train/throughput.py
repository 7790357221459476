"""How close a pipeline stage runs to this machine's GEMM roofline.

A stage's FLOP/s is its tokens/s times the target's FLOPs per token; the roofline is
what torch's matmul reaches here at the target's own shapes, measured in the same
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


def matmul_flops_per_second(config: PretrainedConfig, tokens: int = 512, dtype: torch.dtype = torch.float32,
                            seconds: float = 2.0) -> float:
    """torch's matmul throughput here at the target's MLP shapes ([tokens, H] x [H, I])."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    activations = torch.randn(tokens, hidden, dtype=dtype)
    weight = torch.randn(hidden, intermediate, dtype=dtype)
    torch.matmul(activations, weight)  # warm-up
    runs, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        torch.matmul(activations, weight)
        runs += 1
    return 2.0 * tokens * hidden * intermediate * runs / elapsed


def roofline_line(stage: str, tokens_per_second: float, flops_per_token: float, roofline: float) -> str:
    achieved = tokens_per_second * flops_per_token
    return (f"{stage}: {tokens_per_second:.0f} tokens/s x {flops_per_token / 1e6:.0f} MFLOP/token = "
            f"{achieved / 1e9:.1f} GFLOP/s, {100 * achieved / roofline:.0f}% of this machine's float32 matmul "
            f"roofline ({roofline / 1e9:.1f} GFLOP/s at the target's shapes, {torch.get_num_threads()} threads)")
