"""Greedy speculative decoding inside vLLM equals plain decoding, token for token.

A random tiny Llama (float32) and random-but-initialised Amphista heads, ANPD,
and the awkward batches: 16 prompts of mixed lengths with some finishing
early (stop tokens, small max_tokens), max_tokens=1, and a prompt that nearly
fills max_model_len. One engine per method, each in its own subprocess.
"""

import json
import random
import shutil

import pytest

from conftest import TINY_SPECIAL_TOKENS, TINY_WORDS, run_engine, run_llm
from vllm_amphista.answer_ngrams import ANSWER_NGRAMS_NAME, AnswerNgrams

MAX_MODEL_LEN = 256


def mixed_requests(seed: int = 0) -> list[dict]:
    """16 prompts of mixed lengths, repetitive ones (drafts get accepted) and
    random ones, some stopping early on a stop token; max_tokens=1; and a
    prompt with only 3 tokens of room under max_model_len."""
    rng = random.Random(seed)
    first_word = len(TINY_SPECIAL_TOKENS)
    words = range(first_word, first_word + len(TINY_WORDS))
    requests = []
    for index in range(16):
        if index % 2:
            phrase = [rng.choice(words) for _ in range(rng.randint(2, 6))]
            prompt = (phrase * 20)[: rng.randint(8, 120)]
        else:
            prompt = [rng.choice(words) for _ in range(rng.randint(1, 150))]
        request = {"prompt_token_ids": prompt, "max_tokens": rng.choice([1, 7, 40, 64])}
        if index % 5 == 0:
            request["stop_token_ids"] = [rng.choice(words) for _ in range(20)]
        requests.append(request)
    requests.append({"prompt_token_ids": [first_word + 3] * (MAX_MODEL_LEN - 3), "max_tokens": 3})
    return requests


@pytest.fixture(scope="module")
def requests():
    return mixed_requests()


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, requests):
    return run_engine(tiny_llama_dir, requests)


def assert_same_outputs(spec_run: dict, plain_run: dict, requests: list[dict]) -> None:
    for index, (got, expected) in enumerate(zip(spec_run["token_ids"], plain_run["token_ids"])):
        assert got == expected, f"request {index} ({len(requests[index]['prompt_token_ids'])} prompt tokens) differs"
    assert len(spec_run["token_ids"]) == len(requests)


def test_target_steps_are_counted_per_request(tiny_llama_dir, plain, requests):
    """The benchmark's tau denominator: one step per token without speculation; with it, at
    most one per token and at least what vLLM's counters imply (they also count accepted
    tokens that max_tokens or a stop token then cut off)."""
    assert plain["target_steps"] == [len(ids) for ids in plain["token_ids"]]
    spec_run = run_engine(tiny_llama_dir, requests, {"method": "anpd", "num_speculative_tokens": 4,
                                                     "draft_length": "fixed"})
    generated = sum(len(ids) for ids in spec_run["token_ids"])
    assert all(1 <= steps <= len(ids) for steps, ids in zip(spec_run["target_steps"], spec_run["token_ids"])
               if ids)
    assert generated - spec_run["spec"]["vllm:spec_decode_num_accepted_tokens"] <= sum(spec_run["target_steps"])
    assert sum(spec_run["target_steps"]) < generated  # drafts were accepted


def test_plain_run_covers_the_edges(plain, requests):
    lengths = [len(ids) for ids in plain["token_ids"]]
    assert lengths[-1] == 3  # the near-full prompt still generates up to max_model_len
    assert any(len(ids) < r["max_tokens"] for ids, r in zip(plain["token_ids"], requests))  # stopped early
    assert 1 in lengths


def test_amphista_greedy_equals_plain(tiny_llama_dir, random_heads_dir, plain, requests):
    spec_run = run_engine(tiny_llama_dir, requests,
                          {"method": "amphista", "model": str(random_heads_dir), "num_speculative_tokens": 4})
    assert_same_outputs(spec_run, plain, requests)
    assert spec_run["spec"]["vllm:spec_decode_num_drafts"] > 0  # the drafter really ran


def test_amphista_fewer_tokens_than_heads(tiny_llama_dir, random_heads_dir, plain, requests):
    spec_run = run_engine(tiny_llama_dir, requests,
                          {"method": "amphista", "model": str(random_heads_dir), "num_speculative_tokens": 2,
                           "draft_length": "fixed"})
    assert_same_outputs(spec_run, plain, requests)
    drafts = spec_run["spec"]["vllm:spec_decode_num_drafts"]
    # Two tokens per draft, fewer only where max_model_len leaves no room.
    assert 2 * drafts - 3 <= spec_run["spec"]["vllm:spec_decode_num_draft_tokens"] <= 2 * drafts


