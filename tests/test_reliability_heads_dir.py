"""Broken heads dirs fail at start-up with one clear error naming the file and the problem.

The cases test_speculative_config.py does not cover: an empty dir, heads for
a target of another hidden size, a missing weights file, and a config.json
that is valid JSON but not an object; each through the README's
`--speculative-model` flag and, where the method is needed to reach our
check, through an explicit `{"method": "amphista", ...}`. One case goes
through a real `LLM(...)` start with vLLM's multi-process engine to show the
error reaches the caller intact and nothing is left running.
"""

import json
import shutil
import time

import pytest

from conftest import build_random_heads, build_tiny_llama, report_of, run_python, session_processes
from test_speculative_config import engine_config


def start_up_error(cli_args: list[str]) -> str:
    """The message of the one error `vllm serve <cli_args>` raises while building its config."""
    with pytest.raises(Exception) as raised:
        engine_config(cli_args)
    return str(raised.value)


def amphista_config(heads: object) -> str:
    return json.dumps({"method": "amphista", "model": str(heads)})


@pytest.fixture(scope="module")
def heads_for_narrower_target(tmp_path_factory):
    """Sound heads, but trained for a tiny Llama with hidden size 64 instead of 128."""
    narrow_target = build_tiny_llama(tmp_path_factory.mktemp("narrow_llama"), hidden_size=64)
    return build_random_heads(narrow_target, tmp_path_factory.mktemp("narrow_heads"))


@pytest.fixture()
def heads_with_list_config(random_heads_dir, tmp_path):
    broken = tmp_path / "list-config-heads"
    shutil.copytree(random_heads_dir, broken)
    (broken / "config.json").write_text("[1, 2, 3]")
    return broken


def test_empty_dir_with_method(tiny_llama_dir, tmp_path):
    message = start_up_error([str(tiny_llama_dir), "--speculative-config", amphista_config(tmp_path)])
    assert f"heads dir has no config.json: {tmp_path / 'config.json'}" in message
    assert message.startswith("1 validation error")


def test_empty_dir_with_speculative_model_flag(tiny_llama_dir, tmp_path):
    # Without config.json the method cannot be read from the dir, so vLLM's own
    # loader answers; its message still names the dir and the missing file.
    message = start_up_error([str(tiny_llama_dir), "--speculative-model", str(tmp_path)])
    assert str(tmp_path) in message and "config.json" in message


def test_hidden_size_mismatch(tiny_llama_dir, heads_for_narrower_target):
    message = start_up_error([str(tiny_llama_dir), "--speculative-model", str(heads_for_narrower_target)])
    assert (
        f"{heads_for_narrower_target / 'config.json'}: hidden_size=64 does not match "
        "the target model's hidden_size=128" in message
    )
    assert message.startswith("1 validation error")


def test_missing_weights_file(tiny_llama_dir, random_heads_dir, tmp_path):
    shutil.copy(random_heads_dir / "config.json", tmp_path / "config.json")
    message = start_up_error([str(tiny_llama_dir), "--speculative-model", str(tmp_path)])
    assert f"heads dir has no weights file: {tmp_path / 'model.safetensors'}" in message


def test_config_not_an_object_with_method(tiny_llama_dir, heads_with_list_config):
    message = start_up_error([str(tiny_llama_dir), "--speculative-config", amphista_config(heads_with_list_config)])
    assert f"{heads_with_list_config / 'config.json'} must hold a JSON object, got list" in message


def test_config_not_an_object_with_speculative_model_flag(tiny_llama_dir, heads_with_list_config):
    message = start_up_error([str(tiny_llama_dir), "--speculative-model", str(heads_with_list_config)])
    assert f"{heads_with_list_config / 'config.json'} must hold a JSON object" in message


LLM_START_WITH_MISMATCHED_HEADS = """
import json, os
from vllm import LLM

if __name__ == "__main__":
    try:
        LLM(model={target!r}, dtype="float32", max_model_len=256, enforce_eager=True,
            speculative_config={{"method": "amphista", "model": {heads!r}}})
        outcome = {{"constructed": True}}
    except Exception as error:
        outcome = {{"constructed": False, "error_type": type(error).__name__, "message": str(error)}}
    print("REPORT=" + json.dumps({{**outcome, "pid": os.getpid()}}), flush=True)
"""


def test_llm_construction_raises_the_error_and_exits_cleanly(tiny_llama_dir, heads_for_narrower_target):
    script = LLM_START_WITH_MISMATCHED_HEADS.format(target=str(tiny_llama_dir), heads=str(heads_for_narrower_target))
    started = time.monotonic()
    # vLLM's default multi-process engine: a half-started engine would leave an EngineCore behind.
    completed = run_python(script, extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, timeout=300)
    elapsed = time.monotonic() - started
    outcome = report_of(completed)  # the process exited 0 after the caller caught the error: no hang

    assert not outcome["constructed"]
    assert outcome["error_type"] == "ValidationError"
    assert "hidden_size=64 does not match the target model's hidden_size=128" in outcome["message"]
    assert str(heads_for_narrower_target / "config.json") in outcome["message"]
    assert "EngineCore" not in completed.stderr and "Loading weights" not in completed.stderr
    assert session_processes(outcome["pid"]) == []
    assert elapsed < 240, f"start-up took {elapsed:.0f}s to fail"
