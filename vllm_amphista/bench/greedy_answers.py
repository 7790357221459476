"""The target's greedy answers to benchmark questions, through vLLM, cached with the settings
that made them: the input of every greedy replay (`vllm_amphista/replay.py`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from vllm_amphista.bench.engines import set_engine_env
from vllm_amphista.prompts import load_questions

GREEDY_ANSWERS = "greedy_answers.jsonl"
# The flags that decide the answers: a cache made with others is regenerated.
ANSWER_SETTINGS = ("target", "questions", "per_category", "max_tokens", "max_model_len", "dtype")


def greedy_answers(args) -> list[dict]:
    """The target's greedy answers (cached in --out with the settings that made them), one record per question."""
    path = Path(args.out) / GREEDY_ANSWERS
    settings_path = path.with_suffix(".settings.json")
    settings = {name: getattr(args, name) for name in ANSWER_SETTINGS}
    settings["questions_sha256"] = [hashlib.sha256(Path(q).read_bytes()).hexdigest() for q in args.questions]
    if path.exists() and settings_path.exists() and json.loads(settings_path.read_text()) == settings:
        return [json.loads(line) for line in path.read_text().splitlines()]
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    questions, notes = load_questions(args.questions, tokenizer, None, args.per_category,
                                      args.max_model_len - args.max_tokens)
    for note in notes:
        print(note)
    flat = [(category, question) for category, items in questions.items() for question in items]
    set_engine_env(kv_cache_gib=4)
    llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    outputs = llm.generate([{"prompt_token_ids": q.prompt_ids} for _, q in flat],
                           SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    records = [{"category": category, "question_id": question.question_id, "prompt_ids": question.prompt_ids,
                "output_ids": list(output.outputs[0].token_ids)}
               for (category, question), output in zip(flat, outputs, strict=True)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    settings_path.write_text(json.dumps(settings))
    return records
