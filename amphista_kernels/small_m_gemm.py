"""float32 linears for decode-sized batches on AVX2 CPUs (`small_m_gemm.cpp`), built on first use.

`load()` compiles the C++ once per machine (torch's extension cache, ~30 s) and registers the ops
`torch.ops.amphista_kernels.pack_panels` and `.panel_linear`, with shape functions so that
`torch.compile` traces them.
"""

from __future__ import annotations

import functools
import os
import platform

import torch

SOURCE = os.path.join(os.path.dirname(__file__), "small_m_gemm.cpp")


def supported() -> bool:
    """The kernel needs x86-64 with AVX2 and FMA (torch reports AVX2 or better)."""
    return platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2",
        "AVX512",
    )


@functools.cache
def load() -> None:
    from torch.utils.cpp_extension import load as build

    build(
        name="amphista_small_m_gemm",
        sources=[SOURCE],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )

    @torch.library.register_fake("amphista_kernels::pack_panels")
    def _(weight):
        return weight.new_empty((-(-weight.shape[0] // 16), weight.shape[1], 16))

    @torch.library.register_fake("amphista_kernels::panel_linear")
    def _(x, packed, bias, n, max_rows, large_op, large_state):
        return x.new_empty((*x.shape[:-1], n))


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    load()
    return torch.ops.amphista_kernels.pack_panels(weight)


def panel_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    max_rows: int = 2**62,
    large_op: str = "",
    large_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W.T (+ bias) for W packed by `pack_panels`; batches of more than `max_rows` rows go to
    `large_op(out, x, bias, large_state)`, any registered out-variant linear."""
    state = large_state if large_state is not None else packed
    return torch.ops.amphista_kernels.panel_linear(x, packed, bias, n, max_rows, large_op, state)


def max_rows_where_faster(panel_seconds: dict[int, float], other_seconds: dict[int, float]) -> int:
    """The most rows up to which the panel GEMM was never slower than another GEMM at the row counts
    timed; at least 1: one row streams the weights at the memory's pace on every AVX2 CPU seen."""
    max_rows = 1
    for rows in sorted(panel_seconds):
        if panel_seconds[rows] > other_seconds[rows]:
            break
        max_rows = max(max_rows, rows)
    return max_rows
