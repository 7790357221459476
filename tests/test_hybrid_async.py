"""The amphista_anpd hybrid and ANPD under vLLM's async scheduling, and the ANPD tables following the tokens.

With async scheduling the runner's CPU copy of the newest tokens holds placeholders, so the
hybrid's ANPD tables absorb the sampler's tokens before bookkeeping. In a real engine (random
heads, repetitive and random prompts, early stops, a prompt at max_model_len), every request's
tables must have absorbed exactly its prompt and output (tokens sampled past a stop may follow),
built once, in both scheduling modes; vLLM's own choice admits the hybrid to async scheduling;
and greedy outputs equal plain decoding, with K above the number of heads (the tables draft past
them; test_demo_target.py checks those tokens get accepted). Pure ANPD is admitted too: the same
checks, and the runner verifies each request's real draft only, not the scheduler's K placeholders
(except in steps with structured-output requests, whose grammar masks count every placeholder).
Synchronous ANPD keeps its tables as long: each request's are built once.

The async run keeps vLLM's own decision on CPU (`conftest.KEEP_VLLMS_ASYNC_DECISION`). The draft
length is fixed: the load-aware one may choose K=0 for a whole run of 16 requests on a CPU whose
timings say drafting does not pay, and these tests need drafts to check the tables.
"""

import pytest

from conftest import KEEP_VLLMS_ASYNC_DECISION, run_engine, run_llm
from test_engine_lossless import mixed_requests

K = 4
# Past the random heads' 4 tokens: the tables continue the chain (padded [B, K] drafts under async).
HYBRID_K = 6

RECORD_ABSORBED = """
from vllm_amphista.anpd import AnpdDrafter

absorbed, builds = {}, {}
extend, sync = AnpdDrafter.extend, AnpdDrafter.sync

def count_build(self, req_id):
    if self.num_tokens(req_id) is None:  # the tables of this request start (again) here
        absorbed[req_id] = []
        builds[req_id] = builds.get(req_id, 0) + 1

def recording_extend(self, req_id, token_ids):
    count_build(self, req_id)
    absorbed[req_id].extend(int(token) for token in token_ids)
    return extend(self, req_id, token_ids)

def recording_sync(self, req_id, token_ids):
    count_build(self, req_id)
    absorbed[req_id].extend(int(token) for token in token_ids[len(absorbed[req_id]):])
    return sync(self, req_id, token_ids)

AnpdDrafter.extend, AnpdDrafter.sync = recording_extend, recording_sync
"""

GENERATE = """
outputs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in args["requests"]],
                       [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], stop_token_ids=r.get("stop_token_ids"))
                        for r in args["requests"]])
requests = []
for output in outputs:
    # The runner's request id extends the one LLM.generate returns.
    runner_ids = [req_id for req_id in absorbed if req_id == output.request_id
                  or req_id.startswith(output.request_id + "-")]
    requests.append({"output": list(output.outputs[0].token_ids),
                     "absorbed": [absorbed[req_id] for req_id in runner_ids],
                     "builds": [builds[req_id] for req_id in runner_ids]})
report({"async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
        "requests": requests, "accepted": metrics("vllm:spec_decode_num"),
        "preemptions": metrics("vllm:num_preemptions")["vllm:num_preemptions"]})
"""


@pytest.fixture(scope="module")
def requests():
    return mixed_requests(seed=1)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, requests):
    return run_engine(tiny_llama_dir, requests)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_hybrid_tables_absorb_exactly_the_tokens(tiny_llama_dir, random_heads_dir, requests, plain, async_scheduling):
    # Async: vLLM decides (None), and must pick async scheduling for the hybrid.
    run = run_llm(tiny_llama_dir, GENERATE,
                  {"method": "amphista_anpd", "model": str(random_heads_dir), "num_speculative_tokens": HYBRID_K,
                   "draft_length": "fixed"},
                  llm_kwargs={"async_scheduling": None if async_scheduling else False, "max_num_seqs": 16},
                  args={"requests": requests}, prelude=KEEP_VLLMS_ASYNC_DECISION + RECORD_ABSORBED)
    assert run["async_scheduling"] is async_scheduling
    for index, (request, got, expected) in enumerate(zip(requests, run["requests"], plain["token_ids"])):
        assert got["output"] == expected, f"request {index}: output differs from plain decoding"
        sequence = request["prompt_token_ids"] + expected
        if len(sequence) < 2 or not expected:
            continue
        assert len(got["absorbed"]) == 1, f"request {index}: no tables, or more than one request id matched"
        absorbed = got["absorbed"][0]
        assert got["builds"] == [1], f"request {index}: tables rebuilt mid-request"
        # Tokens sampled past a stop (accepted drafts after it, a bonus token) may follow.
        assert absorbed[:len(sequence)] == sequence, f"request {index}: tables absorbed other tokens"
        assert len(absorbed) <= len(sequence) + HYBRID_K
    assert run["accepted"]["vllm:spec_decode_num_accepted_tokens"] > 0  # the repetitive prompts' drafts come from the tables


