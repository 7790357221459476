"""Configuration of an Amphista drafter (arXiv 2406.13170): shapes, parts and ablation switches.

What each part is and why it is built so: `modeling_amphista.py`. Imports no vLLM.
"""

from __future__ import annotations

from transformers import LlamaConfig, PretrainedConfig
from transformers.activations import ACT2FN

from amphista_kernels.head_attention import MAX_HEAD_POSITIONS, SUPPORTED_HEAD_DIMS

NUM_STAGES = 2
# Which drafted token heads 1..K-1 read through the draft-token MLP: each the one drafted just
# before it (head by head), or all head 0's (two vocabulary passes however many heads).
DRAFT_TOKEN_MLP_READS = ("previous", "first")
# Encoder heads of this size suit the bi-directional head-attention kernel.
PREFERRED_ENCODER_HEAD_DIM = 64


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
        target_feature_layers: list[int] | None = None,
        draft_token_mlp_size: int = 0,
        draft_token_mlp_reads: str = "previous",
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
        self.target_feature_layers = None if target_feature_layers is None else [int(i) for i in target_feature_layers]
        self.draft_token_mlp_size = draft_token_mlp_size
        self.draft_token_mlp_reads = draft_token_mlp_reads
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

    @property
    def feature_size(self) -> int:
        """Width of the target features the drafter reads per position."""
        return self.hidden_size * len(self.target_feature_layers or [None])

    @property
    def eagle_aux_hidden_state_layer_ids(self) -> list[int] | None:
        """The name under which vLLM's runner reads which target layers to hand the drafter
        (`GPUModelRunner._get_eagle3_aux_layers_from_config`); the ids mean the same there."""
        return self.target_feature_layers

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
        require(self.draft_token_mlp_size >= 0, f"draft_token_mlp_size must be >= 0 (0 = off), "
                                                f"got {self.draft_token_mlp_size}")
        require(self.draft_token_mlp_reads in DRAFT_TOKEN_MLP_READS,
                f"draft_token_mlp_reads must be one of {DRAFT_TOKEN_MLP_READS}, got {self.draft_token_mlp_reads!r}")
        if self.draft_token_mlp_size:
            # In vLLM the chain is drafted inside the heads' graph, which ends with the drafter's own lm_head.
            require(self.draft_vocab_size > 0, "heads that read the drafted tokens (draft_token_mlp_size > 0) "
                                               "need a draft vocabulary (draft_vocab_size > 0)")
        if self.target_feature_layers is not None:
            layers = self.target_feature_layers
            require(
                # Ascending: vLLM hands the streams over in the order its layers run.
                len(layers) >= 1 and layers == sorted(set(layers)) and layers[0] >= 1,
                f"target_feature_layers must be ascending distinct layer counts >= 1 (null: the final-norm "
                f"output), got {layers}",
            )
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
        layers = fields.get("target_feature_layers") or []
        if any(layer > text_config.num_hidden_layers for layer in layers):
            raise ValueError(f"invalid AmphistaConfig: target_feature_layers {layers} reach past the target's "
                             f"{text_config.num_hidden_layers} layers")
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
