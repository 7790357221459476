"""The DFlash baseline (arXiv 2602.06036): a block drafter in the format vLLM's own `dflash` method loads.

vLLM 0.32 (`model_executor/models/qwen3_dflash.py`, `v1/spec_decode/dflash.py`)
drafts K tokens in one pass. After the target samples x_p, the drafter's
queries are the block [x_p, MASK x K] at positions p..p+K; its context is the
target's residual streams at every earlier position (vLLM's auxiliary hidden
states of the listed layers), combined as c = hidden_norm(fc(streams)) and
projected by each drafter layer's own k/v weights (no input norm; k per-head
normalised and rotated, at the context positions) into that layer's paged KV.
Inside a layer, Qwen3-style: the block is normalised, projected to q/k/v with
per-head q/k RMSNorm and RoPE (neox), and every block query attends to the
whole context and to every slot of its own block (non-causal); then the MLP.
The final norm and the lm_head give the drafts at slots 1..K (argmax): slot k
drafts x_{p+k}. The mask slots are embedded by a trained vector
(`mask_embedding.pt`, which vLLM puts in place of `mask_token_id`'s row); the
target's embedding and, over a draft vocabulary, the rows of its lm_head are
used frozen, as the Amphista heads use them.

Training: every target output position p whose next tokens are the target's
outputs is an anchor; `anchors` of them per packed row (a random choice per
step) train slots 1..K on x_{p+1..p+K}, head k's loss weighted decay**k as
for the heads.

The ids: `target_feature_layers` here are vLLM's auxiliary-state ids (the
stream after that many layers, as for Amphista), written as the 0-based
`target_layer_ids` DFlash's config uses (vLLM adds one).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from vllm_amphista.checkpoint import CONFIG_NAME, WEIGHTS_NAME, check_weights_match, load_weights, save_weights
from vllm_amphista.train.batch import IGNORE_INDEX, Batch, DraftVocab
from vllm_amphista.train.drafter import DraftMethod, id_list, id_tensor, read_json
from vllm_amphista.train.target import Target

MASK_EMBEDDING_NAME = "mask_embedding.pt"  # the file name vLLM's DFlash loader reads
INIT_STD = 0.02


class DFlashLayer(nn.Module):
    """One Qwen3 decoder layer whose block queries attend to the context's and their own block's keys."""

    def __init__(self, config):
        super().__init__()
        hidden, self.num_heads, self.num_kv_heads = config.hidden_size, config.num_attention_heads, \
            config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        eps = config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.self_attn = nn.Module()
        attn = self.self_attn
        attn.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        attn.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        attn.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        attn.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        attn.q_norm = LlamaRMSNorm(self.head_dim, eps=eps)
        attn.k_norm = LlamaRMSNorm(self.head_dim, eps=eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)

    def _heads(self, projection: nn.Linear, norm: nn.Module | None, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        heads = projection(x).unflatten(-1, (num_heads, self.head_dim))
        return heads if norm is None else norm(heads)

    def context_kv(self, context: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """[T, H] combined context -> rotated keys and values, [T, kv_heads, head_dim] each."""
        attn = self.self_attn
        keys = self._heads(attn.k_proj, attn.k_norm, context, self.num_kv_heads)
        keys = _rotate(keys, rope)
        return keys, self._heads(attn.v_proj, None, context, self.num_kv_heads)

    def forward(self, block: torch.Tensor, block_rope, context_keys, context_values, context_visible):
        """block [N, S, H] (N anchors of S = K+1 slots); context keys/values [T, kv, d];
        context_visible [N, T] -> [N, S, H]."""
        attn = self.self_attn
        x = self.input_layernorm(block)
        queries = _rotate(self._heads(attn.q_proj, attn.q_norm, x, self.num_heads), block_rope)
        keys = _rotate(self._heads(attn.k_proj, attn.k_norm, x, self.num_kv_heads), block_rope)
        values = self._heads(attn.v_proj, None, x, self.num_kv_heads)
        group = self.num_heads // self.num_kv_heads
        scale = self.head_dim ** -0.5
        context_keys, context_values = (t.repeat_interleave(group, dim=1) for t in (context_keys, context_values))
        keys, values = (t.repeat_interleave(group, dim=2) for t in (keys, values))
        context_scores = torch.einsum("nshd,thd->nsht", queries, context_keys.to(queries.dtype)) * scale
        context_scores = context_scores.masked_fill(~context_visible[:, None, None, :], float("-inf"))
        block_scores = torch.einsum("nshd,nuhd->nshu", queries, keys) * scale
        weights = torch.softmax(torch.cat([context_scores, block_scores], dim=-1).float(), dim=-1).to(values.dtype)
        num_context = context_keys.shape[0]
        attended = (torch.einsum("nsht,thd->nshd", weights[..., :num_context], context_values.to(values.dtype))
                    + torch.einsum("nshu,nuhd->nshd", weights[..., num_context:], values))
        block = block + attn.o_proj(attended.flatten(-2))
        x = self.post_attention_layernorm(block)
        return block + self.mlp.down_proj(F.silu(self.mlp.gate_proj(x)) * self.mlp.up_proj(x))


def _rotate(heads: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE (neox layout, as vLLM's default) on [..., L, heads, d] with cos/sin [..., L, d]."""
    cos, sin = (t.unsqueeze(-2).to(heads.dtype) for t in rope)
    return heads * cos + rotate_half(heads) * sin


