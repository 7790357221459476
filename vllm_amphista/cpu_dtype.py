"""Which dtype a CPU decodes fastest in: bfloat16 only where the CPU computes it natively.

vLLM-CPU picks bfloat16 on every x86 CPU. Where the CPU has no bf16 units (no
`avx512_bf16`, no AMX), oneDNN falls back to torch's linear, which converts
to float32 and back around every GEMM: a bf16 forward is then compute bound
even for one token, verifying K+1 tokens costs nearly K+1 times one, and no
drafter can pay (BENCHMARKS.md 7a: 2.7x for 5 tokens in bf16, 1.19x in
float32, on an AVX2-only EPYC). float32 is also the dtype in which greedy
speculative output equals plain output token for token.

oneDNN and torch can be capped below what the CPU has (`ONEDNN_MAX_CPU_ISA`,
`ATEN_CPU_CAPABILITY`); a cap below AVX-512 means bf16 is emulated there too.
Such a cap is no way to imitate another CPU under a live bf16 vLLM engine: on
an AMX CPU vLLM-CPU packs small weights for AMX from the CPU's own flags and
then asks the capped oneDNN for an AMX kernel, and the engine aborts
(`isa_cap_aborts_bf16_engine`). To see what this module tells another CPU,
set `VLLM_AMPHISTA_CPU_FLAGS` to that CPU's flags instead: it changes what
this module reads, never what vLLM or oneDNN run.

No vLLM here: the demo, the benchmark, the serving example and the plugin's
start-up warning all ask this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Instructions that compute 16-bit float dot products in hardware (AVX-512, AMX tiles).
NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}
NATIVE_BF16_FLAGS = NATIVE_FLAGS["bfloat16"]
# What the choice depends on, printed beside every figure.
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")
# Space-separated CPU flags read instead of /proc/cpuinfo's (tests; what another CPU would be told).
FLAGS_OVERRIDE = "VLLM_AMPHISTA_CPU_FLAGS"
# Flags of CPUs whose bf16 linears vLLM-CPU runs on AMX tiles (torch.cpu._is_amx_tile_supported()).
_AMX_FLAGS = ("amx_tile", "amx_bf16")
# Caps below AVX-512 (oneDNN's ONEDNN_MAX_CPU_ISA, torch's ATEN_CPU_CAPABILITY) that leave no bf16 units in use.
_CAPS_WITHOUT_BF16 = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "default")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo", environ=None) -> frozenset[str]:
    """The CPU's feature flags (Linux), or those `VLLM_AMPHISTA_CPU_FLAGS` names; empty where cpuinfo
    cannot be read."""
    environ = os.environ if environ is None else environ
    if FLAGS_OVERRIDE in environ:
        return frozenset(environ[FLAGS_OVERRIDE].split())
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as file:
            for line in file:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _capped_below_avx512(environ) -> str | None:
    for variable in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        value = environ.get(variable, "").strip().lower()
        if value in _CAPS_WITHOUT_BF16:
            return f"{variable}={environ[variable]}"
    return None


def has_native_units(dtype: str = "bfloat16", flags: frozenset[str] | None = None, environ=None) -> bool:
    """Whether matmuls in `dtype` (bfloat16 or float16) run on units for it here (flags default to this CPU's)."""
    environ = os.environ if environ is None else environ
    flags = cpu_flags(environ=environ) if flags is None else flags
    return any(flag in flags for flag in NATIVE_FLAGS[dtype]) and _capped_below_avx512(environ) is None


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "bfloat16" or "float32"
    reason: str
    flags: tuple[str, ...]  # the REPORTED_FLAGS this CPU has

    def describe(self) -> str:
        """One line: the flags, the dtype and why."""
        flags = " ".join(self.flags) or "none of " + "/".join(REPORTED_FLAGS)
        return f"CPU flags: {flags}; fastest dtype here: {self.dtype} ({self.reason})"


def choose_cpu_dtype(flags: frozenset[str] | None = None, environ=None,
                     on_gpu: bool | None = None) -> DtypeChoice:
    """bfloat16 where the CPU has bf16 units, float32 where bf16 would be emulated; bfloat16 (vLLM's
    default) where the model runs on a CUDA GPU (`on_gpu` defaults to whether torch sees one)."""
    environ = os.environ if environ is None else environ
    flags = cpu_flags(environ=environ) if flags is None else flags
    reported = tuple(flag for flag in REPORTED_FLAGS if flag in flags)
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    if on_gpu:
        return DtypeChoice("bfloat16", "a CUDA GPU runs the model: vLLM's default", reported)
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in flags]
    cap = _capped_below_avx512(environ)
    if native and cap is None:
        return DtypeChoice("bfloat16", f"native bf16 ({'+'.join(native)}): half the bytes per weight", reported)
    if native:
        return DtypeChoice("float32", f"bf16 units present but {cap} keeps them unused: bf16 would be emulated",
                           reported)
    return DtypeChoice("float32", "no avx512_bf16/amx_bf16: bf16 is emulated and compute bound, float32 is "
                                  "faster and exact", reported)


def isa_cap_aborts_bf16_engine(flags: frozenset[str] | None = None, environ=None) -> str | None:
    """The oneDNN cap under which a bf16 vLLM-CPU engine aborts on this CPU (an AMX CPU with oneDNN
    capped below AMX: vLLM packs weights for AMX and oneDNN refuses the AMX kernel), else None."""
    environ = os.environ if environ is None else environ
    flags = cpu_flags(environ=environ) if flags is None else flags
    cap = environ.get("ONEDNN_MAX_CPU_ISA", "").strip()
    if cap and "AMX" not in cap.upper() and cap.upper() != "ALL" and any(flag in flags for flag in _AMX_FLAGS):
        return f"ONEDNN_MAX_CPU_ISA={cap}"
    return None


def emulated_bf16_warning(method: str, dtype: str, flags: frozenset[str] | None = None, environ=None) -> str | None:
    """The start-up warning for a speculative method run in a 16-bit dtype this CPU only emulates
    (None when there is nothing to warn about)."""
    if dtype not in NATIVE_FLAGS or has_native_units(dtype, flags, environ):
        return None
    return (f"speculative method {method!r} runs in {dtype}, which this CPU emulates "
            f"({choose_cpu_dtype(flags, environ, on_gpu=False).describe()}): every matmul is emulated and compute bound, so "
            f"verifying K+1 tokens costs nearly K+1 plain steps and the load-aware draft length will mostly "
            f"turn drafting off. Run with dtype='float32' (--dtype float32) for speculation to pay here.")
