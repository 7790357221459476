"""Which plugin method a speculative config asks for, and whether its heads dir is sound.

Runs inside `SpeculativeConfig.__post_init__` (see patches.py), before any
model loads, so every bad input gets one clear error naming the file and the
problem instead of a half-started engine. Imports no vLLM.
"""

from __future__ import annotations

import json
import os
import struct

PLUGIN_METHODS = ("amphista", "anpd")
HEADS_MODEL_TYPES = {"amphista": "amphista"}
WEIGHTS_FILE = "model.safetensors"


class HeadsDirError(ValueError):
    pass


def read_heads_config(path: str) -> dict:
    """The heads dir's config.json as a dict, or a HeadsDirError saying what is wrong."""
    if not os.path.exists(path):
        raise HeadsDirError(f"speculative model path does not exist: {path}")
    if not os.path.isdir(path):
        raise HeadsDirError(f"speculative model must be a heads directory, got a file: {path}")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise HeadsDirError(f"heads dir has no config.json: {config_path}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadsDirError(f"cannot read {config_path}: {e}") from e
    if not isinstance(config, dict):
        raise HeadsDirError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    return config


def check_safetensors_complete(path: str) -> None:
    """Raise if a safetensors file is missing, unreadable or shorter than its header says."""
    if not os.path.isfile(path):
        raise HeadsDirError(f"heads dir has no weights file: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise HeadsDirError(f"{path} is truncated ({size} bytes): no safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if 8 + header_len > size:
            raise HeadsDirError(f"{path} is truncated: header needs {header_len} bytes, file has {size}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HeadsDirError(f"{path} has a corrupt safetensors header: {e}") from e
    data_end = max(
        (entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
        default=0,
    )
    if 8 + header_len + data_end > size:
        raise HeadsDirError(
            f"{path} is truncated: tensors need {8 + header_len + data_end} bytes, file has {size}"
        )


def _model_type_of(path: str | None) -> str | None:
    """The model_type a local model dir declares; a broken config.json is an error, not "unknown"."""
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    return read_heads_config(path).get("model_type")


def check_amphista_heads(path: str, target_hf_config, num_speculative_tokens: int | None) -> int:
    """Validate an Amphista heads dir against its target; return the number of heads K."""
    config = read_heads_config(path)
    config_path = os.path.join(path, "config.json")
    model_type = config.get("model_type")
    if model_type != "amphista":
        raise HeadsDirError(
            f"{config_path} has model_type {model_type!r}; method 'amphista' needs an "
            "Amphista heads dir (model_type 'amphista')"
        )
    check_safetensors_complete(os.path.join(path, WEIGHTS_FILE))
    if target_hf_config is not None:
        target = getattr(target_hf_config, "get_text_config", lambda: target_hf_config)()
        for key in ("hidden_size", "vocab_size"):
            if config.get(key) != getattr(target, key, None):
                raise HeadsDirError(
                    f"{config_path}: {key}={config.get(key)} does not match the target "
                    f"model's {key}={getattr(target, key, None)}; these heads were trained "
                    "for another model"
                )
    num_heads = config.get("num_draft_heads")
    if not isinstance(num_heads, int) or num_heads < 1:
        raise HeadsDirError(f"{config_path}: num_draft_heads must be a positive int, got {num_heads!r}")
    if num_speculative_tokens is not None and num_speculative_tokens > num_heads:
        raise HeadsDirError(
            f"num_speculative_tokens={num_speculative_tokens} exceeds the {num_heads} "
            f"drafting heads in {path}; use at most {num_heads}"
        )
    return num_heads


def resolve_plugin_method(spec) -> str | None:
    """Our method for this SpeculativeConfig (validated, defaults filled), or None if not ours.

    `spec` is vLLM's SpeculativeConfig during __post_init__: only plain
    attributes are read and `num_speculative_tokens` / `prompt_lookup_*` filled.
    """
    method = spec.method
    if method is None and _model_type_of(spec.model) in HEADS_MODEL_TYPES.values():
        method = "amphista"
    if method not in PLUGIN_METHODS:
        return None
    target_config = getattr(spec.target_model_config, "hf_config", None)
    if method == "amphista":
        if not spec.model:
            raise HeadsDirError("method 'amphista' needs 'model': the path of an Amphista heads dir")
        num_heads = check_amphista_heads(spec.model, target_config, spec.num_speculative_tokens)
        if spec.num_speculative_tokens is None:
            spec.num_speculative_tokens = num_heads
    else:
        check_anpd_options(spec)
    return method


# Longest n-gram context (N-1), i.e. N=6: what `python -m vllm_amphista.tune_anpd` recommends for the
# demo target on all 480 Spec-Bench questions (the smallest N within 0.5% of the best tried; BENCHMARKS.md).
ANPD_DEFAULT_MAX_CONTEXT = 5


def check_anpd_options(spec) -> None:
    """ANPD reuses vLLM's n-gram window field: prompt_lookup_max is the longest
    context (N-1) of the N-gram tables; lookups always fall back to 2-grams, so
    prompt_lookup_min, if given, must be 1."""
    if spec.model not in (None, "anpd"):
        raise HeadsDirError(f"method 'anpd' is training-free and takes no 'model', got {spec.model!r}")
    if spec.num_speculative_tokens is None:
        raise HeadsDirError("method 'anpd' needs num_speculative_tokens (draft tokens per step)")
    if spec.prompt_lookup_min not in (None, 1):
        raise HeadsDirError(
            f"method 'anpd' always falls back to 2-grams: prompt_lookup_min must be 1, "
            f"got {spec.prompt_lookup_min}"
        )
    spec.prompt_lookup_min = 1
    if spec.prompt_lookup_max is None:
        spec.prompt_lookup_max = ANPD_DEFAULT_MAX_CONTEXT
