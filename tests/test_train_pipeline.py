"""The self-distillation pipeline on a random tiny Llama: the prompt mix, generation with captured
hidden states and top-k, packing and labels, fit (both objectives), eval, bad inputs, and the
Medusa / EAGLE exports loading in vLLM."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import numpy as np
import torch
from conftest import (
    REPO_ROOT,
    TINY_WORDS,
    VLLM_CPU_TEST_ENV,
    build_tiny_llama,
    build_tiny_tokenizer,
    report_of,
    run_engine,
    run_python,
    tiny_samples,
    write_jsonl,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from vllm_amphista.modeling_amphista import AmphistaDrafter
from vllm_amphista.prompts import DataError, load_prompts
from vllm_amphista.train import prompt_mix
from vllm_amphista.train.batch import IGNORE_INDEX, build_batch, pack_rows
from vllm_amphista.train.cli import main
from vllm_amphista.train.data import (
    Dataset,
    Sample,
    SampleTensors,
    most_frequent_tokens,
    read_token_file,
    write_answers_shard,
    write_shard,
    write_token_file,
)
from vllm_amphista.train.eagle import EagleMethod
from vllm_amphista.train.drafter import reachable_heads
from vllm_amphista.train.fit import FitOptions, fit, leading_samples, split_indices
from vllm_amphista.train.target import load_target

ENGINE_PROMPTS = ["<|user|> what is the answer to w3 ? </s> <|assistant|>", "w1 w2 w3"]
ENGINE_TOKENS = 12
NUM_PROMPTS = 24
MAX_TOKENS = 24


def run_train_cli(args: list[str]) -> subprocess.CompletedProcess:
    """`python -m vllm_amphista.train ...` in a subprocess (its engine must not share this process)."""
    return subprocess.run([sys.executable, "-m", "vllm_amphista.train", *args], cwd=REPO_ROOT,
                          env={**os.environ, **VLLM_CPU_TEST_ENV}, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def prompts_path(tmp_path_factory):
    words = TINY_WORDS[7:]
    records = [{"id": f"p{i}", "category": "words" if i % 2 else "questions",
                "messages": [{"role": "user", "content": " ".join(words[(i * 5 + j) % len(words)]
                                                                  for j in range(3 + i % 7))}]}
               for i in range(NUM_PROMPTS)]
    return write_jsonl(tmp_path_factory.mktemp("mix") / "mix.jsonl", records)


@pytest.fixture(scope="module")
def dataset_dir(tiny_llama_dir, prompts_path, tmp_path_factory):
    """The tiny target's answers to the prompts, made by the `generate` command (shards of 10)."""
    out = tmp_path_factory.mktemp("data") / "dataset"
    completed = run_train_cli(["generate", "--target", str(tiny_llama_dir), "--prompts", str(prompts_path),
                               "--out", str(out), "--max-tokens", str(MAX_TOKENS), "--dtype", "float32",
                               "--max-model-len", "256", "--enforce-eager", "--concurrency", "8",
                               "--shard-size", "10"])
    assert completed.returncode == 0, completed.stderr[-4000:]
    return out


def options(tiny_llama_dir, dataset_dir, out, **overrides) -> FitOptions:
    # Eager unless a test asks: a compile costs more than these short runs, and resumes compare losses exactly.
    fields = dict(target=str(tiny_llama_dir), data=[str(dataset_dir)], out=str(out), state_dir=f"{out}-state",
                  batch_tokens=256, row_tokens=128, eval_fraction=0.1, eval_every=1000, lr=3e-3, threads=1,
                  compile="off")
    fields.update(overrides)
    return FitOptions(**fields)


@pytest.fixture(scope="module")
def trained_heads(tiny_llama_dir, dataset_dir, tmp_path_factory):
    """One quickly trained drafter per method, made through the CLI."""
    root = tmp_path_factory.mktemp("heads")
    for method in ("amphista", "medusa", "eagle"):
        main(["fit", "--method", method, "--target", str(tiny_llama_dir), "--data", str(dataset_dir),
              "--out", str(root / method), "--max-steps", "3", "--batch-tokens", "256", "--row-tokens", "128",
              "--num-heads", "3", "--draft-vocab-size", "200", "--threads", "1", "--state-dir", str(root / "state")])
    return {method: root / method for method in ("amphista", "medusa", "eagle")}


def test_generate_writes_the_targets_answers_hidden_states_and_top_k(tiny_llama_dir, dataset_dir):
    """What `generate` captures is what the target computes: its greedy answer, its final-norm hidden
    state at every position (what vLLM hands drafters and the lm_head reads), its top-k."""
    dataset = Dataset([dataset_dir])
    assert len(dataset) == NUM_PROMPTS and sorted(path.name for path in dataset_dir.iterdir()) == [
        f"shard_0000{i}.{suffix}" for i in range(3) for suffix in ("jsonl", "safetensors")]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for index in (0, 13):
        sample, tensors = dataset.samples[index], dataset.tensors(index)
        ids = torch.tensor([sample.token_ids])
        with torch.inference_mode():
            expected_output = model.generate(torch.tensor([sample.prompt_ids]), max_new_tokens=len(sample.output_ids),
                                             do_sample=False, pad_token_id=0)[0, len(sample.prompt_ids):]
            hidden = model.model(ids).last_hidden_state[0]
            logprobs = torch.log_softmax(model(ids).logits[0], dim=-1)
        assert sample.output_ids == expected_output.tolist()
        assert tensors.hidden.shape == (len(sample.token_ids) - 1, 128)
        assert torch.allclose(tensors.hidden.float(), hidden[:-1], atol=0.02)  # stored in bf16
        top = logprobs[len(sample.prompt_ids) - 1:-1].topk(8)
        assert torch.equal(tensors.topk_ids.long(), top.indices)
        assert torch.allclose(tensors.topk_logprobs.float(), top.values, atol=0.01)


