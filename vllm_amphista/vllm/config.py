"""Which plugin method a speculative config asks for, and whether its heads dir and options are sound.

Runs inside `SpeculativeConfig.__post_init__` (see patches.py), before any
model loads, so every bad input gets one clear error naming the file and the
problem instead of a half-started engine. Reads vLLM's config object but
imports nothing of vLLM.
"""

from __future__ import annotations

import os

from vllm_amphista.answer_ngrams import ANSWER_NGRAMS_NAME, AnswerNgramsError, load_from_dir
from vllm_amphista.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadsDirError,
    check_safetensors_complete,
    read_heads_config,
)

PLUGIN_METHODS = ("amphista", "anpd", "amphista_anpd")
# Methods that draft with Amphista heads (and take a heads dir as `model`).
HEADS_METHODS = ("amphista", "amphista_anpd")
HEADS_MODEL_TYPE = "amphista"


def _model_type_of(path: str | None) -> str | None:
    """The model_type a local model dir declares; a broken config.json is an error, not "unknown"."""
    if not path or not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return None
    return read_heads_config(path).get("model_type")


def check_amphista_heads(path: str, target_hf_config, num_speculative_tokens: int | None,
                         method: str = "amphista") -> int:
    """Validate an Amphista heads dir against its target; return the number of heads K. The heads
    alone draft at most K tokens; the hybrid's N-gram tables continue past them."""
    config = read_heads_config(path)
    config_path = os.path.join(path, CONFIG_NAME)
    model_type = config.get("model_type")
    if model_type != "amphista":
        raise HeadsDirError(
            f"{config_path} has model_type {model_type!r}; method 'amphista' needs an "
            "Amphista heads dir (model_type 'amphista')"
        )
    check_safetensors_complete(os.path.join(path, WEIGHTS_NAME))
    if target_hf_config is not None:
        target = getattr(target_hf_config, "get_text_config", lambda: target_hf_config)()
        trained_for = config.get("target_model_type")
        if trained_for is not None and trained_for != target.model_type:
            raise HeadsDirError(
                f"{config_path}: these heads were trained for a {trained_for!r} target, but the target "
                f"model is a {target.model_type!r}"
            )
        for key in ("hidden_size", "vocab_size"):
            if config.get(key) != getattr(target, key, None):
                raise HeadsDirError(
                    f"{config_path}: {key}={config.get(key)} does not match the target "
                    f"model's {key}={getattr(target, key, None)}; these heads were trained "
                    "for another model"
                )
        layers = config.get("target_feature_layers") or []
        num_layers = getattr(target, "num_hidden_layers", None)
        if num_layers is not None and any(layer > num_layers for layer in layers):
            raise HeadsDirError(
                f"{config_path}: target_feature_layers {layers} reach past the target model's {num_layers} "
                "layers; these heads were trained for another model"
            )
    if method == "amphista_anpd":
        check_answer_ngrams(path, config.get("vocab_size"))
    num_heads = config.get("num_draft_heads")
    if not isinstance(num_heads, int) or num_heads < 1:
        raise HeadsDirError(f"{config_path}: num_draft_heads must be a positive int, got {num_heads!r}")
    if method == "amphista" and num_speculative_tokens is not None and num_speculative_tokens > num_heads:
        raise HeadsDirError(
            f"num_speculative_tokens={num_speculative_tokens} exceeds the {num_heads} "
            f"drafting heads in {path}; use at most {num_heads} (method 'amphista_anpd' drafts past "
            "the heads with its N-gram tables)"
        )
    return num_heads


def check_answer_ngrams(heads_dir: str, vocab_size: int | None) -> None:
    """A dir's answer n-grams, where it has them, load and fit the vocabulary."""
    try:
        ngrams = load_from_dir(heads_dir)
    except AnswerNgramsError as error:
        raise HeadsDirError(str(error)) from None
    if ngrams is not None and vocab_size is not None and ngrams.vocab_size != vocab_size:
        raise HeadsDirError(
            f"{os.path.join(heads_dir, ANSWER_NGRAMS_NAME)} counts a {ngrams.vocab_size}-token vocabulary, "
            f"the model a {vocab_size}-token one: rebuild it from the target's answers (train ngrams)"
        )


