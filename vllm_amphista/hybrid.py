"""Hybrid drafting: the Amphista heads' chain and the ANPD chain, chosen or spliced per request
and step. No vLLM: the proposer (vllm/amphista_anpd.py) and the replay that chose the rule
(tune_hybrid.py) both call `hybrid_draft`.

Each source gives a chain of (token, confidence): the heads their own probability of their
top-1 token, ANPD the smoothed share of the matched context's counts scaled by the match
length, or where no context matches, the answer n-grams' share times anpd.FALLBACK_WEIGHT
(anpd.NgramTables._predict). A chain's expected accepted length is the sum of its
running confidence products. Candidates are every splice of the two: the heads' first j
tokens, then ANPD's continuation of the history extended by them (j = 0 is ANPD's own chain,
j = K the heads' whole chain). The rule takes the candidate with the longest expected
accepted length, with ANPD's confidences weighted by NGRAM_WEIGHT.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Chosen by replaying the target's greedy Spec-Bench answers through every rule and weight
# (python -m vllm_amphista.tune_hybrid; figures in BENCHMARKS.md): "splice" with ANPD's
# confidences doubled gave the highest tau overall and in every category.
NGRAM_WEIGHT = 2.0
RULES = ("heads", "ngram", "longer", "splice")


def expected_accepted(confidences: Sequence[float]) -> float:
    total, running = 0.0, 1.0
    for confidence in confidences:
        running *= confidence
        total += running
    return total


def hybrid_draft(
    heads: Sequence[tuple[int, float]],
    ngram_after: Callable[[int, Sequence[int]], list[tuple[int, float]]],
    k: int,
    rule: str = "splice",
    ngram_weight: float = NGRAM_WEIGHT,
) -> list[tuple[int, float]]:
    """The draft (token, confidence) chain of at most k tokens.

    heads: the heads' chain; ngram_after(n, prefix): ANPD's chain of up to n tokens continuing
    the history followed by prefix (`NgramTables.scored_draft`). rule: "heads", "ngram", "longer" (whichever whole chain has
    the longer expected accepted length) or "splice" (every splice point considered).
    """
    heads = list(heads[:k])
    if rule == "heads":
        return heads
    if rule == "ngram":
        return ngram_after(k, ())
    if rule not in RULES:
        raise ValueError(f"unknown hybrid rule {rule!r}; choose from {RULES}")
    splice_points = (0, len(heads)) if rule == "longer" else range(len(heads) + 1)
    best, best_score = heads, -1.0
    for j in splice_points:
        prefix = heads[:j]
        tail = [(token, confidence * ngram_weight) for token, confidence in
                ngram_after(k - j, [token for token, _ in prefix])] if j < k else []
        candidate = prefix + tail
        score = expected_accepted([confidence for _, confidence in candidate])
        if score > best_score:
            best, best_score = candidate, score
    return best
