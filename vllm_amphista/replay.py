"""Greedy replay: tau of a chain drafter without an engine, from the target's greedy answers.

Under greedy decoding a chain drafter's acceptance is fixed by the context and
the target's greedy continuation alone: at each verification step the target
accepts the longest prefix of the draft that equals its own next tokens, then
adds one token of its own. So once the target's greedy answers are known, tau
(generated tokens / target steps, Spec-Bench's definition) of any drafter
follows exactly and cheaply. `tune_anpd` chose ANPD's N this way and
`tune_hybrid` the hybrid's rule; heads are replayed from the target's hidden
states (one float32 transformers forward per answer), so training runs and
drafter sweeps measure tau the same way.

No vLLM here: the answers come from `bench/greedy_answers.py` (or any source).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_amphista.anpd import NgramTables
from vllm_amphista.answer_ngrams import AnswerNgrams
from vllm_amphista.hybrid import NGRAM_CONFIDENCE_CAP, NGRAM_WEIGHT, hybrid_draft
from vllm_amphista.modeling_amphista import AmphistaDrafter, target_features


def accepted_prefix(draft: list[int], truth: list[int]) -> int:
    accepted = 0
    for drafted, actual in zip(draft, truth):
        if drafted != actual:
            break
        accepted += 1
    return accepted


def replay(prompt_ids: list[int], output_ids: list[int], k: int, draft_fn, absorb_fn=None) -> int:
    """Target steps to produce `output_ids` with a chain drafter.

    draft_fn(context, k) returns the draft; absorb_fn(tokens), if given, is
    told every token that joins the context (an incremental drafter)."""
    # The prefill step emits the first token; drafting starts after it.
    context = list(prompt_ids) + list(output_ids[:1])
    if absorb_fn is not None:
        absorb_fn(context)
    position = steps = min(1, len(output_ids))
    while position < len(output_ids):
        # The engine may draft further; tokens past the end would be cut, so the steps are the same.
        room = min(k, len(output_ids) - position - 1)
        draft = draft_fn(context, room) if room > 0 else []
        emitted = output_ids[position: position + accepted_prefix(draft, output_ids[position:]) + 1]
        context += emitted
        if absorb_fn is not None:
            absorb_fn(emitted)
        position += len(emitted)
        steps += 1
    return steps


def anpd_steps(prompt_ids: list[int], output_ids: list[int], k: int, max_n: int,
               fallback: AnswerNgrams | None = None) -> int:
    tables = NgramTables(max_n, max_entries=1 << 30, fallback=fallback)
    return replay(prompt_ids, output_ids, k, lambda _context, room: tables.draft(room), tables.extend)


@torch.no_grad()
def head_chains(target, drafter: AmphistaDrafter, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """([L-1, K] draft ids, [L-1, K] probabilities): row t is what the heads draft once x_{t+1} is sampled."""
    ids = torch.tensor([token_ids])
    hidden = target_features(target, ids, drafter.config.target_feature_layers)[:, :-1]
    embed = target.get_input_embeddings().weight
    draft_ids, log_probabilities = drafter.draft(hidden, ids[:, 1:], embed, target.get_output_embeddings().weight)
    return draft_ids[0], log_probabilities[0].exp()


def hybrid_steps(record: dict, chains: tuple[torch.Tensor, torch.Tensor], rule: str, k: int, max_n: int,
                 fallback: AnswerNgrams | None = None, ngram_weight: float = NGRAM_WEIGHT,
                 ngram_cap: float = NGRAM_CONFIDENCE_CAP) -> int:
    """Target steps with a `hybrid.RULES` rule over the record's head chains and ANPD tables (falling
    back on the answer n-grams the heads dir ships, as in vLLM); ANPD's weight and cap default to
    the shipped ones."""
    draft_ids, probabilities = chains
    draft_ids, probabilities = draft_ids.tolist(), probabilities.tolist()
    tables = NgramTables(max_n, max_entries=1 << 30, fallback=fallback)

    def draft(context: list[int], room: int) -> list[int]:
        position = len(context) - 2  # h_{L-2} and the last token x_{L-1} give the next drafts
        heads = list(zip(draft_ids[position], probabilities[position]))
        chain = hybrid_draft(heads, tables.scored_draft, k, rule, ngram_weight, ngram_cap)
        return [token for token, _ in chain][:room]

    return replay(record["prompt_ids"], record["output_ids"], k, draft, tables.extend)


def tau_by_category(records: list[dict], steps_of: Callable[[dict], int]) -> dict[str, float]:
    """tau per category of `records` ({"category", "prompt_ids", "output_ids"}) and over "all"."""
    totals: dict[str, list[int]] = {}
    for record in records:
        total = totals.setdefault(record["category"], [0, 0])  # generated tokens, target steps
        total[0] += len(record["output_ids"])
        total[1] += steps_of(record)
    overall = [sum(t[0] for t in totals.values()), sum(t[1] for t in totals.values())]
    return {category: tokens / steps for category, (tokens, steps) in {**totals, "all": overall}.items()}
