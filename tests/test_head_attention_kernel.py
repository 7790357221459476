"""Tests for amphista_kernels.head_attention, runnable on a CPU-only machine.

How the Triton kernel runs without a GPU
----------------------------------------
Triton 3.9 picks interpreter or compiler when ``@triton.jit`` decorates the
kernel, i.e. when ``amphista_kernels.head_attention`` is first imported: it then
reads ``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``). The
interpreter copies every tensor argument's storage to the host, runs the grid
program by program with numpy and copies the results back, so the launcher
accepts CPU tensors as they are.

Because that choice is frozen at the first import, setting ``os.environ`` in
this module would be unreliable: another test module in the same pytest
process may already have imported the kernel module in compiled mode. So
every kernel launch happens in one fresh subprocess started with
``TRITON_INTERPRET=1``. This process builds all inputs and saves them with
``torch.save`` (strides included, so non-contiguous layouts survive); the
subprocess runs the kernel into NaN-poisoned ``out=`` buffers and saves the
outputs; every assertion runs here, against a float64 oracle that slices the
valid keys instead of masking them. The torch reference is held to the same
checks in this process.

The interpreter does not apply the NVIDIA backend's rules (tl.dot's minimum
shapes, for one), so the kernel is also compiled ahead of time to sm_80 and
sm_90 cubins, which needs triton's bundled ptxas but no GPU.

Finally, two subprocesses ask vLLM's CPU platform which attention backend,
model runner and kernel overrides it picks, once with triton (and this
package) imported and once with triton made unimportable; they must agree.
"""

import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from amphista_kernels import (
    bidirectional_head_attention,
    bidirectional_head_attention_reference,
    bidirectional_head_attention_triton,
)
from amphista_kernels import head_attention

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300
RELATIVE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclass(frozen=True)
class AttentionCall:
    """One set of inputs; ``num_valid`` is None, a list, or "random"."""

    batch: int
    positions: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    num_valid: object = None
    num_valid_dtype: torch.dtype = torch.int32
    non_contiguous: bool = False
    scale: float | None = None
    poison_out: bool = True


CALLS = {
    "b1_k1_d32_fp32": AttentionCall(1, 1, 2, 32, torch.float32),
    "b3_k5_d80_fp32_random_valid": AttentionCall(3, 5, 2, 80, torch.float32, "random"),
    "b257_k16_d64_fp32_random_valid": AttentionCall(257, 16, 1, 64, torch.float32, "random"),
    "b3_k16_d128_fp32_all_valid": AttentionCall(
        3, 16, 2, 128, torch.float32, [16] * 3, num_valid_dtype=torch.int64),
    "b3_k5_d96_fp32_one_valid": AttentionCall(3, 5, 2, 96, torch.float32, [1] * 3),
    "b3_k5_d64_fp32_out_of_range_valid": AttentionCall(3, 5, 2, 64, torch.float32, [8, -2, 0]),
    "b3_k5_d64_fp32_non_contiguous": AttentionCall(
        3, 5, 2, 64, torch.float32, "random", non_contiguous=True),
    "b3_k5_d64_fp32_custom_scale": AttentionCall(3, 5, 2, 64, torch.float32, scale=0.3),
    "b3_k5_d64_fp32_allocated_out": AttentionCall(
        3, 5, 2, 64, torch.float32, "random", poison_out=False),
    "b0_k5_d64_fp32": AttentionCall(0, 5, 2, 64, torch.float32, []),
    "b1_k1_d128_bf16": AttentionCall(1, 1, 2, 128, torch.bfloat16),
    "b3_k5_d32_bf16_random_valid": AttentionCall(3, 5, 2, 32, torch.bfloat16, "random"),
    "b257_k5_d80_bf16": AttentionCall(257, 5, 1, 80, torch.bfloat16),
    "b3_k16_d96_bf16_one_valid": AttentionCall(3, 16, 2, 96, torch.bfloat16, [1] * 3),
    "b3_k5_d64_fp16_random_valid": AttentionCall(3, 5, 3, 64, torch.float16, "random"),
    "b257_k1_d128_fp16_all_valid": AttentionCall(257, 1, 1, 128, torch.float16, [1] * 257),
    "b1_k16_d80_fp16_non_contiguous": AttentionCall(
        1, 16, 2, 80, torch.float16, non_contiguous=True),
}


