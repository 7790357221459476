"""Shared test helpers: a random tiny Llama target with an offline tokenizer,
and a runner for short vLLM engines in a subprocess.

The tiny Llama has vLLM-CPU-compatible shapes (attention head dim 32, the
smallest the CPU attention backend supports) and ties its embeddings like
SmolLM2, the real target. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

# Tests share two CPU cores with other jobs; with two intra-op threads,
# OpenMP spin-waiting under contention made tiny training steps ~20x slower.
torch.set_num_threads(1)

TINY_SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
TINY_VOCAB_SIZE = 320
TINY_WORDS = ["what", "is", "the", "answer", "to", "question", "?"]
TINY_WORDS += [f"w{i}" for i in range(TINY_VOCAB_SIZE - len(TINY_SPECIAL_TOKENS) - len(TINY_WORDS))]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Environment for an in-process vLLM engine on this CPU-only machine.
VLLM_CPU_TEST_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


def build_tiny_tokenizer():
    """A word-level PreTrainedTokenizerFast with a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(TINY_SPECIAL_TOKENS + TINY_WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=TINY_SPECIAL_TOKENS[4:],
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def build_tiny_llama(
    directory: str | os.PathLike, seed: int = 0, tie_word_embeddings: bool = True, hidden_size: int = 128
) -> Path:
    """Save a random tiny Llama (by default hidden 128, 2 layers, 4 heads of
    dim 32, 2 KV heads, vocab 320, every id a word of the tokenizer) and its
    tokenizer to `directory`, in float32."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB_SIZE,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    # A wider init than the default 0.02 gives peaked, input-dependent
    # next-token distributions, so greedy text is not one repeated token.
    config.initializer_range = 0.2
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, do_sample=False
    ).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_samples(target_dir: str | os.PathLike, num_samples: int, prompt_len: int = 6, output_len: int = 40, seed: int = 0):
    """Self-distillation data from the tiny target: random word prompts and the
    target's greedy continuations, as {"prompt_ids", "output_ids"} dicts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    first_word_id = len(TINY_SPECIAL_TOKENS)
    prompts = torch.randint(first_word_id, first_word_id + len(TINY_WORDS), (num_samples, prompt_len), generator=generator)
    with torch.inference_mode():
        sequences = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=output_len,
            min_new_tokens=output_len, do_sample=False, pad_token_id=0,
        )
    return [
        {"prompt_ids": prompt.tolist(), "output_ids": sequence[prompt_len:].tolist()}
        for prompt, sequence in zip(prompts, sequences)
    ]


def write_jsonl(path: str | os.PathLike, records) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def run_vllm_generate(
    target_dir: str | os.PathLike,
    prompts: list[str],
    speculative_config: dict | None = None,
    max_tokens: int = 16,
    timeout: float = 300,
) -> dict:
    """Run a short greedy vLLM engine in a fresh subprocess (vLLM keeps global
    state, so one engine per process) and return its JSON report:
    {"texts": [...], "token_ids": [[...]], "spec_metrics": {...}}."""
    script = textwrap.dedent(
        f"""
        import json, sys
        from vllm import LLM, SamplingParams

        if __name__ == "__main__":
            llm = LLM(
                model={str(target_dir)!r}, dtype="float32", max_model_len=256, enforce_eager=True,
                speculative_config={speculative_config!r}, seed=0, disable_log_stats=False,
            )
            outputs = llm.generate({prompts!r}, SamplingParams(temperature=0.0, max_tokens={max_tokens}, ignore_eos=True))
            metrics = {{metric.name: getattr(metric, "value", None) for metric in llm.get_metrics()
                        if metric.name.startswith("vllm:spec_decode")}}
            report = {{
                "texts": [output.outputs[0].text for output in outputs],
                "token_ids": [list(output.outputs[0].token_ids) for output in outputs],
                "spec_metrics": metrics,
            }}
            print("REPORT=" + json.dumps(report))
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env={**os.environ, **VLLM_CPU_TEST_ENV},
        capture_output=True, text=True, timeout=timeout,
    )
    report_lines = [line for line in completed.stdout.splitlines() if line.startswith("REPORT=")]
    if completed.returncode != 0 or not report_lines:
        raise AssertionError(
            f"vLLM engine failed (exit {completed.returncode}):\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}"
        )
    return json.loads(report_lines[-1].removeprefix("REPORT="))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A random tiny Llama target directory, built once per test session."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