FREED_AFTER_WRITING = """
import gc, json, weakref
from vllm_amphista.train import generate
from vllm_amphista.train.data import Dataset

written = []  # weak references to every tensor of every shard written
write_shard = generate.write_shard

def recording_write_shard(out, index, samples, tensors, *args, **kwargs):
    written.extend(weakref.ref(tensor) for sample in tensors for tensor in (sample.hidden, sample.topk_ids))
    return write_shard(out, index, samples, tensors, *args, **kwargs)

generate.write_shard = recording_write_shard
samples = Dataset([{data!r}]).samples[:12]
generate.generate_dataset({target!r}, {out!r}, token_samples=samples, dtype="float32", max_model_len=256,
                          concurrency=4, shard_size=4, enforce_eager=True)
gc.collect()
print("REPORT=" + json.dumps({{"written": len(written), "alive": sum(ref() is not None for ref in written)}}))
"""


def test_generate_frees_each_shards_tensors_once_written(tiny_llama_dir, dataset_dir, tmp_path):
    """A long `features` run must not keep what it wrote: its memory would grow with the dataset."""
    report = report_of(run_python(FREED_AFTER_WRITING.format(data=str(dataset_dir), target=str(tiny_llama_dir),
                                                             out=str(tmp_path / "features"))))
    assert report["written"] == 24 and report["alive"] == 0


def test_generate_resumes_and_recomputes_from_tokens(tiny_llama_dir, dataset_dir, prompts_path, tmp_path):
    dataset = Dataset([dataset_dir])
    # A rerun finds every shard complete and does nothing.
    completed = run_train_cli(["generate", "--target", str(tiny_llama_dir), "--prompts", str(prompts_path),
                               "--out", str(dataset_dir), "--max-tokens", str(MAX_TOKENS), "--shard-size", "10"])
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert json.loads(completed.stdout.strip().splitlines()[-1]) == {"samples": 0, "skipped_shards": 3}
    # The token ids alone bring back the same tensors: as JSONL, and as the compact answers shards
    # the repository commits (uint16, one per dataset shard, written once).
    assert run_train_cli(["export-tokens", "--data", str(dataset_dir), "--out", str(tmp_path / "tokens.jsonl.gz")]
                         ).returncode == 0
    assert read_token_file(tmp_path / "tokens.jsonl.gz") == dataset.samples
    answers = tmp_path / "answers"
    for _ in range(2):
        completed = run_train_cli(["export-tokens", "--data", str(dataset_dir), "--out", str(answers)])
        assert completed.returncode == 0, completed.stderr[-4000:]
    assert "wrote 0 new answers shards" in completed.stdout
    assert sorted(path.name for path in answers.iterdir()) == [f"shard_{i:05d}.npz" for i in range(3)]
    with np.load(answers / "shard_00000.npz") as arrays:
        assert arrays["output_ids"].dtype == np.uint16
    assert read_token_file(answers) == dataset.samples
    completed = run_train_cli(["features", "--target", str(tiny_llama_dir), "--answers", str(answers),
                               "--out", str(tmp_path / "recomputed"), "--enforce-eager",
                               "--max-model-len", "256", "--concurrency", "8"])
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "% of this machine's float32 GEMM roofline" in completed.stdout
    recomputed = Dataset([tmp_path / "recomputed"])
    assert recomputed.samples == dataset.samples
    for index in range(0, NUM_PROMPTS, 7):
        mine, theirs = recomputed.tensors(index), dataset.tensors(index)
        assert torch.allclose(mine.hidden.float(), theirs.hidden.float(), atol=0.02)
        assert torch.equal(mine.topk_ids, theirs.topk_ids)
    # Without log-probabilities: the same hidden states, no top-k, and only the hard objective learns from them.
    completed = run_train_cli(["features", "--target", str(tiny_llama_dir), "--answers", str(answers),
                               "--out", str(tmp_path / "no-top-k"), "--enforce-eager", "--max-model-len", "256",
                               "--concurrency", "8", "--top-k", "0"])
    assert completed.returncode == 0, completed.stderr[-4000:]
    without_top_k = Dataset([tmp_path / "no-top-k"])
    assert without_top_k.top_k == 0 and recomputed.top_k == 8
    for index in range(0, NUM_PROMPTS, 7):
        mine, theirs = without_top_k.tensors(index), recomputed.tensors(index)
        assert torch.equal(mine.hidden, theirs.hidden)
        assert mine.topk_ids.shape == (len(dataset.samples[index].output_ids), 0)
    mixed = [str(tmp_path / "recomputed"), str(tmp_path / "no-top-k")]
    assert fit(options(tiny_llama_dir, mixed[0], tmp_path / "hard", data=mixed, max_steps=2)).steps == 2
    with pytest.raises(DataError, match="keeps none"):
        fit(options(tiny_llama_dir, mixed[0], tmp_path / "distill", data=mixed, max_steps=2, objective="distill"))