def make_inputs(call: AttentionCall, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    shape = (call.batch, call.positions, call.heads, call.head_dim)

    def random_tensor():
        if call.non_contiguous:
            # A [B, H, K, D] buffer viewed as [B, K, H, D], so the K and H
            # strides are swapped relative to the contiguous layout.
            permuted = torch.randn(shape[0], shape[2], shape[1], shape[3], generator=generator)
            return permuted.to(call.dtype).transpose(1, 2)
        return torch.randn(shape, generator=generator).to(call.dtype)

    if call.num_valid is None:
        num_valid = None
    elif call.num_valid == "random":
        # Includes 0 (no valid key) and K (all valid).
        num_valid = torch.randint(0, call.positions + 1, (call.batch,), generator=generator)
    else:
        num_valid = torch.tensor(call.num_valid)
    if num_valid is not None:
        num_valid = num_valid.to(call.num_valid_dtype)
        if call.non_contiguous:
            num_valid = torch.stack([num_valid, num_valid], dim=1)[:, 0]

    inputs = {"q": random_tensor(), "k": random_tensor(), "v": random_tensor(),
              "num_valid": num_valid, "scale": call.scale, "poison_out": call.poison_out}
    if call.non_contiguous:
        assert not inputs["q"].is_contiguous()
    return inputs


def all_inputs() -> dict:
    inputs = {name: make_inputs(call, seed) for seed, (name, call) in enumerate(CALLS.items())}

    # Cross-request leakage: only request 1's keys and values change.
    base = make_inputs(AttentionCall(3, 5, 2, 64, torch.float32, [5, 3, 4]), seed=1000)
    generator = torch.Generator().manual_seed(1001)
    other_request_changed = dict(base)
    for name in ("k", "v"):
        other_request_changed[name] = base[name].clone()
        other_request_changed[name][1] = torch.randn(base[name][1].shape, generator=generator)
    # Masking: only keys and values at positions >= num_valid change.
    masked_keys_changed = dict(base)
    for name in ("k", "v"):
        masked_keys_changed[name] = base[name].clone()
        masked_keys_changed[name][1, 3:] = 1e4
        masked_keys_changed[name][2, 4:] = -1e4
    inputs.update(isolation_base=base, other_request_changed=other_request_changed,
                  masked_keys_changed=masked_keys_changed)
    return inputs


INPUTS = all_inputs()


def float64_oracle(q, k, v, num_valid, scale):
    """Attention over only the valid keys of each request, in float64."""
    batch, positions, _, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float64)
    for request in range(batch):
        valid = positions if num_valid is None else min(max(int(num_valid[request]), 0), positions)
        if valid == 0:
            continue
        queries = q[request].double().transpose(0, 1)          # [H, K, D]
        keys = k[request, :valid].double().transpose(0, 1)     # [H, valid, D]
        values = v[request, :valid].double().transpose(0, 1)   # [H, valid, D]
        probabilities = torch.softmax(scale * queries @ keys.transpose(1, 2), dim=-1)
        out[request] = (probabilities @ values).transpose(0, 1)
    return out


def valid_query_rows(inputs) -> torch.Tensor:
    """[B, K] bool: query positions whose output is specified."""
    batch, positions = inputs["q"].shape[:2]
    if inputs["num_valid"] is None:
        return torch.ones(batch, positions, dtype=torch.bool)
    return torch.arange(positions)[None, :] < inputs["num_valid"][:, None]


@functools.cache
def expected_output(name) -> torch.Tensor:
    inputs = INPUTS[name]
    return float64_oracle(
        inputs["q"], inputs["k"], inputs["v"], inputs["num_valid"], inputs["scale"])


