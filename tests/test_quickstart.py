"""`make demo`'s script on the demo target (slow: six engines): every method gets a row, and in
float32 every method prints the plain answers."""

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, VLLM_CPU_TEST_ENV

pytestmark = pytest.mark.slow

DEMO_TARGET = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"


def test_quickstart_table_in_float32():
    if not (DEMO_TARGET / "model.safetensors").is_file():
        pytest.skip("demo target not built (make target)")
    env = {key: value for key, value in {**os.environ, **VLLM_CPU_TEST_ENV}.items()
           if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # the demo runs vLLM's default engine core
    completed = subprocess.run([sys.executable, "examples/quickstart.py", "--target", str(DEMO_TARGET),
                                "--max-tokens", "32", "--dtype", "float32"],
                               cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    table = completed.stdout.split("=== speed")[1]
    for method in ("vanilla", "ngram", "anpd", "amphista", "amphista_anpd"):
        row = next(line for line in table.splitlines() if line.split() and line.split()[0] == method)
        assert row.split()[1] == "float32" and row.endswith("4/4"), row
    assert "vanilla (bfloat16, vLLM's default)" in table
