"""The Amphista drafter (arXiv 2406.13170) as a plain PyTorch module.

Amphista drafts K tokens at once with K heads, like Medusa, but the heads
cooperate: an Auto-embedding Block lets them attend to each other
(bi-directionally), and Staged Adaptation Layers turn the target's hidden
states, which were trained for next-token prediction, into features suited to
predicting tokens further ahead. This module is the training-side reference;
the vLLM-side model loads the same ``model.safetensors``. It imports torch,
transformers, safetensors and ``amphista_kernels``, never vllm.

Data flow at sequence position t (target hidden state h_t, and x_{t+1}, the
token the target sampled from h_t)::

    fused_t   = fuse([embed(x_{t+1}), h_t])                  # [H]
    stage1    = stage 0 decoder layers over fused   (causal over positions)
    stage2    = stage 1 decoder layers over stage1  (causal over positions)
    head k    = head_proj_k(stage1_t if k < num_near_heads else stage2_t)
                + position_embedding[k]                      # [K, H]
    heads     = encoder(heads)    (bi-directional among the K heads of t only)
    logits_k  = lm_head(final_norm(heads_k))  predicts x_{t+2+k}

Choices for what the paper leaves open, and why
-----------------------------------------------
* Sampled-token fusion: concatenate the token embedding (first) with h_t and
  project 2H -> H with one bias-free linear layer, as EAGLE does. It is the
  cheapest fusion that keeps both inputs intact, and EAGLE showed that the
  sampled token removes most of the uncertainty about where the text goes.
* Stages: standard Llama decoder layers (RMSNorm, RoPE, GQA attention, SwiGLU)
  built from the target's own shapes with transformers' ``LlamaDecoderLayer``.
  vLLM already has fast, KV-cached kernels for exactly these layers, so the
  vLLM side can reuse its own ``LlamaDecoderLayer`` with stacked q/k/v and
  gate/up weights. Attention is causal over positions, like the target's.
* Near/far split: the first ``num_near_heads`` heads (default K//2) read stage
  1's output, the rest read stage 2's. Tokens further ahead need more
  adaptation from next-token features, so they get the deeper stage.
* Auto-embedding Block: one bias-free ``Linear(H -> K*H)`` gives every head its
  own projection of its stage's output; a learnable ``[K, H]`` position
  embedding tells the heads apart; then pre-norm encoder layers (RMSNorm,
  fused qkv attention without RoPE, SiLU MLP, residuals) attend over the K
  heads of one sequence position only, via
  ``amphista_kernels.bidirectional_head_attention``. The heads never see other
  positions or requests, so drafting the last position of a request needs
  nothing but that position's stage outputs.
* Vocabulary projection: ``final_norm`` then, by default, the target's own
  lm_head (shared, not saved): it is the largest matrix in the drafter and the
  target's already maps these features to tokens. With ``draft_vocab_size`` N
  the drafter owns an ``[N, H]`` lm_head over the N most frequent tokens
  (initialised from the target's rows); ``draft_to_target`` maps draft ids back
  to target ids. This cuts the K * V projection, which dominates drafting and
  training cost for large vocabularies.
* Initialisation: every residual branch (stage o_proj/down_proj, encoder
  o_proj/down_proj) starts at zero, ``head_proj`` starts as K identities and
  ``fuse`` starts as "pass h_t through", so an untrained drafter behaves like
  the target's own next-token head. Training starts from a sensible predictor
  instead of noise, which matters for short CPU training runs.

Ablations (config switches): ``use_sampled_token=False`` fuses h_t alone
(``Linear(H -> H)``); ``use_stages=False`` drops the stage layers and every
head reads the fused input; ``use_encoder=False`` drops the encoder, leaving
independent heads as in Medusa (the position embedding is then just a per-head
bias).

Checkpoint names: the Auto-embedding Block's parameters are saved without a
prefix (``head_proj.weight``, ``position_embedding``, ``encoder.*``,
``final_norm.weight``), so ``AutoEmbeddingBlock.load_state_dict`` accepts them
as they are; see ``AmphistaDrafter.checkpoint_state_dict``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from amphista_kernels import bidirectional_head_attention, bidirectional_head_attention_reference
from amphista_kernels.head_attention import MAX_HEAD_POSITIONS, SUPPORTED_HEAD_DIMS

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
AUTO_EMBEDDING_PREFIX = "auto_embedding."
NUM_STAGES = 2
# Encoder heads of this size suit the bi-directional head-attention kernel.
PREFERRED_ENCODER_HEAD_DIM = 64
INIT_STD = 0.02


def _target_rope_theta(text_config: PretrainedConfig) -> float:
    # transformers 5 keeps rope_theta inside rope_parameters; older configs
    # have it at the top level.
    rope_parameters = getattr(text_config, "rope_parameters", None) or {}
    return float(rope_parameters.get("rope_theta", getattr(text_config, "rope_theta", 10000.0)))


class AmphistaConfig(PretrainedConfig):
    """Configuration of an Amphista drafter; see the module docstring for the parts."""

    model_type = "amphista"

    def __init__(
        self,
        hidden_size: int = 4096,
        vocab_size: int = 32000,
        num_draft_heads: int = 4,
        num_near_heads: int | None = None,
        stage_num_layers: int = 1,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int = 11008,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 4096,
        encoder_num_layers: int = 1,
        encoder_num_attention_heads: int | None = None,
        encoder_ffn_size: int | None = None,
        share_lm_head: bool = True,
        draft_vocab_size: int = 0,
        use_encoder: bool = True,
        use_stages: bool = True,
        use_sampled_token: bool = True,
        target_model_type: str | None = None,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_draft_heads = num_draft_heads
        self.num_near_heads = num_draft_heads // 2 if num_near_heads is None else num_near_heads
        self.stage_num_layers = stage_num_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = (
            num_attention_heads if num_key_value_heads is None else num_key_value_heads
        )
        self.head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.encoder_num_layers = encoder_num_layers
        if encoder_num_attention_heads is None:
            encoder_num_attention_heads = (
                hidden_size // PREFERRED_ENCODER_HEAD_DIM
                if hidden_size % PREFERRED_ENCODER_HEAD_DIM == 0
                else num_attention_heads
            )
        self.encoder_num_attention_heads = encoder_num_attention_heads
        self.encoder_ffn_size = intermediate_size if encoder_ffn_size is None else encoder_ffn_size
        self.share_lm_head = share_lm_head
        self.draft_vocab_size = draft_vocab_size
        self.use_encoder = use_encoder
        self.use_stages = use_stages
        self.use_sampled_token = use_sampled_token
        self.target_model_type = target_model_type
        kwargs.setdefault("architectures", ["AmphistaDrafter"])
        super().__init__(**kwargs)
        self.validate()

    @property
    def has_own_lm_head(self) -> bool:
        """Whether the drafter saves its own lm_head instead of using the target's."""
        return not self.share_lm_head or self.draft_vocab_size > 0

    @property
    def output_vocab_size(self) -> int:
        """Size of the drafter's logits: the draft vocabulary, or the target's."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def encoder_head_dim(self) -> int:
        return self.hidden_size // self.encoder_num_attention_heads

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        def require(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(f"invalid AmphistaConfig: {message}")

        require(self.hidden_size >= 1, f"hidden_size must be >= 1, got {self.hidden_size}")
        require(self.vocab_size >= 1, f"vocab_size must be >= 1, got {self.vocab_size}")
        require(
            1 <= self.num_draft_heads <= MAX_HEAD_POSITIONS,
            f"num_draft_heads must be in 1..{MAX_HEAD_POSITIONS}, got {self.num_draft_heads}",
        )
        require(
            0 <= self.num_near_heads <= self.num_draft_heads,
            f"num_near_heads must be in 0..num_draft_heads={self.num_draft_heads}, "
            f"got {self.num_near_heads}",
        )
        require(
            0 <= self.draft_vocab_size <= self.vocab_size,
            f"draft_vocab_size must be in 0..vocab_size={self.vocab_size} (0 = full vocab), "
            f"got {self.draft_vocab_size}",
        )
        require(self.hidden_act in ACT2FN, f"unknown hidden_act {self.hidden_act!r}")
        if self.use_stages:
            require(
                self.stage_num_layers >= 1,
                f"stage_num_layers must be >= 1 when use_stages, got {self.stage_num_layers}",
            )
            require(
                self.num_attention_heads >= 1
                and self.num_key_value_heads >= 1
                and self.num_attention_heads % self.num_key_value_heads == 0,
                f"num_attention_heads ({self.num_attention_heads}) must be a positive multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})",
            )
        if self.use_encoder:
            require(
                self.encoder_num_layers >= 1,
                f"encoder_num_layers must be >= 1 when use_encoder, got {self.encoder_num_layers}",
            )
            require(
                self.encoder_num_attention_heads >= 1
                and self.hidden_size % self.encoder_num_attention_heads == 0,
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"encoder_num_attention_heads ({self.encoder_num_attention_heads})",
            )
            require(
                self.encoder_head_dim in SUPPORTED_HEAD_DIMS,
                f"encoder head dim hidden_size/encoder_num_attention_heads = "
                f"{self.encoder_head_dim} must be one of {SUPPORTED_HEAD_DIMS}",
            )

    @classmethod
    def from_target_config(cls, target_hf_config: PretrainedConfig, **overrides) -> AmphistaConfig:
        """Build a config whose shapes (and stage-layer shapes) follow the target's."""
        text_config = target_hf_config.get_text_config()
        fields = dict(
            hidden_size=text_config.hidden_size,
            vocab_size=text_config.vocab_size,
            num_attention_heads=text_config.num_attention_heads,
            num_key_value_heads=getattr(text_config, "num_key_value_heads", None),
            head_dim=getattr(text_config, "head_dim", None),
            intermediate_size=text_config.intermediate_size,
            hidden_act=getattr(text_config, "hidden_act", "silu"),
            rms_norm_eps=getattr(text_config, "rms_norm_eps", 1e-6),
            rope_theta=_target_rope_theta(text_config),
            max_position_embeddings=text_config.max_position_embeddings,
            target_model_type=text_config.model_type,
        )
        fields.update(overrides)
        return cls(**fields)

    def to_llama_config(self) -> LlamaConfig:
        """The LlamaConfig the stage decoder layers are built from."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=NUM_STAGES * self.stage_num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            vocab_size=self.vocab_size,
            attention_bias=False,
            mlp_bias=False,
            attn_implementation="sdpa",
        )


def _init_linear(layer: nn.Linear, zero: bool = False) -> None:
    if zero:
        nn.init.zeros_(layer.weight)
    else:
        nn.init.normal_(layer.weight, std=INIT_STD)


class HeadEncoderAttention(nn.Module):
    """Multi-head attention across the K heads of each sequence position."""

    def __init__(self, config: AmphistaConfig):
        super().__init__()
        self.num_heads = config.encoder_num_attention_heads
        self.head_dim = config.encoder_head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, heads: torch.Tensor) -> torch.Tensor:
        num_positions, num_draft_heads, hidden_size = heads.shape
        qkv = self.qkv_proj(heads).view(
            num_positions, num_draft_heads, 3, self.num_heads, self.head_dim
        )
        query, key, value = qkv.unbind(dim=2)
        # The Triton kernel has no backward pass; train through the torch
        # reference, which computes the same function.
        attend = (
            bidirectional_head_attention_reference
            if torch.is_grad_enabled() and heads.requires_grad
            else bidirectional_head_attention
        )
        attended = attend(query, key, value)
        return self.o_proj(attended.reshape(num_positions, num_draft_heads, hidden_size))


class HeadEncoderMLP(nn.Module):
    def __init__(self, config: AmphistaConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.encoder_ffn_size, bias=False)
        self.down_proj = nn.Linear(config.encoder_ffn_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(hidden)))


class HeadEncoderLayer(nn.Module):
    """Pre-norm transformer encoder layer over the K head positions."""

    def __init__(self, config: AmphistaConfig):
        super().__init__()
        self.norm1 = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = HeadEncoderAttention(config)
        self.norm2 = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = HeadEncoderMLP(config)

    def forward(self, heads: torch.Tensor) -> torch.Tensor:
        heads = heads + self.attn(self.norm1(heads))
        return heads + self.mlp(self.norm2(heads))


class HeadEncoder(nn.Module):
    def __init__(self, config: AmphistaConfig):
        super().__init__()
        self.layers = nn.ModuleList(HeadEncoderLayer(config) for _ in range(config.encoder_num_layers))

    def forward(self, heads: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            heads = layer(heads)
        return heads


class AutoEmbeddingBlock(nn.Module):
    """Per-head projections, head position embedding, bi-directional encoder and final norm.

    Works on single positions (``N`` rows, from any mix of requests), so the
    vLLM proposer can run it on just the last position of each request.
    """

    def __init__(self, config: AmphistaConfig):
        super().__init__()
        self.num_draft_heads = config.num_draft_heads
        self.num_near_heads = config.num_near_heads
        self.hidden_size = config.hidden_size
        self.head_proj = nn.Linear(config.hidden_size, config.num_draft_heads * config.hidden_size, bias=False)
        self.position_embedding = nn.Parameter(torch.empty(config.num_draft_heads, config.hidden_size))
        self.encoder = HeadEncoder(config) if config.use_encoder else None
        self.final_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, stage1_out: torch.Tensor, stage2_out: torch.Tensor) -> torch.Tensor:
        """[N, H], [N, H] -> [N, K, H] normalised head features."""
        # Slice the projection instead of projecting both inputs for all heads.
        near_rows = self.num_near_heads * self.hidden_size
        near = F.linear(stage1_out, self.head_proj.weight[:near_rows])
        far = F.linear(stage2_out, self.head_proj.weight[near_rows:])
        heads = torch.cat([near, far], dim=-1).view(-1, self.num_draft_heads, self.hidden_size)
        heads = heads + self.position_embedding
        if self.encoder is not None:
            heads = self.encoder(heads)
        return self.final_norm(heads)


def draft_logits(head_hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """[N, K, H] head features -> [N, K, V] logits with the given vocabulary matrix."""
    return F.linear(head_hidden, lm_head_weight.to(head_hidden.dtype))


class AdaptationStage(nn.Module):
    """Llama decoder layers, causal over sequence positions."""

    def __init__(self, llama_config: LlamaConfig, num_layers: int, first_layer_idx: int):
        super().__init__()
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(llama_config, layer_idx=first_layer_idx + i) for i in range(num_layers)
        )

    def forward(
        self,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=attention_mask, position_embeddings=position_embeddings)
        return hidden


def causal_attention_mask(padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[B, T] (1 = real token) -> [B, 1, T, T] boolean "may attend" mask, or
    None for "plain causal" (SDPA's own causal path)."""
    if padding_mask is None:
        return None
    seq_len = padding_mask.shape[-1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=padding_mask.device).tril()
    allowed = causal & padding_mask.bool()[:, None, None, :]
    # Each query may always see itself, so padded rows are never fully masked (NaN).
    return allowed | torch.eye(seq_len, dtype=torch.bool, device=padding_mask.device)