class DFlashMethod(DraftMethod):
    name = "dflash"

    def __init__(self, target_config, feature_layers: list[int], num_steps: int, num_layers: int,
                 draft_to_target: torch.Tensor | None, mask_token_id: int, anchors: int = 256,
                 target_lm_head: torch.Tensor | None = None):
        super().__init__()
        if not feature_layers or feature_layers != sorted(set(feature_layers)) or feature_layers[0] < 1 \
                or feature_layers[-1] > target_config.num_hidden_layers:
            raise ValueError(f"DFlash reads ascending target layers in 1..{target_config.num_hidden_layers}: give "
                             f"--target-feature-layers (got {feature_layers})")
        rope_type = (getattr(target_config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"the DFlash export writes default RoPE; this target's is {rope_type!r}")
        self.target_config = target_config
        self.feature_layers, self.num_heads, self.num_layers = list(feature_layers), num_steps, num_layers
        self.mask_token_id, self.anchors = mask_token_id, anchors
        hidden = target_config.hidden_size
        self.vocab = self.loss_vocab = DraftVocab(draft_to_target, target_config.vocab_size)
        self.fc = nn.Linear(len(feature_layers) * hidden, hidden, bias=False)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=target_config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(target_config) for _ in range(num_layers))
        self.norm = LlamaRMSNorm(hidden, eps=target_config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.empty(hidden))
        # Over a draft vocabulary vLLM reads an own lm_head: the target's rows, kept frozen.
        self.lm_head = None
        if draft_to_target is not None:
            self.lm_head = nn.Linear(hidden, len(draft_to_target), bias=False).requires_grad_(False)
        object.__setattr__(self, "rotary_emb", LlamaRotaryEmbedding(target_config))
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=INIT_STD)
            nn.init.normal_(self.mask_embedding, std=INIT_STD)
            if self.lm_head is not None and target_lm_head is not None:
                self.lm_head.weight.copy_(self.vocab.rows(target_lm_head))

    @classmethod
    def create(cls, target: Target, draft_to_target, feature_layers, num_steps=4, num_layers=2, mask_token_id=0,
               anchors=256) -> DFlashMethod:
        return cls(target.config, feature_layers, num_steps, num_layers, draft_to_target, mask_token_id, anchors,
                   target.lm_head_weight)

    def build_spec(self) -> dict:
        return {"feature_layers": self.feature_layers, "num_steps": self.num_heads, "num_layers": self.num_layers,
                "draft_to_target": id_list(self.vocab.draft_to_target), "mask_token_id": self.mask_token_id,
                "anchors": self.anchors}

    @classmethod
    def from_spec(cls, spec: dict, target: Target) -> DFlashMethod:
        return cls(target.config, spec["feature_layers"], spec["num_steps"], spec["num_layers"],
                   id_tensor(spec["draft_to_target"]), spec["mask_token_id"], spec["anchors"], target.lm_head_weight)

    def vocab_weight(self, target: Target) -> torch.Tensor:
        return target.lm_head_weight if self.lm_head is None else self.lm_head.weight

    def loss_vocab_weight(self, target: Target) -> torch.Tensor:
        return self.vocab_weight(target)  # already the draft vocabulary's rows

    def head_features(self, batch: Batch, target: Target, rows: torch.Tensor) -> torch.Tensor:
        """[M, K, H] final-norm outputs of the mask slots, for the anchors p = t + 1 of the `rows` t
        (row-major, as `batch.labels[rows]`)."""
        steps = self.num_heads
        context = self.hidden_norm(self.fc(batch.hidden.to(self.fc.weight.dtype)))
        features = []
        for row in range(batch.token_ids.shape[0]):
            anchors = rows[row].nonzero().squeeze(-1) + 1
            if anchors.numel() == 0:
                continue
            context_rope = self.rotary_emb(context[row], batch.position_ids[row][None])
            context_rope = tuple(t[0] for t in context_rope)
            context_kv = [layer.context_kv(context[row], context_rope) for layer in self.layers]
            # Anchor p sees the context positions of its own sample before it.
            index = torch.arange(batch.token_ids.shape[1], device=anchors.device)
            segment = batch.segment_ids[row]
            visible = (index[None, :] < anchors[:, None]) & (segment[None, :] == segment[anchors][:, None])
            block_ids = batch.token_ids[row, anchors]
            embeds = F.embedding(block_ids, target.embed_weight).to(self.fc.weight.dtype)
            block = torch.cat([embeds[:, None], self.mask_embedding.to(embeds.dtype).expand(len(anchors), steps, -1)],
                              dim=1)
            positions = batch.position_ids[row, anchors][:, None] + torch.arange(steps + 1, device=anchors.device)
            block_rope = self.rotary_emb(block, positions)
            for layer, (keys, values) in zip(self.layers, context_kv):
                block = layer(block, block_rope, keys, values, visible)
            features.append(self.norm(block[:, 1:]))
        return torch.cat(features)

    def training_loss(self, batch, target, head_weights, objective, valid_prefix=False):
        """The heads' loss at `anchors` random anchors per packed row."""
        # Labels stop 2 positions before a sample's end, so every anchor t + 1 lies inside its sample.
        rows = (batch.labels != IGNORE_INDEX).any(dim=-1)
        chosen = torch.zeros_like(rows)
        for row in range(rows.shape[0]):
            candidates = rows[row].nonzero().squeeze(-1)
            # Drawn from the CPU generator, whose state the resumable checkpoint keeps.
            pick = candidates[torch.randperm(len(candidates))[:self.anchors].to(candidates.device)]
            chosen[row, pick] = True
        logits = F.linear(self.head_features(batch, target, chosen), self.loss_vocab_weight(target))
        return self.loss_from_logits(logits, batch, chosen, head_weights, objective, valid_prefix)

    def config_dict(self) -> dict:
        config = self.target_config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope_theta = float((getattr(config, "rope_parameters", None) or {}).get(
            "rope_theta", getattr(config, "rope_theta", 10000.0)))
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": config.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": head_dim, "intermediate_size": config.intermediate_size, "hidden_act": "silu",
            "rms_norm_eps": config.rms_norm_eps, "vocab_size": config.vocab_size,
            "draft_vocab_size": self.vocab.size, "max_position_embeddings": config.max_position_embeddings,
            "attention_bias": False, "tie_word_embeddings": False, "rope_theta": rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": [layer - 1 for layer in self.feature_layers], "causal": False},
            # Not read by vLLM: what this pipeline needs to load and evaluate the drafter.
            "num_speculative_tokens": self.num_heads, "dflash_train_anchors": self.anchors,
        }

    def save(self, directory, dtype=torch.bfloat16):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.config_dict()
        config["dtype"] = str(dtype).removeprefix("torch.")
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        tensors = {name: tensor for name, tensor in self.state_dict().items() if name != "mask_embedding"}
        if self.vocab.draft_to_target is not None:
            # vLLM's draft-to-target map holds offsets: target id = draft id + d2t.
            tensors["d2t"] = self.vocab.draft_to_target - torch.arange(self.vocab.size)
        save_weights(tensors, directory, dtype)
        torch.save({"mask_token_id": self.mask_token_id, "embedding": self.mask_embedding.detach().to(dtype)},
                   directory / MASK_EMBEDDING_NAME)

    @classmethod
    def load(cls, directory: Path, target: Target) -> DFlashMethod:
        config = read_json(directory / CONFIG_NAME)
        needed = ("num_speculative_tokens", "dflash_train_anchors", "dflash_config")
        if any(key not in config for key in needed) or not (directory / MASK_EMBEDDING_NAME).is_file():
            raise ValueError(f"{directory}: not a DFlash drafter written by `train fit --method dflash` (its "
                             f"config.json needs {list(needed)}, and {MASK_EMBEDDING_NAME} must be there)")
        target.check_matches(config["hidden_size"], config["vocab_size"], str(directory))
        tensors = {name: tensor for name, tensor in load_weights(directory).items()}
        draft_to_target = None
        if "d2t" in tensors:
            offsets = tensors.pop("d2t")
            draft_to_target = offsets.long() + torch.arange(len(offsets))
        method = cls(target.config, [layer + 1 for layer in config["dflash_config"]["target_layer_ids"]],
                     config["num_speculative_tokens"], config["num_hidden_layers"], draft_to_target,
                     config["dflash_config"]["mask_token_id"], config["dflash_train_anchors"])
        tensors["mask_embedding"] = torch.load(directory / MASK_EMBEDDING_NAME)["embedding"]
        tensors = {name: tensor.float() for name, tensor in tensors.items()}
        check_weights_match(method.state_dict(), tensors, str(directory / WEIGHTS_NAME))
        method.load_state_dict(tensors)
        return method


def unused_token_id(samples, vocab_size: int, special_ids: list[int]) -> int:
    """The mask slots' marker: vLLM embeds every occurrence of it by the trained mask embedding, so
    the target should never produce it. The first of the tokenizer's special ids (`special_ids`, the
    end-of-sequence ones left out) that no sample holds, else the largest id no sample holds."""
    seen = {token for sample in samples for token in sample.token_ids}
    candidates = [*special_ids, *range(vocab_size - 1, -1, -1)]
    return next(token for token in candidates if token not in seen and token < vocab_size)
