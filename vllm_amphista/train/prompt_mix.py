"""The self-distillation prompt mix: what users send, built from Alpaca and GSM8K.

    python -m vllm_amphista.train mix --alpaca alpaca.json --gsm8k gsm8k_train.jsonl --out mix.jsonl
    python -m vllm_amphista.train mix --alpaca ... --gsm8k ... --seed 1 --exclude mix.jsonl --out mix_seed1.jsonl
    python -m vllm_amphista.train mix --second-turns-from DATASET_DIR --target T --out mix2.jsonl

Drafting heads learn the target's own answers, so the prompts should look
like what users ask: open questions, writing, roleplay, reasoning, math word
problems, code, extraction, translation, summarization of a given passage,
question answering over a given passage, and second turns. Alpaca instructions
and GSM8K questions are used as they are, and as the material of constructed
tasks (an Alpaca answer becomes a passage to summarize, translate, question or
extract from; a GSM8K problem becomes a coding task). Second turns are
follow-ups to the target's own first answers, so they are built from a
generated dataset. Benchmark questions (Spec-Bench, MT-Bench) are never used.

Output: JSONL records {"id", "category", "messages"}: a conversation that ends
with a user turn, which `generate` answers. The mix is seeded and
deterministic; every category's count is printed.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

from vllm_amphista.prompts import read_records

LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Chinese")
ROLES = (
    "a friendly high-school teacher", "a pirate captain", "a travel guide in Rome", "a detective from the 1920s",
    "a cheerful chef", "a medieval knight", "a patient doctor", "a sports commentator", "a wise old librarian",
    "a startup founder pitching to investors", "a museum tour guide", "an astronaut on the space station",
    "a grumpy cat", "a motivational coach", "a news reporter", "Shakespeare",
)
EXTRACTIONS = (
    "every number and what it refers to",
    "the names of all people, places and organizations",
    "the key facts",
    "the main topic and three keywords",
    "every action or instruction",
)
EXTRACTION_FORMATS = ("Answer as a bulleted list.", "Answer in JSON.", "Answer as a table.", "")
WRITING_FORMS = ("a short blog post", "a short story", "a poem", "a formal email", "a persuasive paragraph",
                 "a product description", "a tweet", "a diary entry")
REWRITES = ("more formal", "simpler, for a ten-year-old", "more persuasive", "shorter", "more enthusiastic")
FOLLOW_UPS = (
    "Can you explain that more simply, as if to a ten-year-old?",
    "Summarize your answer in one sentence.",
    "Give me one more example.",
    "Rewrite your answer as a bulleted list.",
    "What is the most important point in your answer, and why?",
    "Can you make your answer shorter?",
    "Translate your answer into French.",
    "Are you sure? Check your answer step by step.",
    "Write a short title for your answer.",
    "Expand on your answer with more detail.",
)

# Prompts per category of the first-turn mix (second turns are built separately).
DEFAULT_COUNTS = {
    "alpaca": 5000, "math": 4500, "summarization": 2200, "translation": 2000, "passage_qa": 2000,
    "extraction": 1500, "roleplay": 1500, "code": 1200, "reasoning": 1000, "writing": 1000,
}


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _alpaca_prompt(record: dict) -> str:
    return f"{record['instruction']}\n\n{record['input']}" if record.get("input") else record["instruction"]


def _gsm8k_solution(answer: str) -> str:
    """A GSM8K reference solution as plain prose: calculator marks and the final '####' line removed."""
    text = re.sub(r"<<[^>]*>>", "", answer)
    return "\n".join(line for line in text.splitlines() if not line.startswith("####")).strip()


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def first_turn_mix(alpaca: list[dict], gsm8k: list[dict], counts: dict[str, int], seed: int = 0,
                   exclude: list[dict] = ()) -> list[dict]:
    """Conversations for every category in `counts`; each source text is drawn at random (seeded).

    Conversations equal to one in `exclude` (records of earlier mixes) are left out, so a mix with
    another seed adds only prompts whose greedy answers are not already answered."""
    rng = random.Random(seed)
    passages = [r["output"] for r in alpaca if 200 <= len(r["output"]) <= 1500]
    short_texts = [r["output"] for r in alpaca if 40 <= len(r["output"]) <= 400]
    solutions = [_gsm8k_solution(r["answer"]) for r in gsm8k]
    plain_instructions = [r["instruction"] for r in alpaca if not r.get("input")]
    with_passage = [r for r in alpaca if 200 <= len(r["output"]) <= 1500]

    def pick(items: list):
        return items[rng.randrange(len(items))]

    builders = {
        "alpaca": lambda i: _user(_alpaca_prompt(alpaca[i % len(alpaca)])),
        "math": lambda i: _user(gsm8k[i % len(gsm8k)]["question"]),
        "summarization": lambda i: _user(
            f"Summarize the following text in two or three sentences.\n\n{pick(passages + solutions)}"),
        "translation": lambda i: _user(f"Translate the following text into {pick(LANGUAGES)}:\n\n{pick(short_texts)}"),
        "passage_qa": lambda i: _passage_question(pick(with_passage), rng),
        "extraction": lambda i: _user(
            f"Extract {pick(EXTRACTIONS)} from the text below. {pick(EXTRACTION_FORMATS)}".rstrip()
            + f"\n\nText: {pick(passages + [r['question'] for r in gsm8k[:2000]])}"),
        "roleplay": lambda i: _user(f"You are {pick(ROLES)}. Stay in character. {pick(plain_instructions)}"),
        "code": lambda i: _user(
            "Write a Python function that solves this problem and returns the answer, then explain the code "
            f"briefly.\n\n{pick(gsm8k)['question']}"),
        "reasoning": lambda i: _user(f"{pick(plain_instructions)} Think it through step by step and explain "
                                     "your reasoning before giving your final answer."),
        "writing": lambda i: _user(
            f"Write {pick(WRITING_FORMS)} based on this idea: {pick(short_texts)}" if rng.random() < 0.6 else
            f"Rewrite the following text to make it {pick(REWRITES)}.\n\n{pick(short_texts)}"),
    }
    unknown = set(counts) - set(builders)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}; known: {sorted(builders)}")
    records = []
    for category, count in counts.items():
        # Alpaca and GSM8K as they are: a fresh order, no repeats until the file is exhausted.
        order = list(range(count))
        if category in ("alpaca", "math"):
            source = alpaca if category == "alpaca" else gsm8k
            order = rng.sample(range(len(source)), min(count, len(source)))
            order += [rng.randrange(len(source)) for _ in range(count - len(order))]
        for index in order:
            records.append({"category": category, "messages": builders[category](index)})
    rng.shuffle(records)
    answered = {json.dumps(record["messages"]) for record in exclude}
    records = [record for record in records if json.dumps(record["messages"]) not in answered]
    for number, record in enumerate(records):
        record["id"] = f"{record['category']}-{number}"
    return records


def _passage_question(record: dict, rng: random.Random) -> list[dict[str, str]]:
    """A question answered from a given passage: an Alpaca answer, asked about by its own instruction."""
    questions = (record["instruction"], "What is the main point of the passage?",
                 "What details does the passage give? Quote the passage where you can.")
    question = questions[0] if rng.random() < 0.6 else rng.choice(questions[1:])
    return _user(f"Read the passage and answer the question using only the passage.\n\nPassage: {record['output']}"
                 f"\n\nQuestion: {question}")


def second_turn_mix(first_turns: list[dict], count: int, seed: int = 0) -> list[dict]:
    """Follow-ups to the target's own first answers: {"messages": [user, assistant, user], ...}.

    `first_turns`: records with "id", "category", "messages" (the first user turn) and "answer" (text)."""
    rng = random.Random(seed)
    usable = [record for record in first_turns if record["answer"].strip()]
    chosen = rng.sample(usable, min(count, len(usable)))
    return [{"id": f"second-{record['id']}", "category": f"second_turn/{record['category']}",
             "messages": [*record["messages"], {"role": "assistant", "content": record["answer"]},
                          {"role": "user", "content": rng.choice(FOLLOW_UPS)}]}
            for record in chosen]


def write_mix(path: str | Path, records: list[dict]) -> Counter:
    Path(path).write_text("".join(json.dumps(record) + "\n" for record in records))
    return Counter(record["category"] for record in records)


def build_first_turns(alpaca_path: str, gsm8k_path: str, out: str, counts: dict[str, int] | None = None,
                      seed: int = 0, exclude_paths: list[str] = ()) -> Counter:
    exclude = [record for path in exclude_paths for record in read_records(path)]
    records = first_turn_mix(read_records(alpaca_path), read_records(gsm8k_path), counts or DEFAULT_COUNTS, seed,
                             exclude)
    return write_mix(out, records)
