"""The frozen target's pieces that drafters share: its config, token embedding and lm_head.

Which hidden state drafters get: vLLM's model runner hands its proposers
(EAGLE, Medusa, ...) the model's forward output at each position, the tensor
the sampler's logits come from. For Llama that output is taken after the final
norm (``vllm/model_executor/models/llama.py``: ``LlamaModel.forward`` ends with
``self.norm``), i.e. exactly what the lm_head multiplies. `generate` captures
that very tensor from the engine (see ``generate.py``), so drafters train on
what they will be fed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


@dataclass
class Target:
    path: str
    config: PretrainedConfig  # the text config
    embed_weight: torch.Tensor  # [V, H]
    lm_head_weight: torch.Tensor  # [V, H]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def check_matches(self, hidden_size: int, vocab_size: int, source: str) -> None:
        """ValueError if heads built for another model are used with this target."""
        if (hidden_size, vocab_size) != (self.hidden_size, self.vocab_size):
            raise ValueError(
                f"{source} was built for hidden size {hidden_size} and vocab {vocab_size}, but the target "
                f"{self.path} has hidden size {self.hidden_size} and vocab {self.vocab_size}"
            )

    def to(self, device: str | torch.device) -> Target:
        return Target(self.path, self.config, self.embed_weight.to(device), self.lm_head_weight.to(device))


def load_target(path: str) -> Target:
    """The target's embedding and lm_head in float32 (the rest of the model is not kept)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return Target(
        path=str(path),
        config=model.config.get_text_config(),
        embed_weight=model.get_input_embeddings().weight.detach().clone(),
        lm_head_weight=model.get_output_embeddings().weight.detach().clone(),
    )
