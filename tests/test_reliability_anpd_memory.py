"""ANPD's per-request N-gram tables (alone, and in the amphista_anpd hybrid) do not pile up:
1000 short requests through one engine.

The engine is in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so test code
reaches the drafter through vLLM's own `LLM.collective_rpc`, which runs a
callable on the worker: `worker.model_runner.drafter.state_size` is
(requests tracked, N-gram contexts stored). Requests are fed through
`llm.llm_engine.add_request` / `step()` so the state can be read after every
engine step while requests are live.
"""

import random

import pytest

from vllm_amphista.vllm.config import ANPD_DEFAULT_MAX_CONTEXT

from conftest import TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE, run_llm

NUM_REQUESTS = 1000
MAX_NUM_SEQS = 32
MAX_STEPS = 20_000  # a bound on the step loop, far above what 1000 short requests need

STEP_BY_STEP_BODY = """
def drafter_state():
    (requests, contexts), = llm.collective_rpc(lambda worker: worker.model_runner.drafter.state_size)
    return requests, contexts

def live_in_runner():
    return llm.collective_rpc(lambda worker: worker.model_runner.input_batch.num_reqs)[0]

def run_to_completion(requests):
    engine = llm.llm_engine
    for index, request in enumerate(requests):
        engine.add_request(f"{request['id_prefix']}{index}", {"prompt_token_ids": request["prompt_token_ids"]},
                           SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True))
    finished, states, steps = {}, [], 0
    while engine.has_unfinished_requests() and steps < args["max_steps"]:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = len(output.outputs[0].token_ids)
        states.append(drafter_state())
        steps += 1
    return finished, states

def idle_steps():
    for _ in range(3):  # the engine's last steps hand the runner the final finished-request ids
        llm.llm_engine.step()
    return {"drafter": drafter_state(), "runner_requests": live_in_runner()}

finished, states = run_to_completion(args["requests"])
after_drain = drafter_state()
idle_after_1000 = idle_steps()
# A full batch finishing in the same step: same prompt length and max_tokens, started together.
wave = [{"id_prefix": "wave-", "prompt_token_ids": r["prompt_token_ids"][:6], "max_tokens": 8}
        for r in args["requests"][:args["max_num_seqs"]]]
wave_finished, _ = run_to_completion(wave)
idle_after_wave = idle_steps()
one_more, _ = run_to_completion([{"id_prefix": "one-more-", "prompt_token_ids": wave[0]["prompt_token_ids"],
                                  "max_tokens": 8}])
report({"finished": finished, "states": states, "after_drain": after_drain, "idle_after_1000": idle_after_1000,
        "wave_finished": wave_finished, "idle_after_wave": idle_after_wave, "one_more": one_more,
        "after_one_more": drafter_state(), "spec": metrics("vllm:spec_decode")})
"""


def short_requests(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    first_word = len(TINY_SPECIAL_TOKENS)
    requests = []
    for _ in range(NUM_REQUESTS):
        phrase = [rng.randrange(first_word, TINY_VOCAB_SIZE) for _ in range(rng.randint(2, 4))]
        requests.append({"id_prefix": "short-", "prompt_token_ids": (phrase * 8)[: rng.randint(6, 24)],
                         "max_tokens": rng.randint(4, 16)})
    return requests


@pytest.fixture(scope="module")
def requests():
    return short_requests()


@pytest.fixture(scope="module", params=["anpd", "amphista_anpd"])
def run(request, tiny_llama_dir, random_heads_dir, requests):
    # Fixed K: the load-aware default may draft nothing on this CPU, and then no tables are built.
    config = {"method": request.param, "num_speculative_tokens": 4, "draft_length": "fixed"}
    if request.param == "amphista_anpd":
        config["model"] = str(random_heads_dir)
    return run_llm(tiny_llama_dir, STEP_BY_STEP_BODY, config,
                   llm_kwargs={"max_num_seqs": MAX_NUM_SEQS},
                   args={"requests": requests, "max_steps": MAX_STEPS, "max_num_seqs": MAX_NUM_SEQS}, timeout=900)


def test_all_requests_complete(run, requests):
    assert len(run["finished"]) == NUM_REQUESTS
    assert all(run["finished"][f"short-{i}"] == r["max_tokens"] for i, r in enumerate(requests))
    assert run["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_state_is_live_while_requests_run_and_never_exceeds_a_batch(run):
    tracked = [requests for requests, _ in run["states"]]
    contexts = [contexts for _, contexts in run["states"]]
    print(f"{len(run['states'])} steps; tracked requests max {max(tracked)}, contexts max {max(contexts)}; "
          f"after drain {run['after_drain']}, idle after 1000 {run['idle_after_1000']}, "
          f"idle after a full batch finishing together {run['idle_after_wave']}, "
          f"after one more request {run['after_one_more']}")
    assert max(tracked) > 0 and max(contexts) > 0
    assert max(tracked) <= MAX_NUM_SEQS  # finished requests are dropped as the batch moves on
    # Short requests (at most 40 tokens) store at most N-1 contexts per token.
    assert max(contexts) <= MAX_NUM_SEQS * ANPD_DEFAULT_MAX_CONTEXT * 40


def test_a_request_after_idle_holds_only_its_own_tables(run):
    assert run["one_more"] == {"one-more-0": 8}
    requests_tracked, contexts = run["after_one_more"]
    assert requests_tracked == 1 and contexts <= ANPD_DEFAULT_MAX_CONTEXT * (6 + 8)


def test_idle_engine_holds_no_state(run):
    assert len(run["wave_finished"]) == MAX_NUM_SEQS
    for idle in (run["idle_after_1000"], run["idle_after_wave"]):
        assert idle["runner_requests"] == 0  # vLLM itself has let go of every request
        assert idle["drafter"] == [0, 0]  # and so has the drafter, with no request to come
