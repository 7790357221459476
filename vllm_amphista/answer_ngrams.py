"""N-gram statistics of the target's own answers: what ANPD's per-request tables fall back on.

A request's tables (anpd.NgramTables) know only its own text, so early in an answer, or in a
sentence that repeats nothing, none of their contexts matches. The target, though, writes the same
phrases in every answer ("Here are some", "In conclusion, the", list openings, code idioms): the
continuation it most often wrote after the same 1-3 tokens in its answers to the training prompts
usually holds again. These statistics are built once from the committed answers (`python -m
vllm_amphista.train ngrams`), ship in a heads dir as `answer_ngrams.npz`, are shared by every
request of an engine and never change while serving. Imports no vLLM and no torch.

Storage: for each context length c = 1..max_context, the contexts seen at least `min_count` times,
as sorted packed keys (each token `token_bits` bits, oldest first), with the token that most often
followed and its share of the context's count. A lookup is one binary search per context length,
longest first: the longest match is the most specific evidence, as in the per-request tables.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

ANSWER_NGRAMS_NAME = "answer_ngrams.npz"
# Replayed on Spec-Bench (BENCHMARKS.md): contexts of 3 tokens and a count of 5 draft as well as
# 4 tokens and a count of 2, at a quarter of the entries.
DEFAULT_MAX_CONTEXT = 3
DEFAULT_MIN_COUNT = 5


class AnswerNgramsError(ValueError):
    pass


class AnswerNgrams:
    def __init__(self, levels: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], token_bits: int,
                 vocab_size: int, num_tokens: int, min_count: int):
        self.levels = levels  # context length -> (sorted uint64 keys, int32 next tokens, float32 shares)
        self.token_bits = token_bits
        self.vocab_size = vocab_size
        self.num_tokens = num_tokens  # answer tokens they were counted from
        self.min_count = min_count
        self.max_context = max(levels, default=0)

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], vocab_size: int, max_context: int = DEFAULT_MAX_CONTEXT,
              min_count: int = DEFAULT_MIN_COUNT) -> AnswerNgrams:
        """Count, within each sequence, the token after every context of 1..max_context tokens."""
        token_bits = max(1, int(vocab_size - 1).bit_length())
        if max_context < 1 or token_bits * max_context > 64:
            raise AnswerNgramsError(f"max_context must be 1..{64 // token_bits} for a {vocab_size}-token vocabulary")
        if min_count < 1:
            raise AnswerNgramsError(f"min_count must be >= 1, got {min_count}")
        arrays = [np.asarray(sequence, dtype=np.int64) for sequence in sequences]
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
            raise AnswerNgramsError(f"token ids must lie in [0, {vocab_size}); are these answers of another target?")
        sequence_of = np.repeat(np.arange(len(arrays)), [len(array) for array in arrays])
        levels = {}
        for c in range(1, max_context + 1):
            last = np.arange(c - 1, len(tokens) - 1)  # a context ends at `last`, its next token is at last + 1
            last = last[sequence_of[last - c + 1] == sequence_of[last + 1]]
            keys = np.zeros(len(last), dtype=np.uint64)
            for offset in range(c - 1, -1, -1):
                keys = (keys << np.uint64(token_bits)) | tokens[last - offset].astype(np.uint64)
            levels[c] = _most_frequent_next(keys, tokens[last + 1], min_count)
        return cls(levels, token_bits, vocab_size, len(tokens), min_count)

    def predict(self, history: Sequence[int]) -> tuple[int, float] | None:
        """The token that most often followed the longest matching context ending `history`, and
        its share of that context's count; None when no context of 1..max_context tokens matches."""
        key = 0
        bits = self.token_bits
        contexts = []
        for c, token in enumerate(reversed(history[-self.max_context:] if self.max_context else ()), start=1):
            if not 0 <= token < self.vocab_size:  # no context reaches past a token it cannot hold
                break
            key |= int(token) << (bits * (c - 1))
            contexts.append((c, key))
        for c, key in reversed(contexts):
            keys, next_tokens, shares = self.levels[c]
            index = int(keys.searchsorted(np.uint64(key)))
            if index < len(keys) and keys[index] == key:
                return int(next_tokens[index]), float(shares[index])
        return None

    @property
    def num_entries(self) -> int:
        return sum(len(keys) for keys, _, _ in self.levels.values())

    def save(self, path: str | os.PathLike) -> None:
        arrays = {"token_bits": np.int64(self.token_bits), "vocab_size": np.int64(self.vocab_size),
                  "num_tokens": np.int64(self.num_tokens), "min_count": np.int64(self.min_count)}
        for c, (keys, next_tokens, shares) in self.levels.items():
            arrays.update({f"keys_{c}": keys, f"next_{c}": next_tokens, f"share_{c}": shares})
        path = Path(path)
        temporary = path.with_name(".tmp-" + path.name)
        with open(temporary, "wb") as file:
            np.savez_compressed(file, **arrays)
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> AnswerNgrams:
        try:
            with np.load(path, allow_pickle=False) as arrays:
                token_bits, vocab_size = int(arrays["token_bits"]), int(arrays["vocab_size"])
                levels = {}
                for c in range(1, 64 // max(token_bits, 1) + 1):
                    if f"keys_{c}" not in arrays:
                        break
                    levels[c] = (arrays[f"keys_{c}"], arrays[f"next_{c}"], arrays[f"share_{c}"])
                num_tokens, min_count = int(arrays["num_tokens"]), int(arrays["min_count"])
        except (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile, zlib.error) as error:
            raise AnswerNgramsError(f"{path}: not an answer n-gram file ({error!r})") from error
        for c, (keys, next_tokens, shares) in levels.items():
            if (keys.dtype != np.uint64 or not len(keys) == len(next_tokens) == len(shares)
                    or (len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])))):
                raise AnswerNgramsError(f"{path}: its {c}-token contexts are not sorted keys with one token and "
                                        "share each")
            if len(next_tokens) and (next_tokens.min() < 0 or next_tokens.max() >= vocab_size):
                raise AnswerNgramsError(f"{path}: next tokens outside its {vocab_size}-token vocabulary")
        if not levels or token_bits < int(vocab_size - 1).bit_length():
            raise AnswerNgramsError(f"{path}: no contexts, or {token_bits} bits cannot hold a {vocab_size}-token "
                                    "vocabulary")
        return cls(levels, token_bits, vocab_size, num_tokens, min_count)


