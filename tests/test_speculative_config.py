"""How users name our methods, and the errors bad input gets, before any model loads.

These go through vLLM's own argument parsing and config building (the path
`vllm serve` and `LLM(...)` take), with the plugin loaded by vLLM itself.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import VLLM_CPU_TEST_ENV


@pytest.fixture(scope="module")
def heads_dir(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoConfig

    from vllm_amphista.configuration_amphista import AmphistaConfig
    from vllm_amphista.modeling_amphista import AmphistaDrafter

    config = AmphistaConfig.from_target_config(AutoConfig.from_pretrained(tiny_llama_dir), num_draft_heads=4)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("heads")
    AmphistaDrafter(config).save_pretrained(directory)
    return directory


def engine_config(cli_args: list[str]):
    """vLLM's engine config for `vllm serve <cli_args>`, built as the serve command builds it."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(cli_args)
    args.model = args.model_tag  # what `vllm serve` does with its positional model
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def test_speculative_model_flag_reads_method_from_heads_dir(tiny_llama_dir, heads_dir):
    spec = engine_config([str(tiny_llama_dir), "--speculative-model", str(heads_dir)]).speculative_config
    assert spec.method == "amphista"
    assert spec.model == str(heads_dir)
    assert spec.num_speculative_tokens == 4  # defaults to the number of heads
    assert spec.use_eagle()  # drafts from target hidden states, with its own paged KV
    assert spec.draft_model_config.hf_config.model_type == "amphista"


def test_plugin_methods_stay_on_the_v1_model_runner(tiny_llama_dir, heads_dir):
    # On CPU vLLM never picks the V2 runner (no Triton CPU backend); on CUDA this list decides.
    config = engine_config([str(tiny_llama_dir), "--speculative-model", str(heads_dir)])
    assert any("amphista" in feature for feature in config._get_v2_model_runner_unsupported_features())


def test_num_speculative_tokens_flag(tiny_llama_dir, heads_dir):
    spec = engine_config(
        [str(tiny_llama_dir), "--speculative-model", str(heads_dir), "--num-speculative-tokens", "2"]
    ).speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("amphista", 2)


def test_speculative_config_json_with_method(tiny_llama_dir, heads_dir):
    config = json.dumps({"method": "amphista", "model": str(heads_dir), "num_speculative_tokens": 3})
    spec = engine_config([str(tiny_llama_dir), "--speculative-config", config]).speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("amphista", 3)


def test_anpd_config(tiny_llama_dir):
    from vllm_amphista.vllm.config import ANPD_DEFAULT_MAX_CONTEXT

    config = json.dumps({"method": "anpd", "num_speculative_tokens": 5, "prompt_lookup_max": 6})
    spec = engine_config([str(tiny_llama_dir), "--speculative-config", config]).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("anpd", 5, 6)
    assert not spec.use_eagle()
    config = json.dumps({"method": "anpd", "num_speculative_tokens": 2})
    spec = engine_config([str(tiny_llama_dir), "--speculative-config", config]).speculative_config
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (1, ANPD_DEFAULT_MAX_CONTEXT)


def test_anpd_takes_a_dir_of_answer_ngrams(tiny_llama_dir, tmp_path):
    from vllm_amphista.answer_ngrams import ANSWER_NGRAMS_NAME, AnswerNgrams

    AnswerNgrams.build([[5, 6, 7]], vocab_size=320, min_count=1).save(tmp_path / ANSWER_NGRAMS_NAME)
    config = json.dumps({"method": "anpd", "model": str(tmp_path), "num_speculative_tokens": 3})
    spec = engine_config([str(tiny_llama_dir), "--speculative-config", config]).speculative_config
    assert (spec.method, spec.model) == ("anpd", str(tmp_path))
    # A dir without them, or with another vocabulary's, is refused before any model loads.
    message = error_of([str(tiny_llama_dir), "--speculative-config",
                        json.dumps({"method": "anpd", "model": str(tiny_llama_dir), "num_speculative_tokens": 3})])
    assert "its optional 'model' is a directory holding answer_ngrams.npz" in message
    AnswerNgrams.build([[5, 6, 7]], vocab_size=400, min_count=1).save(tmp_path / ANSWER_NGRAMS_NAME)
    assert "counts a 400-token vocabulary, the model a 320-token one" in error_of(
        [str(tiny_llama_dir), "--speculative-config", config])


