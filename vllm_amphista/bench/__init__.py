"""The benchmark: every speculative method side by side in vLLM (`python -m vllm_amphista.bench --help`).

Modules: `engines` (engines in subprocesses, timing and counting), `report`
(figures, tables, plots), `cli` (the command).
"""
