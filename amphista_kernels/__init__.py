"""Triton kernels for the Amphista drafter; independent of vLLM and vllm_amphista."""

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