def anpd_answer_ngrams_dir(model: str | None) -> str | None:
    """The answer n-gram dir ANPD was given as its model; None when it runs training-free."""
    return None if model in (None, "anpd") else model


def check_anpd_answer_ngrams_dir(path: str, vocab_size: int | None) -> None:
    """ANPD's optional 'model': a directory with the target's answer n-grams for its tables to fall back on."""
    if not os.path.isfile(os.path.join(path, ANSWER_NGRAMS_NAME)):
        raise HeadsDirError(
            f"method 'anpd' is training-free: its optional 'model' is a directory holding {ANSWER_NGRAMS_NAME} "
            f"(the target's answer n-grams: a heads dir that ships them, or `train ngrams --out DIR`), got {path!r}"
        )
    check_answer_ngrams(path, vocab_size)


def resolve_plugin_method(spec) -> str | None:
    """Our method for this SpeculativeConfig (validated, defaults filled), or None if not ours.

    `spec` is vLLM's SpeculativeConfig during __post_init__: only plain
    attributes are read and `num_speculative_tokens` / `prompt_lookup_*` filled.
    """
    method = spec.method
    if method is None and _model_type_of(spec.model) == HEADS_MODEL_TYPE:
        method = "amphista"
    if method not in PLUGIN_METHODS:
        return None
    target_config = getattr(spec.target_model_config, "hf_config", None)
    if method in HEADS_METHODS:
        if not spec.model:
            raise HeadsDirError(f"method {method!r} needs 'model': the path of an Amphista heads dir")
        num_heads = check_amphista_heads(spec.model, target_config, spec.num_speculative_tokens, method)
        if spec.num_speculative_tokens is None:
            spec.num_speculative_tokens = num_heads
    else:
        if anpd_answer_ngrams_dir(spec.model):
            target = getattr(target_config, "get_text_config", lambda: target_config)()
            check_anpd_answer_ngrams_dir(spec.model, getattr(target, "vocab_size", None))
        if spec.num_speculative_tokens is None:
            raise HeadsDirError("method 'anpd' needs num_speculative_tokens (draft tokens per step)")
    if method != "amphista":
        check_ngram_options(spec, method)
    return method


# Longest n-gram context (N-1), i.e. N=6: what `python -m vllm_amphista.tune_anpd` recommends for the
# demo target on all 480 Spec-Bench questions (the smallest N within 0.5% of the best tried; BENCHMARKS.md).
ANPD_DEFAULT_MAX_CONTEXT = 5


def check_ngram_options(spec, method: str) -> None:
    """ANPD's tables (alone or in the hybrid) reuse vLLM's n-gram window fields: prompt_lookup_max
    is the longest context (N-1) of the N-gram tables; lookups always fall back to 2-grams, so
    prompt_lookup_min, if given, must be 1."""
    if spec.prompt_lookup_min not in (None, 1):
        raise HeadsDirError(
            f"method {method!r} always falls back to 2-grams: prompt_lookup_min must be 1, "
            f"got {spec.prompt_lookup_min}"
        )
    if spec.prompt_lookup_max is not None and (not isinstance(spec.prompt_lookup_max, int)
                                               or spec.prompt_lookup_max < 1):
        raise HeadsDirError(f"prompt_lookup_max must be a positive int, got {spec.prompt_lookup_max!r}")
    spec.prompt_lookup_min = 1
    if spec.prompt_lookup_max is None:
        spec.prompt_lookup_max = ANPD_DEFAULT_MAX_CONTEXT


# The plugin's speculative-config key for the draft length of amphista and anpd:
#   "adaptive" (default): each step drafts the K (0..num_speculative_tokens) that the load and
#       the measured acceptance make fastest (vllm_amphista/draft_length.py), and each request's
#       draft stops early where its confidence is low;
#   "fixed": always num_speculative_tokens.
# A user's own `num_speculative_tokens_per_batch_size` schedule is respected as given.
DRAFT_LENGTH_KEY = "draft_length"
DRAFT_LENGTH_MODES = ("adaptive", "fixed")
# vLLM expands a per-batch-size schedule up to max_num_seqs: one range covers every batch size.
_ALL_BATCH_SIZES = 1 << 20


