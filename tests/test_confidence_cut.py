"""The heads' and the hybrid's drafts are cut by confidence only where verifying them costs the step.

In a real engine with the load-aware draft length (K held at its maximum so that only the cut can
shorten a draft), random heads' weak drafts are verified in full once the start-up timings say a
full draft is cheap at the live batch size, and cut where they say it is dear; the greedy outputs
are the same either way.
"""

import random

import pytest

from conftest import TINY_SPECIAL_TOKENS, TINY_WORDS, run_llm

K = 3

SCENARIO = """
engine_core = llm.llm_engine.engine_core.engine_core
drafter = engine_core.model_executor.driver_worker.worker.model_runner.drafter
started_timed = drafter.confidence_cut.timed_batch_sizes

class FullDrafts:  # vLLM's per-batch-size draft lengths, read once per step
    def __getitem__(self, batch_size):
        return args["k"]

engine_core.scheduler.dynamic_sd_lookup = FullDrafts()
prompts = [{"prompt_token_ids": prompt} for prompt in args["prompts"]]
params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
runs = {}
for verifying, ms_per_step in (("dear", {1: 10.0, 1 + args["k"]: 20.0}), ("cheap", {1: 10.0, 1 + args["k"]: 10.2})):
    drafter.confidence_cut.calibrate({tokens: ms / 1000 for tokens, ms in ms_per_step.items()})
    before = metrics("vllm:spec_decode")
    outputs = llm.generate(prompts[:1], params)  # batch 1, the calibrated size
    after = metrics("vllm:spec_decode")
    runs[verifying] = {
        "outputs": [list(output.outputs[0].token_ids) for output in outputs],
        "drafts": after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"],
        "draft_tokens": after["vllm:spec_decode_num_draft_tokens"] - before["vllm:spec_decode_num_draft_tokens"],
    }
report({"started_timed": started_timed, "runs": runs})
"""


@pytest.mark.parametrize("method", ["amphista", "amphista_anpd"])
def test_weak_drafts_are_verified_in_full_where_that_is_cheap(tiny_llama_dir, random_heads_dir, method):
    rng = random.Random(0)
    prompt = [rng.randrange(len(TINY_SPECIAL_TOKENS), len(TINY_SPECIAL_TOKENS) + len(TINY_WORDS)) for _ in range(20)]
    report = run_llm(tiny_llama_dir, SCENARIO,
                     speculative_config={"method": method, "model": str(random_heads_dir), "num_speculative_tokens": K},
                     llm_kwargs={"max_num_seqs": 2}, args={"k": K, "prompts": [prompt]})
    assert report["started_timed"] == [1, 2]  # the start-up timing calibrated the cut at every batch size
    dear, cheap = report["runs"]["dear"], report["runs"]["cheap"]
    assert dear["outputs"] == cheap["outputs"]
    assert cheap["drafts"] > 0 and cheap["draft_tokens"] == K * cheap["drafts"]
    assert dear["draft_tokens"] < (K - 1) * dear["drafts"]  # random heads' chains fall below the cut
