"""The EAGLE baseline: EAGLE-1's one decoder layer for a Llama target, in vLLM's format.

``vllm/model_executor/models/llama_eagle.py``: config.json is the target's
Llama config with ``num_hidden_layers`` 1 (vLLM wraps it in EAGLEConfig and
renames the architecture to EagleLlamaForCausalLM); weights ``fc.weight``
(``[H, 2H]``, no bias, on ``cat([embed(x_{t+1}), h_t])``) and ``layers.0.*`` in
HF names. Layer 0 has no input_layernorm in vLLM (it is an Identity there, so
it must not be saved) and there is no final norm: the layer's output feeds the
next step and the target's lm_head. embed_tokens and lm_head are not saved, so
vLLM shares the target's. EAGLE-1 in vLLM has no draft vocabulary either; a
draft vocabulary only narrows its training loss.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from vllm_amphista.checkpoint import CONFIG_NAME, WEIGHTS_NAME, check_weights_match, dtype_name, load_weights, \
    save_weights
from vllm_amphista.modeling_amphista import draft_logits
from vllm_amphista.train.batch import IGNORE_INDEX, DraftVocab, causal_attention_mask
from vllm_amphista.train.drafter import DraftMethod, id_list, id_tensor, read_json
from vllm_amphista.train.target import Target


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
                "draft_to_target": id_list(self.loss_vocab.draft_to_target)}

    @classmethod
    def from_spec(cls, spec: dict, target: Target) -> EagleMethod:
        return cls(target.config, spec["num_steps"], id_tensor(spec["draft_to_target"]), spec["ce_weight"])

    def _step_inputs(self, token_ids: torch.Tensor, hidden: torch.Tensor, target: Target) -> torch.Tensor:
        dtype = self.fc.weight.dtype
        embeds = F.embedding(token_ids, target.embed_weight).to(dtype)
        return self.fc(torch.cat([embeds, hidden.to(dtype)], dim=-1))

    def _layer(self, inputs: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        position_embeddings = self.rotary_emb(inputs, position_ids)
        return self.layers[0](inputs, attention_mask=mask, position_embeddings=position_embeddings)

    def vocab_weight(self, target: Target) -> torch.Tensor:
        return target.lm_head_weight

    def training_loss(self, batch, target, head_weights, objective, valid_prefix=False):
        """EAGLE-1's loss with teacher forcing: smooth-L1 from each feature to the target's next
        hidden state, plus ce_weight times the token loss of its first draft. (head_weights and
        valid_prefix are unused: one step is trained.)"""
        features = self._layer(self._step_inputs(batch.next_token_ids, batch.hidden, target), batch.position_ids,
                               causal_attention_mask(batch.segment_ids))
        next_hidden, has_next_hidden = batch.next_hidden
        has_next_hidden &= (batch.labels != IGNORE_INDEX).any(dim=-1)  # the target's output positions
        regression = F.smooth_l1_loss(features[has_next_hidden].float(), next_hidden[has_next_hidden].float())
        rows = batch.labels[..., 0] != IGNORE_INDEX
        logits = draft_logits(features[rows].unsqueeze(1), self.loss_vocab_weight(target))
        token_loss, head_loss = self.loss_from_logits(logits, batch, rows, torch.ones(1, device=logits.device),
                                                      objective)
        return regression + self.ce_weight * token_loss, head_loss

    def head_logits(self, batch, target, rows):
        """Chained drafting as in vLLM: step j feeds step j-1's feature and its argmax token, at
        position t+j, attending to the teacher-forced prefix (positions <= t of its own sample) and
        to its own earlier steps at t."""
        seq_len = batch.token_ids.shape[1]
        step_inputs = [self._step_inputs(batch.next_token_ids, batch.hidden, target)]
        step_logits = []
        for step in range(self.num_heads):
            inputs = torch.cat(step_inputs, dim=1)
            position_ids = torch.cat([batch.position_ids + j for j in range(step + 1)], dim=1)
            features = self._layer(inputs, position_ids, _chain_attention_mask(batch.segment_ids, step + 1))
            features = features[:, step * seq_len:]
            logits = draft_logits(features, target.lm_head_weight)
            step_logits.append(logits[rows])
            step_inputs.append(self._step_inputs(logits.argmax(dim=-1), features, target))
        return torch.stack(step_logits, dim=1)

    def save(self, directory, dtype=torch.bfloat16):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.layer_config.dtype = dtype_name(dtype)
        self.layer_config.save_pretrained(directory)
        save_weights(self.state_dict(), directory, dtype)

    @classmethod
    def load(cls, directory: Path, target: Target, num_steps: int = 4) -> EagleMethod:
        config = read_json(directory / CONFIG_NAME)
        target.check_matches(config["hidden_size"], config["vocab_size"], str(directory))
        method = cls(target.config, num_steps)
        tensors = {name: tensor.float() for name, tensor in load_weights(directory).items()}
        check_weights_match(method.state_dict(), tensors, str(directory / WEIGHTS_NAME))
        method.load_state_dict(tensors)
        return method


def _chain_attention_mask(segment_ids: torch.Tensor, num_steps: int) -> torch.Tensor:
    """[B, 1, S*T, S*T] "may attend" mask for S chained EAGLE steps laid out step-major: step a at
    position t sees step 0 at positions u <= t of its own sample and steps 1..a at t itself."""
    seq_len = segment_ids.shape[1]
    prefix = causal_attention_mask(segment_ids)  # [B, 1, T, T]
    same_position = torch.eye(seq_len, dtype=torch.bool, device=segment_ids.device).expand_as(prefix)
    nothing = torch.zeros_like(prefix)
    rows = []
    for query_step in range(num_steps):
        own_steps = [same_position if key_step <= query_step else nothing for key_step in range(1, num_steps)]
        rows.append(torch.cat([prefix] + own_steps, dim=-1))
    return torch.cat(rows, dim=-2)
