"""Recording served traffic (opt-in `record_traffic`): what is written, its budget and permissions,
and that an unwritable directory or a refused write stops the recording with one warning while
serving goes on with unchanged outputs."""

import json
import logging
import stat

import pytest
from conftest import run_engine, run_llm

from vllm_amphista.traffic import SHARD_GLOB, TrafficRecorder, read_recording
from vllm_amphista.vllm.config import settle_recording, take_recording

REQUESTS = [{"prompt_token_ids": [12 + (i * 5 + j) % 40 for j in range(4 + 7 * i)], "max_tokens": 12 + i}
            for i in range(5)]


def shard_paths(directory):
    return sorted(directory.glob(SHARD_GLOB))


def test_recorder_writes_owner_only_rotating_shards_within_its_budget(tmp_path, caplog):
    directory = tmp_path / "rec"
    recorder = TrafficRecorder(directory, max_bytes=10_000, shard_bytes=300)
    for i in range(20):
        recorder.record(range(i, i + 10), [7] * i)
    recorder.close()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    paths = shard_paths(directory)
    assert len(paths) > 3 and all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in paths)
    assert all(path.stat().st_size <= 300 for path in paths)
    assert read_recording(directory) == [{"prompt_ids": list(range(i, i + 10)), "output_ids": [7] * i}
                                         for i in range(20)]
    # A second recorder in the same directory counts what is there against the budget.
    used = sum(path.stat().st_size for path in paths)
    with caplog.at_level(logging.WARNING, logger="vllm_amphista.traffic"):
        recorder = TrafficRecorder(directory, max_bytes=used + 100)
        for i in range(10):
            recorder.record([1, 2, 3], [4, 5, 6])
        recorder.close()
    line_bytes = len(json.dumps({"prompt_ids": [1, 2, 3], "output_ids": [4, 5, 6]}, separators=(",", ":"))) + 1
    assert len(read_recording(directory)) == 20 + 100 // line_bytes
    assert "holds its budget" in recorder.stopped_because
    assert sum("traffic recording stopped" in record.message for record in caplog.records) == 1


def test_a_crash_cut_last_line_is_skipped_and_an_empty_recording_is_refused(tmp_path):
    with pytest.raises(ValueError, match="the recording is empty"):
        read_recording(tmp_path)
    (tmp_path / "traffic-x-1-00000.jsonl").write_text('{"prompt_ids":[1],"output_ids":[2]}\n{"prompt_ids":[3')
    assert read_recording(tmp_path) == [{"prompt_ids": [1], "output_ids": [2]}]
    with pytest.raises(ValueError, match="no such recording directory"):
        read_recording(tmp_path / "missing")


def test_config_keys_are_checked():
    assert take_recording({"method": "anpd"}) is None
    config = {"method": "anpd", "record_traffic": "/tmp/x", "record_max_bytes": 5}
    assert take_recording(config) == ("/tmp/x", 5) and config == {"method": "anpd"}
    with pytest.raises(ValueError, match="needs 'record_traffic'"):
        take_recording({"record_max_bytes": 5})
    with pytest.raises(ValueError, match="positive int"):
        take_recording({"record_traffic": "/tmp/x", "record_max_bytes": -1})

    class VllmNgram:
        method = "ngram"

    with pytest.raises(ValueError, match="is for the methods"):
        settle_recording(VllmNgram(), ("/tmp/x", 5))


# In the engine's process: generate, then read the recorder's state (the scheduler flushes it on shutdown).
RECORD_BODY = """
import logging
warnings = []
handler = logging.Handler()
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger("vllm_amphista.traffic").addHandler(handler)
outputs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in args["requests"]],
                       [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"]) for r in args["requests"]])
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
recorder = scheduler._amphista_recorder
recorder.close()
{after_serving}
report({"token_ids": [list(o.outputs[0].token_ids) for o in outputs], "recorded": recorder.recorded,
        "stopped_because": recorder.stopped_because, "warnings": [w for w in warnings if "traffic" in w]})
"""


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir):
    return run_engine(tiny_llama_dir, REQUESTS)["token_ids"]


def recorded_run(tiny_llama_dir, heads_dir, directory, before_serving="", after_serving=""):
    return run_llm(tiny_llama_dir, before_serving + RECORD_BODY.replace("{after_serving}", after_serving),
                   {"method": "amphista_anpd", "model": str(heads_dir), "num_speculative_tokens": 3,
                    "record_traffic": str(directory), "record_max_bytes": 1 << 20},
                   args={"requests": REQUESTS})


def test_served_requests_are_recorded_and_outputs_unchanged(tiny_llama_dir, random_heads_dir, plain_outputs,
                                                            tmp_path):
    run = recorded_run(tiny_llama_dir, random_heads_dir, tmp_path / "traffic")
    assert run["token_ids"] == plain_outputs
    assert run["recorded"] == len(REQUESTS) and run["stopped_because"] is None and run["warnings"] == []
    recorded = sorted(read_recording(tmp_path / "traffic"), key=lambda r: len(r["prompt_ids"]))
    assert recorded == [{"prompt_ids": r["prompt_token_ids"], "output_ids": out}
                        for r, out in zip(REQUESTS, plain_outputs)]
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in shard_paths(tmp_path / "traffic"))


def test_unwritable_directory_stops_recording_not_serving(tiny_llama_dir, random_heads_dir, plain_outputs,
                                                          tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run = recorded_run(tiny_llama_dir, random_heads_dir, blocker / "traffic")
    assert run["token_ids"] == plain_outputs
    assert run["recorded"] == 0 and "cannot write" in run["stopped_because"]
    assert len(run["warnings"]) == 1


def test_refused_writes_stop_recording_not_serving(tiny_llama_dir, random_heads_dir, plain_outputs, tmp_path):
    """Once the engine is up, the kernel refuses its process writes past 200 bytes per file
    (RLIMIT_FSIZE: the error a full disk gives a writer, EFBIG instead of ENOSPC)."""
    limit = ("import resource, signal\n"
             "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
             "hard_limit = resource.getrlimit(resource.RLIMIT_FSIZE)[1]\n"
             "resource.setrlimit(resource.RLIMIT_FSIZE, (200, hard_limit))\n")
    # Lifted before the engine shuts down: torch.distributed's file store must grow then.
    unlimited = "resource.setrlimit(resource.RLIMIT_FSIZE, (hard_limit, hard_limit))\n"
    run = recorded_run(tiny_llama_dir, random_heads_dir, tmp_path / "traffic", limit, unlimited)
    assert run["token_ids"] == plain_outputs
    assert 0 < run["recorded"] < len(REQUESTS) and "cannot write" in run["stopped_because"]
    assert len(run["warnings"]) == 1
    assert len(read_recording(tmp_path / "traffic")) == run["recorded"]  # the refused line is not half-read


def test_stdlib_domain_halves_share_no_module(tmp_path):
    from vllm_amphista.prompts import load_prompts
    from vllm_amphista.train.stdlib_prompts import build

    counts = build(str(tmp_path), per_module=5)
    halves = {half: [json.loads(line) for line in (tmp_path / f"{half}.jsonl").read_text().splitlines()]
              for half in ("served", "test")}
    assert counts == {half: len(records) for half, records in halves.items()} and min(counts.values()) > 100
    assert not {r["module"] for r in halves["served"]} & {r["module"] for r in halves["test"]}
    prompts = load_prompts(tmp_path / "test.jsonl")  # a question file, as the benchmark reads it
    assert all(prompt.count('"""') == 2 and "def " in prompt for prompt in prompts)
