"""Tests for the ANPD algorithm core (vllm_amphista/anpd.py); no vLLM engine."""

import random

import numpy as np
import pytest

from vllm_amphista.anpd import AnpdDrafter, NgramTables


def build(tokens, max_n=3, max_entries=10_000):
    tables = NgramTables(max_n, max_entries)
    tables.extend(tokens)
    return tables


# ---------------------------------------------------------------- drafting


def test_repeating_pattern_drafts_the_cycle():
    # N=3 on [1,2,3,4,1,2,3]:
    #   level 3: (1,2)->3 x2, (2,3)->4, (3,4)->1, (4,1)->2
    #   level 2: (1)->2 x2, (2)->3 x2, (3)->4, (4)->1
    # Tail (2,3) -> 4; then (3,4) -> 1; (4,1) -> 2; (1,2) -> 3; (2,3) -> 4; ...
    tables = build([1, 2, 3, 4, 1, 2, 3])
    assert tables.draft(6) == [4, 1, 2, 3, 4, 1]
    assert tables.draft(3) == [4, 1, 2]
    assert tables.draft(0) == []


def test_unseen_long_context_falls_back_to_shorter_level():
    # N=3 on [5,6,7,9,6]:
    #   level 3: (5,6)->7, (6,7)->9, (7,9)->6
    #   level 2: (5)->6, (6)->7, (7)->9, (9)->6
    # Tail (9,6) is unseen at level 3, so level 2 answers (6)->7.
    # Then (6,7)->9 and (7,9)->6 at level 3, then (9,6) falls back again -> 7, ...
    tables = build([5, 6, 7, 9, 6])
    assert tables.draft(5) == [7, 9, 6, 7, 9]


def test_longest_matching_context_wins_when_levels_disagree():
    # N=3 on [1,2,3,2,4,2,4,1,2]:
    #   level 2: (2) -> {3:1, 4:2} predicts 4; (4) -> {2:1, 1:1} tie, 1 is newer
    #   level 3: (1,2) -> {3:1} predicts 3
    # Tail (1,2): level 3 says 3 and must beat level 2's 4.
    # Continuing: (2,3)->2, (3,2)->4, (2,4)->{2:1, 1:1} tie -> 1, (4,1)->2, (1,2)->3.
    # (Querying shortest-first would give [4,1,2,4,1,2] instead.)
    tables = build([1, 2, 3, 2, 4, 2, 4, 1, 2])
    snapshot = tables.snapshot()
    assert snapshot[(2,)] == (4, {3: 1, 4: 2})
    assert snapshot[(1, 2)] == (3, {3: 1})
    assert tables.draft(6) == [3, 2, 4, 1, 2, 3]


def test_most_frequent_continuation_wins_and_argmax_switches():
    # N=2 on [7,1,7,2,7,2,7]: (7) -> {1:1, 2:2}, so after the trailing 7 we draft 2.
    tables = build([7, 1, 7, 2, 7, 2, 7], max_n=2)
    assert tables.snapshot()[(7,)] == (2, {1: 1, 2: 2})
    assert tables.draft(1) == [2]
    # Adding 1,7,1,7 gives (7) -> {1:3, 2:2}: the prediction switches to 1.
    tables.extend([1, 7, 1, 7])
    assert tables.snapshot()[(7,)] == (1, {1: 3, 2: 2})
    assert tables.draft(1) == [1]


def test_ties_go_to_the_most_recently_seen_continuation():
    # N=2 on [5,1,5,2]: (5) -> {1:1, 2:1}; 2 was seen last, so it wins.
    tables = build([5, 1, 5, 2], max_n=2)
    assert tables.snapshot()[(5,)] == (2, {1: 1, 2: 1})
    # 5,1 -> (5) -> {1:2, 2:1}: 1 leads outright.
    tables.extend([5, 1])
    assert tables.snapshot()[(5,)] == (1, {1: 2, 2: 1})
    # 5,2 -> (5) -> {1:2, 2:2}: tied again, 2 is the newer one.
    tables.extend([5, 2, 5])
    assert tables.snapshot()[(5,)] == (2, {1: 2, 2: 2})
    assert tables.draft(1) == [2]


def test_draft_returns_nothing_when_no_level_matches():
    # N=3 on [1,2,3]: the tail (2,3) and (3) were never followed by anything.
    assert build([1, 2, 3]).draft(5) == []
    assert build([]).draft(5) == []
    assert build([42]).draft(5) == []


