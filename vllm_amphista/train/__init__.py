"""Self-distillation pipeline for Amphista heads and the Medusa / EAGLE baselines.

    python -m vllm_amphista.train mix            # the prompt mix (Alpaca, GSM8K, constructed tasks, second turns)
    python -m vllm_amphista.train generate       # the target answers it through vLLM; hidden states and top-k captured
    python -m vllm_amphista.train export-tokens  # the answers' token ids alone, to keep or share
    python -m vllm_amphista.train fit            # train a drafter on the answers
    python -m vllm_amphista.train eval           # per-head accuracy of saved drafters

Modules: ``prompt_mix``, ``generate`` (vLLM), ``data`` (dataset shards),
``target`` (the frozen target's shared weights), ``batch`` (packing, labels,
objectives), ``drafter`` (the interface) with one module per drafter
(``amphista``, ``medusa``, ``eagle``) and ``methods`` (by name), ``fit``,
``evaluate``, ``cli``.
"""
