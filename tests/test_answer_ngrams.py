"""The target's answer n-grams (vllm_amphista/answer_ngrams.py) and the tables' fallback on them; no engine."""

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from vllm_amphista.anpd import FALLBACK_WEIGHT, AnpdDrafter, NgramTables
from vllm_amphista.answer_ngrams import ANSWER_NGRAMS_NAME, AnswerNgrams, AnswerNgramsError, load_from_dir
from vllm_amphista.assets import SHIPPED_HEADS
from vllm_amphista.checkpoint import HeadsDirError
from vllm_amphista.vllm.config import check_answer_ngrams


def counted_by_hand(sequences, max_context, min_count):
    """context tuple -> (most frequent next token, smallest on ties; its share), counted within sequences."""
    counts: dict[tuple, Counter] = {}
    for sequence in sequences:
        for end in range(len(sequence) - 1):
            for c in range(1, max_context + 1):
                if end - c + 1 >= 0:
                    counts.setdefault(tuple(sequence[end - c + 1: end + 1]), Counter())[sequence[end + 1]] += 1
    table = {}
    for context, counter in counts.items():
        total = sum(counter.values())
        if total >= min_count:
            token = min(counter, key=lambda t: (-counter[t], t))
            table[context] = (token, counter[token] / total)
    return table


def predicted_by_hand(table, history, max_context):
    for c in range(min(max_context, len(history)), 0, -1):
        if tuple(history[-c:]) in table:
            return table[tuple(history[-c:])]
    return None


@pytest.mark.parametrize("min_count", [1, 3])
def test_predictions_equal_counting_by_hand(min_count):
    rng = random.Random(min_count)
    # A small alphabet and repeated phrases: many contexts, ties, and sequence ends.
    phrases = [[rng.randrange(12) for _ in range(rng.randint(2, 5))] for _ in range(6)]
    sequences = [sum((rng.choice(phrases) for _ in range(rng.randint(1, 8))), []) for _ in range(40)]
    ngrams = AnswerNgrams.build(sequences, vocab_size=12, max_context=3, min_count=min_count)
    table = counted_by_hand(sequences, 3, min_count)
    assert ngrams.num_entries == len(table)
    for _ in range(500):
        history = [rng.randrange(12) for _ in range(rng.randint(1, 5))]
        expected = predicted_by_hand(table, history, 3)
        got = ngrams.predict(history)
        if expected is None:
            assert got is None
        else:
            assert got[0] == expected[0] and got[1] == pytest.approx(expected[1])


def test_contexts_do_not_cross_answers():
    ngrams = AnswerNgrams.build([[1, 2, 3], [4, 5]], vocab_size=8, max_context=2, min_count=1)
    assert ngrams.predict([3]) is None  # 3 ends an answer: 4 begins another
    assert ngrams.predict([2, 3]) is None
    assert ngrams.predict([1, 2]) == (3, 1.0)


def test_large_vocabularies_pack_their_contexts():
    vocab = 150_000  # 18 bits per token
    sequences = [[149_999, 70_000, 5, 149_999, 70_000, 6, 149_999, 70_000, 5]]
    ngrams = AnswerNgrams.build(sequences, vocab_size=vocab, max_context=3, min_count=1)
    assert ngrams.token_bits == 18
    assert ngrams.predict([149_999, 70_000]) == (5, pytest.approx(2 / 3))
    with pytest.raises(AnswerNgramsError, match="max_context"):
        AnswerNgrams.build(sequences, vocab_size=vocab, max_context=4)
    with pytest.raises(AnswerNgramsError, match="another target"):
        AnswerNgrams.build(sequences, vocab_size=1000)


def test_save_and_load_keep_the_predictions(tmp_path):
    sequences = [[1, 2, 3, 1, 2, 4, 1, 2, 3]]
    ngrams = AnswerNgrams.build(sequences, vocab_size=8, max_context=3, min_count=1)
    ngrams.save(tmp_path / ANSWER_NGRAMS_NAME)
    loaded = load_from_dir(tmp_path)
    assert loaded.num_entries == ngrams.num_entries and loaded.vocab_size == 8
    for history in ([1, 2], [2], [3, 1, 2], [7]):
        assert loaded.predict(history) == ngrams.predict(history)
    assert load_from_dir(tmp_path / "elsewhere") is None