def test_prompt_mix_covers_every_category_without_benchmark_questions(tmp_path):
    alpaca = [{"instruction": f"Describe topic {i}.", "input": "" if i % 3 else f"context {i}",
               "output": f"Topic {i} is about " + "many things, " * (20 + i % 30) + "and more."}
              for i in range(60)]
    gsm8k = [{"question": f"Tom has {i} apples and buys {i + 2} more. How many now?",
              "answer": f"He has {i}+{i + 2}=<<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2} apples.\n#### {2 * i + 2}"}
             for i in range(40)]
    counts = {category: 5 for category in prompt_mix.DEFAULT_COUNTS}
    records = prompt_mix.first_turn_mix(alpaca, gsm8k, counts, seed=1)
    assert records == prompt_mix.first_turn_mix(alpaca, gsm8k, counts, seed=1)  # deterministic
    assert sorted({r["category"] for r in records}) == sorted(counts) and len(records) == 5 * len(counts)
    assert not any("<<" in r["messages"][0]["content"] for r in records)  # calculator marks removed
    assert prompt_mix.first_turn_mix(alpaca, gsm8k, counts, seed=1, exclude=records) == []
    more = prompt_mix.first_turn_mix(alpaca, gsm8k, counts, seed=2, exclude=records)
    assert more and not {json.dumps(r["messages"]) for r in more} & {json.dumps(r["messages"]) for r in records}
    assert len({r["id"] for r in more}) == len(more)
    first_turns = [{**r, "answer": f"answer {i}"} for i, r in enumerate(records)]
    second = prompt_mix.second_turn_mix(first_turns, 10, seed=0)
    assert len(second) == 10
    assert all([turn["role"] for turn in r["messages"]] == ["user", "assistant", "user"] for r in second)
    assert all(r["messages"][2]["content"] in prompt_mix.FOLLOW_UPS for r in second)


def test_second_turns_from_committed_answers(tiny_llama_dir, tmp_path):
    first = [{"id": f"q{i}", "category": "alpaca", "messages": [{"role": "user", "content": f"w{i} ?"}]}
             for i in range(4)]
    write_jsonl(tmp_path / "first.jsonl", first)
    answers = tmp_path / "answers"
    answers.mkdir()
    write_answers_shard(answers / "shard_00000.npz", [Sample([5, 6], [20 + i, 21], f"q{i}", "alpaca")
                                                      for i in range(3)])
    main(["mix", "--second-turns-from", str(answers), "--first-turns", str(tmp_path / "first.jsonl"),
          "--target", str(tiny_llama_dir), "--out", str(tmp_path / "second.jsonl"), "--count", "10"])
    second = [json.loads(line) for line in (tmp_path / "second.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in second) == ["second-q0", "second-q1", "second-q2"]  # q3 was never answered
    by_id = {r["id"]: r for r in second}
    assert by_id["second-q1"]["messages"][1] == {"role": "assistant", "content": " ".join([TINY_WORDS[14]] * 2)}


def test_packing_keeps_samples_apart_and_labels_only_the_targets_outputs(tmp_path):
    samples = [Sample([10, 11, 12], [20, 21, 22, 23], "a"), Sample([30, 31], [40, 41, 42], "b")]
    tensors = [SampleTensors(torch.arange(6.0)[:, None].repeat(1, 4), torch.full((4, 2), 7), torch.zeros(4, 2)),
               SampleTensors(torch.arange(4.0)[:, None].repeat(1, 4) + 100, torch.full((3, 2), 8), torch.zeros(3, 2))]
    write_shard(tmp_path, 0, samples, tensors, torch.float32)
    dataset = Dataset([tmp_path])
    assert pack_rows([7, 5], 16) == [[0, 1]]
    batch = build_batch(dataset, [[0, 1]], num_heads=2, row_tokens=16)
    assert batch.segment_ids[0].tolist() == [1] * 7 + [2] * 5
    assert batch.position_ids[0].tolist() == list(range(7)) + list(range(5))
    assert batch.next_token_ids[0].tolist() == [11, 12, 20, 21, 22, 23, 0, 31, 40, 41, 42, 0]
    # h_2 (last prompt position) produced x_3 = 20; head 0 there drafts x_4 = 21, head 1 x_5 = 22.
    ignore = IGNORE_INDEX
    assert batch.labels[0, :, 0].tolist() == [ignore, ignore, 21, 22, 23, ignore, ignore, ignore, 41, 42, ignore, ignore]
    assert batch.labels[0, :, 1].tolist() == [ignore, ignore, 22, 23] + [ignore] * 4 + [42] + [ignore] * 3
    assert batch.label_topk_ids[0, 2, 0].tolist() == [7, 7] and batch.label_topk_ids[0, 8, 0].tolist() == [8, 8]
    next_hidden, has_next = batch.next_hidden
    assert has_next[0].tolist() == [True] * 5 + [False] * 2 + [True] * 3 + [False] * 2
    assert next_hidden[0, 7, 0] == 101  # the second sample's own h_1


def test_eagle_chain_matches_step_by_step_drafting(tiny_llama_dir, dataset_dir):
    """The batched chained-EAGLE eval equals drafting one position at a time the way vLLM does:
    teacher-forced prefix, then each draft appended."""
    target = load_target(str(tiny_llama_dir))
    eagle = EagleMethod.create(target, None, num_steps=3).eval()
    with torch.no_grad():
        for parameter in eagle.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    dataset = Dataset([dataset_dir])
    batch = build_batch(dataset, [[0, 1]], num_heads=3, row_tokens=128)
    rows = (batch.labels != IGNORE_INDEX).any(dim=-1)
    t = int(rows[0].nonzero()[0]) + 1
    with torch.no_grad():
        batched = eagle.head_logits(batch, target, rows)
        prefix = eagle._step_inputs(batch.next_token_ids[:, : t + 1], batch.hidden[:, : t + 1], target)
        inputs, steps = prefix, []
        for _ in range(3):
            positions = torch.arange(inputs.shape[1])[None]
            feature = eagle._layer(inputs, positions, None)[:, -1:]
            logits = feature @ target.lm_head_weight.T
            steps.append(logits[0, 0])
            inputs = torch.cat([inputs, eagle._step_inputs(logits.argmax(-1), feature, target)], dim=1)
    assert torch.allclose(batched[int(rows[0, :t].sum())], torch.stack(steps), atol=1e-4)


def test_valid_prefix_masks_heads_after_the_first_wrong_one(tiny_llama_dir, dataset_dir, tmp_path):
    labels = torch.tensor([[1, 2, 3], [1, 5, 3], [4, 2, 3]])
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 0], [1, 2, 3], [0, 2, 3]]), 8).float()
    assert reachable_heads(logits, labels).tolist() == [[True, True, True], [True, True, False],
                                                         [True, False, False]]
    # The masked loss differs from the plain one and still trains.
    result = fit(options(tiny_llama_dir, dataset_dir, tmp_path, epochs=2, valid_prefix=True))
    plain = fit(options(tiny_llama_dir, dataset_dir, tmp_path / "plain", epochs=2))
    assert result.train_losses != pytest.approx(plain.train_losses)
    assert sum(result.train_losses[-3:]) < sum(result.train_losses[:3])


