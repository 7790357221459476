"""The Medusa baseline: K residual blocks on h_t, in the format vLLM 0.32 loads itself.

``vllm/model_executor/models/medusa.py``: config.json with model_type "medusa",
``num_heads``, ``num_hidden_layers``, ``hidden_size``, ``vocab_size``,
``truncated_vocab_size``, ``medusa_fc_bias`` and ``original_lm_head``; weights
``blocks.{i}.layers.{j}.weight/bias``. vLLM never borrows the target's lm_head
for Medusa and checks that every parameter is loaded, so the vocabulary matrix
is saved: with ``original_lm_head`` one matrix, stored as ``lm_heads.0.weight``,
serves every head (the target's frozen lm_head, as Amphista uses). The shipped
baseline keeps only the blocks (``assets.MEDUSA_BLOCKS_FILE``, see
`shippable_blocks`): `demo_target` joins them with the target's lm_head.
vLLM's ``token_map`` draft vocabulary cannot be used: 0.32's loader creates
that parameter inside ``load_weights`` without reporting it loaded and then
fails with "Following weights were not initialized from checkpoint:
{'token_map'}". So the export is always full-vocabulary and a draft
vocabulary only narrows Medusa's training loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from vllm_amphista.checkpoint import CONFIG_NAME, WEIGHTS_NAME, check_weights_match, dtype_name, load_weights, \
    save_weights
from vllm_amphista.train.batch import Batch, DraftVocab
from vllm_amphista.train.drafter import DraftMethod, id_list, id_tensor, read_json
from vllm_amphista.train.target import Target

LM_HEAD_NAME = "lm_heads.0.weight"


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
                "draft_to_target": id_list(self.loss_vocab.draft_to_target)}

    @classmethod
    def from_spec(cls, spec: dict, target: Target) -> MedusaMethod:
        return cls.create(target, id_tensor(spec["draft_to_target"]), spec["num_heads"], spec["num_layers"])

    def head_features(self, batch: Batch, target: Target, rows: torch.Tensor) -> torch.Tensor:
        hidden = batch.hidden[rows].to(self.lm_head_weight.dtype)
        return torch.stack([block(hidden) for block in self.blocks], dim=-2)

    def vocab_weight(self, target: Target) -> torch.Tensor:
        return self.lm_head_weight

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
        tensors[LM_HEAD_NAME] = self.lm_head_weight
        save_weights(tensors, directory, dtype)

    @classmethod
    def load(cls, directory: Path, target: Target) -> MedusaMethod:
        config = read_json(directory / CONFIG_NAME)
        target.check_matches(config["hidden_size"], config["vocab_size"], str(directory))
        tensors = load_weights(directory)
        lm_head_weight = tensors.pop(LM_HEAD_NAME, None)
        if lm_head_weight is None or not config.get("original_lm_head"):
            raise ValueError(f"{directory}: only Medusa heads with one shared lm_head (original_lm_head) are supported")
        method = cls(config["hidden_size"], config["num_heads"], config["num_hidden_layers"], lm_head_weight)
        blocks = {name.removeprefix("blocks."): tensor.float() for name, tensor in tensors.items()}
        check_weights_match(method.blocks.state_dict(), blocks, str(directory / WEIGHTS_NAME))
        method.blocks.load_state_dict(blocks)
        return method


def shippable_blocks(trained_dir: str | Path, out_file: str | Path) -> None:
    """Write a trained Medusa dir's blocks without the target's lm_head (what the package ships)."""
    tensors = load_weights(trained_dir)
    tensors.pop(LM_HEAD_NAME)
    save_file(tensors, str(out_file), metadata={"format": "pt"})
