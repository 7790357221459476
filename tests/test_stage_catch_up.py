"""Steps that draft nothing skip Amphista's stages, which catch up on the next pass.

In a real engine, a draft-length schedule with K=0 stretches (one shorter and one longer than the
backlog bound) runs the same requests twice: stages deferred, and stages run on every step. The
drafts after every stretch must be the same token for token (the catch-up pass wrote the KV the
skipped steps would have), for heads reading one target layer or several, the stages must really
have been skipped, and greedy outputs must equal plain decoding. Async scheduling (padded drafts,
rejected rows in the next step's inputs) and synchronous scheduling (rejected rows dropped) both run
(async kept on CPU as in `conftest.KEEP_VLLMS_ASYNC_DECISION`).
"""

import pytest
import torch

from conftest import KEEP_VLLMS_ASYNC_DECISION, build_random_heads, run_engine, run_llm

K = 3
# A backlog bound shorter than the requests (the shipped one outlasts most answers).
BACKLOG_BOUND = 32
# Scheduler steps (1-based) with K=0: a short stretch, then one past the backlog bound.
ZERO_STRETCHES = [(5, 10), (16, 16 + BACKLOG_BOUND + 8)]

SCENARIO = """
import torch
engine_core = llm.llm_engine.engine_core.engine_core
runner = engine_core.model_executor.driver_worker.worker.model_runner
drafter, model = runner.drafter, runner.drafter.model

class Schedule:
    # Read by vLLM's scheduler once per step, as its per-batch-size draft lengths.
    def __init__(self):
        self.step = 0

    def __getitem__(self, batch_size):
        self.step += 1
        return 0 if any(first <= self.step <= last for first, last in args["zero_stretches"]) else args["k"]

stage_passes, heads_inputs, chains = [], [], []
run_stages, heads_forward, chain = drafter._run_stages, model.heads.forward, model.chain

def recorded_run_stages(num_tokens, cad, rows_to_draft=None):
    stage_passes.append(num_tokens)
    return run_stages(num_tokens, cad, rows_to_draft)

def recorded_heads(stage_outputs):  # eager: the heads' forward runs inside the stages' pass
    heads_inputs.append(stage_outputs.clone())
    return heads_forward(stage_outputs)

def recorded_chain(heads_out, num_tokens):
    token_ids, confidence = chain(heads_out, num_tokens)
    chains.append(token_ids.clone())
    return token_ids, confidence

drafter._run_stages, model.heads.forward, model.chain = recorded_run_stages, recorded_heads, recorded_chain
drafter.max_deferred_positions = args["backlog_bound"]
prompts = [{"prompt_token_ids": [12 + (i * 7 + j) % 40 for j in range(6 + 5 * i)] * 2} for i in range(3)]
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (70, 45, 60)]
runs = {}
for defer in (True, False):
    drafter.defer_idle_stages = defer
    engine_core.scheduler.dynamic_sd_lookup = Schedule()
    for recorded in (stage_passes, heads_inputs, chains):
        recorded.clear()
    outputs = llm.generate(prompts, params)
    assert not drafter.deferred, "finished requests left deferred stage inputs behind"
    assert len(heads_inputs) == len(chains)
    torch.save([("draft", *pair) for pair in zip(heads_inputs, chains)], args["path"] + f"-{defer}.pt")
    runs[defer] = {"outputs": [list(o.outputs[0].token_ids) for o in outputs],
                   "stage_passes": len(stage_passes), "stage_rows": list(stage_passes)}
runs["async_scheduling"] = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
report(runs)
"""


@pytest.fixture(scope="module")
def layered_heads_dir(tiny_llama_dir, tmp_path_factory):
    """Heads reading both target layers: their stage inputs are owed uncombined, [m, 2H] per request."""
    return build_random_heads(tiny_llama_dir, tmp_path_factory.mktemp("layered_heads"), target_feature_layers=[1, 2])


@pytest.mark.parametrize("async_scheduling,layered", [(True, False), (False, False), (False, True)],
                         ids=["async", "sync", "sync-layered-heads"])
def test_drafts_after_skipped_stages_equal_drafts_of_stages_run_every_step(tiny_llama_dir, random_heads_dir,
                                                                           layered_heads_dir, tmp_path,
                                                                           async_scheduling, layered):
    path = str(tmp_path / "drafts")
    heads = layered_heads_dir if layered else random_heads_dir
    runs = run_llm(tiny_llama_dir, SCENARIO,
                   {"method": "amphista", "model": str(heads), "num_speculative_tokens": K,
                    "draft_length": "fixed"},
                   llm_kwargs={"enable_prefix_caching": False, "async_scheduling": async_scheduling},
                   args={"path": path, "k": K, "zero_stretches": ZERO_STRETCHES, "backlog_bound": BACKLOG_BOUND},
                   prelude=KEEP_VLLMS_ASYNC_DECISION)
    assert runs["async_scheduling"] is async_scheduling
    deferred, every_step = runs["true"], runs["false"]  # JSON's keys
    assert deferred["outputs"] == every_step["outputs"]
    # Stages skipped: fewer passes; the longer stretch ran them when the backlog was full.
    assert deferred["stage_passes"] < every_step["stage_passes"] - 10
    assert max(deferred["stage_rows"]) > max(every_step["stage_rows"][1:])  # a catch-up pass of owed rows
    with_deferral, without = torch.load(path + "-True.pt"), torch.load(path + "-False.pt")
    assert len(with_deferral) == len(without) >= 15
    for (_, stages_a, drafts_a), (_, stages_b, drafts_b) in zip(with_deferral, without):
        assert torch.equal(drafts_a, drafts_b)
        torch.testing.assert_close(stages_a, stages_b, rtol=1e-4, atol=1e-4)


def test_greedy_equals_plain_with_skipped_stages(tiny_llama_dir, random_heads_dir):
    requests = [{"prompt_token_ids": [12 + (i * 5 + j) % 40 for j in range(4 + 7 * i)] * 2,
                 "max_tokens": 30 + 15 * i} for i in range(4)]
    plain = run_engine(tiny_llama_dir, requests)
    # K=0 at every batch size but one: the stages defer, and catch up when the batch shrinks to
    # one request (the requests end one after another).
    schedule = {"num_speculative_tokens_per_batch_size": [[1, 1, K], [2, 256, 0]]}
    for method in ("amphista", "amphista_anpd"):
        spec_run = run_engine(tiny_llama_dir, requests, {"method": method, "model": str(random_heads_dir),
                                                         "num_speculative_tokens": K, **schedule})
        assert spec_run["token_ids"] == plain["token_ids"], method
        assert spec_run["spec"]["vllm:spec_decode_num_drafts"] > 0, method
