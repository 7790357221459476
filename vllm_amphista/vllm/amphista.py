"""Amphista inside vLLM: the drafter model over vLLM's paged KV, and its proposer.

vLLM's EAGLE proposer already does what the Staged Adaptation Layers need:
it feeds a draft model the target's hidden states with the tokens shifted by
one (the token sampled after h_t sits beside h_t), over the draft layers'
own paged KV cache, and finds each request's last valid position after
rejections. We keep all of that and replace only what follows the first
pass: instead of EAGLE's autoregressive loop, the Auto-embedding Block reads
the stage outputs at each request's last position and all K heads give the
chain at once.

Drafts are the heads' greedy tokens, so they are deterministic and no draft
probabilities go to the rejection sampler: greedy verification reproduces
the target's output exactly and sampled verification stays exact.

Why the chain is each head's top-1 and not a top-k search by joint score:
the one pass gives every head's distribution without knowing which tokens
the other heads will propose (the encoder mixes head states, not chosen
tokens), so the drafter's joint belief over a chain is the product of the
heads' marginals. Both the chain's joint score prod_k p_k(x_k) and its
expected accepted length sum_i prod_{k<=i} p_k(x_k) grow with each p_k(x_k)
separately, so both are maximised by each head's own argmax: a top-k search
returns the top-1 chain. A joint choice pays only with passes conditioned
on the chosen tokens, the autoregressive loop Amphista removes.

The drafter model: the Staged Adaptation Layers are vLLM's own Llama decoder
layers (as in vLLM's EAGLE drafter), so vLLM's KV cache manager allocates their
paged KV cache and prefix caching, preemption and continuous batching cover
them. The Auto-embedding Block is `modeling_amphista.AutoEmbeddingBlock`
itself: it works on one position per request and keeps no cache. It loads the
same `model.safetensors` as `modeling_amphista.AmphistaDrafter`.
`forward` runs the stages over every scheduled token and returns both stages'
outputs side by side, `[num_tokens, 2H]`; `draft_token_ids` turns the rows at
each request's last position into K draft tokens in one pass.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama_eagle import LlamaDecoderLayer as DraftLlamaDecoderLayer
from vllm.model_executor.models.utils import maybe_prefix
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_amphista.configuration_amphista import NUM_STAGES, AmphistaConfig
from vllm_amphista.modeling_amphista import AutoEmbeddingBlock, FeatureCombiner
from vllm_amphista.vllm.config import draft_length_mode

# With a load-aware draft length, a request's draft stops where the product of its heads'
# probabilities for their own tokens falls below this: unlikely tokens are not verified for nothing.
MIN_DRAFT_CONFIDENCE = 0.1

# Checkpoint (HF) projection names -> vLLM's fused parameter and shard.
_STACKED_PARAMS = (
    (".q_proj", ".qkv_proj", "q"),
    (".k_proj", ".qkv_proj", "k"),
    (".v_proj", ".qkv_proj", "v"),
    (".gate_proj", ".gate_up_proj", 0),
    (".up_proj", ".gate_up_proj", 1),
)


def _drafter_config(vllm_config: VllmConfig) -> AmphistaConfig:
    config = vllm_config.speculative_config.draft_model_config.hf_config
    if not isinstance(config, AmphistaConfig):
        raise TypeError(f"expected an AmphistaConfig, got {type(config).__name__}")
    config.validate()
    return config


def _replicated_linear(vllm_config: VllmConfig):
    """Bias-free linear layers, whole on every tensor-parallel rank, as vLLM builds them (on CPU
    they prepack their weights for oneDNN / the platform's GEMM)."""
    dtype = vllm_config.model_config.dtype

    def make(in_features: int, out_features: int) -> ReplicatedLinear:
        return ReplicatedLinear(in_features, out_features, bias=False, params_dtype=dtype, return_bias=False)

    return make


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "hidden_states": 0})
class AmphistaStages(nn.Module):
    """Fusion of h_t with the sampled token's embedding, then the Staged Adaptation Layers over
    every scheduled token, in vLLM's paged KV; compiled with the target as vLLM's EAGLE model is."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", start_layer_id: int = 0):
        super().__init__()
        config = _drafter_config(vllm_config)
        self.config = config
        # Replaced by the target's embedding when the proposer loads the drafter.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        fuse_in = 2 * config.hidden_size if config.use_sampled_token else config.hidden_size
        self.fuse = _replicated_linear(vllm_config)(fuse_in, config.hidden_size)
        num_stage_layers = NUM_STAGES * config.stage_num_layers if config.use_stages else 0
        # Attention layer names must hold one integer and not clash with the
        # target's, so they continue the target's layer numbering (as EAGLE's do).
        llama_config = config.to_llama_config()
        self.layers = nn.ModuleList(
            DraftLlamaDecoderLayer(vllm_config, disable_input_layernorm=False,
                                   prefix=f"{prefix}.layers.{start_layer_id + i}", config=llama_config)
            for i in range(num_stage_layers)
        )

    def _run_stage(self, stage: int, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        per_stage = self.config.stage_num_layers
        residual = None
        for layer in self.layers[stage * per_stage: (stage + 1) * per_stage]:
            hidden, residual = layer(positions, hidden, residual)
        return hidden + residual

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """input_ids[i] is the token sampled after hidden_states[i] -> [N, 2H] both stages' outputs."""
        if self.config.use_sampled_token:
            fused = self.fuse(torch.cat([self.embed_tokens(input_ids), hidden_states], dim=-1))
        else:
            fused = self.fuse(hidden_states)
        if not self.config.use_stages:
            return torch.cat([fused, fused], dim=-1)
        stage1 = self._run_stage(0, positions, fused)
        return torch.cat([stage1, self._run_stage(1, positions, stage1)], dim=-1)


