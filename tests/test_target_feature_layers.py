"""Drafters that read several target layers, on a random tiny Llama: Amphista heads with
`target_feature_layers`, and the DFlash baseline through vLLM's own `dflash` method.

`train features --feature-layers` records the target's residual streams, drafters train on
them, and inside vLLM the same streams come from the target's own forward pass (its auxiliary
hidden states): the engine drafts what the reference drafter drafts from transformers' streams,
and greedy output equals plain decoding, float32.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import (RECORD_AMPHISTA_PASSES, REPO_ROOT, VLLM_CPU_TEST_ENV, build_random_heads, drafted_rows, run_engine,
                      run_llm, tiny_samples, write_jsonl)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from vllm_amphista.modeling_amphista import AmphistaDrafter, target_features
from vllm_amphista.prompts import DataError
from vllm_amphista.train.batch import Batch
from vllm_amphista.train.data import Dataset
from vllm_amphista.train.dflash import MASK_EMBEDDING_NAME, DFlashMethod
from vllm_amphista.train.fit import FitOptions, fit
from vllm_amphista.train.target import load_target

LAYERS = [1, 2]  # the tiny Llama has 2 layers: after the first, and the final norm's input


@pytest.fixture(scope="module")
def layered_dataset(tiny_llama_dir, tmp_path_factory):
    """Features of the tiny target's own answers with both layers' streams, by the CLI (float32)."""
    root = tmp_path_factory.mktemp("layered")
    answers = write_jsonl(root / "answers.jsonl", tiny_samples(tiny_llama_dir, 12, output_len=30))
    out = root / "features"
    completed = subprocess.run(
        [sys.executable, "-m", "vllm_amphista.train", "features", "--target", str(tiny_llama_dir), "--answers",
         str(answers), "--out", str(out), "--feature-layers", *map(str, LAYERS), "--hidden-dtype", "float32",
         "--max-model-len", "256", "--concurrency", "8", "--shard-size", "5"],
        cwd=REPO_ROOT, env={**os.environ, **VLLM_CPU_TEST_ENV}, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def layered_heads(tiny_llama_dir, tmp_path_factory):
    """Layered heads whose streams' norm weights are far from one: the engine folds them into its
    input matrix, which the drafts then depend on."""
    heads = build_random_heads(tiny_llama_dir, tmp_path_factory.mktemp("layered_heads"), num_draft_heads=3,
                               target_feature_layers=LAYERS)
    drafter = AmphistaDrafter.from_pretrained(heads, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for norm in drafter.combine.norms:
            norm.weight.uniform_(0.25, 2.0, generator=generator)
    drafter.save_pretrained(heads, dtype=torch.float32)
    return heads


@pytest.fixture(scope="module")
def deep_heads(tiny_llama_dir, tmp_path_factory):
    """Layered heads with two layers per adaptation stage and two encoder layers (`fit --init-heads
    --stage-layers 2 --encoder-layers 2` grows heads to this shape)."""
    return build_random_heads(tiny_llama_dir, tmp_path_factory.mktemp("deep_heads"), num_draft_heads=3,
                              target_feature_layers=LAYERS, stage_num_layers=2, encoder_num_layers=2)


@pytest.fixture(scope="module")
def last_layer_heads(tiny_llama_dir, tmp_path_factory):
    """Heads without target_feature_layers: what every heads dir was before the option existed."""
    return build_random_heads(tiny_llama_dir, tmp_path_factory.mktemp("last_layer_heads"), num_draft_heads=3)


def test_features_records_each_layers_stream(tiny_llama_dir, layered_dataset):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    final, layered = Dataset([layered_dataset]), Dataset([layered_dataset], LAYERS)
    reversed_order = final.with_feature_layers(LAYERS[::-1])
    for index in (0, 7, 11):
        ids = torch.tensor([final.samples[index].token_ids])
        with torch.no_grad():
            expected = target_features(model, ids, LAYERS)[0, :-1]
            expected_final = target_features(model, ids, None)[0, :-1]
        assert torch.allclose(layered.tensors(index).hidden, expected, rtol=1e-4, atol=1e-3)
        assert torch.allclose(final.tensors(index).hidden, expected_final, rtol=1e-4, atol=1e-3)
        first, second = layered.tensors(index).hidden.chunk(2, dim=-1)
        assert torch.equal(reversed_order.tensors(index).hidden, torch.cat([second, first], dim=-1))
    with pytest.raises(DataError, match=r"not \[3\].*--feature-layers"):
        final.with_feature_layers([3]).tensors(0)


def test_feature_layers_must_be_in_the_order_vllm_runs_them(tiny_llama_dir, tmp_path):
    from vllm_amphista.train.data import Sample
    from vllm_amphista.train.generate import generate_dataset

    for layers in ([2, 1], [1, 1], [1, 3]):
        with pytest.raises(ValueError, match=r"ascending distinct layer counts in 1\.\.2"):
            generate_dataset(str(tiny_llama_dir), tmp_path, token_samples=[Sample([12, 13], [14])],
                             feature_layers=layers)


def test_fit_trains_heads_that_read_the_layers(tiny_llama_dir, layered_dataset, tmp_path):
    result = fit(FitOptions(target=str(tiny_llama_dir), data=[str(layered_dataset)], out=str(tmp_path / "heads"),
                            state_dir=str(tmp_path / "state"), target_feature_layers=LAYERS, num_heads=3,
                            max_steps=12, batch_tokens=256, row_tokens=128, eval_fraction=0.0, lr=3e-3, threads=1))
    assert sum(result.train_losses[-3:]) < sum(result.train_losses[:3])
    drafter = AmphistaDrafter.from_pretrained(tmp_path / "heads")
    assert drafter.config.target_feature_layers == LAYERS and drafter.combine is not None
    with pytest.raises(ValueError, match="applies to --method amphista and dflash only"):
        FitOptions(target="t", data=["d"], out="o", method="medusa", target_feature_layers=LAYERS).validate()


def fit_draft_token_heads(tiny_llama_dir, dataset, root, reads):
    """Layered heads with a draft vocabulary whose heads 2..K read drafted tokens (`reads`),
    fitted briefly by `fit --draft-token-mlp`, then that MLP's down projection randomised (it starts
    at zero) so that what it reads moves the drafts."""
    result = fit(FitOptions(target=str(tiny_llama_dir), data=[str(dataset)], out=str(root / "fitted"),
                            state_dir=str(root / "state"), target_feature_layers=LAYERS, num_heads=3,
                            draft_vocab_size=64, draft_token_mlp=64, draft_token_mlp_reads=reads, max_steps=12,
                            batch_tokens=256, row_tokens=128, eval_fraction=0.0, lr=3e-3, threads=1))
    drafter = AmphistaDrafter.from_pretrained(root / "fitted", dtype=torch.float32)
    with torch.no_grad():
        down = drafter.auto_embedding.draft_token_mlp.down_proj.weight
        down.copy_(torch.randn(down.shape, generator=torch.Generator().manual_seed(0)) * 0.3)
    drafter.save_pretrained(root / "heads", dtype=torch.float32)
    return root / "heads", result


@pytest.fixture(scope="module")
def draft_token_heads(tiny_llama_dir, layered_dataset, tmp_path_factory):
    """Heads 2..K read the token drafted just before them."""
    return fit_draft_token_heads(tiny_llama_dir, layered_dataset, tmp_path_factory.mktemp("draft_token_heads"),
                                 "previous")


@pytest.fixture(scope="module")
def first_draft_token_heads(tiny_llama_dir, layered_dataset, tmp_path_factory):
    """Heads 2..K read the first head's token."""
    return fit_draft_token_heads(tiny_llama_dir, layered_dataset, tmp_path_factory.mktemp("first_draft_token"),
                                 "first")