@pytest.mark.parametrize("objective", ["hard", "distill"])
def test_fit_lowers_the_loss(tiny_llama_dir, dataset_dir, tmp_path, objective):
    epochs = 4
    result = fit(options(tiny_llama_dir, dataset_dir, tmp_path, epochs=epochs, objective=objective))
    per_epoch = result.steps // epochs
    first, last = result.train_losses[:per_epoch], result.train_losses[-per_epoch:]
    assert sum(last) / per_epoch < 0.8 * sum(first) / per_epoch
    drafter = AmphistaDrafter.from_pretrained(tmp_path)
    assert drafter.config.num_draft_heads == 4
    metrics = json.loads((tmp_path.parent / f"{tmp_path.name}-state" / "metrics.json").read_text())
    assert metrics["steps"] == result.steps and len(metrics["evals"][-1]["top1"]) == 4
    assert metrics["trained_tokens"] > 0 and metrics["train_tokens_per_second"] > 0


def test_compiled_training_step_learns_what_the_eager_one_learns(tiny_llama_dir, dataset_dir, tmp_path):
    steps = 8
    eager = fit(options(tiny_llama_dir, dataset_dir, tmp_path / "eager", max_steps=steps, precision="float32"))
    compiled = fit(options(tiny_llama_dir, dataset_dir, tmp_path / "compiled", max_steps=steps, precision="float32",
                           compile="on"))
    assert eager.compile_seconds is None and compiled.compile_seconds > 0
    assert len(compiled.train_losses) == steps
    # The same batches, the same updates: only the fused kernels' rounding differs.
    assert compiled.train_losses == pytest.approx(eager.train_losses, rel=1e-3)
    assert compiled.train_losses[-1] != pytest.approx(compiled.train_losses[0], rel=1e-3)
    metrics = json.loads((tmp_path / "compiled-state" / "metrics.json").read_text())
    assert metrics["compile_seconds"] == compiled.compile_seconds


def test_max_minutes_then_resume_continues_the_same_run(tiny_llama_dir, dataset_dir, tmp_path):
    straight = fit(options(tiny_llama_dir, dataset_dir, tmp_path / "straight", max_steps=5))
    stopped = fit(options(tiny_llama_dir, dataset_dir, tmp_path / "resumed", max_steps=5, max_minutes=0))
    assert stopped.stopped_early and stopped.steps == 1
    resumed = fit(options(tiny_llama_dir, dataset_dir, tmp_path / "resumed", max_steps=5,
                          resume=str(tmp_path / "resumed-state")))
    assert resumed.steps == 5 and len(resumed.train_losses) == 5
    assert resumed.train_losses == pytest.approx(straight.train_losses, rel=1e-4)
    straight_weights = load_file(tmp_path / "straight" / "model.safetensors")
    for name, tensor in load_file(tmp_path / "resumed" / "model.safetensors").items():
        assert torch.allclose(tensor.float(), straight_weights[name].float(), atol=1e-2), name


def test_sigterm_saves_the_run_and_resume_finishes_it_as_if_never_stopped(tiny_llama_dir, dataset_dir, tmp_path):
    total = 150
    # float32: bf16 kernels may round differently in another process, and this is about resuming.
    straight = fit(options(tiny_llama_dir, dataset_dir, tmp_path / "straight", max_steps=total, precision="float32"))
    state = tmp_path / "killed-state"
    # Checkpoints after every step, so the first one tells that training has begun.
    command = [sys.executable, "-m", "vllm_amphista.train", "fit", "--target", str(tiny_llama_dir),
               "--data", str(dataset_dir), "--out", str(tmp_path / "killed"), "--state-dir", str(state),
               "--max-steps", str(total), "--batch-tokens", "256", "--row-tokens", "128", "--eval-fraction", "0.1",
               "--eval-every", "1000", "--lr", "3e-3", "--threads", "1", "--checkpoint-minutes", "0",
               "--precision", "float32", "--compile", "off"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (state / "state.pt").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    assert "SIGTERM at step" in stdout and f"--resume {state}" in stdout, stdout[-2000:]
    stopped_at = json.loads((state / "metrics.json").read_text())["steps"]
    assert 1 <= stopped_at < total
    resumed = fit(options(tiny_llama_dir, dataset_dir, tmp_path / "killed", max_steps=total, resume=str(state),
                          precision="float32"))
    assert resumed.steps == total and len(resumed.train_losses) == total
    # Same batches in the same order after the stop (none repeated, none skipped), same optimizer state.
    assert resumed.train_losses == pytest.approx(straight.train_losses, rel=1e-4)
    with pytest.raises(FileNotFoundError, match="no state.pt"):
        fit(options(tiny_llama_dir, dataset_dir, tmp_path / "x", max_steps=2, resume=str(tmp_path / "nothing")))


def test_a_run_paused_with_sigstop_does_not_count_the_pause_as_training(tiny_llama_dir, dataset_dir, tmp_path):
    state = tmp_path / "paused-state"
    # Pauses the test's own process for 4 s once the first checkpoint (after ~1 s of training) is on disk.
    pauser = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, sys, time\n"
        f"while not os.path.exists({str(state / 'state.pt')!r}): time.sleep(0.01)\n"
        f"os.kill({os.getpid()}, signal.SIGSTOP); time.sleep(4); os.kill({os.getpid()}, signal.SIGCONT)")])
    started = time.monotonic()
    fit(options(tiny_llama_dir, dataset_dir, tmp_path / "paused", state_dir=str(state), max_steps=150,
                checkpoint_minutes=1 / 60))
    wall = time.monotonic() - started
    assert pauser.wait(timeout=60) == 0
    metrics = json.loads((state / "metrics.json").read_text())
    assert wall > 4
    assert metrics["training_seconds"] < wall - 3.5, (metrics["training_seconds"], wall)


