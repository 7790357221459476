"""The load-aware draft length's price of a verified token reaches every plugin drafter.

Each step the scheduler's controller says how likely to be accepted a draft token must be to
pay for its verification (`AdaptiveDraftLength.min_acceptance`, its maths in
test_draft_length.py), and each drafter stops a request's draft at the first token below it. Here
the controller is pinned to K = max and a price of 0 (every token pays) or 1 (none can: no
confidence reaches 1), so the drafts seen in vLLM's metrics show that the price travelled from
the scheduler to the drafter, in the engine: drafts at 0, none at 1, the same greedy output.
"""

import pytest

from conftest import KEEP_VLLMS_ASYNC_DECISION, run_llm
from test_engine_lossless import mixed_requests

PIN_CONTROLLER = """
from vllm_amphista.draft_length import AdaptiveDraftLength

AdaptiveDraftLength.best = lambda self, batch_size: self.max_k
AdaptiveDraftLength.min_acceptance = lambda self, batch_size, k: {price}
"""

GENERATE = """
outputs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in args["requests"]],
                       [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"]) for r in args["requests"]])
spec = metrics("vllm:spec_decode_num")
report({"outputs": [list(output.outputs[0].token_ids) for output in outputs],
        "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
        "draft_tokens": spec["vllm:spec_decode_num_draft_tokens"],
        "accepted": spec["vllm:spec_decode_num_accepted_tokens"]})
"""


@pytest.fixture(scope="module")
def requests():
    # The repetitive half of the mixed prompts: n-gram matches (and random heads) draft there.
    return [request for request in mixed_requests(seed=2) if len(set(request["prompt_token_ids"])) < 8][:6]


def run_priced(target_dir, requests, speculative_config, price: float, async_scheduling: bool = False) -> dict:
    return run_llm(target_dir, GENERATE, {**speculative_config, "num_speculative_tokens": 4},
                   llm_kwargs={"async_scheduling": None if async_scheduling else False, "max_num_seqs": 8},
                   args={"requests": requests},
                   prelude=(KEEP_VLLMS_ASYNC_DECISION if async_scheduling else "") + PIN_CONTROLLER.format(price=price))


@pytest.mark.parametrize("method", ["anpd", "amphista", "amphista_anpd"])
def test_each_drafter_stops_its_drafts_at_the_schedulers_price(tiny_llama_dir, random_heads_dir, requests, method):
    config = {"method": method} if method == "anpd" else {"method": method, "model": str(random_heads_dir)}
    free = run_priced(tiny_llama_dir, requests, config, price=0.0)
    dear = run_priced(tiny_llama_dir, requests, config, price=1.0)
    assert free["draft_tokens"] > 0
    assert dear["draft_tokens"] == 0
    assert dear["outputs"] == free["outputs"]


def test_anpd_under_async_scheduling_gets_the_price(tiny_llama_dir, requests):
    """Async scheduling hands the runner a trimmed copy of the scheduler's output: the price must survive it."""
    free = run_priced(tiny_llama_dir, requests, {"method": "anpd"}, price=0.0, async_scheduling=True)
    dear = run_priced(tiny_llama_dir, requests, {"method": "anpd"}, price=1.0, async_scheduling=True)
    assert free["async_scheduling"] and dear["async_scheduling"]
    assert dear["outputs"] == free["outputs"]
    # vLLM counts the scheduler's placeholders as drafts: compare what was accepted instead.
    assert free["accepted"] > 0 and dear["accepted"] == 0