def test_draft_stops_early_without_padding():
    # N=2, cap 2, on [2,1,2,1,2,3,2]:
    #   (2)->1, (1)->2, (2)->1, (1)->2, (2)->3 make (2) -> {1:2, 3:1} (most recent),
    #   then (3)->2 is inserted and evicts the least recently updated (1).
    # Tail 2 -> 1, then (1) is gone: stop after one token.
    tables = build([2, 1, 2, 1, 2, 3, 2], max_n=2, max_entries=2)
    assert tables.snapshot() == {(2,): (1, {1: 2, 3: 1}), (3,): (2, {2: 1})}
    assert tables.draft(8) == [1]
    # With room for every context the same text cycles 1,2,1,2,...
    assert build([2, 1, 2, 1, 2, 3, 2], max_n=2).draft(4) == [1, 2, 1, 2]


def test_draft_does_not_mutate_the_tables():
    # Drafting from the tail (1,2) reads the oldest contexts first, so a lookup
    # that refreshed LRU recency would reorder the snapshot.
    tables = build([1, 2, 3, 4, 9, 8, 7, 1, 2])
    before = list(tables.snapshot().items())
    num_tokens = tables.num_tokens
    first = tables.draft(10)
    assert tables.draft(10) == first
    assert list(tables.snapshot().items()) == before
    assert tables.num_tokens == num_tokens


def test_numpy_tokens_are_drafted_as_python_ints():
    tables = build(np.array([1, 2, 3, 4, 1, 2, 3], dtype=np.int64))
    drafted = tables.draft(3)
    assert drafted == [4, 1, 2]
    assert all(type(token) is int for token in drafted)


# ---------------------------------------------------------------- eviction


def test_eviction_keeps_the_cap_and_recent_patterns():
    rng = random.Random(1)
    cap = 8
    tables = NgramTables(max_n=3, max_entries=cap)
    for _ in range(300):
        tables.extend([rng.randint(100, 200)])
        assert tables.num_entries <= cap
    # The last four tokens of the pattern update exactly its 8 contexts,
    # (4)/(3,4)->1, (1)/(4,1)->2, (2)/(1,2)->3, (3)/(2,3)->4, which evict the rest.
    tables.extend([1, 2, 3, 4] * 3)
    assert tables.num_entries == cap
    assert set(tables.snapshot()) == {
        (1,), (2,), (3,), (4,), (1, 2), (2, 3), (3, 4), (4, 1)
    }
    assert tables.draft(5) == [1, 2, 3, 4, 1]


def test_cap_of_one_entry():
    # N=3, cap 1 on [1,2,1]: the second token inserts (1)->2; the third updates
    # (2)->1 (evicting (1)) and then (1,2)->1 (evicting (2)).
    tables = build([1, 2, 1], max_n=3, max_entries=1)
    assert tables.snapshot() == {(1, 2): (1, {1: 1})}
    # Tail (2,1) and (1) are both unseen.
    assert tables.draft(3) == []


# ---------------------------------------------------------------- drafter


def test_incremental_sync_matches_building_from_the_whole_sequence():
    rng = random.Random(0)
    for trial in range(200):
        max_n = rng.randint(2, 5)
        cap = rng.choice([1, 3, 10, 10_000])
        sequence = [rng.randint(0, 4) for _ in range(rng.randint(0, 120))]

        incremental = AnpdDrafter(max_n, cap, num_speculative_tokens=10)
        end = 0
        while end < len(sequence):
            end = min(len(sequence), end + rng.randint(1, 7))
            incremental.sync("req", sequence[:end])
        incremental.sync("req", sequence)  # also covers empty sequences

        whole = build(sequence, max_n=max_n, max_entries=cap)
        tables = incremental._tables["req"]
        assert tables.num_tokens == len(sequence)
        assert list(tables.snapshot().items()) == list(whole.snapshot().items()), trial
        for k in range(11):
            assert incremental.draft("req", k) == whole.draft(k), (trial, k)


class RecordingSequence:
    """A token sequence that records which indices are read."""

    def __init__(self, length):
        self.length = length
        self.read = set()

    def __len__(self):
        return self.length

    def __getitem__(self, key):
        if isinstance(key, slice):
            indices = range(*key.indices(self.length))
            self.read.update(indices)
            return [i % 7 for i in indices]
        index = range(self.length)[key]
        self.read.add(index)
        return index % 7


def test_sync_reads_only_the_new_tokens():
    drafter = AnpdDrafter(max_n=3, max_entries_per_request=100, num_speculative_tokens=4)
    sequence = RecordingSequence(99_999)
    drafter.sync("req", sequence)
    assert len(sequence.read) == 99_999

    sequence.read.clear()
    sequence.length = 100_000
    drafter.sync("req", sequence)
    assert sequence.read == {99_999}

    sequence.read.clear()
    drafter.sync("req", sequence)  # nothing new: nothing read
    assert sequence.read == set()
    # Tokens are i % 7 (0..6 repeating); the last one is 99_999 % 7 == 4.
    assert drafter.draft("req") == [5, 6, 0, 1]