def test_max_output_tokens_trains_on_a_leading_slice(tiny_llama_dir, dataset_dir, tmp_path):
    dataset = Dataset([dataset_dir])
    train_indices, _ = split_indices(len(dataset), 0.1, seed=0, max_eval=400)
    budget = sum(len(dataset.samples[i].output_ids) for i in train_indices[:3])
    assert leading_samples(dataset, train_indices, budget) == train_indices[:3]
    assert leading_samples(dataset, train_indices, budget - 1) == train_indices[:2]
    full = fit(options(tiny_llama_dir, dataset_dir, tmp_path / "full", epochs=1))
    part = fit(options(tiny_llama_dir, dataset_dir, tmp_path / "part", epochs=1, max_output_tokens=budget))
    assert 1 <= part.steps < full.steps
    with pytest.raises(DataError, match="keeps no training sample"):
        fit(options(tiny_llama_dir, dataset_dir, tmp_path / "none", max_output_tokens=0))


def test_draft_vocabulary_is_the_most_frequent_outputs(tiny_llama_dir, dataset_dir, tmp_path):
    fit(options(tiny_llama_dir, dataset_dir, tmp_path, max_steps=2, draft_vocab_size=32))
    samples = Dataset([dataset_dir]).samples
    train_indices, _ = split_indices(len(samples), 0.1, seed=0, max_eval=400)
    expected = most_frequent_tokens([samples[i] for i in train_indices], 32, vocab_size=320)
    saved = load_file(tmp_path / "model.safetensors")
    assert torch.equal(saved["draft_to_target"], expected)
    assert saved["lm_head.weight"].shape == (32, 128)
    with pytest.raises(ValueError, match=r"--draft-vocab-size must be in \[1, 320\]"):
        fit(options(tiny_llama_dir, dataset_dir, tmp_path / "too-wide", max_steps=2, draft_vocab_size=321))
    with pytest.raises(ValueError, match="--draft-vocab-size must be >= 0"):
        fit(options(tiny_llama_dir, dataset_dir, tmp_path / "negative", max_steps=2, draft_vocab_size=-1))


def test_fine_tuning_widens_the_draft_vocabulary_keeping_what_the_heads_draft(tiny_llama_dir, dataset_dir, tmp_path):
    narrow, wide = tmp_path / "narrow", tmp_path / "wide"
    fit(options(tiny_llama_dir, dataset_dir, narrow, max_steps=2, draft_vocab_size=32))
    # A learning rate of ~0 keeps the weights: the widened heads must then score the old ids as before.
    fit(options(tiny_llama_dir, dataset_dir, wide, max_steps=1, lr=1e-12, init_heads=str(narrow), draft_vocab_size=64))
    before, after = AmphistaDrafter.from_pretrained(narrow), AmphistaDrafter.from_pretrained(wide)
    assert after.config.draft_vocab_size == 64 and after.lm_head.weight.shape == (64, 128)
    samples = Dataset([dataset_dir]).samples
    train_indices, _ = split_indices(len(samples), 0.1, seed=0, max_eval=400)
    ranked = most_frequent_tokens([samples[i] for i in train_indices], 64, vocab_size=320).tolist()
    old_ids = before.draft_to_target.tolist()
    assert after.draft_to_target.tolist() == old_ids + [t for t in ranked if t not in old_ids][:32]
    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    lm_head = target.get_output_embeddings().weight
    assert torch.equal(after.lm_head.weight, lm_head[after.draft_to_target].to(after.lm_head.weight.dtype))
    hidden, next_ids = torch.randn(1, 6, 128), torch.randint(0, 320, (1, 6))
    with torch.no_grad():
        old_logits = before(hidden, next_ids, target.get_input_embeddings(), lm_head)
        new_logits = after(hidden, next_ids, target.get_input_embeddings(), lm_head)
    torch.testing.assert_close(new_logits[..., :32], old_logits)
    with pytest.raises(ValueError, match="only widen"):
        fit(options(tiny_llama_dir, dataset_dir, tmp_path / "smaller", max_steps=1, init_heads=str(wide),
                    draft_vocab_size=32))


def test_fine_tuning_deepens_the_heads_from_the_same_function(tiny_llama_dir, dataset_dir, tmp_path):
    shallow, deep = tmp_path / "shallow", tmp_path / "deep"
    fit(options(tiny_llama_dir, dataset_dir, shallow, max_steps=2, draft_vocab_size=32))
    fit(options(tiny_llama_dir, dataset_dir, deep, max_steps=1, lr=1e-12, init_heads=str(shallow), stage_layers=2,
                encoder_layers=2))
    before, after = AmphistaDrafter.from_pretrained(shallow), AmphistaDrafter.from_pretrained(deep)
    assert (after.config.stage_num_layers, after.config.encoder_num_layers) == (2, 2)
    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    hidden, next_ids = torch.randn(1, 6, 128), torch.randint(0, 320, (1, 6))
    with torch.no_grad():
        old_logits = before(hidden, next_ids, target.get_input_embeddings(), None)
        new_logits = after(hidden, next_ids, target.get_input_embeddings(), None)
    torch.testing.assert_close(new_logits, old_logits)
    with pytest.raises(ValueError, match="--stage-layers must be >= 1"):
        fit(options(tiny_llama_dir, dataset_dir, tmp_path / "none", stage_layers=0))
    with pytest.raises(ValueError, match="amphista only"):
        fit(options(tiny_llama_dir, dataset_dir, tmp_path / "medusa", method="medusa", encoder_layers=2))


