"""Tensor parallel: with TP=2 each rank holds half of the target's lm_head, which the Amphista
heads share; the drafter must gather the vocabulary slices as vLLM's own drafters do. Greedy
fp32 outputs at TP=2 equal TP=1, and so do the draft token ids the scheduler receives, step
by step (random heads: their drafts are rarely accepted, so only the draft ids themselves
would show a drafter reading one slice of the vocabulary).

The tiny Llama has 4 attention heads and 2 KV heads, so it splits over 2 ranks (the demo
target's 9 heads do not). On CPU, TP=2 runs one worker process per core
(VLLM_CPU_OMP_THREADS_BIND="0|1").
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO_ROOT, VLLM_CPU_TEST_ENV
from test_engine_lossless import mixed_requests

pytestmark = pytest.mark.slow


def run_recording_drafts(target_dir, speculative_config: dict, tensor_parallel_size: int, requests,
                         directory) -> dict:
    script = textwrap.dedent(f"""
        import json
        from vllm import LLM, SamplingParams
        from vllm.v1.core.sched.scheduler import Scheduler

        drafts = []
        original = Scheduler.update_draft_token_ids

        def recording(self, draft_token_ids):
            # vLLM appends a random suffix to each request id: keep the request's index only.
            drafts.append(sorted((req_id.split("-")[0], ids) for req_id, ids in
                                 zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids)))
            return original(self, draft_token_ids)

        Scheduler.update_draft_token_ids = recording

        if __name__ == "__main__":
            requests = json.loads({json.dumps(requests)!r})
            llm = LLM(model={str(target_dir)!r}, dtype="float32", max_model_len=256, seed=0, enforce_eager=True,
                      max_num_seqs=16, tensor_parallel_size={tensor_parallel_size},
                      distributed_executor_backend="mp" if {tensor_parallel_size} > 1 else None,
                      speculative_config={speculative_config!r})
            params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"]) for r in requests]
            outputs = llm.generate([{{"prompt_token_ids": r["prompt_token_ids"]}} for r in requests], params)
            print("REPORT=" + json.dumps({{"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                                           "drafts": drafts}}))
    """)
    # A file, not stdin: the worker processes re-import the main module.
    path = directory / f"tp{tensor_parallel_size}.py"
    path.write_text(script)
    env = {**os.environ, **VLLM_CPU_TEST_ENV}
    if tensor_parallel_size > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    completed = subprocess.run([sys.executable, str(path)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                               timeout=900)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("REPORT=")]
    assert completed.returncode == 0 and lines, completed.stderr[-6000:]
    return json.loads(lines[-1].removeprefix("REPORT="))


@pytest.mark.parametrize("method", ["amphista", "anpd"])
def test_tp2_equals_tp1(tiny_llama_dir, random_heads_dir, method, tmp_path):
    requests = mixed_requests(seed=3)[:8]
    # Fixed K: the load-aware default reacts to timing, which differs between the two runs.
    config = {"method": method, "num_speculative_tokens": 3, "draft_length": "fixed"}
    if method == "amphista":
        config["model"] = str(random_heads_dir)
    tp1 = run_recording_drafts(tiny_llama_dir, config, 1, requests, tmp_path)
    tp2 = run_recording_drafts(tiny_llama_dir, config, 2, requests, tmp_path)
    assert tp2["token_ids"] == tp1["token_ids"]
    assert sum(len(step) for step in tp1["drafts"]) > 0
    assert tp2["drafts"] == tp1["drafts"]
