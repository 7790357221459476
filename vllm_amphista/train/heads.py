"""The three drafters the pipeline trains, behind one interface, and their
on-disk formats.

All three draft from the target's final-norm hidden state h_t (see
``target.py``); at position t, draft k (0-based) guesses x_{t+2+k}, the token
after x_{t+1}, which the target itself sampled from h_t.

* ``amphista``: ``vllm_amphista.modeling_amphista.AmphistaDrafter``, saved
  with its own ``save_pretrained`` (config.json model_type "amphista").
* ``medusa``: K residual blocks on h_t, in the format vLLM 0.32 loads itself
  (``vllm/model_executor/models/medusa.py``): config.json with model_type
  "medusa", ``num_heads``, ``num_hidden_layers``, ``hidden_size``,
  ``vocab_size``, ``truncated_vocab_size``, ``medusa_fc_bias`` and
  ``original_lm_head``; weights ``blocks.{i}.layers.{j}.weight/bias``. vLLM
  never borrows the target's lm_head for Medusa and checks that every
  parameter is loaded, so the vocabulary matrix is saved: with
  ``original_lm_head`` one matrix, stored as ``lm_heads.0.weight``, serves
  every head (here the target's frozen lm_head, as our Amphista uses).
  vLLM's ``token_map`` draft vocabulary cannot be used: 0.32's loader creates
  that parameter inside ``load_weights`` without reporting it loaded and then
  fails with "Following weights were not initialized from checkpoint:
  {'token_map'}". So the export is always full-vocabulary and
  ``--draft-vocab-size`` only narrows Medusa's training cross-entropy.
* ``eagle``: EAGLE-1's one decoder layer for a Llama target, in the format of
  ``vllm/model_executor/models/llama_eagle.py``: config.json is the target's
  Llama config with ``num_hidden_layers`` 1 (vLLM wraps it in EAGLEConfig and
  renames the architecture to EagleLlamaForCausalLM); weights ``fc.weight``
  (``[H, 2H]``, no bias, on ``cat([embed(x_{t+1}), h_t])``) and
  ``layers.0.*`` in HF names. Layer 0 has no input_layernorm in vLLM (it is
  an Identity there, so it must not be saved) and there is no final norm: the
  layer's output feeds the next step and the target's lm_head. embed_tokens
  and lm_head are not saved, so vLLM shares the target's. EAGLE-1 in vLLM
  has no draft vocabulary either; ``--draft-vocab-size`` only narrows its
  training cross-entropy.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from vllm_amphista.modeling_amphista import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    AmphistaConfig,
    AmphistaDrafter,
    causal_attention_mask,
    check_weights_match,
    draft_logits,
    dtype_name,
    load_weights,
    save_weights,
)
from vllm_amphista.train.data import Sample
from vllm_amphista.train.target import Target, right_pad

IGNORE_INDEX = -100
METHODS = ("amphista", "medusa", "eagle")


@dataclass
class Batch:
    """Right-padded sequences (prompt + target output) with the target's hidden states."""

    hidden: torch.Tensor  # [B, T, H] final-norm hidden state h_t
    token_ids: torch.Tensor  # [B, T] x_t, 0 where padded
    padding_mask: torch.Tensor  # [B, T] True for real tokens
    loss_mask: torch.Tensor  # [B, T] positions t whose x_{t+1} is to be learnt from

    @classmethod
    def from_samples(cls, samples: list[Sample], hidden_states: list[torch.Tensor], train_on_prompt: bool = False,
                     max_seq_len: int | None = None) -> Batch:
        """Right-pad samples (cut to max_seq_len). Without train_on_prompt only
        positions whose next token is one of the target's outputs are learnt."""
        sequences = [sample.token_ids[:max_seq_len] for sample in samples]
        token_ids, padding_mask = right_pad(sequences)
        hidden = torch.zeros(*token_ids.shape, hidden_states[0].shape[-1], dtype=hidden_states[0].dtype)
        loss_mask = torch.zeros_like(padding_mask)
        for row, (sample, sequence) in enumerate(zip(samples, sequences, strict=True)):
            hidden[row, : len(sequence)] = hidden_states[row][: len(sequence)]
            first = 0 if train_on_prompt else len(sample.prompt_ids) - 1
            loss_mask[row, first : len(sequence) - 1] = True  # x_{t+1} must exist
        return cls(hidden, token_ids, padding_mask, loss_mask)

    def to(self, device: torch.device | str) -> Batch:
        tensors = (self.hidden, self.token_ids, self.padding_mask, self.loss_mask)
        return Batch(*(tensor.to(device) for tensor in tensors))

    @property
    def next_token_ids(self) -> torch.Tensor:
        """x_{t+1}, the token the target sampled from h_t (0 past the end)."""
        return F.pad(self.token_ids[:, 1:], (0, 1))

    def target_labels(self, num_heads: int) -> torch.Tensor:
        """[B, T, K] target ids x_{t+2+k}, IGNORE_INDEX where absent or masked."""
        batch, seq_len = self.token_ids.shape
        labels = torch.full((batch, seq_len, num_heads), IGNORE_INDEX, dtype=torch.long, device=self.token_ids.device)
        for k in range(num_heads):
            shift = 2 + k
            if shift >= seq_len:
                break
            valid = self.padding_mask[:, shift:] & self.loss_mask[:, :-shift]
            labels[:, :-shift, k] = torch.where(valid, self.token_ids[:, shift:], IGNORE_INDEX)
        return labels


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

    def to_draft_labels(self, target_labels: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids; ids outside the draft vocabulary are ignored."""
        if self.target_to_draft is None:
            return target_labels
        target_to_draft = self.target_to_draft.to(target_labels.device)
        return torch.where(target_labels == IGNORE_INDEX, IGNORE_INDEX, target_to_draft[target_labels.clamp(min=0)])

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_to_target is None else self.draft_to_target.to(draft_ids.device)[draft_ids]


def weighted_head_loss(
    logits: torch.Tensor, labels: torch.Tensor, head_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_k w_k * mean CE of head k over its labelled rows; also the per-head CEs.

    logits [M, K, V], labels [M, K] in draft ids (IGNORE_INDEX to skip)."""
    num_heads = logits.shape[1]
    token_ce = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(-1, num_heads)
    counts = (labels != IGNORE_INDEX).sum(dim=0)
    # A head with no labels in this batch contributes 0 rather than NaN.
    head_ce = token_ce.sum(dim=0) / counts.clamp(min=1)
    return (head_weights * head_ce).sum(), head_ce.detach()


def _id_list(ids: torch.Tensor | None) -> list[int] | None:
    return None if ids is None else ids.tolist()


def _id_tensor(ids: list[int] | None) -> torch.Tensor | None:
    return None if ids is None else torch.tensor(ids, dtype=torch.int64)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text())


