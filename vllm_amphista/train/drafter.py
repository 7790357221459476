"""What fit and eval need from a drafter, whichever it is: features, loss, save and load.

All drafters draft from the target's final-norm hidden state h_t (see
``target.py``); at position t, draft k (0-based) guesses x_{t+2+k}. One module
per drafter: ``amphista.py``, ``medusa.py`` (baseline), ``eagle.py``
(baseline); ``methods.py`` picks one by name or by a saved directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vllm_amphista.modeling_amphista import draft_logits
from vllm_amphista.train.batch import (
    IGNORE_INDEX,
    Batch,
    DraftVocab,
    distillation_loss,
    hard_label_loss,
)
from vllm_amphista.train.target import Target


class DraftMethod(nn.Module):
    name: str
    num_heads: int
    vocab: DraftVocab  # the ids head_logits ranges over, as deployed
    loss_vocab: DraftVocab  # the ids the training loss ranges over
    feature_layers: list[int] | None = None  # target layers read instead of h_t (Dataset's feature_layers)

    def head_features(self, batch: Batch, target: Target, rows: torch.Tensor) -> torch.Tensor:
        """[M, K, H] features of the M positions where `rows` [B, T] is True."""
        raise NotImplementedError

    def vocab_weight(self, target: Target) -> torch.Tensor:
        """The [vocab.size, H] matrix the features are projected on when drafting."""
        raise NotImplementedError

    def loss_vocab_weight(self, target: Target) -> torch.Tensor:
        """The [loss_vocab.size, H] matrix the training loss projects the features on."""
        return self.loss_vocab.rows(self.vocab_weight(target))

    def head_logits(self, batch: Batch, target: Target, rows: torch.Tensor) -> torch.Tensor:
        """[M, K, vocab.size] logits at the `rows` positions, head k drafting x_{t+2+k}."""
        return draft_logits(self.head_features(batch, target, rows), self.vocab_weight(target))

    def training_loss(self, batch: Batch, target: Target, head_weights: torch.Tensor, objective: str,
                      valid_prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(scalar loss, per-head loss) on one batch; `valid_prefix`: head k learns only at positions
        where heads 1..k-1 draft the target's tokens (a chain verifier reads head k only there)."""
        rows = (batch.labels != IGNORE_INDEX).any(dim=-1)
        features = self.head_features(batch, target, rows)
        logits = draft_logits(features, self.loss_vocab_weight(target))
        return self.loss_from_logits(logits, batch, rows, head_weights, objective, valid_prefix)

    def loss_from_logits(self, logits: torch.Tensor, batch: Batch, rows: torch.Tensor, head_weights: torch.Tensor,
                         objective: str, valid_prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        num_heads = logits.shape[1]
        labels = self.loss_vocab.to_draft_ids(batch.labels[rows][:, :num_heads])
        reachable = reachable_heads(logits, labels) if valid_prefix else None
        if objective == "hard":
            if reachable is not None:
                labels = labels.masked_fill(~reachable, IGNORE_INDEX)
            return hard_label_loss(logits, labels, head_weights)
        topk_ids = self.loss_vocab.to_draft_ids(batch.label_topk_ids[rows][:, :num_heads])
        if reachable is not None:
            topk_ids = topk_ids.masked_fill(~reachable.unsqueeze(-1), IGNORE_INDEX)
        return distillation_loss(logits, topk_ids, batch.label_topk_logprobs[rows][:, :num_heads], head_weights)

    def widen_draft_vocab(self, ranked_ids: torch.Tensor, target: Target) -> None:
        """Fine-tuning with a larger draft vocabulary of len(ranked_ids) ids: see AmphistaMethod."""
        raise ValueError(f"--draft-vocab-size with --init-heads widens Amphista heads only, not {self.name}")

    def save(self, directory: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> None:
        raise NotImplementedError

    def build_spec(self) -> dict:
        """Constructor arguments that rebuild this drafter (for resumable checkpoints)."""
        raise NotImplementedError


def reachable_heads(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[M, K] whether heads 0..k-1 all draft their labels (logits [M, K, V], labels [M, K] draft ids)."""
    right = (logits.detach().argmax(dim=-1) == labels).long()
    return F.pad(right.cumprod(dim=1)[:, :-1], (1, 0), value=1).bool()


def id_list(ids: torch.Tensor | None) -> list[int] | None:
    return None if ids is None else ids.tolist()


def id_tensor(ids: list[int] | None) -> torch.Tensor | None:
    return None if ids is None else torch.tensor(ids, dtype=torch.int64)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