def _embedding_weight(embed_tokens: nn.Embedding | torch.Tensor) -> torch.Tensor:
    return embed_tokens.weight if isinstance(embed_tokens, nn.Module) else embed_tokens


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as config.json files spell it."""
    return str(dtype).removeprefix("torch.")


def save_weights(tensors: dict[str, torch.Tensor], directory: str | os.PathLike, dtype: torch.dtype) -> None:
    """Write `directory`/model.safetensors, floating tensors cast to `dtype`
    (integer buffers such as id maps keep their dtype)."""
    tensors = {
        name: (tensor.to(dtype) if tensor.is_floating_point() else tensor).detach().cpu().contiguous()
        for name, tensor in tensors.items()
    }
    save_file(tensors, os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})


def load_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read `directory`/model.safetensors; FileNotFoundError if absent,
    ValueError if truncated or corrupt."""
    path = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {directory}")
    try:
        return load_file(path)
    except SafetensorError as error:
        raise ValueError(f"{path} is truncated or corrupt: {error}") from error


def check_weights_match(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], source: str) -> None:
    """One ValueError listing every missing, unexpected or misshapen tensor."""
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    misshapen = [
        f"{name}: {list(tensors[name].shape)} (expected {list(expected[name].shape)})"
        for name in sorted(expected.keys() & tensors.keys())
        if tensors[name].shape != expected[name].shape
    ]
    if missing or unexpected or misshapen:
        raise ValueError(
            f"{source} does not match the model: missing {missing}, unexpected {unexpected}, wrong shapes {misshapen}"
        )


