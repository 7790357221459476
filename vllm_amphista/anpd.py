"""Algorithm core of ANPD: Adaptive N-gram Parallel Decoding (arXiv 2404.08698).

ANPD drafts tokens for speculative decoding from N-gram statistics of the
request's own text; the target model then verifies the draft, so the output is
unchanged whatever the draft is. This module is plain Python (no vLLM, no
torch) so it can be tested on its own.

Levels
    A request keeps one table per level n = 2..N. Level n maps a context of
    the n-1 preceding tokens to counts of the tokens that followed it. All
    levels share one dict, keyed by the context tuple: the tuple's length
    (n-1) already says which level it belongs to.

Drafting with multi-level fallback
    To predict the next token, query with the last N-1 tokens (level N); if
    that context was never seen, drop its oldest token and query level N-1,
    and so on down to level 2 (a single-token context). The longest matching
    context wins because it is the most specific evidence. The predicted
    token is appended to a scratch copy of the last N-1 tokens and the
    process repeats, up to k tokens. Drafting stops early, returning fewer
    tokens, as soon as no level matches. Drafting never changes the tables.

Prediction and ties
    Each context stores its counts and its current argmax, kept up to date on
    every increment, so a lookup is O(1). Ties go to the continuation seen
    most recently: a token whose count reaches the current maximum takes
    over. Favouring recent text fits the adaptive spirit of the method.

"Adaptive"
    The tables start from the prompt and are updated online with every token
    the request accepts, so the drafts adapt to the text as it is generated.
    Updates are incremental: absorbing m new tokens costs O(m * N), never
    O(context length), and only the last N-1 tokens of history are kept.

The target's own answers
    Where no context of the request matches (not even a 2-gram), the tables
    may fall back on n-gram statistics of the target's answers to its
    training prompts (answer_ngrams.AnswerNgrams, shared read-only by all
    requests), looked up with the last N-1 tokens at most, their confidence
    scaled by FALLBACK_WEIGHT: the request's own text, when it matches at
    all, knows better what comes next than the target's habits do.

Memory bound and eviction
    Each request holds at most `max_entries` contexts across all levels. The
    shared dict is an LRU (OrderedDict): a context moves to the end whenever
    one of its counts is incremented, and when the cap is exceeded the least
    recently updated context is dropped from the front, in O(1). Lookups
    while drafting do not refresh recency. A context that is evicted and seen
    again starts counting from zero.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_amphista.answer_ngrams import AnswerNgrams

# The answer n-grams' shares are scaled by this: replayed on Spec-Bench (BENCHMARKS.md), halving them
# gave the hybrid its highest tau (the heads' chain is kept where the two disagree).
FALLBACK_WEIGHT = 0.5


class _Continuations:
    """Counts of the tokens that followed one context, plus their argmax."""

    __slots__ = ("counts", "best_token", "best_count", "total")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.best_token = -1
        self.best_count = 0
        self.total = 0

    def add(self, token: int) -> None:
        count = self.counts.get(token, 0) + 1
        self.counts[token] = count
        self.total += 1
        # ">=" hands ties to the token seen most recently.
        if count >= self.best_count:
            self.best_token = token
            self.best_count = count


class NgramTables:
    """Multi-level N-gram statistics of one request (levels n = 2..max_n)."""

    def __init__(self, max_n: int, max_entries: int, fallback: AnswerNgrams | None = None) -> None:
        if max_n < 2:
            raise ValueError(f"max_n must be >= 2, got {max_n}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_n = max_n
        self.max_entries = max_entries
        self.fallback = fallback
        # Context tuple (length n-1 for level n) -> continuations, LRU order.
        self._entries: OrderedDict[tuple[int, ...], _Continuations] = OrderedDict()
        # The last max_n-1 tokens: all that updates and drafts ever look at.
        self._recent: deque[int] = deque(maxlen=max_n - 1)
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Number of tokens absorbed so far by `extend`."""
        return self._num_tokens

    @property
    def num_entries(self) -> int:
        """Number of contexts stored, across all levels."""
        return len(self._entries)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the history and count each one at every level."""
        entries = self._entries
        recent = self._recent
        for token in tokens:
            token = int(token)
            history = tuple(recent)
            # Contexts of length 1..len(history), i.e. levels 2..N.
            for start in range(len(history) - 1, -1, -1):
                context = history[start:]
                continuations = entries.get(context)
                if continuations is None:
                    continuations = entries[context] = _Continuations()
                    if len(entries) > self.max_entries:
                        entries.popitem(last=False)
                else:
                    entries.move_to_end(context)
                continuations.add(token)
            recent.append(token)
            self._num_tokens += 1

    def draft(self, k: int, min_confidence: float = 0.0) -> list[int]:
        """Propose up to k tokens continuing the history; fewer if nothing matches, or once the
        product of the predictions' confidences falls below min_confidence."""
        return confident_prefix(self.scored_draft(k), min_confidence)

    def scored_draft(self, k: int, prefix: Sequence[int] = ()) -> list[tuple[int, float]]:
        """Up to k (token, confidence) predictions continuing the history followed by `prefix`
        (tokens proposed by someone else), stopping where nothing matches."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        scratch = deque(self._recent, maxlen=self.max_n - 1)
        scratch.extend(prefix)
        drafted: list[tuple[int, float]] = []
        while len(drafted) < k:
            prediction = self._predict(tuple(scratch))
            if prediction is None:
                break
            drafted.append(prediction)
            scratch.append(prediction[0])
        return drafted

    def _predict(self, history: tuple[int, ...]) -> tuple[int, float] | None:
        """The next token and a confidence in (0, 1): the continuation's share of the
        context's counts (smoothed, so a context seen once is not certain), scaled by
        how long the matched context is (a 2-gram match says less than an N-gram one); where no
        context matches, the fallback's prediction."""
        # Longest context first: level N, then N-1, ..., down to level 2.
        for start in range(len(history)):
            context = history[start:]
            continuations = self._entries.get(context)
            if continuations is not None:
                share = (continuations.best_count + 1) / (continuations.total + 2)
                return continuations.best_token, share * len(context) / (self.max_n - 1)
        if self.fallback is not None:
            prediction = self.fallback.predict(history)
            if prediction is not None:
                return prediction[0], prediction[1] * FALLBACK_WEIGHT
        return None

    def snapshot(self) -> dict[tuple[int, ...], tuple[int, dict[int, int]]]:
        """Copy of the tables for tests and debugging, least recently updated first.

        Maps each context to (predicted token, counts of its continuations).
        Costs O(size of the tables).
        """
        return {
            context: (c.best_token, dict(c.counts))
            for context, c in self._entries.items()
        }


