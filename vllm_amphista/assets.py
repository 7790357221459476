"""Where the shipped heads and the project's default data live, named once.

The defaults for data outside the package (the demo target, the Spec-Bench
questions) are this project's layout, relative to the repo root; every command
takes another path.
"""

import os

SHIPPED_HEADS_ROOT = os.path.join(os.path.dirname(__file__), "heads")
# The heads for the demo target, and the baselines trained for it (for the benchmark).
SHIPPED_HEADS = os.path.join(SHIPPED_HEADS_ROOT, "smollm2-135m-instruct")
SHIPPED_MEDUSA_HEADS = os.path.join(SHIPPED_HEADS_ROOT, "smollm2-135m-instruct-medusa")
SHIPPED_EAGLE_HEADS = os.path.join(SHIPPED_HEADS_ROOT, "smollm2-135m-instruct-eagle")
# The Medusa baseline ships without the target's lm_head; `demo_target` joins them.
MEDUSA_BLOCKS_FILE = "medusa_blocks.safetensors"

DEMO_TARGET = os.path.join("models", "SmolLM2-135M-Instruct")
SPEC_BENCH_QUESTIONS = os.path.join("..", "shared", "data", "eval", "spec_bench_question.jsonl")
MT_BENCH_QUESTIONS = os.path.join("..", "shared", "data", "eval", "mt_bench_question.jsonl")