def test_sync_accepts_numpy_slices():
    drafter = AnpdDrafter(max_n=3, max_entries_per_request=100, num_speculative_tokens=3)
    token_ids = np.array([1, 2, 3, 4, 1, 2, 3, 0, 0], dtype=np.int32)
    drafter.sync("req", token_ids[:5])
    drafter.sync("req", token_ids[:7])
    assert drafter.draft("req") == [4, 1, 2]


def test_shorter_sequence_rebuilds_the_tables():
    drafter = AnpdDrafter(max_n=3, max_entries_per_request=100, num_speculative_tokens=5)
    drafter.sync("req", [1, 2, 3, 4, 1, 2, 3])
    assert drafter.draft("req", 1) == [4]

    drafter.sync("req", [9, 8, 9])
    tables = drafter._tables["req"]
    assert tables.num_tokens == 3
    assert list(tables.snapshot().items()) == list(build([9, 8, 9]).snapshot().items())
    # (8,9) unseen, (9)->8, then (9,8)->9, (8,9) unseen -> (9)->8, ...
    assert drafter.draft("req") == [8, 9, 8, 9, 8]


def test_drop_and_retain_only_free_all_state():
    drafter = AnpdDrafter(max_n=3, max_entries_per_request=50, num_speculative_tokens=2)
    for req_id in ("a", "b", "c"):
        drafter.sync(req_id, [1, 2, 3, 1, 2])
    assert drafter.num_requests == 3
    # Each: level 2 (1),(2),(3); level 3 (1,2)->3, (2,3)->1, (3,1)->2.
    assert drafter.total_entries == 3 * 6

    drafter.retain_only({"a", "c", "not-a-request"})
    assert drafter.num_requests == 2
    drafter.drop("a")
    drafter.drop("never-seen")
    assert drafter.num_requests == 1
    drafter.retain_only([])
    assert drafter.num_requests == 0
    assert drafter.total_entries == 0


def test_memory_stays_bounded_across_requests():
    rng = random.Random(2)
    drafter = AnpdDrafter(max_n=4, max_entries_per_request=64, num_speculative_tokens=3)
    for req_id in range(5):
        drafter.sync(str(req_id), [rng.randint(0, 50) for _ in range(2_000)])
    assert drafter.total_entries <= 5 * 64


def test_draft_defaults_and_limits():
    drafter = AnpdDrafter(max_n=3, max_entries_per_request=100, num_speculative_tokens=3)
    drafter.sync("req", [1, 2, 3, 4, 1, 2, 3])
    assert drafter.draft("req") == [4, 1, 2]
    assert drafter.draft("req", 2) == [4, 1]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        drafter.draft("req", 4)
    with pytest.raises(KeyError, match="sync"):
        drafter.draft("unknown")


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_n=1, max_entries_per_request=10, num_speculative_tokens=3), "max_n"),
        (dict(max_n=3, max_entries_per_request=0, num_speculative_tokens=3),
         "max_entries_per_request"),
        (dict(max_n=3, max_entries_per_request=10, num_speculative_tokens=0),
         "num_speculative_tokens"),
    ],
)
def test_drafter_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AnpdDrafter(**kwargs)


def test_tables_validation():
    with pytest.raises(ValueError, match="max_n"):
        NgramTables(max_n=1, max_entries=10)
    with pytest.raises(ValueError, match="max_entries"):
        NgramTables(max_n=2, max_entries=0)
    with pytest.raises(ValueError, match="k must be"):
        NgramTables(max_n=2, max_entries=10).draft(-1)


def test_replay_counts_target_steps():
    from vllm_amphista.replay import anpd_steps, replay

    output = list(range(100, 111))  # 11 tokens: the prefill step emits the first
    oracle = lambda context, room: output[len(context) - 3: len(context) - 3 + room]  # noqa: E731
    # 1 prefill step, then 10 tokens at up to K + 1 = 5 per step.
    assert replay([1, 2, 3], output, 4, oracle) == 3
    assert replay([1, 2, 3], output, 4, lambda context, room: []) == 11
    assert replay([1, 2, 3], output, 4, lambda context, room: [0] * room) == 11
    # The prompt holds the answer: once the first token is out, ANPD copies 4 + 1 tokens a step.
    assert anpd_steps([7, 8, *output, 9], output, 4, max_n=3) == 3
