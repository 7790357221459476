"""amphista_kernels.small_m_gemm (the panel GEMM for decode-sized float32 batches) and the patch that
hands vLLM's float32 linears to it on CPU."""

import pytest
import torch

from amphista_kernels import small_m_gemm
from conftest import report_of, run_python

pytestmark = pytest.mark.skipif(not small_m_gemm.supported(), reason="the panel GEMM needs x86-64 with AVX2")

# (N, K): the demo target's projections, an lm_head-like width, and sizes that are no multiple of 16 or 8.
SHAPES = [(960, 576), (576, 1536), (4099, 576), (17, 37), (1, 5)]


@pytest.fixture(scope="module", autouse=True)
def built():
    small_m_gemm.load()


def reference(x, weight, bias=None):
    return torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_a_float64_linear(n, k):
    generator = torch.Generator().manual_seed(n * 31 + k)
    weight = torch.randn(n, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    packed = small_m_gemm.pack_panels(weight)
    for rows in (1, 2, 3, 5, 6, 7, 12, 16, 40):
        x = torch.randn(rows, k, generator=generator)
        for b in (None, bias):
            y = small_m_gemm.panel_linear(x, packed, n, b)
            assert y.shape == (rows, n) and y.is_contiguous()
            torch.testing.assert_close(y.double(), reference(x, weight, b), atol=1e-4 * k**0.5, rtol=1e-5)


def test_keeps_the_leading_dimensions():
    weight = torch.randn(48, 24)
    x = torch.randn(2, 3, 24)
    y = small_m_gemm.panel_linear(x, small_m_gemm.pack_panels(weight), 48)
    assert y.shape == (2, 3, 48)
    torch.testing.assert_close(y.double(), reference(x, weight), atol=1e-5, rtol=1e-5)


def test_a_row_gets_the_same_bits_whatever_else_is_in_the_batch():
    # What lets verification of K drafts reproduce plain decoding's one-row forward exactly.
    weight = torch.randn(960, 576)
    packed = small_m_gemm.pack_panels(weight)
    x = torch.randn(16, 576)
    alone = torch.cat([small_m_gemm.panel_linear(x[i : i + 1], packed, 960) for i in range(16)])
    for rows in (2, 5, 6, 7, 13, 16):
        assert torch.equal(small_m_gemm.panel_linear(x[:rows], packed, 960), alone[:rows])


def test_traced_by_torch_compile_with_a_dynamic_batch():
    weight = torch.randn(100, 64)
    packed = small_m_gemm.pack_panels(weight)
    compiled = torch.compile(lambda x: small_m_gemm.panel_linear(x, packed, 100), dynamic=True, fullgraph=True)
    for rows in (1, 3, 20):
        x = torch.randn(rows, 64)
        assert torch.equal(compiled(x), small_m_gemm.panel_linear(x, packed, 100))


def test_rejects_inputs_it_cannot_multiply():
    packed = small_m_gemm.pack_panels(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="features"):
        small_m_gemm.panel_linear(torch.randn(2, 9), packed, 32)
    with pytest.raises(RuntimeError, match="float32"):
        small_m_gemm.panel_linear(torch.randn(2, 8, dtype=torch.bfloat16), packed, 32)
    with pytest.raises(RuntimeError, match="n does not match"):
        small_m_gemm.panel_linear(torch.randn(2, 8), packed, 64)


# vLLM's CPU GEMM dispatch with the plugin loaded, as a worker loads it: float32 layers get the panel
# GEMM up to the row count timed on this CPU and vLLM's oneDNN GEMM above; other dtypes keep vLLM's.
DISPATCH_PROBE = """
import json
import torch
from vllm.plugins import load_general_plugins

if __name__ == "__main__":
    load_general_plugins()
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils
    from amphista_kernels import small_m_gemm
    from vllm_amphista.vllm import patches

    def layer_of(weight):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        return layer

    torch.manual_seed(0)
    weight = torch.randn(960, 576)
    layer = layer_of(weight)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    packed = small_m_gemm.pack_panels(weight)
    onednn = ops.create_onednn_mm(weight.t(), 32)
    report = {"patched": getattr(utils.dispatch_cpu_unquantized_gemm, "_vllm_amphista_patched", False),
              "weight_left": layer.weight.numel(), "max_rows": patches.panel_gemm_max_rows()}
    for rows in sorted({1, report["max_rows"], report["max_rows"] + 1, 64}):
        x = torch.randn(rows, 576)
        y = layer.cpu_linear(x, layer.weight, None)
        report[str(rows)] = {
            "panel": torch.equal(y, small_m_gemm.panel_linear(x, packed, 960)),
            "onednn": torch.equal(y, ops.onednn_mm(onednn, x, None)),
            "error": (y.double() - x.double() @ weight.double().t()).abs().max().item(),
        }
    bf16 = layer_of(weight.bfloat16())
    utils.dispatch_cpu_unquantized_gemm(bf16, remove_weight=False)
    x = torch.randn(3, 576, dtype=torch.bfloat16)
    report["bf16_dtype"] = str(bf16.cpu_linear(x, bf16.weight, None).dtype)
    print("REPORT=" + json.dumps(report))
"""


def test_vllms_float32_linears_take_the_panel_gemm_for_small_batches_only():
    report = report_of(run_python(DISPATCH_PROBE, timeout=300))
    assert report["patched"] and report["weight_left"] == 0
    assert 1 <= report["max_rows"] <= 16
    small, large = sorted({1, report["max_rows"]}), [report["max_rows"] + 1, 64]
    for rows in small:
        assert report[str(rows)]["panel"], rows
    for rows in large:
        assert report[str(rows)]["onednn"], rows
    for rows in small + large:
        assert report[str(rows)]["error"] < 1e-3
    assert report["bf16_dtype"] == "torch.bfloat16"


def test_the_panel_gemm_takes_the_rows_up_to_where_it_first_loses():
    panel = {2: 1.0, 4: 1.1, 6: 1.5, 8: 2.0, 10: 2.0}
    onednn = {2: 1.3, 4: 1.6, 6: 1.9, 8: 1.9, 10: 2.5}
    assert small_m_gemm.max_rows_where_faster(panel, onednn) == 6  # 10 wins again, past a loss: not taken
    assert small_m_gemm.max_rows_where_faster(panel, {rows: 0.5 for rows in panel}) == 1
    assert small_m_gemm.max_rows_where_faster(panel, {rows: 9.0 for rows in panel}) == 10


def test_the_switch_leaves_vllms_dispatch_alone():
    probe = """
import json
from vllm.plugins import load_general_plugins
if __name__ == "__main__":
    load_general_plugins()
    from vllm.model_executor.layers import utils
    print("REPORT=" + json.dumps({"patched": getattr(utils.dispatch_cpu_unquantized_gemm, "_vllm_amphista_patched", False)}))
"""
    report = report_of(run_python(probe, extra_env={"VLLM_AMPHISTA_SMALL_M_GEMM": "0"}, timeout=300))
    assert report == {"patched": False}


def test_without_a_compiler_vllms_gemms_stay():
    probe = """
import json
import torch
from vllm.plugins import load_general_plugins
if __name__ == "__main__":
    load_general_plugins()
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils
    from amphista_kernels import small_m_gemm

    def no_compiler():
        raise RuntimeError("g++: not found")

    small_m_gemm.load = no_compiler
    layer = torch.nn.Module()
    weight = torch.randn(64, 32)
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    x = torch.randn(3, 32)
    y = layer.cpu_linear(x, layer.weight, None)
    print("REPORT=" + json.dumps({"onednn": torch.equal(y, ops.onednn_mm(ops.create_onednn_mm(weight.t(), 32), x, None))}))
"""
    completed = run_python(probe, timeout=300)
    assert report_of(completed) == {"onednn": True}
    assert "did not build" in completed.stderr + completed.stdout