def test_ablation_flags(tiny_llama_dir, dataset_dir, tmp_path):
    fit(options(tiny_llama_dir, dataset_dir, tmp_path, max_steps=1,
                no_encoder=True, no_stages=True, no_sampled_token=True))
    config = AmphistaDrafter.from_pretrained(tmp_path).config
    assert not (config.use_encoder or config.use_stages or config.use_sampled_token)
    with pytest.raises(ValueError, match="--method amphista only"):
        fit(options(tiny_llama_dir, dataset_dir, tmp_path, method="medusa", no_encoder=True))


def test_eval_prints_a_table_for_every_method(tiny_llama_dir, dataset_dir, trained_heads, capsys):
    main(["eval", "--target", str(tiny_llama_dir), "--data", str(dataset_dir), "--eagle-steps", "3",
          "--row-tokens", "128", "--heads", *map(str, trained_heads.values())])
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].startswith("| heads | head 1 top-1 | head 2 top-1 | head 3 top-1 | mean accepted")
    assert len(table) == 2 + len(trained_heads)


def test_curve_replays_every_heads_dir_on_the_same_answers(tiny_llama_dir, dataset_dir, trained_heads,
                                                            random_heads_dir, tmp_path):
    """`curve` on cached answers (as `greedy_answers` caches them): one point per heads dir, tau of
    the heads and the hybrid per category, MT-Bench's categories together, a plot."""
    import hashlib

    from vllm_amphista.replay import head_chains, replay

    questions = write_jsonl(tmp_path / "questions.jsonl", [{"question_id": 1, "category": "writing", "turns": ["x"]}])
    samples = Dataset([dataset_dir]).samples[:6]
    records = [{"category": ("writing", "coding", "rag")[i % 3], "question_id": i, "prompt_ids": s.prompt_ids,
                "output_ids": s.output_ids} for i, s in enumerate(samples)]
    out = tmp_path / "curve"
    out.mkdir()
    (out / "greedy_answers.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    (out / "greedy_answers.settings.json").write_text(json.dumps({
        "target": str(tiny_llama_dir), "questions": [str(questions)], "per_category": 10, "max_tokens": 256,
        "max_model_len": 2048, "dtype": "bfloat16",
        "questions_sha256": [hashlib.sha256(questions.read_bytes()).hexdigest()]}))
    main(["curve", "--target", str(tiny_llama_dir), "--questions", str(questions), "--out", str(out),
          "--heads", str(trained_heads["amphista"]), str(random_heads_dir), "--output-tokens", "1000", "100",
          "--notes", "3 steps", "random", "--plot", str(tmp_path / "curve.png")])
    points = json.loads((out / "curve.json").read_text())
    assert [point["output_tokens"] for point in points] == [1000, 100]
    assert set(points[0]["heads_tau"]) == {"writing", "coding", "rag", "all"}
    # The heads' tau is what a step-by-step replay of the same drafter gives.
    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    drafter = AmphistaDrafter.from_pretrained(trained_heads["amphista"], dtype=torch.float32).eval()
    steps = tokens = 0
    for record in records:
        draft_ids, _ = head_chains(target, drafter, record["prompt_ids"] + record["output_ids"])
        steps += replay(record["prompt_ids"], record["output_ids"], 4,
                        lambda context, room: draft_ids[len(context) - 2].tolist()[:room])
        tokens += len(record["output_ids"])
    assert points[0]["heads_tau"]["all"] == pytest.approx(tokens / steps)
    # MT-Bench's categories together (writing, coding here; not rag): between the two.
    by_category = points[0]["heads_tau"]
    low, high = sorted([by_category["writing"], by_category["coding"]])
    assert low <= points[0]["heads_tau_mt_bench"] <= high
    assert "| 1,000 | 3 steps |" in (out / "curve.md").read_text() and (tmp_path / "curve.png").stat().st_size > 0


def test_tune_hybrid_replays_answer_shards(tiny_llama_dir, dataset_dir, trained_heads, tmp_path):
    """`tune_hybrid --answers`: committed answer shards replace the benchmark's answers, one column per
    shard, and each row's tau is what a replay with its weight and cap gives."""
    from vllm_amphista import tune_hybrid
    from vllm_amphista.replay import head_chains, hybrid_steps

    samples = Dataset([dataset_dir]).samples[:5]
    shards = [tmp_path / "held-out" / "shard_00000.npz", tmp_path / "held-out" / "shard_00001.npz"]
    shards[0].parent.mkdir()
    write_answers_shard(shards[0], samples[:3])
    write_answers_shard(shards[1], samples[3:])
    out = tmp_path / "tune"
    tune_hybrid.main(["--target", str(tiny_llama_dir), "--heads", str(trained_heads["amphista"]), "--answers",
                      *map(str, shards), "--per-shard", "2", "-k", "6", "--ngram-weights", "1", "3",
                      "--ngram-caps", "0.5", "inf", "--out", str(out)])
    taus = json.loads((out / "tune_hybrid.json").read_text())
    assert set(taus["splice w=3 cap=0.5"]) == {"held-out/shard_00000", "held-out/shard_00001", "all"}
    assert len(taus) == 2 + 2 * 2 * 2
    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    drafter = AmphistaDrafter.from_pretrained(trained_heads["amphista"], dtype=torch.float32).eval()
    records = [{"prompt_ids": s.prompt_ids, "output_ids": s.output_ids} for s in samples[:2] + samples[3:5]]
    steps = sum(hybrid_steps(record, head_chains(target, drafter, record["prompt_ids"] + record["output_ids"]),
                             "splice", 6, tune_hybrid.ANPD_DEFAULT_MAX_CONTEXT + 1, ngram_weight=3.0, ngram_cap=0.5)
                for record in records)
    tokens = sum(len(record["output_ids"]) for record in records)
    assert taus["splice w=3 cap=0.5"]["all"] == pytest.approx(tokens / steps)


