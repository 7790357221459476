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
    head k    = proj_k(stage1_t if k < num_near_heads else stage2_t)   # near_proj / far_proj rows
                + position_embedding[k]                      # [K, H]
    heads     = encoder(heads)    (bi-directional among the K heads of t only)
    logits_k  = lm_head(final_norm(heads_k))  predicts x_{t+2+k}

With ``draft_token_mlp_size`` > 0, head k >= 1 also reads the token y_{k-1}
drafted by the head before it (the chain is drafted head by head, one small
MLP and one lm_head pass per head)::

    head_k   += down(act(up([final_norm(heads_k), norm(embed(y_{k-1}))])))

or, with ``draft_token_mlp_reads="first"``, every head k >= 1 reads head 0's y_0
(one lm_head pass for head 0, then one MLP and one lm_head pass for the rest).

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
* Auto-embedding Block: bias-free projections (``near_proj``: H -> near*H on
  stage 1, ``far_proj``: H -> far*H on stage 2) give every head its own
  projection of its stage's output; a learnable ``[K, H]`` position
  embedding tells the heads apart; then pre-norm encoder layers (RMSNorm,
  fused qkv attention without RoPE, SiLU MLP, residuals) attend over the K
  heads of one sequence position only, via
  ``amphista_kernels.bidirectional_head_attention`` on CUDA (its torch
  reference elsewhere and in training). The heads never see other
  positions or requests, so drafting the last position of a request needs
  nothing but that position's stage outputs.