def take_draft_length(speculative_config: dict | None) -> str | None:
    """Remove the plugin's key from a user's speculative-config dict (vLLM forbids unknown
    keys) and check its value; None when not given."""
    if not speculative_config or DRAFT_LENGTH_KEY not in speculative_config:
        return None
    requested = speculative_config.pop(DRAFT_LENGTH_KEY)
    if requested not in DRAFT_LENGTH_MODES:
        raise ValueError(
            f"speculative config {DRAFT_LENGTH_KEY!r} must be one of {list(DRAFT_LENGTH_MODES)}, got {requested!r}"
        )
    return requested


def settle_draft_length(spec, requested: str | None) -> None:
    """Record on a built SpeculativeConfig how its draft length is chosen; for "adaptive", mark
    it as vLLM's dynamic speculative decoding so vLLM passes a per-step K to the drafter (and,
    on CUDA, captures graphs for varying verification lengths)."""
    if spec is None:
        return
    if spec.method not in PLUGIN_METHODS:
        if requested is not None:
            raise ValueError(
                f"speculative config {DRAFT_LENGTH_KEY!r} is for the methods {list(PLUGIN_METHODS)}, "
                f"not {spec.method!r}"
            )
        return
    if spec.num_speculative_tokens_per_batch_size is not None:
        if requested is not None:
            raise ValueError(
                f"give either {DRAFT_LENGTH_KEY!r} or num_speculative_tokens_per_batch_size, not both"
            )
        spec.draft_length = "schedule"
        return
    spec.draft_length = requested or "adaptive"
    if spec.draft_length == "adaptive":
        spec.num_speculative_tokens_per_batch_size = [(1, _ALL_BATCH_SIZES, spec.num_speculative_tokens)]


def draft_length_mode(spec) -> str | None:
    """"adaptive", "fixed" or "schedule" for our methods; None for vLLM's own."""
    return getattr(spec, "draft_length", None)


# The plugin's speculative-config keys for recording served traffic (vllm_amphista/traffic.py):
#   "record_traffic": a directory; off when absent (token ids of users' prompts are user data);
#   "record_max_bytes": the recording's budget in bytes (default traffic.DEFAULT_MAX_BYTES).
RECORD_TRAFFIC_KEY = "record_traffic"
RECORD_MAX_BYTES_KEY = "record_max_bytes"


def take_recording(speculative_config: dict | None) -> tuple[str, int] | None:
    """Remove the recording keys from a user's speculative-config dict and check them:
    (directory, max bytes), or None when no recording is asked for."""
    from vllm_amphista.traffic import DEFAULT_MAX_BYTES

    if not speculative_config:
        return None
    directory = speculative_config.pop(RECORD_TRAFFIC_KEY, None)
    max_bytes = speculative_config.pop(RECORD_MAX_BYTES_KEY, None)
    if directory is None:
        if max_bytes is not None:
            raise ValueError(f"speculative config {RECORD_MAX_BYTES_KEY!r} needs {RECORD_TRAFFIC_KEY!r} (a directory)")
        return None
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise ValueError(f"speculative config {RECORD_TRAFFIC_KEY!r} must be a directory path, got {directory!r}")
    if max_bytes is None:
        max_bytes = DEFAULT_MAX_BYTES
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"speculative config {RECORD_MAX_BYTES_KEY!r} must be a positive int, got {max_bytes!r}")
    return str(directory), max_bytes


def settle_recording(spec, recording: tuple[str, int] | None) -> None:
    """Record on a built SpeculativeConfig where its traffic goes (`spec.record_traffic`)."""
    if recording is not None and (spec is None or spec.method not in PLUGIN_METHODS):
        raise ValueError(f"speculative config {RECORD_TRAFFIC_KEY!r} is for the methods {list(PLUGIN_METHODS)}, "
                         f"not {getattr(spec, 'method', None)!r}")
    if spec is not None and spec.method in PLUGIN_METHODS:
        spec.record_traffic = recording