# The load-aware default may choose K=0 for most of a run where this CPU's timings say drafting
# does not pay: only a fixed K is sure to verify drafts, so only there are accepted drafts asserted.
def hybrid_config(heads_dir, draft_length: str) -> dict:
    # K=6 with 4 heads: the tables draft past the heads.
    return {"method": "amphista_anpd", "model": str(heads_dir), "num_speculative_tokens": 6,
            "draft_length": draft_length}


@pytest.fixture(scope="module")
def hybrid_fixed(tiny_llama_dir, random_heads_dir, requests):
    return run_engine(tiny_llama_dir, requests, hybrid_config(random_heads_dir, "fixed"))


@pytest.mark.parametrize("draft_length", ["fixed", "adaptive"])
def test_hybrid_greedy_equals_plain(tiny_llama_dir, random_heads_dir, plain, requests, draft_length, request):
    spec_run = (request.getfixturevalue("hybrid_fixed") if draft_length == "fixed"
                else run_engine(tiny_llama_dir, requests, hybrid_config(random_heads_dir, draft_length)))
    assert_same_outputs(spec_run, plain, requests)
    if draft_length == "fixed":
        # Random heads are rarely right: accepted drafts on the repetitive prompts come from the tables.
        assert spec_run["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_hybrid_falls_back_on_the_heads_dirs_answer_ngrams(tiny_llama_dir, random_heads_dir, plain, requests,
                                                           hybrid_fixed, tmp_path):
    """A heads dir that ships answer n-grams (here counted from plain decoding's own outputs, so they
    draft well): the tables fall back on them, more drafts are accepted, the outputs stay plain's."""
    heads = tmp_path / "heads"
    shutil.copytree(random_heads_dir, heads)
    vocab_size = json.loads((heads / "config.json").read_text())["vocab_size"]
    AnswerNgrams.build(plain["token_ids"], vocab_size, min_count=1).save(heads / ANSWER_NGRAMS_NAME)
    spec_run = run_engine(tiny_llama_dir, requests, hybrid_config(heads, "fixed"))
    assert_same_outputs(spec_run, plain, requests)
    accepted = "vllm:spec_decode_num_accepted_tokens"
    assert spec_run["spec"][accepted] > hybrid_fixed["spec"][accepted]


@pytest.fixture(scope="module")
def anpd_fixed(tiny_llama_dir, requests):
    return run_engine(tiny_llama_dir, requests,
                      {"method": "anpd", "num_speculative_tokens": 4, "draft_length": "fixed"})