def assert_matches_oracle(out, name):
    """Fails on any NaN/inf anywhere (an unwritten poisoned element shows up
    here), on a dtype or shape change, and on a relative error above the
    dtype's tolerance over the specified rows."""
    inputs = INPUTS[name]
    q = inputs["q"]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum()} non-finite outputs"
    expected = expected_output(name)
    rows = valid_query_rows(inputs)
    if inputs["num_valid"] is not None:
        no_valid_key = inputs["num_valid"] <= 0
        assert (out[no_valid_key] == 0).all(), "requests without valid keys must be zeros"
    if not rows.any():
        return
    error = (out[rows].double() - expected[rows]).norm() / expected[rows].norm()
    assert error <= RELATIVE_TOLERANCE[q.dtype], f"relative error {error:.3e}"


def run_reference(inputs, batched_matmul: bool = True) -> torch.Tensor:
    return bidirectional_head_attention_reference(
        inputs["q"], inputs["k"], inputs["v"], inputs["num_valid"], inputs["scale"], batched_matmul)


INTERPRETER_WORKER = textwrap.dedent("""
    import sys
    import torch
    from amphista_kernels import head_attention

    inputs = torch.load(sys.argv[1])
    outputs = {}
    for name, call in inputs.items():
        args = (call["q"], call["k"], call["v"], call["num_valid"], call["scale"])
        if call["poison_out"]:
            out = torch.full_like(call["q"], float("nan"))
            head_attention.bidirectional_head_attention_triton(*args, out=out)
        else:
            out = head_attention.bidirectional_head_attention_triton(*args)
        outputs[name] = {"out": out, "q_stride": call["q"].stride()}
    torch.save({"interpreted": head_attention._KERNEL_IS_INTERPRETED, "outputs": outputs},
               sys.argv[2])
""")


def subprocess_env(**extra) -> dict:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def interpreter_outputs(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("triton_interpreter")
    inputs_path, outputs_path = workdir / "inputs.pt", workdir / "outputs.pt"
    torch.save(INPUTS, inputs_path)
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETER_WORKER, str(inputs_path), str(outputs_path)],
        env=subprocess_env(TRITON_INTERPRET="1"), cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    saved = torch.load(outputs_path)
    assert saved["interpreted"], "the subprocess did not run the kernel in the interpreter"
    for name, inputs in INPUTS.items():
        assert saved["outputs"][name]["q_stride"] == inputs["q"].stride()
    return {name: saved["outputs"][name]["out"] for name in INPUTS}


@pytest.fixture(scope="module", params=["torch_reference", "torch_reference_broadcast", "triton_interpreter"])
def outputs(request) -> dict:
    if request.param == "triton_interpreter":
        return request.getfixturevalue("interpreter_outputs")
    batched_matmul = request.param == "torch_reference"
    return {name: run_reference(inputs, batched_matmul) for name, inputs in INPUTS.items()}


@pytest.mark.parametrize("name", CALLS)
def test_matches_float64_oracle(outputs, name):
    assert_matches_oracle(outputs[name], name)


def test_requests_do_not_leak_into_each_other(outputs):
    base, changed = outputs["isolation_base"], outputs["other_request_changed"]
    assert torch.equal(base[[0, 2]], changed[[0, 2]])
    assert not torch.allclose(base[1], changed[1]), "the change must be visible in request 1"
    assert_matches_oracle(changed, "other_request_changed")


def test_masked_keys_do_not_change_any_output(outputs):
    assert torch.equal(outputs["isolation_base"], outputs["masked_keys_changed"])


def test_oracle_comparison_rejects_nan():
    name = "b3_k5_d64_fp32_out_of_range_valid"
    for position in [(0, 0, 0, 0), (2, 4, 1, 63)]:  # a specified row, an unspecified one
        out = run_reference(INPUTS[name])
        out[position] = float("nan")
        with pytest.raises(AssertionError):
            assert_matches_oracle(out, name)