def _most_frequent_next(keys: np.ndarray, next_tokens: np.ndarray, min_count: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unique contexts seen >= min_count times, the token most often after each, its share)."""
    order = np.lexsort((next_tokens, keys))
    keys, next_tokens = keys[order], next_tokens[order]
    new_pair = np.ones(len(keys), dtype=bool)
    new_pair[1:] = (keys[1:] != keys[:-1]) | (next_tokens[1:] != next_tokens[:-1])
    pair_starts = np.flatnonzero(new_pair)
    pair_counts = np.diff(np.append(pair_starts, len(keys)))
    pair_keys, pair_next = keys[pair_starts], next_tokens[pair_starts]
    new_key = np.ones(len(pair_keys), dtype=bool)
    new_key[1:] = pair_keys[1:] != pair_keys[:-1]
    key_starts = np.flatnonzero(new_key)
    totals = np.add.reduceat(pair_counts, key_starts) if len(key_starts) else pair_counts[:0]
    # Within each context, the pair with the highest count first (ties: the smaller token).
    context_of = np.cumsum(new_key) - 1
    by_count = np.lexsort((pair_next, -pair_counts, context_of))
    best = by_count[np.searchsorted(context_of[by_count], np.arange(len(key_starts)))]
    keep = totals >= min_count
    return (pair_keys[key_starts][keep], pair_next[best][keep].astype(np.int32),
            (pair_counts[best][keep] / totals[keep]).astype(np.float32))


def load_from_dir(directory: str | os.PathLike | None) -> AnswerNgrams | None:
    """The answer n-grams a heads dir ships, or None when it has none."""
    if directory is None:
        return None
    path = Path(directory) / ANSWER_NGRAMS_NAME
    return AnswerNgrams.load(path) if path.is_file() else None