@support_torch_compile(dynamic_arg_dims={"stage_outputs": 0})
class AmphistaHeads(nn.Module):
    """The Auto-embedding Block on each request's last position: [B, 2H] stage outputs -> [B, K, H]."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.block = AutoEmbeddingBlock(_drafter_config(vllm_config), _replicated_linear(vllm_config))

    def forward(self, stage_outputs: torch.Tensor) -> torch.Tensor:
        stage1, stage2 = stage_outputs.chunk(2, dim=-1)
        return self.block(stage1, stage2)


class AmphistaDrafterForVLLM(nn.Module):
    # Read by vLLM's proposer: it shares the target's embedding, and its
    # lm_head too unless the checkpoint has its own (draft vocabulary).
    has_own_embed_tokens = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = _drafter_config(vllm_config)
        self.config = config
        self.vllm_config = vllm_config
        self.has_own_lm_head = config.has_own_lm_head
        self.model = AmphistaStages(
            vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
            start_layer_id=vllm_config.model_config.get_num_layers(vllm_config.parallel_config))
        self.heads = AmphistaHeads(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "heads"))
        # Heads that read several target layers get them from vLLM as its auxiliary hidden states
        # (the runner concatenates them), and combine them to one row per token before the stages.
        self.combine = (FeatureCombiner(config, _replicated_linear(vllm_config))
                        if config.target_feature_layers else None)
        if config.has_own_lm_head:
            # A draft vocabulary is small: whole on every rank, so no gather is needed.
            self.lm_head = _replicated_linear(vllm_config)(config.hidden_size, config.output_vocab_size)
        # The shared lm_head is the target's, split by vocabulary across tensor-parallel
        # ranks: vLLM's logits processor gathers the slices.
        self.logits_processor = LogitsProcessor(config.vocab_size)
        if config.draft_vocab_size:
            self.register_buffer("draft_to_target", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        else:
            self.draft_to_target = None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

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
        return self.model(input_ids, positions, hidden_states)

    def compute_logits(self, head_features: torch.Tensor) -> torch.Tensor:
        """[M, H] -> [M, V_draft] logits over the drafter's vocabulary, whole on every rank."""
        if self.has_own_lm_head:
            return self.lm_head(head_features)
        return self.logits_processor(self.lm_head, head_features)

    def draft(self, stage_outputs: torch.Tensor, num_tokens: int,
              with_confidence: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, 2H] stage outputs at each request's last position -> ([B, num_tokens] draft token ids,
        [B, num_tokens] each head's probability of its own draft, or None without `with_confidence`:
        the softmax's logsumexp over the draft vocabulary is then skipped).

        All K heads run (the encoder is bi-directional among them, as trained);
        the first `num_tokens` heads' greedy tokens form the chain.
        """
        batch = stage_outputs.shape[0]
        with set_forward_context(None, self.vllm_config, num_tokens=batch):
            heads = self.heads(stage_outputs)[:, :num_tokens]
        # fp32: the argmax of bf16 logits is several times slower on CPU, and the softmax needs it.
        logits = self.compute_logits(heads.reshape(batch * num_tokens, -1)).float()
        best, token_ids = logits.max(dim=-1)
        confidence = None
        if with_confidence:
            confidence = torch.exp(best - torch.logsumexp(logits, dim=-1)).view(batch, num_tokens)
        if self.draft_to_target is not None:
            token_ids = self.draft_to_target[token_ids]
        return token_ids.view(batch, num_tokens), confidence

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
            elif name not in ("lm_head.weight", "draft_to_target") and not name.startswith("combine."):
                name = f"heads.block.{name}"
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


class AmphistaProposer(EagleProposer):
    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        # Per-request lengths need list drafts; async scheduling reads them as one [B, K] tensor.
        self.truncate_drafts = (draft_length_mode(vllm_config.speculative_config) == "adaptive"
                                and not vllm_config.scheduler_config.async_scheduling)

    def propose(self, num_speculative_tokens: int, *args, **kwargs) -> torch.Tensor | list[list[int]]:
        token_ids, confidence = self.draft_with_confidence(num_speculative_tokens, *args,
                                                           with_confidence=self.truncate_drafts, **kwargs)
        if not self.truncate_drafts:
            return token_ids
        lengths = (confidence.cumprod(dim=1) >= MIN_DRAFT_CONFIDENCE).sum(dim=1).tolist()
        return [row[:length] for row, length in zip(token_ids.tolist(), lengths)]

    def draft_with_confidence(
        self,
        num_speculative_tokens,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings=None,
        with_confidence: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, K] draft token ids, [B, K] each head's probability of its own token, or None
        without `with_confidence`)."""
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        if self.model.combine is not None:  # [N, n*H] target layers -> [N, H], as EAGLE-3 combines them
            target_hidden_states = self.model.combine(target_hidden_states)
        # The first pass of SpecDecodeBaseProposer.propose: the stages see every
        # scheduled token and write their KV.
        num_tokens, token_indices_to_sample, common_attn_metadata = self.set_inputs_first_pass(
            target_token_ids=target_token_ids,
            next_token_ids=next_token_ids,
            target_positions=target_positions,
            target_hidden_states=target_hidden_states,
            token_indices_to_sample=token_indices_to_sample,
            cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        _, per_layer_attn_metadata = self.build_per_group_and_layer_attn_metadata(common_attn_metadata)
        cudagraph_runtime_mode, num_input_tokens, num_tokens_across_dp = self._determine_batch_execution_and_padding(
            num_tokens
        )
        model_kwargs, slot_mapping_size = self.build_model_inputs_first_pass(num_tokens, num_input_tokens, None)
        with set_forward_context(
            per_layer_attn_metadata,
            self.vllm_config,
            num_tokens=num_input_tokens,
            num_tokens_across_dp=num_tokens_across_dp,
            cudagraph_runtime_mode=cudagraph_runtime_mode,
            slot_mapping=self._get_slot_mapping(slot_mapping_size, common_attn_metadata.slot_mapping),
        ):
            stage_outputs = self.model(**model_kwargs)
        last_positions = stage_outputs[token_indices_to_sample]
        if num_speculative_tokens == 0:  # dynamic speculation chose K=0; the KV above stays in sync
            empty = last_positions.new_empty(last_positions.shape[0], 0)
            return empty.long(), empty.float() if with_confidence else None
        return self.model.draft(last_positions, num_speculative_tokens, with_confidence)

    def dummy_run(self, num_tokens: int, *args, **kwargs) -> None:
        super().dummy_run(num_tokens, *args, **kwargs)
        # The heads run on each request's last position only: warm them (and compile them, in a
        # compiled engine) at start-up too, not at the first request.
        batch = min(num_tokens, self.max_batch_size)
        self.model.draft(self.hidden_states.new_zeros(batch, 2 * self.hidden_size), self.num_speculative_tokens)
