"""The self-distillation pipeline on a random tiny Llama: data, fit, eval,
bad inputs, and the Medusa / EAGLE exports loading in vLLM."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import (
    REPO_ROOT,
    VLLM_CPU_TEST_ENV,
    build_tiny_llama,
    build_tiny_tokenizer,
    run_engine,
    tiny_samples,
    write_jsonl,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from vllm_amphista.modeling_amphista import AmphistaDrafter
from vllm_amphista.train.cli import main
from vllm_amphista.train.data import DataError, Sample, load_prompts, most_frequent_tokens, read_samples
from vllm_amphista.train.fit import FitOptions, fit, split_indices
from vllm_amphista.train.heads import IGNORE_INDEX, Batch, EagleMethod
from vllm_amphista.train.target import load_target

ENGINE_PROMPTS = ["<|user|> what is the answer to w3 ? </s> <|assistant|>", "w1 w2 w3"]
ENGINE_TOKENS = 12


@pytest.fixture(scope="module")
def samples_path(tiny_llama_dir, tmp_path_factory):
    samples = tiny_samples(tiny_llama_dir, 24, output_len=24)
    return write_jsonl(tmp_path_factory.mktemp("data") / "samples.jsonl", samples)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hidden_cache")


def options(tiny_llama_dir, samples_path, cache_dir, out, **overrides) -> FitOptions:
    fields = dict(target=str(tiny_llama_dir), data=str(samples_path), out=str(out), cache_dir=str(cache_dir),
                  target_dtype="float32", batch_tokens=256, eval_fraction=0.1, eval_every=1000, lr=3e-3, threads=1)
    fields.update(overrides)
    return FitOptions(**fields)


@pytest.fixture(scope="module")
def trained_heads(tiny_llama_dir, samples_path, cache_dir, tmp_path_factory):
    """One quickly trained drafter per method, made through the CLI."""
    root = tmp_path_factory.mktemp("heads")
    for method in ("amphista", "medusa", "eagle"):
        main(["fit", "--method", method, "--target", str(tiny_llama_dir), "--data", str(samples_path),
              "--out", str(root / method), "--cache-dir", str(cache_dir), "--target-dtype", "float32",
              "--max-steps", "3", "--batch-tokens", "256", "--num-heads", "3", "--draft-vocab-size", "200",
              "--threads", "1"])
    return {method: root / method for method in ("amphista", "medusa", "eagle")}


def test_drafters_get_the_final_norm_output(tiny_llama_dir):
    """vLLM hands drafters the hidden state its lm_head reads (after the final norm)."""
    target = load_target(str(tiny_llama_dir), "float32")
    ids = torch.tensor([[5, 9, 30, 2, 77]])
    hidden = target.final_hidden_states(ids)
    assert torch.allclose(hidden @ target.lm_head_weight.T, target.model(ids).logits, atol=1e-5)


def test_labels_cover_the_target_outputs_only():
    sample = Sample(prompt_ids=[10, 11, 12], output_ids=[20, 21, 22, 23])
    hidden = [torch.zeros(7, 4)]
    batch = Batch.from_samples([sample], hidden)
    # h_2 (last prompt position) produced x_3 = 20, the first output token.
    assert batch.loss_mask[0].tolist() == [False, False, True, True, True, True, False]
    assert batch.next_token_ids[0].tolist() == [11, 12, 20, 21, 22, 23, 0]
    labels = batch.target_labels(2)[0]
    assert labels[:, 0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 21, 22, 23, IGNORE_INDEX, IGNORE_INDEX]
    assert labels[:, 1].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 22, 23, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    with_prompt = Batch.from_samples([sample], hidden, train_on_prompt=True).target_labels(1)[0, :, 0]
    assert with_prompt.tolist() == [12, 20, 21, 22, 23, IGNORE_INDEX, IGNORE_INDEX]


def test_eagle_chain_matches_step_by_step_drafting(tiny_llama_dir):
    """The batched chained-EAGLE eval equals drafting one position at a time
    the way vLLM does: teacher-forced prefix, then each draft appended."""
    target = load_target(str(tiny_llama_dir), "float32")
    eagle = EagleMethod.create(target, None, num_steps=3).eval()
    with torch.no_grad():
        for parameter in eagle.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    sample = Sample(prompt_ids=[10, 11, 12], output_ids=[20, 21, 22, 23, 24])
    ids = torch.tensor([sample.token_ids])
    batch = Batch.from_samples([sample], [target.final_hidden_states(ids)[0]])
    with torch.no_grad():
        batched = eagle.head_logits(batch, target)
        t = 4
        prefix = eagle._step_inputs(batch.next_token_ids[:, : t + 1], batch.hidden[:, : t + 1], target)
        inputs, steps = prefix, []
        for _ in range(3):
            positions = torch.arange(inputs.shape[1])[None]
            feature = eagle._layer(inputs, positions, None)[:, -1:]
            logits = feature @ target.lm_head_weight.T
            steps.append(logits[0, 0])
            inputs = torch.cat([inputs, eagle._step_inputs(logits.argmax(-1), feature, target)], dim=1)
    assert torch.allclose(batched[0, t], torch.stack(steps), atol=1e-4)


def test_fit_lowers_the_loss(tiny_llama_dir, samples_path, cache_dir, tmp_path):
    epochs = 4
    result = fit(options(tiny_llama_dir, samples_path, cache_dir, tmp_path, epochs=epochs))
    per_epoch = result.steps // epochs
    first, last = result.train_losses[:per_epoch], result.train_losses[-per_epoch:]
    assert sum(last) / per_epoch < 0.8 * sum(first) / per_epoch
    drafter = AmphistaDrafter.from_pretrained(tmp_path)
    assert drafter.config.num_draft_heads == 4
    metrics = json.loads((tmp_path / "training" / "metrics.json").read_text())
    assert metrics["steps"] == result.steps and len(metrics["evals"][-1]["top1"]) == 4


def test_max_minutes_then_resume_continues_the_same_run(tiny_llama_dir, samples_path, cache_dir, tmp_path):
    straight = fit(options(tiny_llama_dir, samples_path, cache_dir, tmp_path / "straight", max_steps=5))
    stopped = fit(options(tiny_llama_dir, samples_path, cache_dir, tmp_path / "resumed", max_steps=5, max_minutes=0))
    assert stopped.stopped_early and stopped.steps == 1
    resumed = fit(options(tiny_llama_dir, samples_path, cache_dir, tmp_path / "resumed", max_steps=5, resume=True))
    assert resumed.steps == 5 and len(resumed.train_losses) == 5
    assert resumed.train_losses == pytest.approx(straight.train_losses, rel=1e-4)
    straight_weights = load_file(tmp_path / "straight" / "model.safetensors")
    for name, tensor in load_file(tmp_path / "resumed" / "model.safetensors").items():
        assert torch.allclose(tensor.float(), straight_weights[name].float(), atol=1e-2), name


def test_draft_vocabulary_is_the_most_frequent_outputs(tiny_llama_dir, samples_path, cache_dir, tmp_path):
    fit(options(tiny_llama_dir, samples_path, cache_dir, tmp_path, max_steps=2, draft_vocab_size=32))
    samples = read_samples(samples_path)
    train_indices, _ = split_indices(len(samples), 0.1, seed=0)
    expected = most_frequent_tokens([samples[i] for i in train_indices], 32, vocab_size=320)
    saved = load_file(tmp_path / "model.safetensors")
    assert torch.equal(saved["draft_to_target"], expected)
    assert saved["lm_head.weight"].shape == (32, 128)


def test_ablation_flags(tiny_llama_dir, samples_path, cache_dir, tmp_path):
    fit(options(tiny_llama_dir, samples_path, cache_dir, tmp_path, max_steps=1,
                no_encoder=True, no_stages=True, no_sampled_token=True))
    config = AmphistaDrafter.from_pretrained(tmp_path).config
    assert not (config.use_encoder or config.use_stages or config.use_sampled_token)
    with pytest.raises(ValueError, match="--method amphista only"):
        fit(options(tiny_llama_dir, samples_path, cache_dir, tmp_path, method="medusa", no_encoder=True))


def test_eval_prints_a_table_for_every_method(tiny_llama_dir, samples_path, cache_dir, trained_heads, capsys):
    main(["eval", "--target", str(tiny_llama_dir), "--samples", str(samples_path), "--cache-dir", str(cache_dir),
          "--target-dtype", "float32", "--eagle-steps", "3", "--heads", *map(str, trained_heads.values())])
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].startswith("| heads | head 1 top-1 | head 2 top-1 | head 3 top-1 | mean accepted")
    assert len(table) == 2 + len(trained_heads)


def test_exports_are_in_vllm_formats(trained_heads):
    medusa = json.loads((trained_heads["medusa"] / "config.json").read_text())
    assert medusa["model_type"] == "medusa" and medusa["num_heads"] == 3 and medusa["original_lm_head"]
    medusa_weights = load_file(trained_heads["medusa"] / "model.safetensors")
    assert set(medusa_weights) == {f"blocks.{i}.layers.0.{p}" for i in range(3) for p in ("weight", "bias")} | {
        "lm_heads.0.weight"}
    eagle = json.loads((trained_heads["eagle"] / "config.json").read_text())
    assert eagle["model_type"] == "llama" and eagle["num_hidden_layers"] == 1
    eagle_weights = load_file(trained_heads["eagle"] / "model.safetensors")
    assert "fc.weight" in eagle_weights and "layers.0.self_attn.q_proj.weight" in eagle_weights
    assert not any("input_layernorm" in name or "embed_tokens" in name or "lm_head" in name for name in eagle_weights)


def hf_greedy(target_dir, prompt_ids: list[int], max_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_baselines_load_and_generate_in_vllm(tiny_llama_dir, trained_heads, method):
    tokenizer = build_tiny_tokenizer()
    requests = [{"prompt_token_ids": tokenizer(prompt)["input_ids"], "max_tokens": ENGINE_TOKENS}
                for prompt in ENGINE_PROMPTS]
    report = run_engine(tiny_llama_dir, requests,
                        {"method": method, "model": str(trained_heads[method]), "num_speculative_tokens": 3})
    assert report["spec"]["vllm:spec_decode_num_drafts"] > 0
    # Speculative decoding is lossless: the target's own greedy text (up to EOS, as vLLM stops there).
    assert report["token_ids"] == [hf_greedy(tiny_llama_dir, request["prompt_token_ids"], ENGINE_TOKENS)
                                   for request in requests]


def test_generate_cli_writes_samples(tiny_llama_dir, tmp_path):
    prompts = tmp_path / "alpaca.json"
    prompts.write_text(json.dumps([
        {"instruction": "what is the answer", "input": "w5 w6", "output": "w1"},
        {"instruction": "what is w7 ?", "input": "", "output": "w2"},
    ]))
    out = tmp_path / "samples.jsonl"
    completed = subprocess.run(
        [sys.executable, "-m", "vllm_amphista.train", "generate", "--target", str(tiny_llama_dir),
         "--prompts", str(prompts), "--out", str(out), "--max-tokens", "8", "--dtype", "float32",
         "--max-model-len", "256", "--enforce-eager"],
        cwd=REPO_ROOT, env={**os.environ, **VLLM_CPU_TEST_ENV}, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    samples = read_samples(out)
    tokenizer = build_tiny_tokenizer()
    expected_prompt = tokenizer("<|user|> what is the answer\n\nw5 w6 </s> <|assistant|>")["input_ids"]
    assert samples[0].prompt_ids == expected_prompt
    assert len(samples) == 2 and all(1 <= len(sample.output_ids) <= 8 for sample in samples)


def test_bad_inputs_give_clear_errors(tiny_llama_dir, samples_path, cache_dir, trained_heads, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        read_samples(empty)
    with pytest.raises(DataError, match="empty"):
        load_prompts(empty)

    wrong_samples = write_jsonl(tmp_path / "wrong.jsonl", [{"prompt_ids": [1, 2], "text": "w1"}])
    with pytest.raises(DataError, match="'output_ids'"):
        read_samples(wrong_samples)

    wrong_prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"question": "w1"}, {"answer": "w2"}])
    with pytest.raises(DataError, match="record 1 has no field 'question'"):
        load_prompts(wrong_prompts)
    with pytest.raises(DataError, match="no prompt field.*--prompt-field"):
        load_prompts(write_jsonl(tmp_path / "odd.jsonl", [{"text": "w1"}]))

    # Through the CLI: exit status 2 and one line naming the problem.
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--target", str(tiny_llama_dir), "--data", str(empty), "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert "the dataset is empty" in capsys.readouterr().err

    other_target = build_tiny_llama(tmp_path / "other", hidden_size=64)
    for method, heads in trained_heads.items():
        with pytest.raises(SystemExit):
            main(["eval", "--target", str(other_target), "--samples", str(samples_path), "--heads", str(heads),
                  "--cache-dir", str(cache_dir)])
        assert "built for hidden size 128 and vocab 320" in capsys.readouterr().err, method
