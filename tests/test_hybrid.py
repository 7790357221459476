"""The hybrid rule's maths (no vLLM): choosing and splicing the heads' chain and ANPD's."""

import pytest

from vllm_amphista.anpd import NgramTables
from vllm_amphista.hybrid import NGRAM_CONFIDENCE_CAP, NGRAM_WEIGHT, expected_accepted, hybrid_draft


def tables_of(tokens: list[int]) -> NgramTables:
    tables = NgramTables(max_n=4, max_entries=1 << 20)
    tables.extend(tokens)
    return tables


def test_expected_accepted_is_the_sum_of_running_products():
    assert expected_accepted([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)
    assert expected_accepted([]) == 0.0


def test_a_repeated_passage_beats_unsure_heads():
    # The history repeats 10 11 12 13 14 15: the tables continue it with confidence.
    tables = tables_of([10, 11, 12, 13, 14, 15, 9, 10, 11, 12])
    heads = [(20, 0.3), (21, 0.2), (22, 0.1), (23, 0.1)]
    assert [t for t, _ in hybrid_draft(heads, tables.scored_draft, 4, "splice")] == [13, 14, 15, 9]
    assert [t for t, _ in hybrid_draft(heads, tables.scored_draft, 4, "heads")] == [20, 21, 22, 23]


def test_sure_heads_beat_a_weak_match():
    tables = tables_of([5, 6, 7, 8, 12, 30])  # only a 2-gram seen once continues "... 12"
    heads = [(40, 0.9), (41, 0.9), (42, 0.9), (43, 0.9)]
    assert [t for t, _ in hybrid_draft(heads, tables.scored_draft, 4, "longer")] == [40, 41, 42, 43]


def test_splice_continues_the_heads_first_token_from_the_tables():
    # Nothing matches after the history's last token 99, but after the head's first token 10
    # the tables know the passage 10 11 12 13.
    tables = tables_of([10, 11, 12, 13, 50, 99])
    heads = [(10, 0.9), (77, 0.05), (78, 0.05), (79, 0.05)]
    spliced = [t for t, _ in hybrid_draft(heads, tables.scored_draft, 4, "splice")]
    assert spliced == [10, 11, 12, 13]
    assert [t for t, _ in hybrid_draft(heads, tables.scored_draft, 4, "longer")] == [10, 77, 78, 79]


def test_never_longer_than_k():
    tables = tables_of([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2])
    heads = [(3, 0.9), (4, 0.9), (5, 0.9), (6, 0.9)]
    for k in range(5):
        assert len(hybrid_draft(heads, tables.scored_draft, k, "splice")) <= k


def test_weighted_ngram_confidences_stay_below_the_cap():
    # A passage seen many times: each context's share is near 1, more than the cap once weighted.
    tables = tables_of([1, 2, 3, 4, 5] * 20 + [1, 2, 3])
    assert tables.scored_draft(1)[0][1] * NGRAM_WEIGHT > NGRAM_CONFIDENCE_CAP
    heads = [(9, 0.1), (9, 0.1), (9, 0.1), (9, 0.1)]
    chain = hybrid_draft(heads, tables.scored_draft, 4, "splice")
    assert [t for t, _ in chain] == [4, 5, 1, 2]
    assert all(confidence == NGRAM_CONFIDENCE_CAP for _, confidence in chain)
