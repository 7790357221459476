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
accepted length, with ANPD's confidences weighted by NGRAM_WEIGHT and capped at
NGRAM_CONFIDENCE_CAP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# "splice" gave the highest tau of the rules on the target's greedy Spec-Bench answers; the weight
# and cap were chosen by replaying held-out training answers (`self-seed9`, which neither the
# shipped heads nor their answer n-grams learned from) through `python -m vllm_amphista.tune_hybrid
# --answers ...`; figures in BENCHMARKS.md.
NGRAM_WEIGHT = 1.25
# ANPD's matched contexts are surer than their smoothed share says, but a weighted confidence
# over 1 would make every further token of its chain raise the chain's expected length.
NGRAM_CONFIDENCE_CAP = 0.95
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
    ngram_cap: float = NGRAM_CONFIDENCE_CAP,
) -> list[tuple[int, float]]:
    """The draft (token, confidence) chain of at most k tokens.

    heads: the heads' chain; ngram_after(n, prefix): ANPD's chain of up to n tokens continuing
    the history followed by prefix (`NgramTables.scored_draft`). rule: "heads", "ngram",
    "longer" (whichever whole chain has the longer expected accepted length) or "splice" (every
    splice point considered).
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
        tail = [(token, min(confidence * ngram_weight, ngram_cap)) for token, confidence in
                ngram_after(k - j, [token for token, _ in prefix])] if j < k else []
        candidate = prefix + tail
        score = expected_accepted([confidence for _, confidence in candidate])
        if score > best_score:
            best, best_score = candidate, score
    return best