def test_adapt_fine_tunes_heads_on_recorded_traffic(tiny_llama_dir, dataset_dir, trained_heads, tmp_path):
    """A recording (as `record_traffic` writes it) of the target's own answers: `adapt` prefills
    it, fine-tunes the heads from their weights with the original data mixed in, and a rerun
    finds everything done; an empty recording or one with ids past the vocabulary is refused."""
    from vllm_amphista.traffic import TrafficRecorder

    recording = tmp_path / "traffic"
    recorder = TrafficRecorder(recording)
    for sample in tiny_samples(tiny_llama_dir, 20, output_len=30, seed=3):
        recorder.record(sample["prompt_ids"], sample["output_ids"])
    recorder.close()
    command = ["adapt", "--target", str(tiny_llama_dir), "--recording", str(recording), "--heads",
               str(trained_heads["amphista"]), "--original-data", str(dataset_dir), "--out", str(tmp_path / "adapted"),
               "--work-dir", str(tmp_path / "work"), "--batch-tokens", "256", "--row-tokens", "128", "--dtype", "float32",
               "--max-model-len", "256"]
    completed = run_train_cli(command)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "fine-tuned" in completed.stdout
    before = load_file(trained_heads["amphista"] / "model.safetensors")
    after = load_file(tmp_path / "adapted" / "model.safetensors")
    assert set(before) == set(after) and torch.equal(before["draft_to_target"], after["draft_to_target"])
    assert not torch.equal(before["fuse.weight"], after["fuse.weight"])
    metrics = json.loads((tmp_path / "work" / "fit" / "metrics.json").read_text())
    assert metrics["steps"] > 0 and not metrics["stopped_early"]
    rerun = run_train_cli(command)
    assert rerun.returncode == 0 and f"fine-tuned {metrics['steps']} steps" in rerun.stdout
    recorder = TrafficRecorder(recording)  # the recording grows: the work dir no longer matches it
    recorder.record([5, 6, 7], [8, 9])
    recorder.close()
    changed = run_train_cli(command)
    assert changed.returncode == 2 and "changed since" in changed.stderr

    (tmp_path / "empty").mkdir()
    refused = run_train_cli([*command[:3], "--recording", str(tmp_path / "empty"), *command[5:]])
    assert refused.returncode == 2 and "the recording is empty" in refused.stderr
    foreign = tmp_path / "foreign"
    recorder = TrafficRecorder(foreign)
    recorder.record([5, 6, 7], [100000, 8])
    recorder.close()
    refused = run_train_cli([*command[:3], "--recording", str(foreign), *command[5:]])
    assert refused.returncode == 2 and "recorded with another target" in refused.stderr


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


def test_bad_inputs_give_clear_errors(tiny_llama_dir, dataset_dir, trained_heads, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        read_token_file(empty)
    with pytest.raises(DataError, match="empty"):
        load_prompts(empty)
    with pytest.raises(DataError, match="no complete shard"):
        Dataset([tmp_path])

    wrong_samples = write_jsonl(tmp_path / "wrong.jsonl", [{"prompt_ids": [1, 2], "text": "w1"}])
    with pytest.raises(DataError, match="'output_ids'"):
        read_token_file(wrong_samples)
    write_token_file(tmp_path / "ok.jsonl.gz", [Sample([1, 2], [3])])
    assert read_token_file(tmp_path / "ok.jsonl.gz") == [Sample([1, 2], [3])]
    (tmp_path / "no_answers").mkdir()
    with pytest.raises(DataError, match="no answers shards"):
        read_token_file(tmp_path / "no_answers")
    (tmp_path / "broken_answers").mkdir()
    (tmp_path / "broken_answers" / "shard_00000.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not an answers shard"):
        read_token_file(tmp_path / "broken_answers")
    # Ids past uint16 are kept whole.
    write_answers_shard(tmp_path / "broken_answers" / "shard_00000.npz", [Sample([70000, 1], [2, 65536], "a", "c")])
    assert read_token_file(tmp_path / "broken_answers") == [Sample([70000, 1], [2, 65536], "a", "c")]

    wrong_prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"question": "w1"}, {"answer": "w2"}])
    with pytest.raises(DataError, match="record 1 has no field 'question'"):
        load_prompts(wrong_prompts)
    with pytest.raises(DataError, match="no prompt field.*--prompt-field"):
        load_prompts(write_jsonl(tmp_path / "odd.jsonl", [{"text": "w1"}]))

    # Through the CLI: exit status 2 and one line naming the problem.
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--target", str(tiny_llama_dir), "--data", str(tmp_path), "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert "no complete shard" in capsys.readouterr().err

    other_target = build_tiny_llama(tmp_path / "other", hidden_size=64)
    for method, heads in trained_heads.items():
        with pytest.raises(SystemExit):
            main(["eval", "--target", str(other_target), "--data", str(dataset_dir), "--heads", str(heads)])
        assert "built for hidden size 128 and vocab 320" in capsys.readouterr().err, method


