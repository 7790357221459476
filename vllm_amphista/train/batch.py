"""Packed training batches, the draft vocabulary and the two training objectives.

Packing: samples are laid end to end in rows of `row_tokens` (first fit,
longest first), each with its own positions 0..L-1 and a segment id; attention
is causal inside a segment only (`causal_attention_mask`), so a packed row
computes exactly what the samples would compute alone, and the only padding is
the tail of each row. The vocabulary projection, the costliest part of a
drafter, runs on labelled positions only.

Labels: at position t, head k (0-based) drafts x_{t+2+k}: the token after
x_{t+1}, which the target itself produced from h_t. A label exists where
x_{t+2+k} is one of the target's output tokens of the same sample (prompts are
the user's text, not the target's). With the target's top-k distribution at
that token's position, head k can also learn the target's whole belief there
(`distillation_loss`) instead of the one token it chose (`hard_label_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_amphista.train.data import Dataset

IGNORE_INDEX = -100
OBJECTIVES = ("hard", "distill")


@dataclass
class Batch:
    hidden: torch.Tensor  # [B, T, H] h_t, 0 where padded
    token_ids: torch.Tensor  # [B, T] x_t, 0 where padded
    next_token_ids: torch.Tensor  # [B, T] x_{t+1} of the same sample, 0 past its end
    position_ids: torch.Tensor  # [B, T] position inside the sample
    segment_ids: torch.Tensor  # [B, T] 1, 2, ... per sample in the row, 0 where padded
    has_hidden: torch.Tensor  # [B, T] whether h_t is known (a sample's last token was never fed back)
    labels: torch.Tensor  # [B, T, K] target ids x_{t+2+k}, IGNORE_INDEX where there is none
    label_topk_ids: torch.Tensor  # [B, T, K, k] the target's top-k at each label's position (target ids)
    label_topk_logprobs: torch.Tensor  # [B, T, K, k]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(getattr(self, name).to(device) for name in self.__dataclass_fields__))

    @property
    def num_tokens(self) -> int:
        return int((self.segment_ids > 0).sum())

    @property
    def next_hidden(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(h_{t+1} of the same sample, [B, T] mask of where it exists)."""
        same = (self.segment_ids[:, 1:] == self.segment_ids[:, :-1]) & self.has_hidden[:, 1:]
        return F.pad(self.hidden[:, 1:], (0, 0, 0, 1)), F.pad(same, (0, 1))