def test_fit_trains_heads_that_read_the_drafted_tokens(draft_token_heads, first_draft_token_heads):
    for (heads, result), reads in ((draft_token_heads, "previous"), (first_draft_token_heads, "first")):
        assert sum(result.train_losses[-3:]) < sum(result.train_losses[:3])
        drafter = AmphistaDrafter.from_pretrained(heads)
        assert drafter.config.draft_token_mlp_size == 64 and drafter.config.draft_vocab_size == 64
        assert drafter.config.draft_token_mlp_reads == reads
    with pytest.raises(ValueError, match="amphista only"):
        FitOptions(target="t", data=["d"], out="o", method="eagle", draft_token_mlp=64).validate()
    with pytest.raises(ValueError, match="applies to heads with --draft-token-mlp"):
        FitOptions(target="t", data=["d"], out="o", draft_token_mlp_reads="first").validate()


# In the engine's process: what the stages were fed and what was drafted, step by step.
RECORD_DRAFTS_BODY = RECORD_AMPHISTA_PASSES + """
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
outputs = llm.generate([{"prompt_token_ids": args["prompt"]}], SamplingParams(temperature=0.0, max_tokens=40))
torch.save(calls, args["path"])
report({"output": list(outputs[0].outputs[0].token_ids), "aux": runner.use_aux_hidden_state_outputs})
"""


