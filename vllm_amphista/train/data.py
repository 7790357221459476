"""Prompt files in, self-distillation samples out, and the draft vocabulary.

Prompt files: Alpaca JSON (``instruction`` + optional ``input``), GSM8K JSONL
(``question``), MT-Bench / Spec-Bench JSONL (``turns``: the first turn is
used), or any JSON/JSONL list of records with ``--prompt-field``.

Samples file: JSONL, one ``{"prompt_ids": [...], "output_ids": [...]}`` per
line: the chat-formatted prompt and the target's own continuation.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

# Looked for, in this order, when no --prompt-field is given.
KNOWN_PROMPT_FIELDS = ("instruction", "question", "turns", "prompt")


class DataError(ValueError):
    """A data file is empty, unreadable or of the wrong shape."""


@dataclass
class Sample:
    prompt_ids: list[int]
    output_ids: list[int]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


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


def _prompt_text(record: dict, field: str) -> str:
    value = record[field]
    if field == "turns" or isinstance(value, list):
        value = value[0] if value else ""
    if field == "instruction" and record.get("input"):
        value = f"{value}\n\n{record['input']}"
    return value


def load_prompts(path: str | os.PathLike, prompt_field: str | None = None, max_prompts: int | None = None) -> list[str]:
    """User prompts of a prompt file (see the module docstring for the formats)."""
    records = read_records(path)
    field = prompt_field or next((name for name in KNOWN_PROMPT_FIELDS if name in records[0]), None)
    if field is None:
        raise DataError(
            f"{path}: records have no prompt field (looked for {', '.join(KNOWN_PROMPT_FIELDS)}; "
            f"the first record has {sorted(records[0])}); pass --prompt-field"
        )
    prompts = []
    for index, record in enumerate(records[:max_prompts]):
        if field not in record:
            raise DataError(f"{path}: record {index} has no field {field!r} (it has {sorted(record)})")
        text = _prompt_text(record, field)
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{path}: record {index} field {field!r} is not a non-empty string")
        prompts.append(text)
    return prompts


def read_samples(path: str | os.PathLike) -> list[Sample]:
    """Samples written by `generate`; DataError on an empty file or a malformed line."""
    samples = []
    for index, record in enumerate(read_records(path)):
        prompt_ids, output_ids = record.get("prompt_ids"), record.get("output_ids")
        if not (_is_id_list(prompt_ids) and _is_id_list(output_ids)) or not prompt_ids:
            raise DataError(
                f"{path}: record {index} must have non-empty integer lists 'prompt_ids' and 'output_ids' "
                f"(it has {sorted(record)})"
            )
        samples.append(Sample(prompt_ids, output_ids))
    return samples


def _is_id_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(token, int) and token >= 0 for token in value)


def write_samples(path: str | os.PathLike, samples: list[Sample], append: bool = False) -> None:
    with open(path, "a" if append else "w", encoding="utf-8") as file:
        for sample in samples:
            file.write(json.dumps({"prompt_ids": sample.prompt_ids, "output_ids": sample.output_ids}) + "\n")


def check_token_ids(samples: list[Sample], vocab_size: int, source: str) -> None:
    """DataError if a sample holds an id outside the target's vocabulary."""
    largest = max(max(sample.token_ids) for sample in samples)
    if largest >= vocab_size:
        raise DataError(f"{source}: token id {largest} is outside the target's vocabulary of {vocab_size}")


def most_frequent_tokens(samples: list[Sample], draft_vocab_size: int, vocab_size: int) -> torch.Tensor:
    """The draft vocabulary: the `draft_vocab_size` most frequent ids of the
    target's outputs (the tokens the drafter must predict), ties broken by id,
    topped up with the lowest unused ids if the outputs have fewer distinct ids."""
    counts = Counter(token for sample in samples for token in sample.output_ids)
    ranked = sorted(counts, key=lambda token: (-counts[token], token))[:draft_vocab_size]
    if len(ranked) < draft_vocab_size:
        seen = set(ranked)
        ranked += [token for token in range(vocab_size) if token not in seen][: draft_vocab_size - len(ranked)]
    return torch.tensor(ranked, dtype=torch.int64)