@pytest.mark.parametrize("draft_length", ["fixed", "adaptive"])
def test_anpd_greedy_equals_plain(tiny_llama_dir, plain, requests, draft_length, request):
    spec_run = (request.getfixturevalue("anpd_fixed") if draft_length == "fixed"
                else run_engine(tiny_llama_dir, requests, {"method": "anpd", "num_speculative_tokens": 4,
                                                           "draft_length": draft_length}))
    assert_same_outputs(spec_run, plain, requests)
    if draft_length == "fixed":
        assert spec_run["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0  # repetitive prompts get accepted


def test_anpd_falls_back_on_answer_ngrams(tiny_llama_dir, plain, requests, anpd_fixed, tmp_path):
    """ANPD given a directory of answer n-grams as its model (counted here from plain decoding's own
    outputs): more drafts accepted, the outputs stay plain's."""
    vocab_size = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    AnswerNgrams.build(plain["token_ids"], vocab_size, min_count=1).save(tmp_path / ANSWER_NGRAMS_NAME)
    spec_run = run_engine(tiny_llama_dir, requests, {"method": "anpd", "model": str(tmp_path),
                                                     "num_speculative_tokens": 4, "draft_length": "fixed"})
    assert_same_outputs(spec_run, plain, requests)
    accepted = "vllm:spec_decode_num_accepted_tokens"
    assert spec_run["spec"][accepted] > anpd_fixed["spec"][accepted]


def test_plugin_loads_in_the_engine_process(tiny_llama_dir, plain, requests):
    """With vLLM's multi-process engine the drafter lives in another process:
    drafts there prove vLLM itself loaded the plugin (nothing here imports it)."""
    spec_run = run_engine(tiny_llama_dir, requests[:4], {"method": "anpd", "num_speculative_tokens": 3},
                          extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert_same_outputs(spec_run, plain, requests[:4])
    assert spec_run["spec"]["vllm:spec_decode_num_drafts"] > 0


# Records, in order, what the engine core does while the requests run: its calls to the worker
# (by method), the scheduler's update from each step's output, and the load-aware draft length's
# observations of the steps.
RECORD_ENGINE_CORE = """
engine_core = llm.llm_engine.engine_core.engine_core
executor, scheduler = engine_core.model_executor, engine_core.scheduler
controller = scheduler.dynamic_sd_lookup
events = []
collective_rpc, update_from_output, observe_step = (executor.collective_rpc, scheduler.update_from_output,
                                                    controller.observe_step)

def recorded_rpc(method, *rpc_args, **rpc_kwargs):
    events.append(method)
    return collective_rpc(method, *rpc_args, **rpc_kwargs)

def recorded_update(*update_args):
    events.append("update")
    try:
        return update_from_output(*update_args)
    finally:
        events.append("updated")

def recorded_observation(*observed):
    events.append("observe")
    return observe_step(*observed)

executor.collective_rpc, scheduler.update_from_output, controller.observe_step = (
    recorded_rpc, recorded_update, recorded_observation)
params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], stop_token_ids=r.get("stop_token_ids"))
          for r in args]
outputs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in args], params, use_tqdm=False)
report({"token_ids": [list(o.outputs[0].token_ids) for o in outputs], "events": events,
        "spec": metrics("vllm:spec_decode")})
"""


@pytest.fixture(scope="module")
def anpd_with_worker_process(tiny_llama_dir, requests):
    """ANPD, load-aware draft length, the worker in a process of its own (as on every CPU)."""
    return run_llm(tiny_llama_dir, RECORD_ENGINE_CORE, {"method": "anpd", "num_speculative_tokens": 3},
                   llm_kwargs={"distributed_executor_backend": "mp"}, args=requests[:8])


def test_drafts_come_back_with_the_sampled_tokens(anpd_with_worker_process, plain, requests):
    """Where the worker is another process, the step's drafts ride back on its output: the engine
    core asks the worker for nothing after sampling, and the outputs stay those of plain decoding."""
    run = anpd_with_worker_process
    assert_same_outputs(run, plain, requests[:8])
    assert run["spec"]["vllm:spec_decode_num_drafts"] > 0
    assert run["events"].count("sample_tokens") > 0
    assert "take_draft_token_ids" not in run["events"]


def test_the_draft_length_learns_while_the_worker_runs_the_next_step(anpd_with_worker_process):
    """The load-aware draft length learns from every step (all but the last, still pending at the
    end), each once the next step is with the worker: never between a step's output and the next
    step's start."""
    events = anpd_with_worker_process["events"]
    assert events.count("observe") == events.count("update") - 1 > 10
    for index, event in enumerate(events):
        if event == "observe":
            assert events[index - 1] == "execute_model", events[max(index - 6, 0):index + 2]


def decode_steps(run: dict) -> int:
    """Request-steps after each request's first token: the steps a fixed-K drafter drafts for."""
    return sum(steps - 1 for steps, ids in zip(run["target_steps"], run["token_ids"]) if ids)


# vLLM's own per-batch-size schedule: as requests finish, the batch shrinks from 17 and each
# running request goes through K=2, then K=0, then K=4.
SCHEDULE = [[1, 2, 4], [3, 6, 0], [7, 64, 2]]


@pytest.mark.parametrize("method", ["amphista", "anpd", "amphista_anpd"])
def test_greedy_equals_plain_when_k_changes_mid_request(tiny_llama_dir, random_heads_dir, plain, requests, method):
    config = {"method": method, "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": SCHEDULE}
    if method != "anpd":
        config["model"] = str(random_heads_dir)
    spec_run = run_engine(tiny_llama_dir, requests, config)
    assert_same_outputs(spec_run, plain, requests)
    spec = spec_run["spec"]
    assert spec["vllm:spec_decode_num_drafts"] > 0
    if method == "amphista":  # drafts every step it may: the K=0 steps show as steps without a draft
        assert spec["vllm:spec_decode_num_drafts"] < decode_steps(spec_run) - 20


def test_adaptive_amphista_stops_drafting_what_is_rejected(tiny_llama_dir, random_heads_dir, plain, requests):
    """Random heads are almost never accepted: the load-aware default learns that and verifies
    far fewer draft tokens than fixed K, and the output stays the target's."""
    config = {"method": "amphista", "model": str(random_heads_dir), "num_speculative_tokens": 4}
    adaptive = run_engine(tiny_llama_dir, requests, config)
    fixed = run_engine(tiny_llama_dir, requests, {**config, "draft_length": "fixed"})
    assert_same_outputs(adaptive, plain, requests)
    assert_same_outputs(fixed, plain, requests)
    adaptive_tokens = adaptive["spec"]["vllm:spec_decode_num_draft_tokens"]
    assert adaptive_tokens < 0.5 * fixed["spec"]["vllm:spec_decode_num_draft_tokens"]