@pytest.mark.parametrize("kind, enforce_eager", [
    pytest.param("layered", True, id="layered"),
    pytest.param("last-layer", True, id="last-layer"),
    pytest.param("deep", True, id="deep"),
    pytest.param("draft-tokens", True, id="draft-tokens"),
    pytest.param("first-draft-tokens", True, id="first-draft-tokens"),
    # A minute of compiling, for the head-by-head form no shipped heads use (the shipped heads, which read
    # the first head's token, are compared compiled in test_demo_target).
    pytest.param("draft-tokens", False, id="draft-tokens-compiled", marks=pytest.mark.slow),
])
def test_vllm_drafts_from_the_targets_layers_as_the_reference_does(tiny_llama_dir, layered_heads, last_layer_heads,
                                                                   deep_heads, draft_token_heads,
                                                                   first_draft_token_heads, tmp_path, kind,
                                                                   enforce_eager):
    """Heads reading several target layers, heads from before the option (the final norm's
    output only), deeper stages and encoder, and layered heads that read the tokens drafted before
    them (head by head, eager and compiled, or all the first head's) draft in vLLM what the
    reference drafter drafts."""
    heads = {"layered": layered_heads, "last-layer": last_layer_heads, "deep": deep_heads,
             "draft-tokens": draft_token_heads[0], "first-draft-tokens": first_draft_token_heads[0]}[kind]
    layers = None if kind == "last-layer" else LAYERS
    prompt = [12, 40, 41, 12, 40, 41, 12, 40, 41, 12, 57]
    run = run_llm(tiny_llama_dir, RECORD_DRAFTS_BODY, {"method": "amphista", "model": str(heads),
                                                       "num_speculative_tokens": 3, "draft_length": "fixed"},
                  llm_kwargs={"enforce_eager": enforce_eager},
                  args={"prompt": prompt, "path": str(tmp_path / "calls.pt")})
    assert run["aux"] == bool(layers)  # vLLM captures the target's layers only for layered heads
    ids = torch.tensor([prompt + run["output"]])
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    reference = AmphistaDrafter.from_pretrained(heads, dtype=torch.float32).eval()
    with safe_open(str(tiny_llama_dir / "model.safetensors"), framework="pt") as weights:
        embed = weights.get_tensor("model.embed_tokens.weight").float()
    with torch.no_grad():
        features = target_features(model, ids, layers)
        # Row t drafts once x_{t+1} is known: the heads' view of the final sequence.
        reference_drafts = reference.draft(features[:, :-1], ids[:, 1:], embed, embed)[0][0]  # tied lm_head
    compared = 0
    for (_, _, positions, _, _), row, engine_drafts in drafted_rows(torch.load(tmp_path / "calls.pt")):
        last = int(positions[row])
        assert engine_drafts == reference_drafts[last].tolist(), f"drafts differ at position {last}"
        compared += 1
    assert compared >= 10