def causal_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] segment ids -> [B, 1, T, T] boolean "may attend": same segment, not in the future.
    Every position may see itself, so padded rows are never fully masked (NaN)."""
    seq_len = segment_ids.shape[-1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    eye = torch.eye(seq_len, dtype=torch.bool, device=segment_ids.device)
    return ((same & causal) | eye)[:, None]


def pack_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Indices grouped into rows of at most `row_tokens` tokens (first fit, longest first)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = min(lengths[index], row_tokens)
        row = next((r for r, free in enumerate(room) if free >= length), None)
        if row is None:
            rows.append([])
            room.append(row_tokens)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= length
    return rows


def build_batch(dataset: Dataset, rows: list[list[int]], num_heads: int, row_tokens: int,
                train_on_prompt: bool = False) -> Batch:
    """One batch of packed rows of dataset samples (cut to row_tokens)."""
    first = dataset.tensors(rows[0][0])
    hidden_size, top_k = first.hidden.shape[-1], dataset.top_k
    length = min(row_tokens, max(sum(min(len(dataset.samples[i].token_ids), row_tokens) for i in row) for row in rows))
    shape = (len(rows), length)
    hidden = torch.zeros(*shape, hidden_size, dtype=first.hidden.dtype)
    token_ids = torch.zeros(shape, dtype=torch.long)
    next_token_ids = torch.zeros(shape, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    segment_ids = torch.zeros(shape, dtype=torch.long)
    has_hidden = torch.zeros(shape, dtype=torch.bool)
    labels = torch.full((*shape, num_heads), IGNORE_INDEX, dtype=torch.long)
    topk_ids = torch.zeros((*shape, num_heads, top_k), dtype=torch.long)
    topk_logprobs = torch.full((*shape, num_heads, top_k), float("-inf"))
    for row, indices in enumerate(rows):
        start = 0
        for segment, index in enumerate(indices, start=1):
            sample = dataset.samples[index]
            tensors = dataset.tensors(index)
            ids = torch.tensor(sample.token_ids[:row_tokens])
            n = len(ids)
            end = start + n
            token_ids[row, start:end] = ids
            next_token_ids[row, start:end - 1] = ids[1:]
            position_ids[row, start:end] = torch.arange(n)
            segment_ids[row, start:end] = segment
            known = min(n, tensors.hidden.shape[0])
            hidden[row, start:start + known] = tensors.hidden[:known]
            has_hidden[row, start:start + known] = True
            prompt_len = len(sample.prompt_ids)
            # Drafting starts after the prompt: at its last position, h_t produced the first output
            # token. Position p >= prompt_len holds output token p - prompt_len and its top-k.
            first_t = 0 if train_on_prompt else prompt_len - 1
            for k in range(num_heads):
                last_t = n - 3 - k  # x_{t+2+k} must be inside the (cut) sample
                if last_t < first_t:
                    continue
                label_positions = torch.arange(first_t, last_t + 1) + 2 + k
                labels[row, start + first_t:start + last_t + 1, k] = ids[label_positions]
                output_rows = label_positions - prompt_len
                has_topk = output_rows >= 0
                target_rows = torch.arange(first_t, last_t + 1)[has_topk] + start
                topk_ids[row, target_rows, k] = tensors.topk_ids[output_rows[has_topk], :top_k].long()
                topk_logprobs[row, target_rows, k] = tensors.topk_logprobs[output_rows[has_topk], :top_k].float()
            start = end
    return Batch(hidden, token_ids, next_token_ids, position_ids, segment_ids, has_hidden, labels, topk_ids,
                 topk_logprobs)


def make_batches(dataset: Dataset, indices: list[int], num_heads: int, batch_tokens: int, row_tokens: int,
                 train_on_prompt: bool = False) -> list[list[list[int]]]:
    """Plans of batches (rows of sample indices) of about `batch_tokens` tokens each."""
    lengths = [len(dataset.samples[i].token_ids) for i in indices]
    rows = [[indices[position] for position in row] for row in pack_rows(lengths, row_tokens)]
    rows_per_batch = max(1, batch_tokens // row_tokens)
    return [rows[start:start + rows_per_batch] for start in range(0, len(rows), rows_per_batch)]


class DraftVocab:
    """The ids a drafter can emit: all target ids, or a frequency-ranked subset."""

    def __init__(self, draft_to_target: torch.Tensor | None, vocab_size: int):
        self.draft_to_target = draft_to_target
        self.vocab_size = vocab_size
        self.target_to_draft = None
        if draft_to_target is not None:
            self.target_to_draft = torch.full((vocab_size,), IGNORE_INDEX, dtype=torch.long)
            self.target_to_draft[draft_to_target] = torch.arange(len(draft_to_target))

    @property
    def size(self) -> int:
        return self.vocab_size if self.draft_to_target is None else len(self.draft_to_target)

    def rows(self, weight: torch.Tensor) -> torch.Tensor:
        """The draft vocabulary's rows of a [V, H] target matrix."""
        return weight if self.draft_to_target is None else weight[self.draft_to_target.to(weight.device)]

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids; ids outside the draft vocabulary (and IGNORE_INDEX) become IGNORE_INDEX."""
        if self.target_to_draft is None:
            return target_ids
        target_to_draft = self.target_to_draft.to(target_ids.device)
        return torch.where(target_ids == IGNORE_INDEX, IGNORE_INDEX, target_to_draft[target_ids.clamp(min=0)])

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_to_target is None else self.draft_to_target.to(draft_ids.device)[draft_ids]


def _weighted_mean_per_head(token_loss: torch.Tensor, valid: torch.Tensor, head_weights: torch.Tensor):
    """token_loss, valid [M, K] -> (sum_k w_k * mean loss of head k, per-head means). A head with no
    labels in the batch contributes 0 rather than NaN."""
    head_loss = (token_loss * valid).sum(dim=0) / valid.sum(dim=0).clamp(min=1)
    return (head_weights * head_loss).sum(), head_loss.detach()


def hard_label_loss(logits: torch.Tensor, labels: torch.Tensor, head_weights: torch.Tensor):
    """Cross-entropy with the target's chosen token. logits [M, K, V], labels [M, K] in draft ids."""
    token_ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="none").view(labels.shape)
    return _weighted_mean_per_head(token_ce, labels != IGNORE_INDEX, head_weights)


def distillation_loss(logits: torch.Tensor, topk_draft_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                      head_weights: torch.Tensor):
    """Cross-entropy with the target's top-k distribution (renormalised over the ids the drafter can emit):
    the KL to it, up to a constant. logits [M, K, V]; topk_draft_ids / topk_logprobs [M, K, k]."""
    usable = (topk_draft_ids != IGNORE_INDEX) & torch.isfinite(topk_logprobs)
    target = torch.softmax(topk_logprobs.masked_fill(~usable, float("-inf")), dim=-1).nan_to_num(0.0)
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(-1, topk_draft_ids.clamp(min=0))
    token_ce = -(target * log_q.masked_fill(~usable, 0.0)).sum(dim=-1)
    return _weighted_mean_per_head(token_ce, usable.any(dim=-1), head_weights)