def test_dispatch_runs_the_reference_on_cpu():
    inputs = INPUTS["b3_k5_d80_fp32_random_valid"]
    out = bidirectional_head_attention(
        inputs["q"], inputs["k"], inputs["v"], inputs["num_valid"], inputs["scale"])
    assert torch.equal(out, run_reference(inputs))


@pytest.mark.skipif(head_attention._KERNEL_IS_INTERPRETED,
                    reason="the kernel was imported in interpreter mode")
def test_compiled_kernel_refuses_cpu_tensors():
    q = torch.randn(2, 4, 2, 64)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        bidirectional_head_attention_triton(q, q, q)


@pytest.mark.skipif(head_attention._KERNEL_IS_INTERPRETED,
                    reason="the kernel was imported in interpreter mode")
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_kernel_compiles_for_nvidia_gpus(dtype, arch):
    """The interpreter skips the NVIDIA backend's checks (tl.dot's minimum
    shapes, for one), so also compile ahead of time down to a cubin, with the
    block sizes the launcher would use. Needs no GPU, only triton's bundled
    ptxas. Strides are plain i32 here; at launch triton may specialise some."""
    kernel = head_attention._bidirectional_head_attention_kernel
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update({name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")})
    signature.update(num_valid_ptr="*i64", scale="fp32", HAS_NUM_VALID="constexpr",
                     BLOCK_K="constexpr", BLOCK_D="constexpr")
    for positions, head_dim in [(1, 80), (16, 128)]:
        block_k, block_d = head_attention._block_sizes(positions, head_dim)
        source = ASTSource(kernel, signature, constexprs={
            "HAS_NUM_VALID": True, "BLOCK_K": block_k, "BLOCK_D": block_d})
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options={"enable_fp_fusion": True})  # as the launcher
        assert compiled.asm["cubin"]


def qkv(batch=2, positions=4, heads=2, head_dim=64, dtype=torch.float32, device="cpu"):
    return torch.randn(batch, positions, heads, head_dim, dtype=dtype, device=device)


BAD_INPUTS = {
    "q_rank_3": (lambda: (qkv()[0], qkv(), qkv(), None), "4-D"),
    "k_shape_mismatch": (lambda: (qkv(), qkv(positions=5), qkv(), None), "same .* shape"),
    "v_shape_mismatch": (lambda: (qkv(), qkv(), qkv(heads=3), None), "same .* shape"),
    "dtype_mismatch": (lambda: (qkv(), qkv(dtype=torch.float16), qkv(), None), "same dtype"),
    "float64": (lambda: (qkv(dtype=torch.float64),) * 3 + (None,), "unsupported dtype"),
    "int8": (lambda: (torch.zeros(2, 4, 2, 64, dtype=torch.int8),) * 3 + (None,),
             "unsupported dtype"),
    "head_dim_48": (lambda: (qkv(head_dim=48),) * 3 + (None,), "head dim D=48"),
    "head_dim_256": (lambda: (qkv(head_dim=256),) * 3 + (None,), "head dim D=256"),
    "zero_positions": (lambda: (qkv(positions=0),) * 3 + (None,), "K=0"),
    "17_positions": (lambda: (qkv(positions=17),) * 3 + (None,), "K=17"),
    "devices_differ": (lambda: (qkv(), qkv(device="meta"), qkv(), None), "same device"),
    "num_valid_not_tensor": (lambda: (qkv(),) * 3 + ([4, 4],), "num_valid must be a torch"),
    "num_valid_too_long": (lambda: (qkv(),) * 3 + (torch.tensor([4, 4, 4]),), r"shape \[B\]"),
    "num_valid_2d": (lambda: (qkv(),) * 3 + (torch.tensor([[4], [4]]),), r"shape \[B\]"),
    "num_valid_float": (lambda: (qkv(),) * 3 + (torch.tensor([4.0, 4.0]),), "int32 or int64"),
    "num_valid_bool": (lambda: (qkv(),) * 3 + (torch.tensor([True, True]),), "int32 or int64"),
    "num_valid_other_device": (
        lambda: (qkv(),) * 3 + (torch.tensor([4, 4], device="meta"),), "num_valid is on meta"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
@pytest.mark.parametrize("entry_point", [
    bidirectional_head_attention,
    bidirectional_head_attention_reference,
    bidirectional_head_attention_triton,
])
def test_bad_inputs_raise_value_error(entry_point, name):
    make_args, message = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=message):
        entry_point(*make_args())


def test_bad_scale_raises_value_error():
    with pytest.raises(ValueError, match="scale must be a finite number"):
        bidirectional_head_attention(qkv(), qkv(), qkv(), scale=float("nan"))


def test_bad_out_raises_value_error():
    with pytest.raises(ValueError, match="out must be a tensor with q's"):
        bidirectional_head_attention_triton(qkv(), qkv(), qkv(), out=qkv(heads=3))


VLLM_BACKEND_PROBE = textwrap.dedent("""
    import json
    import sys

    if sys.argv[1] == "without_triton":
        # A None entry makes `import triton` fail and
        # importlib.util.find_spec("triton") return None, which is how vLLM
        # decides whether triton is installed.
        sys.modules["triton"] = None
    else:
        import amphista_kernels  # noqa: F401  (imports triton before vLLM, as the plugin will)

    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils import dispatcher
    from vllm.v1.attention.selector import get_attn_backend

    config = VllmConfig()
    with set_current_vllm_config(config):
        attention_backends = {}
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for head_size in (64, 128):
                backend = get_attn_backend(head_size, dtype, "auto")
                attention_backends[f"{dtype}, D={head_size}"] = (
                    f"{backend.__module__}.{backend.__qualname__}")
        use_v2_model_runner = config.use_v2_model_runner

    # What the worker does at start-up: with triton unusable, vLLM swaps its
    # own Triton kernels for C++ ones. The registry is private; it is the
    # only record of which kernels were swapped.
    current_platform.register_triton_kernel_overrides()
    kernel_types = {
        name: type(getattr(*dispatcher._resolve_kernel(name))).__name__
        for name in dispatcher._registry
    }
    print(json.dumps({
        "triton_imported": sys.modules.get("triton") is not None,
        "platform": type(current_platform).__name__,
        "has_triton": HAS_TRITON,
        "attention_backends": attention_backends,
        "use_v2_model_runner": use_v2_model_runner,
        "engine_kernel_types": kernel_types,
    }))
""")


def vllm_engine_selection(triton_mode: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", VLLM_BACKEND_PROBE, triton_mode],
        env=subprocess_env(), cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_triton_does_not_change_vllm_cpu_engine_kernels():
    """vLLM's CPU platform must select the same attention backend, model runner
    and kernel overrides whether or not triton (and this package) is importable."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    with_triton = vllm_engine_selection("with_triton")
    without_triton = vllm_engine_selection("without_triton")

    assert with_triton.pop("triton_imported") is True
    assert without_triton.pop("triton_imported") is False
    assert with_triton == without_triton
    assert with_triton["platform"] == "CpuPlatform"
    assert set(with_triton["attention_backends"].values()) == {
        "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"}


@pytest.mark.parametrize("with_num_valid", [False, True])
def test_custom_op_is_sound_for_compiled_graphs(with_num_valid):
    """torch.library.opcheck: the op's fake tensor (what compiled graphs plan with) matches what it
    returns, strides included, and it survives torch.compile."""
    q, k, v = (torch.randn(3, 4, 9, 64).transpose(1, 2).contiguous().transpose(1, 2) for _ in range(3))
    num_valid = torch.tensor([4, 2, 0]) if with_num_valid else None
    torch.library.opcheck(head_attention._head_attention_op, (q, k, v, num_valid, 0.125))
    compiled = torch.compile(lambda a, b, c: bidirectional_head_attention(a, b, c, num_valid, 0.125) * 2,
                             fullgraph=True)
    assert torch.allclose(compiled(q, k, v), bidirectional_head_attention_reference(q, k, v, num_valid, 0.125) * 2,
                          atol=1e-5)