def test_layered_heads_without_their_projection_are_refused(tiny_llama_dir, layered_heads, tmp_path):
    """The engine multiplies combine.proj into fuse as it loads them: heads that lost it are refused by
    name, not run on a half-loaded matrix."""
    broken = tmp_path / "heads"
    shutil.copytree(layered_heads, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["combine.proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(AssertionError, match=r"Amphista checkpoint lacks \['combine.proj.weight'\]"):
        run_llm(tiny_llama_dir, "report({})", {"method": "amphista", "model": str(broken), "num_speculative_tokens": 3})


def test_greedy_equals_plain_with_layered_heads(tiny_llama_dir, layered_heads, draft_token_heads):
    requests = [{"prompt_token_ids": [12 + (i * 7 + j) % 40 for j in range(5 + 9 * i)] * 2, "max_tokens": 32}
                for i in range(6)]
    plain = run_engine(tiny_llama_dir, requests)
    for heads, method in ((layered_heads, "amphista"), (layered_heads, "amphista_anpd"),
                          (draft_token_heads[0], "amphista")):
        spec_run = run_engine(tiny_llama_dir, requests, {"method": method, "model": str(heads),
                                                         "num_speculative_tokens": 3, "draft_length": "fixed"})
        assert spec_run["token_ids"] == plain["token_ids"], (heads, method)
        assert spec_run["spec"]["vllm:spec_decode_num_drafts"] > 0


@pytest.fixture(scope="module")
def dflash_dir(tiny_llama_dir, layered_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    result = fit(FitOptions(target=str(tiny_llama_dir), data=[str(layered_dataset)], out=str(root / "drafter"),
                            state_dir=str(root / "state"), method="dflash", target_feature_layers=LAYERS,
                            num_heads=3, dflash_layers=2, dflash_anchors=16, draft_vocab_size=200, max_steps=12,
                            batch_tokens=256, row_tokens=128, eval_fraction=0.0, lr=3e-3, threads=1))
    return root / "drafter", result


def test_dflash_trains_and_saves_in_vllms_format(tiny_llama_dir, layered_dataset, dflash_dir):
    directory, result = dflash_dir
    assert sum(result.train_losses[-3:]) < sum(result.train_losses[:3])
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_hidden_layers"] == 2
    assert config["dflash_config"]["target_layer_ids"] == [0, 1]  # vLLM adds one
    weights = load_file(directory / "model.safetensors")
    assert weights["lm_head.weight"].shape == (200, 128) and weights["d2t"].dtype == torch.int64
    assert "layers.1.self_attn.k_norm.weight" in weights and "mask_embedding" not in weights
    assert torch.load(directory / MASK_EMBEDDING_NAME)["embedding"].shape == (128,)
    # The mask marker is an id the data never holds.
    assert all(config["dflash_config"]["mask_token_id"] not in sample.token_ids
               for sample in Dataset([layered_dataset]).samples)
    target = load_target(str(tiny_llama_dir))
    loaded = DFlashMethod.load(directory, target)
    # The draft vocabulary's lm_head is the target's rows of the d2t-mapped ids, frozen.
    assert torch.allclose(loaded.lm_head.weight, target.lm_head_weight[loaded.vocab.draft_to_target], atol=0.02)
    with pytest.raises(ValueError, match="give --target-feature-layers"):
        FitOptions(target="t", data=["d"], out="o", method="dflash").validate()


# In the engine's process: each step's bonus token, the position it takes, and the DFlash drafts.
RECORD_DFLASH_BODY = """
import torch
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
propose = runner.drafter.propose
steps = []

def recorded_propose(num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                     next_token_ids, token_indices_to_sample, common_attn_metadata, *rest, **options):
    drafts = propose(num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                     next_token_ids, token_indices_to_sample, common_attn_metadata, *rest, **options)
    rejected = options.get("num_rejected_tokens_gpu")
    position = int(common_attn_metadata.seq_lens[0]) - (0 if rejected is None else int(rejected[0]))
    steps.append((position, int(next_token_ids[0]), drafts[0].tolist()))
    return drafts

runner.drafter.propose = recorded_propose
outputs = llm.generate([{"prompt_token_ids": args["prompt"]}], SamplingParams(temperature=0.0, max_tokens=40))
report({"output": list(outputs[0].outputs[0].token_ids), "steps": steps,
        "aux": runner.use_aux_hidden_state_outputs, "spec": metrics("vllm:spec_decode")})
"""


def test_vllm_dflash_drafts_what_the_reference_drafts(tiny_llama_dir, dflash_dir):
    """vLLM's own DFlash model and proposer, loading our export, draft at every step the tokens
    our training-side DFlash drafts from transformers' streams of the same prefix (float32)."""
    directory, _ = dflash_dir
    prompt = [12, 40, 41, 12, 40, 41, 12, 40, 41, 12, 57]
    # Every weight moved apart (norm weights of the two layers differ widely), so a kernel that mixed
    # up layers or rows would draft differently.
    target = load_target(str(tiny_llama_dir))
    reference = DFlashMethod.load(directory, target)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            scale = 0.5 if name.endswith("norm.weight") else 0.05
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    directory = directory.parent / "moved"
    reference.save(directory, dtype=torch.float32)
    reference.eval()
    run = run_llm(tiny_llama_dir, RECORD_DFLASH_BODY, {"method": "dflash", "model": str(directory),
                                                       "num_speculative_tokens": 3},
                  args={"prompt": prompt})
    assert run["aux"] and len(run["steps"]) >= 10
    ids = torch.tensor([prompt + run["output"]])
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        features = target_features(model, ids, LAYERS)
        length = ids.shape[1]
        batch = Batch(hidden=features, token_ids=ids, next_token_ids=F.pad(ids[:, 1:], (0, 1)),
                      position_ids=torch.arange(length)[None], segment_ids=torch.ones_like(ids),
                      has_hidden=torch.ones_like(ids, dtype=torch.bool), labels=None, label_topk_ids=None,
                      label_topk_logprobs=None)
        rows = torch.zeros_like(ids, dtype=torch.bool)
        rows[0, len(prompt) - 1:-1] = True  # anchors p = t + 1: the first output token onwards
        drafts = reference.vocab.to_target_ids(reference.head_logits(batch, target, rows).argmax(dim=-1))
    first_anchor = len(prompt)
    for position, bonus, engine_drafts in run["steps"]:
        assert ids[0, position] == bonus, f"step bookkeeping: position {position} does not hold the bonus token"
        assert engine_drafts == drafts[position - first_anchor].tolist(), f"drafts differ at anchor {position}"


def test_greedy_equals_plain_with_dflash(tiny_llama_dir, dflash_dir):
    requests = [{"prompt_token_ids": [12 + (i * 7 + j) % 40 for j in range(5 + 9 * i)] * 2, "max_tokens": 32}
                for i in range(6)]
    plain = run_engine(tiny_llama_dir, requests)
    spec_run = run_engine(tiny_llama_dir, requests, {"method": "dflash", "model": str(dflash_dir[0]),
                                                     "num_speculative_tokens": 3})
    assert spec_run["token_ids"] == plain["token_ids"]
    assert spec_run["spec"]["vllm:spec_decode_num_drafts"] > 0