RECORD_VERIFIED = """
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

verified = []
calc_spec_decode_metadata = GPUModelRunner._calc_spec_decode_metadata

def recording_calc(self, num_draft_tokens, *args, **kwargs):
    verified.append(int(num_draft_tokens.sum()))
    return calc_spec_decode_metadata(self, num_draft_tokens, *args, **kwargs)

GPUModelRunner._calc_spec_decode_metadata = recording_calc
"""


def test_anpd_under_async_scheduling(tiny_llama_dir, requests, plain):
    run = run_llm(tiny_llama_dir, GENERATE.replace('report({', 'report({"verified": sum(verified), '),
                  {"method": "anpd", "num_speculative_tokens": K, "draft_length": "fixed"},
                  llm_kwargs={"async_scheduling": None, "max_num_seqs": 16},
                  args={"requests": requests}, prelude=KEEP_VLLMS_ASYNC_DECISION + RECORD_ABSORBED + RECORD_VERIFIED)
    assert run["async_scheduling"] is True  # vLLM's own decision
    for index, (request, got, expected) in enumerate(zip(requests, run["requests"], plain["token_ids"])):
        assert got["output"] == expected, f"request {index}: output differs from plain decoding"
        if not got["absorbed"]:
            continue  # finished at its prefill
        assert got["builds"] == [1], f"request {index}: tables rebuilt mid-request"
        sequence = request["prompt_token_ids"] + expected
        assert got["absorbed"][0][:len(sequence)] == sequence, f"request {index}: tables absorbed other tokens"
    assert run["accepted"]["vllm:spec_decode_num_accepted_tokens"] > 0
    # The scheduler placed K placeholders for every decoding request; the runner verified the real
    # drafts only (random prompts rarely have a match): all K would be verified without the cut.
    assert 0 < run["verified"] < run["accepted"]["vllm:spec_decode_num_draft_tokens"]


STRUCTURED = """
from vllm.sampling_params import StructuredOutputsParams

prompts = [[17, 18] * 6, [19, 20, 21] * 4, [30, 31, 40, 2, 9] * 3]
grammars = ["(w3|w4|w9)+", "(w5|w6|w7|w8)+", "(w10|w11|w12|w13|w14)+"]
outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                       [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=g))
                        for g in grammars])
report({"token_ids": [list(output.outputs[0].token_ids) for output in outputs],
        "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
        "accepted": metrics("vllm:spec_decode_num_accepted_tokens")})
"""


def test_anpd_under_async_scheduling_with_structured_outputs(tiny_llama_dir):
    # Three requests, each held to its own grammar: vLLM's bitmask has a row per placeholder, so
    # cutting one request's placeholders would hand the next ones other requests' masks.
    spec = {"method": "anpd", "num_speculative_tokens": K, "draft_length": "fixed"}
    plain = run_llm(tiny_llama_dir, STRUCTURED, llm_kwargs={"async_scheduling": None},
                    prelude=KEEP_VLLMS_ASYNC_DECISION)
    run = run_llm(tiny_llama_dir, STRUCTURED, spec, llm_kwargs={"async_scheduling": None},
                  prelude=KEEP_VLLMS_ASYNC_DECISION)
    assert run["async_scheduling"] is True
    assert run["token_ids"] == plain["token_ids"]
    assert run["accepted"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_anpd_tables_kept_through_preemption(tiny_llama_dir, requests, plain):
    # A KV cache of 12 blocks of 32 tokens: the scheduler preempts requests, which leave the batch
    # but not the runner, and come back with the same tokens.
    run = run_llm(tiny_llama_dir, GENERATE, {"method": "anpd", "num_speculative_tokens": K, "draft_length": "fixed"},
                  llm_kwargs={"max_num_seqs": 16, "num_gpu_blocks_override": 12, "block_size": 32},
                  args={"requests": requests}, prelude=RECORD_ABSORBED)
    assert run["preemptions"] > 0
    drafted = 0
    for index, (request, got, expected) in enumerate(zip(requests, run["requests"], plain["token_ids"])):
        assert got["output"] == expected, f"request {index}: output differs from plain decoding"
        if not got["absorbed"]:
            continue  # never drafted: its last step had no room, or it stopped at its prefill
        drafted += 1
        assert got["builds"] == [1], f"request {index}: tables rebuilt mid-request"
        sequence = request["prompt_token_ids"] + expected
        assert sequence[:len(got["absorbed"][0])] == got["absorbed"][0], f"request {index}: tables absorbed other tokens"
    assert drafted > 0 and run["accepted"]["vllm:spec_decode_num_accepted_tokens"] > 0
