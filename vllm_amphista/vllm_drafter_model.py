"""The Amphista drafter as a vLLM model: Staged Adaptation Layers in paged KV.

Loads the same `model.safetensors` as `modeling_amphista.AmphistaDrafter`.
The stage layers are vLLM's own Llama decoder layers (as in vLLM's EAGLE
drafter), so vLLM's KV cache manager allocates their paged KV cache and
prefix caching, preemption and continuous batching cover them. The
Auto-embedding Block is `modeling_amphista.AutoEmbeddingBlock` itself: it
works on one position per request and keeps no cache.

`forward` runs the stages over every scheduled token and returns both stages'
outputs side by side, `[num_tokens, 2H]`; `draft_token_ids` turns the rows at
each request's last position into K draft tokens in one pass.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama_eagle import LlamaDecoderLayer as DraftLlamaDecoderLayer

from vllm_amphista.modeling_amphista import NUM_STAGES, AmphistaConfig, AutoEmbeddingBlock, draft_logits

# Checkpoint (HF) projection names -> vLLM's fused parameter and shard.
_STACKED_PARAMS = (
    (".q_proj", ".qkv_proj", "q"),
    (".k_proj", ".qkv_proj", "k"),
    (".v_proj", ".qkv_proj", "v"),
    (".gate_proj", ".gate_up_proj", 0),
    (".up_proj", ".gate_up_proj", 1),
)


class _StageLayers(nn.Module):
    """Holds the embedding vLLM's proposer replaces with the target's, and the stage layers."""

    def __init__(self, vllm_config: VllmConfig, config: AmphistaConfig, prefix: str):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        fuse_in = 2 * config.hidden_size if config.use_sampled_token else config.hidden_size
        self.fuse = ReplicatedLinear(
            fuse_in, config.hidden_size, bias=False, params_dtype=vllm_config.model_config.dtype, return_bias=False
        )
        num_stage_layers = NUM_STAGES * config.stage_num_layers if config.use_stages else 0
        # Attention layer names must hold one integer and not clash with the
        # target's, so they continue the target's layer numbering (as EAGLE's do).
        first = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        llama_config = config.to_llama_config()
        self.layers = nn.ModuleList(
            DraftLlamaDecoderLayer(
                vllm_config, disable_input_layernorm=False, prefix=f"{prefix}.layers.{first + i}", config=llama_config
            )
            for i in range(num_stage_layers)
        )


class AmphistaDrafterForVLLM(nn.Module):
    # Read by vLLM's proposer: it shares the target's embedding, and its
    # lm_head too unless the checkpoint has its own (draft vocabulary).
    has_own_embed_tokens = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.speculative_config.draft_model_config.hf_config
        if not isinstance(config, AmphistaConfig):
            raise TypeError(f"expected an AmphistaConfig, got {type(config).__name__}")
        config.validate()
        self.config = config
        self.has_own_lm_head = config.has_own_lm_head
        self.model = _StageLayers(vllm_config, config, prefix="model")
        self.auto_embedding = AutoEmbeddingBlock(config)
        if config.has_own_lm_head:
            self.lm_head = nn.Linear(config.hidden_size, config.output_vocab_size, bias=False)
        if config.draft_vocab_size:
            self.register_buffer("draft_to_target", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        else:
            self.draft_to_target = None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def _run_stage(self, stage: int, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        per_stage = self.config.stage_num_layers
        residual = None
        for layer in self.model.layers[stage * per_stage : (stage + 1) * per_stage]:
            hidden, residual = layer(positions, hidden, residual)
        return hidden + residual

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids[i] is the token sampled after hidden_states[i] -> [N, 2H] stage outputs."""
        if inputs_embeds is not None:
            raise NotImplementedError("the Amphista drafter takes token ids, not embeddings")
        if self.config.use_sampled_token:
            fused = self.model.fuse(torch.cat([self.embed_input_ids(input_ids), hidden_states], dim=-1))
        else:
            fused = self.model.fuse(hidden_states)
        if not self.config.use_stages:
            return torch.cat([fused, fused], dim=-1)
        stage1 = self._run_stage(0, positions, fused)
        stage2 = self._run_stage(1, positions, stage1)
        return torch.cat([stage1, stage2], dim=-1)

    def draft_token_ids(self, stage_outputs: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[B, 2H] stage outputs at each request's last position -> [B, num_tokens] drafts.

        All K heads run (the encoder is bi-directional among them, as trained);
        the first `num_tokens` heads' greedy tokens form the chain.
        """
        stage1, stage2 = stage_outputs.chunk(2, dim=-1)
        heads = self.auto_embedding(stage1, stage2)[:, :num_tokens]
        logits = draft_logits(heads, self.lm_head.weight)[..., : self.config.output_vocab_size]
        token_ids = logits.argmax(dim=-1)
        if self.draft_to_target is not None:
            token_ids = self.draft_to_target[token_ids]
        return token_ids

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        if self.draft_to_target is not None:
            params["draft_to_target"] = self.draft_to_target
        per_stage = self.config.stage_num_layers
        loaded: set[str] = set()
        for name, tensor in weights:
            shard = None
            if name.startswith("stages."):
                _, stage, _, index, rest = name.split(".", 4)
                name = f"model.layers.{int(stage) * per_stage + int(index)}.{rest}"
                for hf_name, vllm_name, shard_id in _STACKED_PARAMS:
                    if hf_name in name:
                        name, shard = name.replace(hf_name, vllm_name), shard_id
                        break
            elif name == "fuse.weight":
                name = "model.fuse.weight"
            elif name not in ("lm_head.weight", "draft_to_target"):
                name = f"auto_embedding.{name}"
            if name not in params:
                raise ValueError(f"Amphista checkpoint has an unexpected tensor {name!r}")
            param = params[name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                weight_loader(param, tensor)
            else:
                weight_loader(param, tensor, shard)
            loaded.add(name)
        # The embedding is the target's, shared after loading.
        missing = {n for n in params if not n.startswith("model.embed_tokens")} - loaded
        if missing:
            raise ValueError(f"Amphista checkpoint lacks {sorted(missing)}")
        return loaded | {n for n in params if n.startswith("model.embed_tokens")}