def test_self_prompts_open_a_user_turn_and_keep_distinct_complete_requests(tiny_llama_dir):
    from transformers import AutoTokenizer

    from vllm_amphista.prompts import chat_prompt_ids
    from vllm_amphista.train.self_prompts import keep_request, request_key, user_turn_prefix

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prefix = user_turn_prefix(tokenizer)
    request = " ".join(TINY_WORDS[7:11])
    prompt = chat_prompt_ids(tokenizer, request)
    # What the target continues from is exactly what stands before a user's words in a real prompt.
    assert prompt[:len(prefix)] == prefix and tokenizer.decode(prompt[len(prefix):]).startswith(TINY_WORDS[7])
    assert request_key("Write a poem, about  the sea!") == request_key("write a poem about the sea")
    assert keep_request("Write a poem about the sea.", finished=True)
    assert not keep_request("Write a poem about the sea.", finished=False)  # cut by the token limit
    assert not keep_request("Hi", finished=True)
    assert not keep_request("Tell me <|im_start|>assistant about it", finished=True)


def test_self_prompts_open_requests_with_a_training_files_first_words_in_proportion(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from vllm_amphista.prompts import chat_prompt_ids
    from vllm_amphista.train.self_prompts import (opener_sequence, opening_words, user_turn_prefix,
                                                  write_self_prompts)

    prompts = ["Write a poem.", "write: a story", "Describe the sea", "Write it down", "Name three birds!", "  ", "Why?"]
    # Ranked by how many prompts each opens, spelled as most often written, punctuation stripped.
    assert opening_words(prompts, 3) == [("Write", 3), ("Describe", 1), ("Name", 1)]
    sequence = opener_sequence(opening_words(prompts, 3), seed=0)
    assert sorted(sequence) == ["Describe", "Name", "Write", "Write", "Write"]
    assert sequence == opener_sequence(opening_words(prompts, 3), seed=0)

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    opener, rest = TINY_WORDS[7], " ".join(TINY_WORDS[8:11])
    opened = user_turn_prefix(tokenizer) + tokenizer(opener, add_special_tokens=False)["input_ids"]
    # The target continues from what stands before the rest of a real prompt that opens with the word.
    assert chat_prompt_ids(tokenizer, f"{opener} {rest}")[:len(opened)] == opened
    with pytest.raises(ValueError, match="--num-openers must be >= 1"):
        write_self_prompts(str(tiny_llama_dir), tmp_path / "requests.jsonl", count=1, openers_from="unread.json",
                           num_openers=0)


def test_self_prompts_drop_answered_listed_and_evaluation_requests(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from vllm_amphista.prompts import chat_prompt_ids
    from vllm_amphista.train.data import Sample, write_answers_shard
    from vllm_amphista.train.self_prompts import RequestFilter, answered_requests

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    words = TINY_WORDS[7:40]
    answered, later_turn = " ".join(words[0:4]), " ".join(words[4:7])
    answers_dir = tmp_path / "answers"
    answers_dir.mkdir()
    two_turns = [{"role": "user", "content": " ".join(words[7:9])}, {"role": "assistant", "content": words[9]},
                 {"role": "user", "content": later_turn}]
    write_answers_shard(answers_dir / "shard_00000.npz", [
        Sample(chat_prompt_ids(tokenizer, answered), [5, 6]), Sample(chat_prompt_ids(tokenizer, two_turns), [7])])
    listed = tmp_path / "listed.jsonl"
    listed.write_text(json.dumps({"question_id": 1, "turns": [" ".join(words[10:14])]}) + "\n")
    eval_file = tmp_path / "eval.jsonl"
    eval_turn = " ".join(words[14:24])
    eval_file.write_text(json.dumps({"question_id": 1, "turns": [" ".join(words[24:27]), eval_turn]}) + "\n")

    # Only single-turn prompts hold a first request; a later turn's prompt is not one.
    assert answered_requests(answers_dir, tokenizer) == [answered]
    request_filter = RequestFilter(tokenizer, [answers_dir, listed], [eval_file])
    assert request_filter.num_known == 2
    assert request_filter.is_known(answered.upper() + "!")
    assert request_filter.is_known(" ".join(words[10:14]))
    assert request_filter.is_known(" ".join(words[24:27]))  # an evaluation turn itself
    assert not request_filter.is_known(later_turn)
    assert not request_filter.is_known(" ".join(words[0:5]))
    assert request_filter.is_near_eval(f"{words[30]} {' '.join(words[15:23])} {words[31]}")  # 8 words shared
    assert not request_filter.is_near_eval(" ".join(words[15:22]))  # 7 are not enough
    with pytest.raises(DataError, match="no answers shards"):
        RequestFilter(tokenizer, [tmp_path], [eval_file])
    with pytest.raises(DataError, match="no such file"):
        RequestFilter(tokenizer, [], [tmp_path / "missing.jsonl"])


MMAPPED_BYTES_AFTER_A_LARGE_FREE = """
import ctypes, sys, torch
from vllm_amphista.train.fit import map_large_allocations
if sys.argv[1] == "fit":
    map_large_allocations()
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
freed = torch.empty(8 << 20, dtype=torch.uint8)
del freed
before = libc.mallinfo2().hblkhd
kept = torch.empty(4 << 20, dtype=torch.uint8)
print(libc.mallinfo2().hblkhd - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "confstr")
                    or "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or ""), reason="glibc's malloc")
def test_fit_maps_each_large_batch_tensor_so_freeing_it_returns_it():
    """After an 8 MiB free, glibc's default carves a 4 MiB tensor from the heap (fragmenting it as
    batch sizes vary); the setting `fit` makes maps it."""
    def mmapped_bytes(mode: str) -> int:
        result = subprocess.run([sys.executable, "-c", MMAPPED_BYTES_AFTER_A_LARGE_FREE, mode],
                                cwd=REPO_ROOT, capture_output=True, text=True, check=True)
        return int(result.stdout.split()[-1])

    assert mmapped_bytes("default") == 0
    assert mmapped_bytes("fit") >= 4 << 20
