"""`generate`: the target answers prompts through vLLM (self-distillation data).

Train on instruction data (Alpaca, GSM8K train, ShareGPT, ...), never on the
benchmark prompts you will evaluate speed on (MT-Bench, Spec-Bench): drafters
trained on the test prompts report inflated acceptance.
"""

from __future__ import annotations

import logging
import os

from tqdm import tqdm

from vllm_amphista.train.data import Sample, write_samples

logger = logging.getLogger(__name__)


def chat_prompt_ids(tokenizer, prompt: str, use_chat_template: bool = True) -> list[int]:
    """Token ids of `prompt` as a single user turn, ready for the assistant's answer."""
    if not use_chat_template:
        return tokenizer(prompt)["input_ids"]
    if not tokenizer.chat_template:
        raise ValueError("the target's tokenizer has no chat template; pass --no-chat-template to use raw prompts")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    # The template already holds any BOS the model expects.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate_samples(
    target: str,
    prompts: list[str],
    output_path: str | os.PathLike,
    *,
    max_tokens: int = 512,
    temperature: float = 0.0,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_model_len: int = 1024,
    batch_size: int = 256,
    enforce_eager: bool = False,
    use_chat_template: bool = True,
) -> int:
    """Write one sample per usable prompt to `output_path` (JSONL); return how
    many were written. Prompts that leave no room for `max_tokens` are skipped."""
    # vLLM reads these at import; 4 GiB of KV cache suits this CPU machine.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(target)
    all_prompt_ids = [chat_prompt_ids(tokenizer, prompt, use_chat_template) for prompt in prompts]
    prompt_ids = [ids for ids in all_prompt_ids if len(ids) + max_tokens <= max_model_len]
    if len(prompt_ids) < len(all_prompt_ids):
        logger.warning(
            "skipped %d of %d prompts longer than max_model_len - max_tokens = %d tokens",
            len(all_prompt_ids) - len(prompt_ids), len(all_prompt_ids), max_model_len - max_tokens,
        )
    if not prompt_ids:
        raise ValueError("no prompt fits in max_model_len - max_tokens; raise --max-model-len or lower --max-tokens")

    llm = LLM(model=target, dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager)
    sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    write_samples(output_path, [])
    for start in tqdm(range(0, len(prompt_ids), batch_size), desc="generate", unit="batch"):
        batch = prompt_ids[start:start + batch_size]
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], sampling, use_tqdm=False)
        # Written batch by batch so an interrupted run keeps what it made.
        write_samples(
            output_path,
            [Sample(ids, list(output.outputs[0].token_ids)) for ids, output in zip(batch, outputs, strict=True)],
            append=True,
        )
    return len(prompt_ids)
