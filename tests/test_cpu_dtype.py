"""The dtype chooser and the emulated-bf16 warning text, on given CPU flags (no vLLM)."""

import pytest

from vllm_amphista.cpu_dtype import (FLAGS_OVERRIDE, choose_cpu_dtype, cpu_flags, emulated_bf16_warning,
                                     has_native_units, isa_cap_aborts_bf16_engine)

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512_BF16 = AVX2_ONLY | {"avx512f", "avx512_bf16"}
AMX = AVX2_ONLY | {"avx512f", "amx_bf16", "amx_tile"}


def test_float32_where_bf16_is_emulated_and_bf16_where_native():
    assert choose_cpu_dtype(AVX2_ONLY, environ={}, on_gpu=True).dtype == "bfloat16"
    choice = choose_cpu_dtype(AVX2_ONLY, environ={}, on_gpu=False)
    assert choice.dtype == "float32" and "emulated" in choice.reason
    assert choice.describe().startswith("CPU flags: avx2; fastest dtype here: float32")
    for flags, native in ((AVX512_BF16, "avx512_bf16"), (AMX, "amx_bf16")):
        choice = choose_cpu_dtype(flags, environ={}, on_gpu=False)
        assert choice.dtype == "bfloat16" and native in choice.reason and native in choice.describe()


@pytest.mark.parametrize("cap", [{"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"ATEN_CPU_CAPABILITY": "avx2"}])
def test_an_isa_cap_below_avx512_counts_as_emulated(cap):
    choice = choose_cpu_dtype(AVX512_BF16, environ=cap, on_gpu=False)
    assert choice.dtype == "float32" and next(iter(cap)) in choice.reason
    assert not has_native_units("bfloat16", AVX512_BF16, cap)
    assert has_native_units("bfloat16", AVX512_BF16, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"})


def test_warning_only_for_16_bit_dtypes_the_cpu_emulates():
    warning = emulated_bf16_warning("amphista", "bfloat16", AVX2_ONLY, environ={})
    assert "'amphista'" in warning and "float32" in warning and "draft" in warning
    assert emulated_bf16_warning("anpd", "float16", AVX512_BF16, environ={}) is not None  # no fp16 units
    assert emulated_bf16_warning("anpd", "float32", AVX2_ONLY, environ={}) is None
    assert emulated_bf16_warning("anpd", "bfloat16", AVX512_BF16, environ={}) is None
    assert emulated_bf16_warning("anpd", "float16", AVX2_ONLY | {"avx512_fp16"}, environ={}) is None


def test_cpu_flags_reads_the_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512_bf16\n\n")
    assert cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_flags_override_stands_in_for_cpuinfo_everywhere(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    override = {FLAGS_OVERRIDE: " avx2  fma "}
    assert cpu_flags(str(cpuinfo), environ=override) == {"avx2", "fma"}
    assert cpu_flags(str(cpuinfo), environ={}) >= {"amx_bf16", "avx512_bf16"}
    # The chooser and the warning read the override when no flags are given, as the plugin calls them.
    assert choose_cpu_dtype(environ=override, on_gpu=False).dtype == "float32"
    assert emulated_bf16_warning("anpd", "bfloat16", environ=override) is not None
    assert emulated_bf16_warning("anpd", "bfloat16", environ={FLAGS_OVERRIDE: "avx2 avx512_bf16"}) is None


def test_a_onednn_cap_below_amx_is_flagged_only_on_amx_cpus():
    assert isa_cap_aborts_bf16_engine(AMX, {"ONEDNN_MAX_CPU_ISA": "AVX2"}) == "ONEDNN_MAX_CPU_ISA=AVX2"
    assert isa_cap_aborts_bf16_engine(AMX, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}) is not None
    assert isa_cap_aborts_bf16_engine(AMX, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}) is None
    assert isa_cap_aborts_bf16_engine(AMX, {}) is None
    assert isa_cap_aborts_bf16_engine(AVX512_BF16, {"ONEDNN_MAX_CPU_ISA": "AVX2"}) is None
