"""Preemption loses nothing: a KV cache too small for the batch, outputs still equal plain decoding.

16 long greedy requests (each running to max_model_len) share a KV cache of
16 blocks of 32 tokens, room for two requests at full length, so the
scheduler preempts and later recomputes requests again and again (checked
with vLLM's `vllm:num_preemptions` counter). A preempted request loses its
KV cache, Amphista's draft KV included; ANPD keeps its tables (the runner
keeps the request) and goes on from them when it returns. The reference is a plain engine with
a roomy cache (no preemption).
"""

import random

import pytest

from conftest import TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE, run_llm

MAX_MODEL_LEN = 256
SMALL_KV_CACHE = {"num_gpu_blocks_override": 16, "block_size": 32, "max_num_seqs": 16}

GENERATE_BODY = """
outputs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in args],
                       [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in args])
report({"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "preemptions": metrics("vllm:num_preemptions")["vllm:num_preemptions"],
        "spec": metrics("vllm:spec_decode")})
"""


def long_requests(seed: int = 0, count: int = 16) -> list[dict]:
    """Prompts of 40-120 tokens (half repetitive), each generating up to max_model_len."""
    rng = random.Random(seed)
    first_word = len(TINY_SPECIAL_TOKENS)
    requests = []
    for index in range(count):
        length = rng.randint(40, 120)
        if index % 2:
            phrase = [rng.randrange(first_word, TINY_VOCAB_SIZE) for _ in range(rng.randint(2, 6))]
            prompt = (phrase * length)[:length]
        else:
            prompt = [rng.randrange(first_word, TINY_VOCAB_SIZE) for _ in range(length)]
        requests.append({"prompt_token_ids": prompt, "max_tokens": MAX_MODEL_LEN - length})
    return requests


@pytest.fixture(scope="module")
def requests():
    return long_requests()


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, requests):
    run = run_llm(tiny_llama_dir, GENERATE_BODY, args=requests)
    assert run["preemptions"] == 0
    return run


@pytest.mark.slow
@pytest.mark.parametrize("method", ["amphista", "anpd"])
def test_outputs_survive_preemption(method, tiny_llama_dir, random_heads_dir, requests, plain):
    config = {"amphista": {"method": "amphista", "model": str(random_heads_dir), "num_speculative_tokens": 4},
              "anpd": {"method": "anpd", "num_speculative_tokens": 4}}[method]
    run = run_llm(tiny_llama_dir, GENERATE_BODY, config, llm_kwargs=SMALL_KV_CACHE, args=requests)
    print(f"{method}: {run['preemptions']} preemptions, spec metrics {run['spec']}")
    assert run["preemptions"] >= len(requests) // 2  # preemption really happened, many times
    for index, (got, expected) in enumerate(zip(run["token_ids"], plain["token_ids"])):
        assert got == expected, f"request {index} differs after preemption"
    assert [len(ids) for ids in run["token_ids"]] == [r["max_tokens"] for r in requests]
    assert run["spec"]["vllm:spec_decode_num_drafts"] > 0
