"""Prompts in, token ids out: prompt files, benchmark questions and the chat template.

Shared by training, the benchmark, tune_anpd, the examples and the tests, so
that every one of them formats a question exactly the same way. No vLLM.

Prompt files: Alpaca JSON (``instruction`` + optional ``input``), GSM8K JSONL
(``question``), MT-Bench / Spec-Bench JSONL (``turns``: the first turn is
used), a prompt mix (``messages``: a conversation ending with a user turn),
or any JSON/JSONL list of records with an explicit prompt field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# Looked for, in this order, when no prompt field is given.
KNOWN_PROMPT_FIELDS = ("instruction", "question", "turns", "messages", "prompt")
UNCATEGORIZED = "uncategorized"


class DataError(ValueError):
    """A data file is empty, unreadable or of the wrong shape."""


def read_records(path: str | os.PathLike) -> list[dict]:
    """Records of a JSON list or a JSONL file; DataError if empty or not records."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            records = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: not valid {'JSONL' if path.suffix == '.jsonl' else 'JSON'}: {error}") from error
    if not isinstance(records, list):
        raise DataError(f"{path}: expected a JSON list of records, got a {type(records).__name__}")
    if not records:
        raise DataError(f"{path}: the dataset is empty")
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{path}: record {index} is a {type(record).__name__}, expected an object")
    return records


Conversation = list[dict[str, str]]


def _conversation(record: dict, field: str) -> Conversation:
    value = record[field]
    if field == "messages":
        return value
    if field == "turns" or isinstance(value, list):
        value = value[0] if value else ""
    if field == "instruction" and record.get("input"):
        value = f"{value}\n\n{record['input']}"
    return [{"role": "user", "content": value}]


def _is_conversation(value) -> bool:
    return (
        isinstance(value, list) and bool(value)
        and all(isinstance(turn, dict) and isinstance(turn.get("content"), str) and turn["content"].strip()
                for turn in value)
        and value[-1].get("role") == "user"
    )


def load_conversations(path: str | os.PathLike, prompt_field: str | None = None,
                       max_prompts: int | None = None) -> list[Conversation]:
    """The conversations of a prompt file (see the module docstring), each ending with a user turn."""
    records = read_records(path)
    field = prompt_field or next((name for name in KNOWN_PROMPT_FIELDS if name in records[0]), None)
    if field is None:
        raise DataError(
            f"{path}: records have no prompt field (looked for {', '.join(KNOWN_PROMPT_FIELDS)}; "
            f"the first record has {sorted(records[0])}); pass --prompt-field"
        )
    conversations = []
    for index, record in enumerate(records[:max_prompts]):
        if field not in record:
            raise DataError(f"{path}: record {index} has no field {field!r} (it has {sorted(record)})")
        conversation = _conversation(record, field)
        if not _is_conversation(conversation):
            raise DataError(f"{path}: record {index} field {field!r} is not a non-empty prompt")
        conversations.append(conversation)
    return conversations


def load_prompts(path: str | os.PathLike, prompt_field: str | None = None, max_prompts: int | None = None) -> list[str]:
    """The single user prompts of a prompt file (the last user turn of each conversation)."""
    return [conversation[-1]["content"] for conversation in load_conversations(path, prompt_field, max_prompts)]


def chat_prompt_ids(tokenizer, conversation: str | Conversation, use_chat_template: bool = True) -> list[int]:
    """Token ids of a user prompt (or a conversation ending with a user turn), ready for the assistant's answer."""
    if isinstance(conversation, str):
        conversation = [{"role": "user", "content": conversation}]
    if not use_chat_template:
        return tokenizer("\n\n".join(turn["content"] for turn in conversation))["input_ids"]
    if not tokenizer.chat_template:
        raise ValueError("the target's tokenizer has no chat template; pass --no-chat-template to use raw prompts")
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    # The template already holds any BOS the model expects.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Question:
    question_id: object
    category: str
    prompt_ids: list[int]


def load_questions(paths: list[str], tokenizer, categories: list[str] | None = None, per_category: int | None = None,
                   max_prompt_tokens: int | None = None) -> tuple[dict[str, list[Question]], list[str]]:
    """Chat-formatted first turns of Spec-Bench / MT-Bench style files, grouped by category (in file
    order), and notes on what was left out. With several files, categories are named file/category,
    as files may share category names. DataError for an unknown category or nothing left to ask."""
    grouped: dict[str, list[tuple[str, str, object]]] = {}  # category -> (raw category, text, question id)
    for path in paths:
        # load_prompts keeps record order, so its texts line up with the records.
        for index, (record, text) in enumerate(zip(read_records(path), load_prompts(path))):
            category = str(record.get("category", UNCATEGORIZED))
            name = f"{Path(path).stem}/{category}" if len(paths) > 1 else category
            grouped.setdefault(name, []).append((category, text, record.get("question_id", index)))
    if categories:
        unknown = [wanted for wanted in categories
                   if not any(wanted in (name, entries[0][0]) for name, entries in grouped.items())]
        if unknown:
            raise DataError(f"unknown categories {unknown}; the question files have: {', '.join(grouped)}")
        grouped = {name: entries for name, entries in grouped.items()
                   if name in categories or entries[0][0] in categories}

    questions: dict[str, list[Question]] = {}
    notes = []
    for name, entries in grouped.items():
        kept = []
        for _, text, question_id in entries:
            if per_category is not None and len(kept) == per_category:
                break
            prompt_ids = chat_prompt_ids(tokenizer, text)
            if max_prompt_tokens is not None and len(prompt_ids) > max_prompt_tokens:
                notes.append(f"{name} question {question_id}: {len(prompt_ids)} prompt tokens leave no room "
                             f"for the answer; left out")
                continue
            kept.append(Question(question_id, name, prompt_ids))
        if kept:
            questions[name] = kept
    if not questions:
        raise DataError("no question to ask: check the question files, the categories and the length limit")
    return questions, notes