class DraftMethod(nn.Module):
    """What fit and eval need from a drafter: loss, per-head logits, save and load."""

    name: str
    num_heads: int
    vocab: DraftVocab  # the ids head_logits ranges over, as deployed
    loss_vocab: DraftVocab  # the ids the training cross-entropy ranges over

    def head_logits(self, batch: Batch, target: Target) -> torch.Tensor:
        """[B, T, K, vocab.size] logits, head k at position t drafting x_{t+2+k}."""
        raise NotImplementedError

    def training_loss(
        self, batch: Batch, target: Target, head_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scalar loss, per-head CE) on one batch."""
        raise NotImplementedError

    def save(self, directory: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> None:
        raise NotImplementedError

    def build_spec(self) -> dict:
        """Constructor arguments that rebuild this drafter (for resumable checkpoints)."""
        raise NotImplementedError


class AmphistaMethod(DraftMethod):
    name = "amphista"

    def __init__(self, drafter: AmphistaDrafter):
        super().__init__()
        self.drafter = drafter
        self.num_heads = drafter.config.num_draft_heads
        self.vocab = self.loss_vocab = DraftVocab(drafter.draft_to_target, drafter.config.vocab_size)
        if drafter.lm_head is not None and drafter.config.share_lm_head:
            # A draft-vocabulary slice of the target's lm_head stays the target's.
            drafter.lm_head.requires_grad_(False)

    @classmethod
    def create(cls, target: Target, draft_to_target: torch.Tensor | None, **config_overrides) -> AmphistaMethod:
        draft_vocab_size = 0 if draft_to_target is None else len(draft_to_target)
        config = AmphistaConfig.from_target_config(target.config, draft_vocab_size=draft_vocab_size, **config_overrides)
        drafter = AmphistaDrafter(config)
        drafter.init_from_target(target.lm_head_weight.detach().float(), draft_to_target)
        return cls(drafter)

    def build_spec(self) -> dict:
        return {"config": self.drafter.config.to_dict(), "draft_to_target": _id_list(self.vocab.draft_to_target)}

    @classmethod
    def from_spec(cls, spec: dict, target: Target) -> AmphistaMethod:
        config = AmphistaConfig.from_dict(spec["config"])
        target.check_matches(config.hidden_size, config.vocab_size, "the Amphista checkpoint")
        drafter = AmphistaDrafter(config)
        drafter.init_from_target(target.lm_head_weight.detach().float(), _id_tensor(spec["draft_to_target"]))
        return cls(drafter)

    def _head_features(self, batch: Batch, target: Target) -> torch.Tensor:
        # No padding mask: batches are right-padded, so causal attention never
        # lets a real position see padding, and SDPA's causal path is faster.
        return self.drafter.head_hidden_states(batch.hidden, batch.next_token_ids, target.embed_weight)

    def head_logits(self, batch, target):
        return draft_logits(self._head_features(batch, target), self.drafter.vocab_weight(target.lm_head_weight))

    def training_loss(self, batch, target, head_weights):
        labels = self.loss_vocab.to_draft_labels(batch.target_labels(self.num_heads))
        rows = (labels != IGNORE_INDEX).any(dim=-1)
        # The vocabulary projection dominates the cost: run it on labelled rows only.
        features = self._head_features(batch, target)[rows]
        logits = draft_logits(features, self.drafter.vocab_weight(target.lm_head_weight))
        return weighted_head_loss(logits, labels[rows], head_weights)

    def save(self, directory, dtype=torch.bfloat16):
        self.drafter.save_pretrained(directory, dtype=dtype)

    @classmethod
    def load(cls, directory: Path, target: Target) -> AmphistaMethod:
        drafter = AmphistaDrafter.from_pretrained(directory, dtype=torch.float32)
        target.check_matches(drafter.config.hidden_size, drafter.config.vocab_size, str(directory))
        return cls(drafter)


class MedusaResidualBlock(nn.Module):
    """vLLM's Medusa ResidualBlock: x + SiLU(W x + b), repeated."""

    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=True) for _ in range(num_layers))
        self.act = nn.SiLU()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = hidden + self.act(layer(hidden))
        return hidden