def test_hybrid_refuses_broken_answer_ngrams(tiny_llama_dir, heads_dir, tmp_path):
    from vllm_amphista.answer_ngrams import ANSWER_NGRAMS_NAME, AnswerNgrams

    other = tmp_path / "heads"
    shutil.copytree(heads_dir, other)
    AnswerNgrams.build([[5, 6, 7, 5, 6, 8]], vocab_size=320, min_count=1).save(other / ANSWER_NGRAMS_NAME)
    whole = (other / ANSWER_NGRAMS_NAME).read_bytes()
    (other / ANSWER_NGRAMS_NAME).write_bytes(whole[: len(whole) // 2])  # a copy cut short
    config = json.dumps({"method": "amphista_anpd", "model": str(other), "num_speculative_tokens": 4})
    message = error_of([str(tiny_llama_dir), "--speculative-config", config])
    assert "answer_ngrams.npz: not an answer n-gram file" in message


def error_of(cli_args: list[str]) -> str:
    with pytest.raises(Exception) as raised:
        engine_config(cli_args)
    return str(raised.value)


def test_unknown_method_is_named(tiny_llama_dir):
    message = error_of([str(tiny_llama_dir), "--speculative-config", '{"method": "amphistaa", "num_speculative_tokens": 2}'])
    assert "amphistaa" in message and "'amphista'" in message and "'anpd'" in message


def test_missing_heads_dir(tiny_llama_dir, tmp_path):
    missing = tmp_path / "no-such-heads"
    message = error_of([str(tiny_llama_dir), "--speculative-config", json.dumps({"method": "amphista", "model": str(missing)})])
    assert f"speculative model path does not exist: {missing}" in message


def test_heads_dir_of_the_wrong_kind(tiny_llama_dir):
    # The target itself is a model dir, but not Amphista heads.
    message = error_of([str(tiny_llama_dir), "--speculative-config", json.dumps({"method": "amphista", "model": str(tiny_llama_dir)})])
    assert "model_type 'llama'" in message and "needs an Amphista heads dir" in message


def test_more_tokens_than_heads(tiny_llama_dir, heads_dir):
    message = error_of([str(tiny_llama_dir), "--speculative-model", str(heads_dir), "--num-speculative-tokens", "5"])
    assert "num_speculative_tokens=5 exceeds the 4 drafting heads" in message


def test_hybrid_drafts_past_the_heads(tiny_llama_dir, heads_dir):
    config = json.dumps({"method": "amphista_anpd", "model": str(heads_dir), "num_speculative_tokens": 8})
    spec = engine_config([str(tiny_llama_dir), "--speculative-config", config]).speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("amphista_anpd", 8)


def test_heads_for_another_target(tiny_llama_dir, heads_dir, tmp_path):
    other = tmp_path / "other-heads"
    shutil.copytree(heads_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 1
    (other / "config.json").write_text(json.dumps(config))
    message = error_of([str(tiny_llama_dir), "--speculative-model", str(other)])
    assert "vocab_size=321 does not match the target model's vocab_size=320" in message


def test_heads_reading_layers_the_target_lacks(tiny_llama_dir, heads_dir, tmp_path):
    other = tmp_path / "deeper-heads"
    shutil.copytree(heads_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["target_feature_layers"] = [1, 5]
    (other / "config.json").write_text(json.dumps(config))
    message = error_of([str(tiny_llama_dir), "--speculative-model", str(other)])
    assert "target_feature_layers [1, 5] reach past the target model's 2 layers" in message


def test_heads_for_another_kind_of_target(tiny_llama_dir, heads_dir, tmp_path):
    other = tmp_path / "mistral-heads"
    shutil.copytree(heads_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["target_model_type"] = "mistral"
    (other / "config.json").write_text(json.dumps(config))
    message = error_of([str(tiny_llama_dir), "--speculative-model", str(other)])
    assert "trained for a 'mistral' target, but the target model is a 'llama'" in message


def test_truncated_weights(tiny_llama_dir, heads_dir, tmp_path):
    broken = tmp_path / "truncated-heads"
    shutil.copytree(heads_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    message = error_of([str(tiny_llama_dir), "--speculative-model", str(broken)])
    assert f"{weights} is truncated" in message


def test_unreadable_config(tiny_llama_dir, heads_dir, tmp_path):
    broken = tmp_path / "bad-config-heads"
    shutil.copytree(heads_dir, broken)
    (broken / "config.json").write_text("{not json")
    message = error_of([str(tiny_llama_dir), "--speculative-config", json.dumps({"method": "amphista", "model": str(broken)})])
    assert f"cannot read {broken / 'config.json'}" in message


# `make setup` makes the venv's `vllm` the plugin's console script (vllm-cpu's own dies reading its version).
CLI_SCRIPTS = ["vllm", "vllm-amphista"]


@pytest.mark.parametrize("script", CLI_SCRIPTS)
def test_cli_reports_its_version_on_vllm_cpu(script):
    completed = subprocess.run(
        [str(Path(sys.executable).parent / script), "--version"],
        capture_output=True, text=True, timeout=120, env={**VLLM_CPU_TEST_ENV, "PATH": "/usr/bin:/bin"},
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    import vllm

    assert completed.stdout.strip().splitlines()[-1] == f"{vllm.__version__}+cpu"


@pytest.mark.parametrize("script", CLI_SCRIPTS)
def test_cli_serve_help_lists_our_flags(script):
    completed = subprocess.run(
        [str(Path(sys.executable).parent / script), "serve", "--help=all"],
        capture_output=True, text=True, timeout=120, env={**VLLM_CPU_TEST_ENV, "PATH": "/usr/bin:/bin"},
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "--speculative-model" in completed.stdout and "--num-speculative-tokens" in completed.stdout


def test_cli_version_fix_stays_in_the_cli_process():
    """Other programs in the venv still see the installed distributions as they are."""
    import importlib.metadata

    importlib.metadata.version("vllm-cpu")  # this check is about the CPU build
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")


def test_draft_length_is_adaptive_by_default(tiny_llama_dir, heads_dir):
    spec = engine_config([str(tiny_llama_dir), "--speculative-model", str(heads_dir)]).speculative_config
    assert spec.draft_length == "adaptive"
    # Marked as vLLM's dynamic speculative decoding, so vLLM passes a per-step K to the drafter.
    assert spec.uses_dynamic_speculative_decoding()


def test_fixed_draft_length(tiny_llama_dir):
    config = json.dumps({"method": "anpd", "num_speculative_tokens": 3, "draft_length": "fixed"})
    spec = engine_config([str(tiny_llama_dir), "--speculative-config", config]).speculative_config
    assert (spec.draft_length, spec.num_speculative_tokens) == ("fixed", 3)
    assert not spec.uses_dynamic_speculative_decoding()


def test_users_own_schedule_is_respected(tiny_llama_dir):
    schedule = [[1, 4, 3], [5, 64, 1]]
    config = json.dumps({"method": "anpd", "num_speculative_tokens": 3,
                         "num_speculative_tokens_per_batch_size": schedule})
    spec = engine_config([str(tiny_llama_dir), "--speculative-config", config]).speculative_config
    assert spec.draft_length == "schedule"
    assert [list(entry) for entry in spec.num_speculative_tokens_per_batch_size] == schedule


def test_bad_draft_length(tiny_llama_dir):
    message = error_of([str(tiny_llama_dir), "--speculative-config",
                        '{"method": "anpd", "num_speculative_tokens": 2, "draft_length": "sometimes"}'])
    assert "draft_length" in message and "sometimes" in message and "adaptive" in message


def test_draft_length_is_ours_only(tiny_llama_dir):
    message = error_of([str(tiny_llama_dir), "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, '
                        '"draft_length": "adaptive"}'])
    assert "draft_length" in message and "ngram" in message


def test_draft_length_and_a_schedule_conflict(tiny_llama_dir):
    message = error_of([str(tiny_llama_dir), "--speculative-config",
                        '{"method": "anpd", "num_speculative_tokens": 2, "draft_length": "fixed", '
                        '"num_speculative_tokens_per_batch_size": [[1, 8, 2]]}'])
    assert "draft_length" in message and "num_speculative_tokens_per_batch_size" in message


def test_hybrid_config(tiny_llama_dir, heads_dir):
    config = json.dumps({"method": "amphista_anpd", "model": str(heads_dir), "num_speculative_tokens": 3})
    spec = engine_config([str(tiny_llama_dir), "--speculative-config", config]).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.draft_length) == ("amphista_anpd", 3, "adaptive")
    assert spec.use_eagle()  # the heads draft from the target's hidden states, with their own paged KV
    assert spec.prompt_lookup_max >= 1  # the tables' longest context


def test_hybrid_needs_heads(tiny_llama_dir):
    message = error_of([str(tiny_llama_dir), "--speculative-config",
                        '{"method": "amphista_anpd", "num_speculative_tokens": 2}'])
    assert "amphista_anpd" in message and "heads dir" in message


def test_hybrid_bad_ngram_options(tiny_llama_dir, heads_dir):
    config = json.dumps({"method": "amphista_anpd", "model": str(heads_dir), "prompt_lookup_min": 3})
    message = error_of([str(tiny_llama_dir), "--speculative-config", config])
    assert "prompt_lookup_min" in message and "amphista_anpd" in message
