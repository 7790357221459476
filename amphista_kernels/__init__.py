"""Kernels, independent of vLLM and vllm_amphista: the Triton kernel for the Amphista drafter's
head attention, and `small_m_gemm` (CPU, float32 linears of a few rows; imported on its own, it
compiles on first use)."""

from amphista_kernels.head_attention import (
    bidirectional_head_attention,
    bidirectional_head_attention_reference,
    bidirectional_head_attention_triton,
)

__all__ = [
    "bidirectional_head_attention",
    "bidirectional_head_attention_reference",
    "bidirectional_head_attention_triton",
]