* Drafted tokens (optional, TreeFlash's correction, arXiv 2606.03819): the
  heads' one pass never sees the tokens the heads before them chose, so the
  far heads guess marginals over every way the chain may go. A chain verifier
  reads head k only where heads 0..k-1 drafted the target's own tokens, so
  training feeds head k the true x_{t+1+k} (teacher forcing is exact for what
  is accepted) and drafting feeds it y_{k-1}. One MLP is shared by the heads
  (they differ by their position embedding); its down projection starts at
  zero, so it starts as the heads without it (and can be added to trained heads).
  Reading head 0's token only (``draft_token_mlp_reads="first"``) keeps most of
  the correction (head 1 reads what it reads in the chain) at a fixed cost: two
  vocabulary passes and one MLP pass instead of K and K-1, each a few small
  kernels that a CPU step pays per call, not per row.
* Vocabulary projection: ``final_norm`` then, by default, the target's own
  lm_head (shared, not saved): it is the largest matrix in the drafter and the
  target's already maps these features to tokens. With ``draft_vocab_size`` N
  the drafter owns an ``[N, H]`` lm_head over the N most frequent tokens
  (initialised from the target's rows); ``draft_to_target`` maps draft ids back
  to target ids. This cuts the K * V projection, which dominates drafting and
  training cost for large vocabularies.
* Initialisation: every residual branch (stage o_proj/down_proj, encoder
  o_proj/down_proj) starts at zero, each head's projection starts as the identity and
  ``fuse`` starts as "pass h_t through", so an untrained drafter behaves like
  the target's own next-token head. Training starts from a sensible predictor
  instead of noise, which matters for short CPU training runs.

Target features: by default h_t is the target's final-norm output, the input
of its lm_head. With ``target_feature_layers`` (EAGLE-3's finding: one layer
lacks what several carry) h_t is instead ``combine``'s projection of the
residual stream after each listed number of target layers (the target's layer
L's stream is its final-norm input): each stream is RMS-normalised (their
scales differ by orders of magnitude), the n of them concatenated and
projected nH -> H, starting as the identity on the last listed layer. The ids
mean what vLLM's auxiliary hidden states mean, so vLLM hands the drafter
exactly these streams from the target's own forward pass.

Ablations (config switches): ``use_sampled_token=False`` fuses h_t alone
(``Linear(H -> H)``); ``use_stages=False`` drops the stage layers and every
head reads the fused input; ``use_encoder=False`` drops the encoder, leaving
independent heads as in Medusa (the position embedding is then just a per-head
bias).

Checkpoint names: the Auto-embedding Block's parameters are saved without a
prefix (``near_proj.weight``, ``far_proj.weight``, ``position_embedding``, ``encoder.*``,
``final_norm.weight``), so ``AutoEmbeddingBlock.load_state_dict`` accepts them
as they are; see ``AmphistaDrafter.checkpoint_state_dict``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from amphista_kernels import bidirectional_head_attention, bidirectional_head_attention_reference
from vllm_amphista.checkpoint import WEIGHTS_NAME, check_weights_match, dtype_name, load_weights, save_weights
from vllm_amphista.configuration_amphista import NUM_STAGES, AmphistaConfig

AUTO_EMBEDDING_PREFIX = "auto_embedding."
INIT_STD = 0.02


LinearFactory = Callable[[int, int], nn.Module]
NormFactory = Callable[[int, float], nn.Module]


def plain_linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


def plain_rms_norm(hidden_size: int, eps: float) -> LlamaRMSNorm:
    return LlamaRMSNorm(hidden_size, eps=eps)


def _init_linear(layer: nn.Linear, zero: bool = False) -> None:
    if zero:
        nn.init.zeros_(layer.weight)
    else:
        nn.init.normal_(layer.weight, std=INIT_STD)


@torch.no_grad()
def _init_residual_layer(layer: nn.Module) -> None:
    """A residual layer that starts as the identity: its output projections zero."""
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            _init_linear(module, zero=name.endswith(("o_proj", "down_proj")))


class HeadEncoderAttention(nn.Module):
    """Multi-head attention across the K heads of each sequence position."""

    def __init__(self, config: AmphistaConfig, linear: LinearFactory = plain_linear):
        super().__init__()
        self.num_heads = config.encoder_num_attention_heads
        self.head_dim = config.encoder_head_dim
        self.qkv_proj = linear(config.hidden_size, 3 * config.hidden_size)
        self.o_proj = linear(config.hidden_size, config.hidden_size)

    def forward(self, heads: torch.Tensor) -> torch.Tensor:
        num_positions, num_draft_heads, hidden_size = heads.shape
        qkv = self.qkv_proj(heads).view(
            num_positions, num_draft_heads, 3, self.num_heads, self.head_dim
        )
        query, key, value = qkv.unbind(dim=2)
        # The Triton kernel (CUDA) has no backward pass: training, and CPU tensors, use the torch
        # reference, which computes the same function; inline, a compiled graph can fuse it, products
        # included when they are broadcast sums (a compiled graph is an engine's: a few rows).
        training = torch.is_grad_enabled() and heads.requires_grad
        if heads.is_cuda and not training:
            attended = bidirectional_head_attention(query, key, value)
        else:
            attended = bidirectional_head_attention_reference(
                query, key, value, batched_matmul=training or not torch.compiler.is_compiling())
        return self.o_proj(attended.reshape(num_positions, num_draft_heads, hidden_size))


class HeadEncoderMLP(nn.Module):
    def __init__(self, config: AmphistaConfig, linear: LinearFactory = plain_linear):
        super().__init__()
        self.up_proj = linear(config.hidden_size, config.encoder_ffn_size)
        self.down_proj = linear(config.encoder_ffn_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(hidden)))


class HeadEncoderLayer(nn.Module):
    """Pre-norm transformer encoder layer over the K head positions."""

    def __init__(self, config: AmphistaConfig, linear: LinearFactory = plain_linear,
                 norm: NormFactory = plain_rms_norm):
        super().__init__()
        self.norm1 = norm(config.hidden_size, config.rms_norm_eps)
        self.attn = HeadEncoderAttention(config, linear)
        self.norm2 = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = HeadEncoderMLP(config, linear)

    def forward(self, heads: torch.Tensor) -> torch.Tensor:
        heads = heads + self.attn(self.norm1(heads))
        return heads + self.mlp(self.norm2(heads))


class HeadEncoder(nn.Module):
    def __init__(self, config: AmphistaConfig, linear: LinearFactory = plain_linear,
                 norm: NormFactory = plain_rms_norm):
        super().__init__()
        self.layers = nn.ModuleList(HeadEncoderLayer(config, linear, norm) for _ in range(config.encoder_num_layers))

    def forward(self, heads: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            heads = layer(heads)
        return heads


class DraftTokenMLP(nn.Module):
    """head + down(act(up([head, norm(token embedding)]))): a head's features corrected by the
    token drafted before it."""

    def __init__(self, config: AmphistaConfig, linear: LinearFactory = plain_linear,
                 norm: NormFactory = plain_rms_norm):
        super().__init__()
        self.reads_first_draft = config.draft_token_mlp_reads == "first"
        self.token_norm = norm(config.hidden_size, config.rms_norm_eps)
        self.up_proj = linear(2 * config.hidden_size, config.draft_token_mlp_size)
        self.down_proj = linear(config.draft_token_mlp_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The zero down projection: heads with this MLP start as the heads without it."""
        _init_linear(self.up_proj)
        _init_linear(self.down_proj, zero=True)

    def forward(self, heads: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """[..., H] head features, [..., H] embeddings of the tokens drafted before them (or one
        embedding that broadcasts to every head, normalised once) -> [..., H]."""
        mixed = torch.cat([heads, self.token_norm(token_embeds.to(heads.dtype)).expand_as(heads)], dim=-1)
        return heads + self.down_proj(self.act(self.up_proj(mixed)))


class AutoEmbeddingBlock(nn.Module):
    """Per-head projections, head position embedding, bi-directional encoder and final norm.

    Works on single positions (``N`` rows, from any mix of requests), so the
    vLLM proposer can run it on just the last position of each request. Every
    matrix is a module made by `linear` and every norm by `norm` (``nn.Linear``
    and transformers' RMSNorm here; the vLLM side passes its own linear layers,
    which prepack their weights for the CPU, and norms that run vLLM's kernels).
    """

    def __init__(self, config: AmphistaConfig, linear: LinearFactory = plain_linear,
                 norm: NormFactory = plain_rms_norm):
        super().__init__()
        self.num_draft_heads = config.num_draft_heads
        self.hidden_size = config.hidden_size
        num_near, num_far = config.num_near_heads, config.num_draft_heads - config.num_near_heads
        # Head k's projection is rows k*H:(k+1)*H of the near (stage 1) or far (stage 2) matrix.
        self.near_proj = linear(config.hidden_size, num_near * config.hidden_size) if num_near else None
        self.far_proj = linear(config.hidden_size, num_far * config.hidden_size) if num_far else None
        self.position_embedding = nn.Parameter(torch.empty(config.num_draft_heads, config.hidden_size))
        self.encoder = HeadEncoder(config, linear, norm) if config.use_encoder else None
        self.final_norm = norm(config.hidden_size, config.rms_norm_eps)
        self.draft_token_mlp = DraftTokenMLP(config, linear, norm) if config.draft_token_mlp_size else None

    def forward(self, stage1_out: torch.Tensor, stage2_out: torch.Tensor) -> torch.Tensor:
        """[N, H], [N, H] -> [N, K, H] normalised head features."""
        projected = [projection(stage_out) for projection, stage_out in
                     ((self.near_proj, stage1_out), (self.far_proj, stage2_out)) if projection is not None]
        heads = torch.cat(projected, dim=-1).view(-1, self.num_draft_heads, self.hidden_size)
        heads = heads + self.position_embedding
        if self.encoder is not None:
            heads = self.encoder(heads)
        return self.final_norm(heads)

    def read_drafts(self, heads: torch.Tensor, draft_embeds: torch.Tensor) -> torch.Tensor:
        """[N, K, H] head features, [N, K-1, H] embeddings of the tokens heads 0..K-2 drafted ->
        [N, K, H] with heads 1..K-1 corrected by them (as they are without `draft_token_mlp`)."""
        if self.draft_token_mlp is None:
            return heads
        return torch.cat([heads[:, :1], self.draft_token_mlp(heads[:, 1:], draft_embeds)], dim=1)


def teacher_forced_drafts(next_token_ids: torch.Tensor, num_draft_heads: int,
                          segment_ids: torch.Tensor | None = None, reads_first_draft: bool = False) -> torch.Tensor:
    """[B, T] x_{t+1} -> [B, T, K-1] x_{t+2}..x_{t+K}: the tokens heads 0..K-2 draft at t when they
    are right, which heads 1..K-1 read (with `reads_first_draft`, x_{t+2} for each: head 0's); 0 past
    the sequence (or past a packed sample's end)."""
    seq_len = next_token_ids.shape[1]
    shifted = []
    for shift in [1] * (num_draft_heads - 1) if reads_first_draft else range(1, num_draft_heads):
        tokens = F.pad(next_token_ids[:, shift:], (0, min(shift, seq_len)))
        if segment_ids is not None:
            same = F.pad(segment_ids[:, shift:], (0, min(shift, seq_len))) == segment_ids
            tokens = tokens.masked_fill(~same, 0)
        shifted.append(tokens)
    return torch.stack(shifted, dim=-1) if shifted else next_token_ids.new_zeros(*next_token_ids.shape, 0)


def greedy_tokens(logits: torch.Tensor, with_log_probs: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., V] logits -> ([...] each row's argmax, [...] its log-probability, or None without
    `with_log_probs`: on CPU the float32 logsumexp costs 3-4x the argmax alone). The argmax is
    `max`'s index (the first maximum, as `argmax`'s): on CPU torch's bf16 `argmax` costs ~9x it."""
    if not with_log_probs:
        return _first_max(logits)[1], None
    logits = logits.float()  # the softmax needs float32
    best, token_ids = _first_max(logits)
    return token_ids, best - torch.logsumexp(logits, dim=-1)


def _first_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits.max(dim=-1)`: each row's maximum and its first index. In a graph Inductor compiles for
    the CPU it is two plain reductions (the maximum, then the least int32 index holding it), where
    Inductor's fused value-and-index reduction is slow: over [3, 8192] bf16 compiled alone 96 us
    against 14, and the drafter graph's two kernels holding its argmaxes ~100 us a call against ~40.
    Eager, `max` is the faster."""
    if not (torch.compiler.is_compiling() and logits.device.type == "cpu"):
        return logits.max(dim=-1)
    best = logits.amax(dim=-1, keepdim=True)
    last = logits.shape[-1] - 1
    positions = torch.arange(last + 1, dtype=torch.int32, device=logits.device)
    # A row without a match (NaN logits) gets the last index: a valid id, where an index past the
    # end would fail the vocabulary lookup after it.
    return best.squeeze(-1), torch.where(logits == best, positions, last).amin(dim=-1).long()


def draft_chain(
    heads: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    embed: Callable[[torch.Tensor], torch.Tensor],
    draft_to_target: torch.Tensor | None,
    draft_token_mlp: DraftTokenMLP | None,
    with_log_probs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, K, H] head features -> ([N, K] each head's greedy token as a target id, [N, K] its
    log-probability, or None without `with_log_probs`). `project` maps features to
    draft-vocabulary logits, `embed` target ids to embeddings. With `draft_token_mlp` the chain is
    drafted head by head, each head reading the token drafted before it, or head 0 then the rest at
    once reading head 0's; without it, in one projection."""
    def to_target(token_ids: torch.Tensor) -> torch.Tensor:
        return token_ids if draft_to_target is None else draft_to_target[token_ids]

    if draft_token_mlp is None:
        token_ids, log_probs = greedy_tokens(project(heads), with_log_probs)
        return to_target(token_ids), log_probs
    if draft_token_mlp.reads_first_draft:
        first, first_log_probs = greedy_tokens(project(heads[:, 0]), with_log_probs)
        first = to_target(first)
        rest = draft_token_mlp(heads[:, 1:], embed(first)[:, None])
        rest, rest_log_probs = greedy_tokens(project(rest), with_log_probs)
        token_ids = torch.cat([first[:, None], to_target(rest)], dim=1)
        return token_ids, torch.cat([first_log_probs[:, None], rest_log_probs], dim=1) if with_log_probs else None
    chain, chain_log_probs, previous = [], [], None
    for k in range(heads.shape[1]):
        head = heads[:, k]
        if previous is not None:
            head = draft_token_mlp(head, embed(previous))
        token_ids, log_probs = greedy_tokens(project(head), with_log_probs)
        previous = to_target(token_ids)
        chain.append(previous)
        chain_log_probs.append(log_probs)
    return torch.stack(chain, dim=1), torch.stack(chain_log_probs, dim=1) if with_log_probs else None


def draft_logits(head_hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """[N, K, H] head features -> [N, K, V] logits with the given vocabulary matrix."""
    return F.linear(head_hidden, lm_head_weight.to(head_hidden.dtype))


class FeatureCombiner(nn.Module):
    """[N, n*H] residual streams of n target layers -> [N, H] features in the place of h_t."""

    def __init__(self, config: AmphistaConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.norms = nn.ModuleList(plain_rms_norm(config.hidden_size, config.rms_norm_eps)
                                   for _ in config.target_feature_layers)
        self.proj = plain_linear(config.feature_size, config.hidden_size)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        streams = features.split(self.hidden_size, dim=-1)
        return self.proj(torch.cat([norm(stream) for norm, stream in zip(self.norms, streams)], dim=-1))


def target_features(target: nn.Module, token_ids: torch.Tensor, layers: list[int] | None) -> torch.Tensor:
    """[B, T] ids -> [B, T, n*H] the features a drafter with `target_feature_layers` = `layers` reads,
    from a transformers causal LM (the final-norm output when `layers` is None)."""
    # transformers' last hidden state is after the final norm; the stream entering it is caught too.
    pre_norm = {}
    handle = target.model.norm.register_forward_hook(lambda module, inputs, output: pre_norm.update(x=inputs[0]))
    try:
        outputs = target.model(token_ids, output_hidden_states=True)
    finally:
        handle.remove()
    if layers is None:
        return outputs.last_hidden_state
    num_layers = len(outputs.hidden_states) - 1
    return torch.cat([pre_norm["x"] if layer == num_layers else outputs.hidden_states[layer] for layer in layers],
                     dim=-1)


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


def _embedding_weight(embed_tokens: nn.Embedding | torch.Tensor) -> torch.Tensor:
    return embed_tokens.weight if isinstance(embed_tokens, nn.Module) else embed_tokens


class AmphistaDrafter(nn.Module):
    """Fusion, staged adaptation layers, Auto-embedding Block and vocabulary projection."""

    def __init__(self, config: AmphistaConfig):
        super().__init__()
        config.validate()
        self.config = config
        hidden_size = config.hidden_size
        self.combine = FeatureCombiner(config) if config.target_feature_layers else None
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
        if self.combine is not None:
            self.combine.proj.weight.zero_()
            self.combine.proj.weight[:, -hidden_size:] = identity  # the last listed layer
        for stage in self.stages or []:
            for layer in stage.layers:
                _init_residual_layer(layer)
        block = self.auto_embedding
        for projection in (block.near_proj, block.far_proj):
            if projection is not None:
                projection.weight.copy_(identity.repeat(projection.out_features // hidden_size, 1))
        nn.init.normal_(block.position_embedding, std=INIT_STD)
        if block.encoder is not None:
            for layer in block.encoder.layers:
                _init_residual_layer(layer)
        if block.draft_token_mlp is not None:
            block.draft_token_mlp.reset_parameters()
        if self.lm_head is not None:
            _init_linear(self.lm_head)

    @torch.no_grad()
    def deepen(self, stage_num_layers: int, encoder_num_layers: int) -> None:
        """Grow each adaptation stage and the Auto-embedding Block's encoder to these many layers. The
        new layers follow the old ones and start as identities, so the deeper drafter starts as this one."""
        config = self.config
        if stage_num_layers < config.stage_num_layers or encoder_num_layers < config.encoder_num_layers:
            raise ValueError(f"a drafter with {config.stage_num_layers} layers per stage and "
                             f"{config.encoder_num_layers} encoder layers can only grow, not become "
                             f"{stage_num_layers} and {encoder_num_layers}")
        if stage_num_layers > config.stage_num_layers and self.stages is None:
            raise ValueError("this drafter has no adaptation stages to deepen")
        if encoder_num_layers > config.encoder_num_layers and self.auto_embedding.encoder is None:
            raise ValueError("this drafter has no Auto-embedding Block encoder to deepen")
        dtype = self.fuse.weight.dtype
        device = self.fuse.weight.device
        config.stage_num_layers, config.encoder_num_layers = stage_num_layers, encoder_num_layers
        if self.stages is not None:
            llama_config = config.to_llama_config()
            grown = []
            for index, old in enumerate(self.stages):
                # Layer numbers run on through the stages, as a fresh drafter of this depth numbers them.
                stage = AdaptationStage(llama_config, stage_num_layers, index * stage_num_layers)
                for layer, old_layer in zip(stage.layers, old.layers):
                    layer.load_state_dict(old_layer.state_dict())
                for layer in stage.layers[len(old.layers):]:
                    _init_residual_layer(layer)
                grown.append(stage.to(device=device, dtype=dtype))
            self.stages = nn.ModuleList(grown)
        encoder = self.auto_embedding.encoder
        if encoder is not None:
            while len(encoder.layers) < encoder_num_layers:
                layer = HeadEncoderLayer(config)
                _init_residual_layer(layer)
                encoder.layers.append(layer.to(device=device, dtype=dtype))

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

    def fuse_inputs(
        self,
        target_hidden: torch.Tensor,
        next_token_ids: torch.Tensor | None,
        embed_tokens: nn.Embedding | torch.Tensor | None,
    ) -> torch.Tensor:
        dtype = self.fuse.weight.dtype
        if self.combine is not None:
            target_hidden = self.combine(target_hidden.to(dtype))
        if not self.config.use_sampled_token:
            return self.fuse(target_hidden.to(dtype))
        if next_token_ids is None or embed_tokens is None:
            raise ValueError("use_sampled_token drafters need next_token_ids and embed_tokens")
        token_embeds = F.embedding(next_token_ids, _embedding_weight(embed_tokens)).to(dtype)
        return self.fuse(torch.cat([token_embeds, target_hidden.to(dtype)], dim=-1))

    def stage_outputs(
        self,
        target_hidden: torch.Tensor,
        next_token_ids: torch.Tensor | None,
        embed_tokens: nn.Embedding | torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, feature_size] target features -> both stages' outputs, [B, T, H] each (the fused
        input twice without stages)."""
        batch, seq_len, feature_size = target_hidden.shape
        if feature_size != self.config.feature_size:
            raise ValueError(
                f"target features have width {feature_size}, this drafter reads {self.config.feature_size} "
                f"(target_feature_layers={self.config.target_feature_layers})"
            )
        stage1_out = self.fuse_inputs(target_hidden, next_token_ids, embed_tokens)
        stage2_out = stage1_out
        if self.stages is not None:
            if position_ids is None:
                position_ids = torch.arange(seq_len, device=target_hidden.device).expand(batch, seq_len)
            position_embeddings = self.rotary_emb(stage1_out, position_ids)
            stage1_out = self.stages[0](stage1_out, position_embeddings, attention_mask)
            stage2_out = self.stages[1](stage1_out, position_embeddings, attention_mask)
        return stage1_out, stage2_out

    def _heads(self, *inputs, **options) -> torch.Tensor:
        """`stage_outputs`' inputs -> [B*T, K, H] the Auto-embedding Block's head features."""
        stage1_out, stage2_out = self.stage_outputs(*inputs, **options)
        hidden_size = stage1_out.shape[-1]
        return self.auto_embedding(stage1_out.reshape(-1, hidden_size), stage2_out.reshape(-1, hidden_size))

    def head_hidden_states(
        self,
        target_hidden: torch.Tensor,
        next_token_ids: torch.Tensor | None,
        embed_tokens: nn.Embedding | torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`stage_outputs`' inputs -> [B, T, K, H] head features, head k >= 1 reading the true
        x_{t+1+k} where it reads drafted tokens (teacher forcing)."""
        heads = self._heads(target_hidden, next_token_ids, embed_tokens, position_ids, attention_mask)
        heads = self.read_true_drafts(heads, next_token_ids, embed_tokens)
        return heads.view(*target_hidden.shape[:-1], *heads.shape[1:])

    def read_true_drafts(
        self,
        heads: torch.Tensor,
        next_token_ids: torch.Tensor,
        embed_tokens: nn.Embedding | torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[M, K, H] head features at every position of next_token_ids' [B, T] (or where `rows`
        [B, T] is True) -> the same with heads 1..K-1 reading the true x_{t+1+k} (teacher forcing;
        unchanged where the heads read no drafted tokens). `segment_ids` as `teacher_forced_drafts`."""
        if self.auto_embedding.draft_token_mlp is None:
            return heads
        drafts = teacher_forced_drafts(next_token_ids, self.config.num_draft_heads, segment_ids,
                                       self.auto_embedding.draft_token_mlp.reads_first_draft)
        drafts = drafts[rows] if rows is not None else drafts.reshape(heads.shape[0], -1)
        return self.auto_embedding.read_drafts(heads, F.embedding(drafts, _embedding_weight(embed_tokens)))

    @torch.no_grad()
    def draft(
        self,
        target_hidden: torch.Tensor,
        next_token_ids: torch.Tensor | None,
        embed_tokens: nn.Embedding | torch.Tensor | None,
        lm_head_weight: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s inputs -> ([B, T, K] the chain drafted at each position as target ids, [B, T, K]
        each head's log-probability of its token): what the engine drafts there."""
        heads = self._heads(target_hidden, next_token_ids, embed_tokens, position_ids, attention_mask)
        vocab = self.vocab_weight(lm_head_weight)
        embed_weight = None if embed_tokens is None else _embedding_weight(embed_tokens)
        token_ids, log_probs = draft_chain(
            heads, lambda features: draft_logits(features, vocab),
            lambda ids: F.embedding(ids, embed_weight), self.draft_to_target, self.auto_embedding.draft_token_mlp)
        leading = target_hidden.shape[:-1]
        return token_ids.view(*leading, -1), log_probs.view(*leading, -1)

    def forward(
        self,
        target_hidden: torch.Tensor,
        next_token_ids: torch.Tensor | None,
        embed_tokens: nn.Embedding | torch.Tensor | None,
        lm_head_weight: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, K, V_draft]: head k at position t predicts x_{t+2+k} (reading the true
        x_{t+1+k} where it reads drafted tokens: what training fits; `draft` drafts the chain).

        target_hidden [B, T, H]: the target's final-norm output h_t ([B, T, n*H] streams with
            target_feature_layers; `target_features` computes either).
        next_token_ids [B, T]: x_{t+1}, the token the target produced from h_t.
        embed_tokens / lm_head_weight: the target's (nn.Embedding or weight).
        position_ids [B, T]: defaults to 0..T-1 (pass them for left padding).
        attention_mask [B, 1, T, T]: True where a position may attend to another (causal, and
            within its own sample when samples are packed or padded); None is plain causal.
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