class AmphistaDrafter(nn.Module):
    """Fusion, staged adaptation layers, Auto-embedding Block and vocabulary projection."""

    def __init__(self, config: AmphistaConfig):
        super().__init__()
        config.validate()
        self.config = config
        hidden_size = config.hidden_size
        fuse_in = 2 * hidden_size if config.use_sampled_token else hidden_size
        self.fuse = nn.Linear(fuse_in, hidden_size, bias=False)
        if config.use_stages:
            llama_config = config.to_llama_config()
            # Kept out of the module tree so .to(bfloat16) never rounds its
            # inv_freq; it moves inv_freq to the input's device on every call.
            object.__setattr__(self, "rotary_emb", LlamaRotaryEmbedding(llama_config))
            self.stages = nn.ModuleList(
                AdaptationStage(llama_config, config.stage_num_layers, stage * config.stage_num_layers)
                for stage in range(NUM_STAGES)
            )
        else:
            object.__setattr__(self, "rotary_emb", None)
            self.stages = None
        self.auto_embedding = AutoEmbeddingBlock(config)
        self.lm_head = (
            nn.Linear(hidden_size, config.output_vocab_size, bias=False) if config.has_own_lm_head else None
        )
        if config.draft_vocab_size:
            # Placeholder until init_from_target() installs the real mapping.
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size, dtype=torch.int64))
        else:
            self.draft_to_target = None
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Near-identity start; see "Initialisation" in the module docstring."""
        hidden_size = self.config.hidden_size
        identity = torch.eye(hidden_size)
        self.fuse.weight.zero_()
        self.fuse.weight[:, -hidden_size:] = identity  # h_t is the last input block
        for stage in self.stages or []:
            for layer in stage.layers:
                for name, module in layer.named_modules():
                    if isinstance(module, nn.Linear):
                        _init_linear(module, zero=name.endswith(("o_proj", "down_proj")))
        block = self.auto_embedding
        block.head_proj.weight.copy_(identity.repeat(self.config.num_draft_heads, 1))
        nn.init.normal_(block.position_embedding, std=INIT_STD)
        if block.encoder is not None:
            for name, module in block.encoder.named_modules():
                if isinstance(module, nn.Linear):
                    _init_linear(module, zero=name.endswith(("o_proj", "down_proj")))
        if self.lm_head is not None:
            _init_linear(self.lm_head)

    @torch.no_grad()
    def init_from_target(
        self, target_lm_head_weight: torch.Tensor, draft_to_target: torch.Tensor | None = None
    ) -> None:
        """Install the draft vocabulary mapping and copy the own lm_head's rows from the target's."""
        expected_shape = (self.config.vocab_size, self.config.hidden_size)
        if tuple(target_lm_head_weight.shape) != expected_shape:
            raise ValueError(
                f"target lm_head has shape {tuple(target_lm_head_weight.shape)}, but this drafter "
                f"expects [vocab_size, hidden_size] = {list(expected_shape)}"
            )
        if self.draft_to_target is not None:
            if draft_to_target is None:
                raise ValueError("a drafter with draft_vocab_size > 0 needs draft_to_target")
            draft_to_target = torch.as_tensor(draft_to_target, dtype=torch.int64)
            if draft_to_target.shape != (self.config.draft_vocab_size,):
                raise ValueError(
                    f"draft_to_target must have shape [{self.config.draft_vocab_size}], "
                    f"got {list(draft_to_target.shape)}"
                )
            in_range = (draft_to_target >= 0) & (draft_to_target < self.config.vocab_size)
            if not bool(in_range.all()) or draft_to_target.unique().numel() != draft_to_target.numel():
                raise ValueError("draft_to_target must hold distinct target token ids in 0..vocab_size-1")
            self.draft_to_target.copy_(draft_to_target)
        elif draft_to_target is not None:
            raise ValueError("draft_to_target given, but the config has draft_vocab_size = 0")
        if self.lm_head is not None:
            self.lm_head.weight.copy_(
                target_lm_head_weight if self.draft_to_target is None else target_lm_head_weight[self.draft_to_target]
            )

    def vocab_weight(self, target_lm_head_weight: torch.Tensor | None) -> torch.Tensor:
        """The [V_draft or V, H] matrix the heads project onto."""
        if self.lm_head is not None:
            return self.lm_head.weight
        if target_lm_head_weight is None:
            raise ValueError("this drafter shares the target's lm_head: pass lm_head_weight")
        return target_lm_head_weight

    def to_target_ids(self, draft_token_ids: torch.Tensor) -> torch.Tensor:
        """Map ids of the drafter's vocabulary to target token ids."""
        if self.draft_to_target is None:
            return draft_token_ids
        return self.draft_to_target[draft_token_ids]

    def fuse_inputs(
        self,
        target_hidden: torch.Tensor,
        next_token_ids: torch.Tensor | None,
        embed_tokens: nn.Embedding | torch.Tensor | None,
    ) -> torch.Tensor:
        dtype = self.fuse.weight.dtype
        if not self.config.use_sampled_token:
            return self.fuse(target_hidden.to(dtype))
        if next_token_ids is None or embed_tokens is None:
            raise ValueError("use_sampled_token drafters need next_token_ids and embed_tokens")
        token_embeds = F.embedding(next_token_ids, _embedding_weight(embed_tokens)).to(dtype)
        return self.fuse(torch.cat([token_embeds, target_hidden.to(dtype)], dim=-1))

    def head_hidden_states(
        self,
        target_hidden: torch.Tensor,
        next_token_ids: torch.Tensor | None,
        embed_tokens: nn.Embedding | torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, T, H] target hidden states -> [B, T, K, H] normalised head features."""
        batch, seq_len, hidden_size = target_hidden.shape
        if hidden_size != self.config.hidden_size:
            raise ValueError(
                f"target hidden size {hidden_size} != drafter hidden_size {self.config.hidden_size}"
            )
        stage1_out = self.fuse_inputs(target_hidden, next_token_ids, embed_tokens)
        stage2_out = stage1_out
        if self.stages is not None:
            if position_ids is None:
                position_ids = torch.arange(seq_len, device=target_hidden.device).expand(batch, seq_len)
            position_embeddings = self.rotary_emb(stage1_out, position_ids)
            mask = causal_attention_mask(attention_mask)
            stage1_out = self.stages[0](stage1_out, position_embeddings, mask)
            stage2_out = self.stages[1](stage1_out, position_embeddings, mask)
        heads = self.auto_embedding(stage1_out.reshape(-1, hidden_size), stage2_out.reshape(-1, hidden_size))
        return heads.view(batch, seq_len, self.config.num_draft_heads, hidden_size)

    def forward(
        self,
        target_hidden: torch.Tensor,
        next_token_ids: torch.Tensor | None,
        embed_tokens: nn.Embedding | torch.Tensor | None,
        lm_head_weight: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, K, V_draft]: head k at position t predicts x_{t+2+k}.

        target_hidden [B, T, H]: the target's final-norm output h_t.
        next_token_ids [B, T]: x_{t+1}, the token the target produced from h_t.
        embed_tokens / lm_head_weight: the target's (nn.Embedding or weight).
        position_ids [B, T]: defaults to 0..T-1 (pass them for left padding).
        attention_mask [B, T]: 1 for real tokens, 0 for padding.
        """
        heads = self.head_hidden_states(target_hidden, next_token_ids, embed_tokens, position_ids, attention_mask)
        return draft_logits(heads, self.vocab_weight(lm_head_weight))

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict under the checkpoint names (Auto-embedding Block unprefixed)."""
        return {name.removeprefix(AUTO_EMBEDDING_PREFIX): tensor for name, tensor in self.state_dict().items()}

    def load_checkpoint_state_dict(self, tensors: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Load checkpoint-named tensors, with one clear error for missing, extra or misshapen ones."""
        check_weights_match(self.checkpoint_state_dict(), tensors, source)
        module_names = {name.removeprefix(AUTO_EMBEDDING_PREFIX): name for name in self.state_dict()}
        self.load_state_dict({module_names[name]: tensor for name, tensor in tensors.items()})

    def save_pretrained(self, save_directory: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write config.json and model.safetensors (floating tensors in ``dtype``;
        the target's shared embedding and lm_head are never saved)."""
        os.makedirs(save_directory, exist_ok=True)
        self.config.dtype = dtype_name(dtype)
        self.config.save_pretrained(save_directory)
        save_weights(self.checkpoint_state_dict(), save_directory, dtype)

    @classmethod
    def from_pretrained(
        cls, directory: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> AmphistaDrafter:
        """Load a drafter that save_pretrained wrote to a local directory, in `dtype` (default: as saved)."""
        config = AmphistaConfig.from_pretrained(directory)
        tensors = load_weights(directory)
        model = cls(config)
        model.load_checkpoint_state_dict(tensors, source=os.path.join(directory, WEIGHTS_NAME))
        if dtype is None:
            dtype = next(tensor.dtype for tensor in tensors.values() if tensor.is_floating_point())
        return model.to(device=device, dtype=dtype)
