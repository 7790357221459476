"""Self-distillation pipeline for Amphista heads and the Medusa / EAGLE baselines.

    python -m vllm_amphista.train generate  # the target answers prompts (vLLM)
    python -m vllm_amphista.train fit       # train a drafter on those answers
    python -m vllm_amphista.train eval      # per-head accuracy of saved drafters

Modules: ``data`` (prompt and sample files), ``generate`` (vLLM), ``target``
(frozen target and hidden-state cache), ``heads`` (the three drafters and
their vLLM formats), ``fit``, ``evaluate``, ``cli``.
"""