def confident_prefix(chain: Sequence[tuple[int, float]], min_confidence: float) -> list[int]:
    """The tokens of a (token, confidence) chain up to where the running product of the
    confidences falls below min_confidence."""
    tokens = []
    running = 1.0
    for token, confidence in chain:
        running *= confidence
        if running < min_confidence:
            break
        tokens.append(token)
    return tokens


class AnpdDrafter:
    """ANPD state of every live request of one engine, keyed by request id."""

    def __init__(
        self,
        max_n: int,
        max_entries_per_request: int,
        num_speculative_tokens: int,
        fallback: AnswerNgrams | None = None,
    ) -> None:
        if max_n < 2:
            raise ValueError(
                f"ANPD max_n must be >= 2 (a 2-gram uses one context token), got {max_n}"
            )
        if max_entries_per_request < 1:
            raise ValueError(
                f"ANPD max_entries_per_request must be >= 1, got {max_entries_per_request}"
            )
        if num_speculative_tokens < 1:
            raise ValueError(
                f"ANPD num_speculative_tokens must be >= 1, got {num_speculative_tokens}"
            )
        self.max_n = max_n
        self.max_entries_per_request = max_entries_per_request
        self.num_speculative_tokens = num_speculative_tokens
        self.fallback = fallback  # shared by every request's tables
        self._tables: dict[str, NgramTables] = {}

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    @property
    def total_entries(self) -> int:
        """Contexts stored across all requests (O(num_requests) to compute)."""
        return sum(tables.num_entries for tables in self._tables.values())

    def sync(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Absorb the tokens of `token_ids` (the request's full sequence so far)
        that the request's tables have not seen yet.

        Only token_ids[num_tokens:] is read, so the usual step costs O(new
        tokens). A sequence shorter than what was absorbed (recompute, or a
        reused request id) rebuilds the tables from scratch. A sequence of the
        same or greater length whose already-absorbed prefix changed is not
        detected; the drafts stay safe since the target model verifies them.
        """
        tables = self._tables.get(req_id)
        if tables is None or len(token_ids) < tables.num_tokens:
            tables = self._tables[req_id] = NgramTables(
                self.max_n, self.max_entries_per_request, self.fallback
            )
        if len(token_ids) > tables.num_tokens:
            tables.extend(token_ids[tables.num_tokens:])

    def extend(self, req_id: str, token_ids: Sequence[int]) -> int:
        """Append tokens to a request's sequence (a new request starts empty); returns its length."""
        tables = self._tables.get(req_id)
        if tables is None:
            tables = self._tables[req_id] = NgramTables(self.max_n, self.max_entries_per_request, self.fallback)
        tables.extend(token_ids)
        return tables.num_tokens

    def num_tokens(self, req_id: str) -> int | None:
        """Tokens a request's tables have absorbed; None for a request without state."""
        tables = self._tables.get(req_id)
        return None if tables is None else tables.num_tokens

    def draft(self, req_id: str, k: int | None = None, min_confidence: float = 0.0) -> list[int]:
        """Draft up to k tokens (default num_speculative_tokens) for a synced request,
        stopping where the chain's confidence falls below min_confidence."""
        if k is None:
            k = self.num_speculative_tokens
        elif k > self.num_speculative_tokens:
            raise ValueError(
                f"k={k} exceeds num_speculative_tokens={self.num_speculative_tokens}"
            )
        tables = self._tables.get(req_id)
        if tables is None:
            raise KeyError(f"request {req_id!r} has no ANPD state; call sync() first")
        return tables.draft(k, min_confidence)

    def scored_draft(self, req_id: str, k: int, prefix: Sequence[int] = ()) -> list[tuple[int, float]]:
        """`NgramTables.scored_draft` of a synced request."""
        tables = self._tables.get(req_id)
        if tables is None:
            raise KeyError(f"request {req_id!r} has no ANPD state; call sync() first")
        return tables.scored_draft(k, prefix)

    def drop(self, req_id: str) -> None:
        """Free a request's state; unknown ids are ignored."""
        self._tables.pop(req_id, None)

    def retain_only(self, req_ids: Iterable[str]) -> None:
        """Free the state of every request not in `req_ids` (e.g. the live batch)."""
        live = set(req_ids)
        for req_id in [r for r in self._tables if r not in live]:
            del self._tables[req_id]