class MedusaMethod(DraftMethod):
    name = "medusa"

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int, lm_head_weight: torch.Tensor,
                 loss_draft_to_target: torch.Tensor | None = None):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, lm_head_weight.shape[0]
        self.num_heads, self.num_layers = num_heads, num_layers
        self.blocks = nn.ModuleList(MedusaResidualBlock(hidden_size, num_layers) for _ in range(num_heads))
        for block in self.blocks:
            # Zero weights make each head start as the target's own next-token head (as in Medusa).
            for layer in block.layers:
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)
        self.vocab = DraftVocab(None, self.vocab_size)
        self.loss_vocab = DraftVocab(loss_draft_to_target, self.vocab_size)
        # The shared, frozen lm_head (vLLM's original_lm_head); rebuilt from
        # the target on resume, so not part of training checkpoints.
        self.register_buffer("lm_head_weight", lm_head_weight.detach().float().clone(), persistent=False)

    @classmethod
    def create(cls, target: Target, draft_to_target: torch.Tensor | None, num_heads: int = 4, num_layers: int = 1):
        return cls(target.hidden_size, num_heads, num_layers, target.lm_head_weight, draft_to_target)

    def build_spec(self) -> dict:
        return {"num_heads": self.num_heads, "num_layers": self.num_layers,
                "draft_to_target": _id_list(self.loss_vocab.draft_to_target)}

    @classmethod
    def from_spec(cls, spec: dict, target: Target) -> MedusaMethod:
        return cls.create(target, _id_tensor(spec["draft_to_target"]), spec["num_heads"], spec["num_layers"])

    def _heads(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.lm_head_weight.dtype)
        return torch.stack([block(hidden) for block in self.blocks], dim=-2)

    def head_logits(self, batch, target):
        return draft_logits(self._heads(batch.hidden), self.lm_head_weight)

    def training_loss(self, batch, target, head_weights):
        labels = self.loss_vocab.to_draft_labels(batch.target_labels(self.num_heads))
        rows = (labels != IGNORE_INDEX).any(dim=-1)
        logits = draft_logits(self._heads(batch.hidden[rows]), self.loss_vocab.rows(self.lm_head_weight))
        return weighted_head_loss(logits, labels[rows], head_weights)

    def save(self, directory, dtype=torch.bfloat16):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_heads": self.num_heads,
            "num_hidden_layers": self.num_layers,
            "truncated_vocab_size": self.vocab_size,
            "medusa_fc_bias": True,
            "original_lm_head": True,
            "dtype": dtype_name(dtype),
        }
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        tensors = {f"blocks.{name}": tensor for name, tensor in self.blocks.state_dict().items()}
        tensors["lm_heads.0.weight"] = self.lm_head_weight
        save_weights(tensors, directory, dtype)

    @classmethod
    def load(cls, directory: Path, target: Target) -> MedusaMethod:
        config = _read_json(directory / CONFIG_NAME)
        target.check_matches(config["hidden_size"], config["vocab_size"], str(directory))
        tensors = load_weights(directory)
        lm_head_weight = tensors.pop("lm_heads.0.weight", None)
        if lm_head_weight is None or not config.get("original_lm_head"):
            raise ValueError(f"{directory}: only Medusa heads with one shared lm_head (original_lm_head) are supported")
        method = cls(config["hidden_size"], config["num_heads"], config["num_hidden_layers"], lm_head_weight)
        blocks = {name.removeprefix("blocks."): tensor.float() for name, tensor in tensors.items()}
        check_weights_match(method.blocks.state_dict(), blocks, str(directory / WEIGHTS_NAME))
        method.blocks.load_state_dict(blocks)
        return method