def test_a_broken_file_is_refused_with_its_path(tmp_path):
    path = tmp_path / ANSWER_NGRAMS_NAME
    AnswerNgrams.build([[1, 2, 3, 1, 2, 4]], vocab_size=8, min_count=1).save(path)
    whole = path.read_bytes()
    np.save(tmp_path / "array.npy", np.arange(3))
    for broken in (b"", b"not a zip", whole[: len(whole) // 2], (tmp_path / "array.npy").read_bytes()):
        path.write_bytes(broken)
        with pytest.raises(AnswerNgramsError, match=ANSWER_NGRAMS_NAME):
            load_from_dir(tmp_path)
        with pytest.raises(HeadsDirError, match=ANSWER_NGRAMS_NAME):
            check_answer_ngrams(str(tmp_path), 8)
    unsorted = {"token_bits": np.int64(3), "vocab_size": np.int64(8), "num_tokens": np.int64(4),
                "min_count": np.int64(1), "keys_1": np.array([5, 2], dtype=np.uint64),
                "next_1": np.array([1, 1], dtype=np.int32), "share_1": np.array([1, 1], dtype=np.float32)}
    np.savez(tmp_path / ANSWER_NGRAMS_NAME, **unsorted)
    with pytest.raises(AnswerNgramsError, match="sorted"):
        load_from_dir(tmp_path)


def test_another_vocabulary_is_refused(tmp_path):
    AnswerNgrams.build([[1, 2, 3]], vocab_size=8, min_count=1).save(tmp_path / ANSWER_NGRAMS_NAME)
    check_answer_ngrams(str(tmp_path), 8)
    with pytest.raises(HeadsDirError, match="8-token vocabulary"):
        check_answer_ngrams(str(tmp_path), 16)


def test_tables_fall_back_only_where_the_request_matches_nothing():
    answers = AnswerNgrams.build([[7, 8, 9], [7, 8, 9], [1, 5]], vocab_size=16, min_count=1)
    tables = NgramTables(max_n=3, max_entries=1000, fallback=answers)
    tables.extend([1, 2, 10, 1])
    # The request saw 1 -> 2: its own table wins over the answers' 1 -> 5.
    assert tables.scored_draft(1)[0][0] == 2
    assert [token for token, _ in tables.scored_draft(4)] == [2, 10, 1, 2]  # the request's own cycle
    tables.extend([2, 10, 7])
    # The request never saw 7: the answers continue 7 -> 8 -> 9 at half their share.
    assert tables.scored_draft(2) == [(8, pytest.approx(FALLBACK_WEIGHT)), (9, pytest.approx(FALLBACK_WEIGHT))]
    alone = NgramTables(max_n=3, max_entries=1000)
    alone.extend([1, 2, 10, 1, 2, 10, 7])
    assert alone.scored_draft(2) == []  # the same request without the answers drafts nothing there


def test_every_request_of_a_drafter_falls_back_also_after_a_rebuild():
    answers = AnswerNgrams.build([[7, 8, 9]], vocab_size=16, min_count=1)
    drafter = AnpdDrafter(max_n=3, max_entries_per_request=100, num_speculative_tokens=3, fallback=answers)
    drafter.extend("a", [1, 7])
    drafter.sync("b", [2, 3, 7])
    assert drafter.draft("a") == drafter.draft("b") == [8, 9]
    drafter.sync("b", [5, 7])  # shorter than what it absorbed: its tables start again
    assert drafter.draft("b", 2) == [8, 9]
    plain = AnpdDrafter(max_n=3, max_entries_per_request=100, num_speculative_tokens=3)
    plain.extend("a", [1, 7])
    assert plain.draft("a") == []


def test_tokens_outside_the_vocabulary_match_nothing():
    answers = AnswerNgrams.build([[1, 2, 3, 1, 2, 3]], vocab_size=4, min_count=1)
    assert answers.predict([5, 1, 2]) == (3, 1.0)  # the context stops at the foreign token
    assert answers.predict([1, 2, 4]) is None


def test_the_shipped_heads_dir_ships_answer_ngrams_for_its_vocabulary():
    ngrams = load_from_dir(SHIPPED_HEADS)
    config = json.loads((Path(SHIPPED_HEADS) / "config.json").read_text())
    assert ngrams is not None and ngrams.vocab_size == config["vocab_size"]
    assert ngrams.num_entries > 100_000