class EagleMethod(DraftMethod):
    name = "eagle"

    def __init__(self, target_config, num_steps: int, loss_draft_to_target: torch.Tensor | None = None,
                 ce_weight: float = 0.1):
        super().__init__()
        if target_config.model_type != "llama":
            raise ValueError(f"the EAGLE baseline supports Llama targets only, not {target_config.model_type!r}")
        self.layer_config = copy.deepcopy(target_config)
        self.layer_config.num_hidden_layers = 1
        self.layer_config.architectures = ["LlamaForCausalLM"]
        self.layer_config._attn_implementation = "sdpa"
        hidden_size = target_config.hidden_size
        self.num_heads = num_steps
        self.ce_weight = ce_weight
        self.vocab = DraftVocab(None, target_config.vocab_size)
        self.loss_vocab = DraftVocab(loss_draft_to_target, target_config.vocab_size)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(self.layer_config, layer_idx=0)])
        # vLLM replaces layer 0's input_layernorm by Identity (as EAGLE does).
        self.layers[0].input_layernorm = nn.Identity()
        object.__setattr__(self, "rotary_emb", LlamaRotaryEmbedding(self.layer_config))
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02)
            # Start as "pass h_t through": its first guess is the target's next token.
            self.fc.weight.zero_()
            self.fc.weight[:, hidden_size:] = torch.eye(hidden_size)

    @classmethod
    def create(cls, target: Target, draft_to_target: torch.Tensor | None, num_steps: int = 4, ce_weight: float = 0.1):
        return cls(target.config, num_steps, draft_to_target, ce_weight)

    def build_spec(self) -> dict:
        return {"num_steps": self.num_heads, "ce_weight": self.ce_weight,
                "draft_to_target": _id_list(self.loss_vocab.draft_to_target)}

    @classmethod
    def from_spec(cls, spec: dict, target: Target) -> EagleMethod:
        return cls(target.config, spec["num_steps"], _id_tensor(spec["draft_to_target"]), spec["ce_weight"])

    def _step_inputs(self, token_ids: torch.Tensor, hidden: torch.Tensor, target: Target) -> torch.Tensor:
        dtype = self.fc.weight.dtype
        embeds = F.embedding(token_ids, target.embed_weight).to(dtype)
        return self.fc(torch.cat([embeds, hidden.to(dtype)], dim=-1))

    def _layer(self, inputs: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        position_embeddings = self.rotary_emb(inputs, position_ids)
        return self.layers[0](inputs, attention_mask=mask, position_embeddings=position_embeddings)

    def training_loss(self, batch, target, head_weights):
        """EAGLE-1's loss with teacher forcing: smooth-L1 from each feature to
        the target's next hidden state, plus ce_weight * CE of its next token.
        (head_weights is unused: one step is trained.)"""
        seq_len = batch.token_ids.shape[1]
        position_ids = torch.arange(seq_len, device=batch.token_ids.device).expand_as(batch.token_ids)
        # Right padding: plain causal attention keeps real positions exact (see AmphistaMethod).
        features = self._layer(self._step_inputs(batch.next_token_ids, batch.hidden, target), position_ids, None)
        has_next_hidden = batch.loss_mask & F.pad(batch.padding_mask[:, 1:], (0, 1))
        next_hidden = F.pad(batch.hidden[:, 1:], (0, 0, 0, 1))
        regression = F.smooth_l1_loss(features[has_next_hidden].float(), next_hidden[has_next_hidden].float())
        labels = self.loss_vocab.to_draft_labels(batch.target_labels(1))
        rows = labels[..., 0] != IGNORE_INDEX
        logits = draft_logits(features[rows].unsqueeze(1), self.loss_vocab.rows(target.lm_head_weight))
        ce, head_ce = weighted_head_loss(logits, labels[rows], torch.ones(1, device=logits.device))
        return regression + self.ce_weight * ce, head_ce

    def head_logits(self, batch, target):
        """Chained drafting as in vLLM: step j feeds step j-1's feature and its
        argmax token, at position t+j, attending to the teacher-forced prefix
        (positions <= t) and to its own earlier steps at t."""
        batch_size, seq_len = batch.token_ids.shape
        positions = torch.arange(seq_len, device=batch.token_ids.device).expand(batch_size, seq_len)
        step_inputs = [self._step_inputs(batch.next_token_ids, batch.hidden, target)]
        step_logits = []
        for step in range(self.num_heads):
            inputs = torch.cat(step_inputs, dim=1)
            position_ids = torch.cat([positions + j for j in range(step + 1)], dim=1)
            features = self._layer(inputs, position_ids, _chain_attention_mask(batch.padding_mask, step + 1))
            features = features[:, step * seq_len:]
            logits = draft_logits(features, target.lm_head_weight)
            step_logits.append(logits)
            step_inputs.append(self._step_inputs(logits.argmax(dim=-1), features, target))
        return torch.stack(step_logits, dim=2)

    def save(self, directory, dtype=torch.bfloat16):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.layer_config.dtype = dtype_name(dtype)
        self.layer_config.save_pretrained(directory)
        save_weights(self.state_dict(), directory, dtype)

    @classmethod
    def load(cls, directory: Path, target: Target, num_steps: int = 4) -> EagleMethod:
        config = _read_json(directory / CONFIG_NAME)
        target.check_matches(config["hidden_size"], config["vocab_size"], str(directory))
        method = cls(target.config, num_steps)
        tensors = {name: tensor.float() for name, tensor in load_weights(directory).items()}
        check_weights_match(method.state_dict(), tensors, str(directory / WEIGHTS_NAME))
        method.load_state_dict(tensors)
        return method


def _chain_attention_mask(padding_mask: torch.Tensor, num_steps: int) -> torch.Tensor:
    """[B, 1, S*T, S*T] "may attend" mask for S chained EAGLE steps laid out
    step-major: step a at position t sees step 0 at real positions u <= t and
    steps 1..a at t itself."""
    seq_len = padding_mask.shape[1]
    prefix = causal_attention_mask(padding_mask)  # [B, 1, T, T]
    same_position = torch.eye(seq_len, dtype=torch.bool, device=padding_mask.device).expand_as(prefix)
    nothing = torch.zeros_like(prefix)
    rows = []
    for query_step in range(num_steps):
        own_steps = [same_position if key_step <= query_step else nothing for key_step in range(1, num_steps)]
        blocks = [prefix] + own_steps
        rows.append(torch.cat(blocks, dim=-1))
    return torch.cat(rows, dim=-2)


def detect_method(directory: str | os.PathLike) -> str:
    """Which of METHODS a saved heads directory holds."""
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no {CONFIG_NAME}: not a heads directory")
    model_type = _read_json(config_path).get("model_type")
    if model_type in ("amphista", "medusa"):
        return model_type
    if "fc.weight" in load_weights(directory):
        return "eagle"
    raise ValueError(f"{directory} holds neither Amphista, Medusa nor EAGLE heads (model_type {model_type!r})")


def load_heads(directory: str | os.PathLike, target: Target, eagle_steps: int = 4) -> DraftMethod:
    """Load any saved drafter for evaluation, checking it matches the target."""
    directory = Path(directory)
    method = detect_method(directory)
    if method == "amphista":
        return AmphistaMethod.load(directory, target)
    if method == "medusa":
        return MedusaMethod.load(directory, target)
    return EagleMethod.load(directory, target, eagle_steps)


METHOD_CLASSES = {"amphista": AmphistaMethod, "medusa": MedusaMethod, "eagle": EagleMethod}
