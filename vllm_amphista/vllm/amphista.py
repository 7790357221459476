"""Amphista inside vLLM: the drafter model over vLLM's paged KV, and its proposer.

vLLM's EAGLE proposer already does what the Staged Adaptation Layers need:
it feeds a draft model the target's hidden states with the tokens shifted by
one (the token sampled after h_t sits beside h_t), over the draft layers'
own paged KV cache, and finds each request's last valid position after
rejections. We keep all of that and replace only what follows the first
pass: instead of EAGLE's autoregressive loop, the Auto-embedding Block reads
the stage outputs at each request's last position and all K heads give the
chain at once (heads that read the drafted tokens give it head by head, in the
same compiled graph).

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
outputs side by side, `[num_tokens, 2H]`; a drafting step runs the heads at each
request's last position in the same compiled graph (`forward_and_draft`), or,
where the stages' pass replays a CUDA graph, in the heads' own (`run_heads`);
`chain` turns their output into K draft tokens per request.

Steps that draft nothing (K=0, chosen by the load-aware draft length) skip the
stages: each request keeps the stage inputs of the positions it skipped, and
the next pass over its rows first runs those positions as one short prefill
(`_catch_up`), so the stages' KV is what running every step would have written.
The catch-up runs only when a request drafts again or its backlog reaches its
bound (`MAX_DEFERRED_POSITIONS`), so a request that ends inside a K=0 stretch
never pays for its stages there: at a batch size where drafting does not pay,
the stages' share of a step (~6% of the demo target's compute) is not paid
either. Only decode steps are deferred, so a prompt's stage KV is always
written when its prefill runs; what a request leaves unpaid when it finishes
is KV of its generated tokens, which only a later prompt that repeats them
(prefix caching) would read, for drafting only.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama_eagle import LlamaDecoderLayer as DraftLlamaDecoderLayer
from vllm.model_executor.models.utils import maybe_prefix
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_amphista.configuration_amphista import NUM_STAGES, AmphistaConfig
from vllm_amphista.draft_length import ConfidenceCut
from vllm_amphista.modeling_amphista import AutoEmbeddingBlock, draft_chain, greedy_tokens
from vllm_amphista.vllm.config import draft_length_mode

# With a load-aware draft length, a request's draft stops where the product of its heads'
# probabilities for their own tokens falls below this, at batch sizes where verifying drafts costs
# the step (draft_length.ConfidenceCut): unlikely tokens are not verified for nothing.
MIN_DRAFT_CONFIDENCE = 0.1

# How many positions a request's stages may fall behind on steps that draft nothing before they
# catch up anyway: bounds the catch-up pass and the stored inputs (a row of the target's features
# each, ~7 KB for the demo heads' three layers in float32, ~1.8 MB a request at the bound: a sixth
# of the target's KV for those positions). Long enough that most answers end before it.
MAX_DEFERRED_POSITIONS = 256

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


class CpuRMSNorm(RMSNorm):
    """vLLM's RMSNorm with an eager CPU path on vLLM's C++ kernels: vLLM-CPU runs the formula, six
    torch ops that cost ~4x the kernel at the drafter's few rows. In a compiled graph the norm
    takes `forward_native` (custom ops off), so Inductor fuses the formula as before. Like vLLM's
    CUDA kernels, the fused add-norm updates `x` and `residual` in place."""

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.variance_size_override is not None or not self.has_weight or self.weight.dtype != x.dtype:
            return self.forward_native(x, residual)
        x = x.contiguous()  # the kernels read rows as contiguous: a strided view would be misread
        if residual is None:
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, self.weight.data, self.variance_epsilon)
            return out
        residual = residual.contiguous()
        torch.ops._C.fused_add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)
        return x, residual


def _rms_norm(hidden_size: int, eps: float) -> CpuRMSNorm:
    return CpuRMSNorm(hidden_size, eps=eps)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "hidden_states": 0})
class AmphistaStages(nn.Module):
    """Fusion of h_t with the sampled token's embedding, then the Staged Adaptation Layers over
    every scheduled token, in vLLM's paged KV; compiled with the target as vLLM's EAGLE model is.
    Heads that read several target layers combine them here, in the same graph."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", start_layer_id: int = 0):
        super().__init__()
        config = _drafter_config(vllm_config)
        self.config = config
        # Replaced by the target's embedding when the proposer loads the drafter.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # The runner concatenates the target layers' streams (vLLM's auxiliary hidden states). The
        # reference drafter normalises each stream (combine.norms), projects them (combine.proj) and
        # fuses the result with the token's embedding (fuse); past the normalisation all of it is
        # linear, so here one matrix does it (`load_weights` multiplies the norms' weights, the
        # projection and fuse out): one GEMM less, fewer weights to read, and the streams
        # normalised in one call over [N * n, H] with unit weights instead of one norm each.
        self.stream_norm = (_rms_norm(config.hidden_size, config.rms_norm_eps)
                            if config.target_feature_layers else None)
        fuse_in = config.feature_size + (config.hidden_size if config.use_sampled_token else 0)
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
        for layer in self.layers:
            layer.input_layernorm = _rms_norm(config.hidden_size, config.rms_norm_eps)
            layer.post_attention_layernorm = _rms_norm(config.hidden_size, config.rms_norm_eps)

    def _run_stage(self, stage: int, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        per_stage = self.config.stage_num_layers
        residual = None
        for layer in self.layers[stage * per_stage: (stage + 1) * per_stage]:
            hidden, residual = layer(positions, hidden, residual)
        return hidden + residual

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """input_ids[i] is the token sampled after hidden_states[i] ([N, H], or [N, n*H] for n target
        layers) -> [N, 2H] both stages' outputs."""
        if self.stream_norm is not None:
            num_tokens = hidden_states.shape[0]
            hidden_states = self.stream_norm(hidden_states.reshape(-1, self.config.hidden_size)).view(num_tokens, -1)
        if self.config.use_sampled_token:
            fused = self.fuse(torch.cat([self.embed_tokens(input_ids), hidden_states], dim=-1))
        else:
            fused = self.fuse(hidden_states)
        if not self.config.use_stages:
            return torch.cat([fused, fused], dim=-1)
        stage1 = self._run_stage(0, positions, fused)
        # A stage's first layer keeps its input as the residual, which vLLM's fused add-norm kernels
        # update in place: stage 2 gets its own copy, so stage 1's output survives it.
        return torch.cat([stage1, self._run_stage(1, positions, stage1.clone())], dim=-1)


@support_torch_compile(dynamic_arg_dims={"stage_outputs": 0})
class AmphistaHeads(nn.Module):
    """The Auto-embedding Block on each request's last position: [B, 2H] stage outputs -> [B, K, H]
    head features; given the drafter's own lm_head, the chain ([B, K] target token ids, each head's
    greedy token, and [B, K] their log-probabilities, or None without `with_confidence`) in the
    same compiled graph."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", lm_head: nn.Module | None = None):
        super().__init__()
        config = _drafter_config(vllm_config)
        self.block = AutoEmbeddingBlock(config, _replicated_linear(vllm_config), _rms_norm)
        self.lm_head = lm_head
        if config.draft_vocab_size:
            self.register_buffer("draft_to_target", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        else:
            self.draft_to_target = None
        # Heads that read the drafted tokens embed them with the target's embedding (`share_embedding`).
        object.__setattr__(self, "embed_tokens", None)
        # Set by the proposer before the first pass (a compiled graph is traced once).
        self.with_confidence = True

    def share_embedding(self, embed_tokens: nn.Module) -> None:
        object.__setattr__(self, "embed_tokens", embed_tokens)

    def forward(self, stage_outputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        stage1, stage2 = stage_outputs.chunk(2, dim=-1)
        heads = self.block(stage1, stage2)
        if self.lm_head is None:
            return heads
        return draft_chain(heads, self.lm_head, self.embed_tokens, self.draft_to_target, self.block.draft_token_mlp,
                           self.with_confidence)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "hidden_states": 0, "rows_to_draft": 0})
class AmphistaDraftPass(nn.Module):
    """The stages over every scheduled token and the heads at the rows to draft from, in one
    compiled graph: a drafting step that replays no CUDA graph (every step on CPU) pays one graph
    call and one forward context instead of two (`AmphistaProposer._heads_join_stages`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", stages: AmphistaStages, heads: AmphistaHeads):
        super().__init__()
        self.stages = stages
        self.heads = heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                rows_to_draft: torch.Tensor):
        return self.heads(self.stages(input_ids, positions, hidden_states)[rows_to_draft])


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
        own_lm_head = None
        if config.has_own_lm_head:
            # A draft vocabulary is small: whole on every rank, so no gather is needed, and the heads'
            # graph ends with it (registered there too; its parameter keeps the name lm_head.weight).
            self.lm_head = own_lm_head = _replicated_linear(vllm_config)(config.hidden_size, config.output_vocab_size)
        self.heads = AmphistaHeads(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "heads"), lm_head=own_lm_head)
        # Registered after the stages and heads, so their parameters keep the names above.
        self.draft_pass = AmphistaDraftPass(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "draft_pass"),
                                            stages=self.model, heads=self.heads)
        # The shared lm_head is the target's, split by vocabulary across tensor-parallel
        # ranks: vLLM's logits processor gathers the slices.
        self.logits_processor = LogitsProcessor(config.vocab_size)

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

    def forward_and_draft(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                          rows_to_draft: torch.Tensor, inputs_embeds: torch.Tensor | None = None):
        """`forward`, then the heads at `rows_to_draft` (each request's last position), in one compiled
        graph -> the heads' output, for `chain`."""
        if inputs_embeds is not None:
            raise NotImplementedError("the Amphista drafter takes token ids, not embeddings")
        # One index dtype: a graph compiled for one reads another's memory wrong (no guards).
        return self.draft_pass(input_ids, positions, hidden_states, rows_to_draft.long())

    def run_heads(self, stage_outputs: torch.Tensor):
        """[B, 2H] stage outputs at each request's last position -> the heads' output, for `chain`,
        in the heads' own graph."""
        with set_forward_context(None, self.vllm_config, num_tokens=stage_outputs.shape[0]):
            return self.heads(stage_outputs)

    def chain(self, heads_out, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The heads' output for B requests -> ([B, num_tokens] draft token ids, [B, num_tokens] each
        head's probability of its own draft, or None where the heads give none
        (`AmphistaHeads.with_confidence`)).

        All K heads ran (the encoder is bi-directional among them, as trained);
        the first `num_tokens` heads' greedy tokens form the chain.
        """
        if self.has_own_lm_head:
            token_ids, log_confidence = heads_out
        else:
            batch = heads_out.shape[0]
            logits = self.compute_logits(heads_out.reshape(batch * self.config.num_draft_heads, -1))
            token_ids, log_confidence = greedy_tokens(logits, self.heads.with_confidence)
            token_ids = token_ids.view(batch, -1)
            log_confidence = None if log_confidence is None else log_confidence.view(batch, -1)
        token_ids = token_ids[:, :num_tokens]
        return token_ids, None if log_confidence is None else log_confidence[:, :num_tokens].exp()

    def _input_matrix(self, fuse: torch.Tensor, combine: torch.Tensor | None,
                      stream_norm_weights: list[torch.Tensor]) -> torch.Tensor:
        """The checkpoint's fuse ([H, H + H] with the token's embedding, else [H, H]), combine.proj
        ([H, n*H]) and the n streams' norm weights ([H] each) -> the one matrix of
        fuse([embedding,] combine.proj(w * unit-weight-normalised streams)) over [embedding,]
        unit-weight-normalised streams, in float32 (rounded once, to the engine's dtype, when loaded)."""
        if combine is None:
            return fuse
        hidden_size = self.config.hidden_size
        fuse = fuse.float()
        streams = fuse[:, -hidden_size:] @ (combine.float() * torch.cat(stream_norm_weights).float())
        return torch.cat([fuse[:, :-hidden_size], streams], dim=1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        if self.heads.draft_to_target is not None:
            params["draft_to_target"] = self.heads.draft_to_target
        per_stage = self.config.stage_num_layers
        loaded: set[str] = set()
        input_matrices: dict[str, torch.Tensor] = {}  # multiplied out into model.fuse below
        for name, tensor in weights:
            shard = None
            if name in ("fuse.weight", "combine.proj.weight") or name.startswith("combine.norms."):
                input_matrices[name] = tensor
                continue
            if name.startswith("stages."):
                _, stage, _, index, rest = name.split(".", 4)
                name = f"model.layers.{int(stage) * per_stage + int(index)}.{rest}"
                for hf_name, vllm_name, shard_id in _STACKED_PARAMS:
                    if hf_name in name:
                        name, shard = name.replace(hf_name, vllm_name), shard_id
                        break
            elif name not in ("lm_head.weight", "draft_to_target"):
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
        num_streams = len(self.config.target_feature_layers or ())
        stream_norm_names = [f"combine.norms.{index}.weight" for index in range(num_streams)]
        expected = {"fuse.weight"} | ({"combine.proj.weight", *stream_norm_names} if num_streams else set())
        if set(input_matrices) - expected:
            raise ValueError(f"Amphista checkpoint has an unexpected tensor {sorted(set(input_matrices) - expected)}")
        if set(input_matrices) == expected:
            param = params["model.fuse.weight"]
            getattr(param, "weight_loader", default_weight_loader)(
                param, self._input_matrix(input_matrices["fuse.weight"], input_matrices.get("combine.proj.weight"),
                                          [input_matrices[name] for name in stream_norm_names]))
            loaded.add("model.fuse.weight")
        if self.model.stream_norm is not None:  # its weights are in model.fuse: it only normalises
            self.model.stream_norm.weight.data.fill_(1.0)
            loaded.add("model.stream_norm.weight")
        # The embedding is the target's, shared after loading.
        missing = ({n for n in params if not n.startswith("model.embed_tokens")} - loaded - {"model.fuse.weight"}
                   | expected - set(input_matrices))
        if missing:
            raise ValueError(f"Amphista checkpoint lacks {sorted(missing)}")
        return loaded | {n for n in params if n.startswith("model.embed_tokens")}


class DeferredStageRows:
    """A request's stage inputs for consecutive positions the stages have not run yet, in buffers
    that grow by doubling (a step appends its rows in place)."""

    def __init__(self, first_position: int, input_ids: torch.Tensor, hidden_states: torch.Tensor):
        """Empty, for rows like those of the proposer's `input_ids` and `hidden_states`."""
        self.first_position = first_position
        self.count = 0
        self._token_ids = input_ids.new_empty(16)
        self._hidden_states = hidden_states.new_empty(16, hidden_states.shape[-1])

    @property
    def token_ids(self) -> torch.Tensor:  # [m] the token sampled after each position
        return self._token_ids[:self.count]

    @property
    def hidden_states(self) -> torch.Tensor:  # [m, H] or [m, n*H]: the target's features at each position
        return self._hidden_states[:self.count]

    @property
    def end_position(self) -> int:
        return self.first_position + self.count

    def append(self, token_ids: torch.Tensor, hidden_states: torch.Tensor) -> None:
        end = self.count + token_ids.shape[0]
        if end > self._token_ids.shape[0]:
            capacity = max(end, 2 * self._token_ids.shape[0])
            self._token_ids = torch.cat([self.token_ids, self._token_ids.new_empty(capacity - self.count)])
            self._hidden_states = torch.cat([self.hidden_states,
                                             self._hidden_states.new_empty(capacity - self.count,
                                                                           self._hidden_states.shape[-1])])
        self._token_ids[self.count:end] = token_ids
        self._hidden_states[self.count:end] = hidden_states
        self.count = end

    def keep_before(self, position: int) -> bool:
        """Keep the rows before `position`, where this step's rows begin (rows at or past it were
        rejected drafts, or come again); False if none are left or the rows do not lead up to it."""
        if not self.first_position < position <= self.end_position:
            return False
        self.count = position - self.first_position
        return True


class AmphistaProposer(EagleProposer):
    def __init__(self, vllm_config, device, runner):
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        adaptive = draft_length_mode(vllm_config.speculative_config) == "adaptive"
        # Per-request lengths need list drafts; async scheduling reads them as one [B, K] tensor.
        self.truncate_drafts = adaptive and not vllm_config.scheduler_config.async_scheduling
        # Whether the heads' chains come with each head's probability of its token.
        self.with_confidence = self.truncate_drafts
        # The start-up timing calibrates the cut (read where drafts are truncated, and by the hybrid).
        self.confidence_cut = ConfidenceCut(MIN_DRAFT_CONFIDENCE if adaptive else 0.0,
                                            vllm_config.speculative_config.num_speculative_tokens)
        parallel = vllm_config.parallel_config
        # With data or context parallelism a rank that skips its stages would leave the others
        # waiting in the pass's collectives.
        self.defer_idle_stages = (parallel.data_parallel_size == 1
                                  and parallel.decode_context_parallel_size == 1
                                  and parallel.prefill_context_parallel_size == 1)
        self.deferred: dict[str, DeferredStageRows] = {}
        self._empty_drafts: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        # On CPU the sampler's verdict and the attention metadata are host tensors, at hand in Python:
        # the drafter's inputs are prepared there (`prepare_*_padded`), and the stages run without the
        # rows of rejected drafts, which vLLM pads a step's batch with so that its shape is known before
        # the verdict (one CUDA graph per size, no device sync); on CPU the stages' GEMMs cost by the row.
        self.host_side = torch.device(device).type == "cpu"
        # vLLM-CPU captures no CUDA graphs, so a pass runs its exact token count, and with one data-parallel
        # rank there is no count to agree on: vLLM's dispatch would answer that at ~30 us a pass.
        self.unpadded_passes = self.host_side and parallel.data_parallel_size == 1
        # The most rows a decode step schedules for one request: its sampled token and its drafts.
        self.rows_per_decode_step = 1 + vllm_config.speculative_config.num_speculative_tokens
        # A full backlog plus one step's rows must fit one pass of the input buffers.
        self.max_deferred_positions = min(MAX_DEFERRED_POSITIONS, self.max_num_tokens - self.rows_per_decode_step + 1)
        if self.uses_mrope:
            raise ValueError("the Amphista drafter takes one position per token, not M-RoPE positions")
        self.target_uses_mrope = vllm_config.model_config.uses_mrope
        config = _drafter_config(vllm_config)
        if config.target_feature_layers:  # the stages take the target layers' streams uncombined
            self.hidden_states = torch.zeros((self.max_num_tokens, config.feature_size), dtype=self.dtype,
                                             device=device)

    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        # vLLM has given the stages the target's embedding; heads that read drafted tokens embed them so too.
        self.model.heads.share_embedding(self.model.model.embed_tokens)
        self.model.heads.with_confidence = self.with_confidence

    def _set_positions(self, num_tokens: int, positions: torch.Tensor) -> None:
        # vLLM's reads the target's `uses_mrope` (a walk of its HF config, ~0.1 ms on CPU) every call.
        self.positions[:num_tokens] = positions[0] if self.target_uses_mrope else positions

    def prepare_next_token_ids_padded(self, sampled_token_ids: torch.Tensor, requests, gpu_input_batch,
                                      discard_request_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's (each request's last valid sampled token, or its last known token where none is
        valid or its sample is discarded; and its count of valid tokens), computed in plain Python
        where the tensors are on the host: vLLM's CPU path converts and copies its int32 tensors
        around a C++ kernel, ~10 small ops that cost 10-20 us each right after the target's forward."""
        if not self.host_side:
            return super().prepare_next_token_ids_padded(sampled_token_ids, requests, gpu_input_batch,
                                                         discard_request_mask)
        vocab_size = gpu_input_batch.vocab_size
        # The mask is the runner's whole buffer (max_num_seqs rows): read only the batch's.
        discarded_rows = discard_request_mask[:sampled_token_ids.shape[0]].tolist()
        next_token_ids, valid_counts = [], []
        for row, (tokens, discarded) in enumerate(zip(sampled_token_ids.tolist(), discarded_rows)):
            valid = [] if discarded else [token for token in tokens if token != -1 and token < vocab_size]
            if valid:
                next_token_ids.append(valid[-1])
            else:
                req_id = gpu_input_batch.req_ids[row]
                next_token_ids.append(requests[req_id].get_token_id(gpu_input_batch.num_tokens_no_spec[row] - 1))
            valid_counts.append(len(valid))
        return torch.tensor(next_token_ids, dtype=torch.int32), torch.tensor(valid_counts, dtype=torch.int32)

    def prepare_inputs_padded(self, common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count):
        """vLLM's (the padded step's attention metadata, each request's row to draft from, its count
        of rejected drafts), in plain Python where the tensors are on the host, as above."""
        if not self.host_side:
            return super().prepare_inputs_padded(common_attn_metadata, spec_decode_metadata,
                                                 valid_sampled_tokens_count)
        cad = common_attn_metadata
        num_reqs = cad.num_reqs
        cu_num_draft_tokens = spec_decode_metadata.cu_num_draft_tokens.tolist()[:num_reqs]
        num_draft_tokens = [end - start for start, end in zip([0, *cu_num_draft_tokens], cu_num_draft_tokens)]
        rejected = [drafted + 1 - valid if drafted > 0 else 0
                    for drafted, valid in zip(num_draft_tokens, valid_sampled_tokens_count.tolist())]
        starts = cad.query_start_loc_cpu.tolist()
        total_num_tokens = starts[-1]
        spec_cad = CommonAttentionMetadata(
            query_start_loc=cad.query_start_loc,
            seq_lens=cad.seq_lens,
            query_start_loc_cpu=cad.query_start_loc_cpu,
            seq_lens_cpu_upper_bound=cad.seq_lens_cpu_upper_bound,
            num_reqs=num_reqs,
            num_actual_tokens=total_num_tokens,
            max_query_len=max(end - start for start, end in zip(starts, starts[1:])),
            max_seq_len=cad.max_seq_len,
            block_table_tensor=cad.block_table_tensor,
            slot_mapping=cad.slot_mapping[:total_num_tokens],
            causal=True,
            dcp_local_seq_lens=cad.dcp_local_seq_lens,
        )
        token_indices_to_sample = torch.tensor([end - 1 - dropped for end, dropped in zip(starts[1:], rejected)],
                                               dtype=torch.int32)
        return spec_cad, token_indices_to_sample, torch.tensor(rejected, dtype=torch.int32)

    def propose(self, num_speculative_tokens: int, *args, **kwargs) -> torch.Tensor | list[list[int]]:
        token_ids, confidence = self.draft_with_confidence(num_speculative_tokens, *args, **kwargs)
        if not self.truncate_drafts:
            return token_ids
        if not num_speculative_tokens:
            return [[] for _ in range(token_ids.shape[0])]
        min_confidence = self.confidence_cut(token_ids.shape[0])
        if not min_confidence:
            return token_ids.tolist()
        lengths = (confidence.cumprod(dim=1) >= min_confidence).sum(dim=1).tolist()
        return [row[:length] for row, length in zip(token_ids.tolist(), lengths)]

    def drop_finished(self, req_ids) -> None:
        for req_id in req_ids:
            self.deferred.pop(req_id, None)

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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, K] draft token ids, [B, K] each head's probability of its own token, or None
        without `with_confidence`)."""
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        cad = common_attn_metadata
        req_ids = self.runner.input_batch.req_ids[:cad.num_reqs]
        # A decode step (no prefill chunk) that drafts nothing may leave the stages for later.
        defer = (num_speculative_tokens == 0 and self.defer_idle_stages
                 and cad.max_query_len <= self.rows_per_decode_step)
        backlog: dict[int, DeferredStageRows] = {}
        if defer or self.deferred:
            first_positions = target_positions[cad.query_start_loc_cpu[:-1]].tolist()
            backlog = self._scheduled_backlog(req_ids, first_positions)
            if backlog and not defer:  # this step's rows attend to those positions: run them first
                self._catch_up(cad, req_ids, backlog)
        if defer and cad.num_actual_tokens == cad.num_reqs:
            # One row a request and nothing verified: each row's stage input is the token just
            # sampled and the target's features there, deferred as they are, without the input buffers.
            rows = ((row, next_token_ids[row:row + 1], target_hidden_states[row:row + 1])
                    for row in range(cad.num_reqs))
            return self._defer_rows(cad, req_ids, first_positions, backlog, rows)
        # The first pass of SpecDecodeBaseProposer.propose: the stages see every
        # scheduled token and write their KV.
        first_pass_inputs = dict(target_token_ids=target_token_ids, next_token_ids=next_token_ids,
                                 target_positions=target_positions, target_hidden_states=target_hidden_states,
                                 token_indices_to_sample=token_indices_to_sample, cad=cad,
                                 num_rejected_tokens_gpu=num_rejected_tokens_gpu)
        if num_rejected_tokens_gpu is not None and self.host_side:
            num_tokens, token_indices_to_sample, cad = self._set_kept_inputs(**first_pass_inputs)
        else:
            num_tokens, token_indices_to_sample, cad = self.set_inputs_first_pass(**first_pass_inputs)
        if defer:
            starts = cad.query_start_loc_cpu.tolist()
            rows = ((row, self.input_ids[start:end], self.hidden_states[start:end])
                    for row, (start, end) in enumerate(zip(starts, starts[1:])) if start < end)
            return self._defer_rows(cad, req_ids, first_positions, backlog, rows)
        if num_speculative_tokens == 0:  # a prefill chunk: the stages write their KV
            self._run_stages(num_tokens, cad)
            return self._no_drafts(cad.num_reqs)
        return self.model.chain(self._run_stages(num_tokens, cad, token_indices_to_sample), num_speculative_tokens)

    def _set_kept_inputs(self, target_token_ids: torch.Tensor, next_token_ids: torch.Tensor,
                         target_positions: torch.Tensor, target_hidden_states: torch.Tensor,
                         token_indices_to_sample: torch.Tensor, cad, num_rejected_tokens_gpu: torch.Tensor):
        """vLLM's `set_inputs_first_pass` (a row's input is the token after it, a request's last row's the
        token just sampled) without the rows of rejected drafts (the last `num_rejected_tokens_gpu[i]` of
        request i's rows) -> (num_tokens, each request's last row, cad for the rows kept). Lossless: no kept row
        attends to a dropped one, and the dropped positions are scheduled, and their KV written, again
        next step. Plain Python over the step's few requests, and only the kept rows copied: right after
        the target's forward every small tensor or numpy op costs 10-20 us here (cold caches)."""
        starts = cad.query_start_loc_cpu.tolist()
        rejected = num_rejected_tokens_gpu.tolist()
        lengths = [end - start - dropped for start, end, dropped in zip(starts, starts[1:], rejected)]
        if min(lengths) < 1 or self.needs_extra_input_slots or self.use_heterogeneous_vocab:
            # A request discarded whole, or inputs laid out otherwise: vLLM's, every row kept.
            return self.set_inputs_first_pass(target_token_ids, next_token_ids, target_positions,
                                              target_hidden_states, token_indices_to_sample, cad,
                                              num_rejected_tokens_gpu)
        new_starts = list(itertools.accumulate(lengths, initial=0))
        num_tokens = new_starts[-1]
        if starts[:-1] == new_starts[:-1]:  # only the last request drops rows: the kept rows stay put
            self.input_ids[:num_tokens - 1] = target_token_ids[1:num_tokens]
            self._set_positions(num_tokens, target_positions[..., :num_tokens])
            self.hidden_states[:num_tokens] = target_hidden_states[:num_tokens]
            slot_mapping = cad.slot_mapping[:num_tokens]
        else:
            keep = torch.tensor([row for start, length in zip(starts, lengths) for row in range(start, start + length)])
            # Each row's next token; a request's last row's is overwritten below.
            self.input_ids[:num_tokens] = target_token_ids[(keep + 1).clamp_(max=target_token_ids.shape[0] - 1)]
            self._set_positions(num_tokens, target_positions[..., keep])
            self.hidden_states[:num_tokens] = target_hidden_states[keep]
            slot_mapping = cad.slot_mapping[keep]
        last_rows = torch.tensor([start - 1 for start in new_starts[1:]], dtype=token_indices_to_sample.dtype)
        self.input_ids[last_rows] = next_token_ids
        if not any(rejected):
            return num_tokens, last_rows, cad
        query_start_loc = torch.tensor(new_starts, dtype=cad.query_start_loc_cpu.dtype)
        seq_lens = cad.seq_lens - num_rejected_tokens_gpu
        cad = dataclasses.replace(
            cad,
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc,
            seq_lens=seq_lens,
            seq_lens_cpu_upper_bound=seq_lens,
            num_actual_tokens=num_tokens,
            max_query_len=max(lengths),
            slot_mapping=slot_mapping,
            positions=None if cad.positions is None else self.positions[:num_tokens],
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        return num_tokens, last_rows, cad

    def _no_drafts(self, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`draft_with_confidence`'s answer on a step that drafts nothing: [B, 0] token ids and
        confidences (None without `with_confidence`); made once per batch size (they hold nothing)."""
        answer = self._empty_drafts.get(num_reqs)
        if answer is None:
            empty = torch.empty(num_reqs, 0, device=self.input_ids.device)
            answer = self._empty_drafts[num_reqs] = (empty.long(), empty if self.with_confidence else None)
        return answer

    def _run_stages(self, num_tokens: int, cad, rows_to_draft: torch.Tensor | None = None):
        """The stages over the first `num_tokens` rows of the input buffers, as `cad` describes them
        -> [N, 2H] stage outputs; with `rows_to_draft`, the heads' output at those rows instead (for
        `chain`), from the stages' own graph unless this pass replays a CUDA graph."""
        _, per_layer_attn_metadata = self.build_per_group_and_layer_attn_metadata(cad)
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
            slot_mapping=self._get_slot_mapping(slot_mapping_size, cad.slot_mapping),
        ):
            if rows_to_draft is not None and self._heads_join_stages(cudagraph_runtime_mode):
                return self.model.forward_and_draft(**model_kwargs, rows_to_draft=rows_to_draft)
            stage_outputs = self.model(**model_kwargs)
        return stage_outputs if rows_to_draft is None else self.model.run_heads(stage_outputs[rows_to_draft])

    def _determine_batch_execution_and_padding(self, num_tokens: int, use_cudagraphs: bool = True
                                               ) -> tuple[CUDAGraphMode, int, torch.Tensor | None]:
        if self.unpadded_passes:
            return CUDAGraphMode.NONE, num_tokens, None
        return super()._determine_batch_execution_and_padding(num_tokens, use_cudagraphs)

    @staticmethod
    def _heads_join_stages(cudagraph_runtime_mode: CUDAGraphMode) -> bool:
        """Whether a drafting pass runs the heads in the stages' compiled graph: not where it replays
        a captured CUDA graph, which takes one size (the token count) and not a second (the rows to
        draft from)."""
        return cudagraph_runtime_mode == CUDAGraphMode.NONE

    def _scheduled_backlog(self, req_ids: list[str], first_positions: list[int]) -> dict[int, DeferredStageRows]:
        """Batch row -> the positions a scheduled request's stages still owe before this step's
        rows; backlogs that no longer lead up to them (rejected drafts, preemption) are trimmed."""
        backlog = {}
        for row, (req_id, position) in enumerate(zip(req_ids, first_positions)):
            owed = self.deferred.get(req_id)
            if owed is None:
                continue
            if owed.keep_before(position):
                backlog[row] = owed
            else:
                del self.deferred[req_id]
        return backlog

    def _defer_rows(self, cad, req_ids: list[str], first_positions: list[int],
                    backlog: dict[int, DeferredStageRows], rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append this step's stage inputs, `rows` of (batch row, token ids, the target's features),
        to each request's backlog; catch up the backlogs that are full; draft nothing."""
        for row, token_ids, hidden_states in rows:
            owed = backlog.get(row)
            if owed is None:
                owed = backlog[row] = self.deferred[req_ids[row]] = DeferredStageRows(
                    first_positions[row], self.input_ids, self.hidden_states)
            owed.append(token_ids, hidden_states)
        # Only backlogs at their bound catch up (this step's rows included): the others may yet end unpaid.
        full = {row: owed for row, owed in backlog.items() if owed.count >= self.max_deferred_positions}
        if full:
            self._catch_up(cad, req_ids, full)
        return self._no_drafts(cad.num_reqs)

    def _catch_up(self, cad, req_ids: list[str], backlog: dict[int, DeferredStageRows]) -> None:
        """Run the stages over the owed positions of the batch rows in `backlog`, as a prefill of
        those positions (each request's context before them is in the KV already), in passes that
        fit the input buffers; the owed rows are then dropped."""
        rows = sorted(backlog)
        while rows:
            chunk, size = [], 0
            while rows and (not chunk or size + backlog[rows[0]].count <= self.max_num_tokens):
                size += backlog[rows[0]].count
                chunk.append(rows.pop(0))
            self._run_stages(size, self._load_backlog(cad, [backlog[row] for row in chunk], chunk))
            for row in chunk:
                del self.deferred[req_ids[row]]

    def _load_backlog(self, cad, owed: list[DeferredStageRows], rows: list[int]):
        """Write owed rows into the input buffers; their attention metadata: `cad` narrowed to
        those requests, each querying its owed positions."""
        lengths = [pending.count for pending in owed]
        num_tokens = sum(lengths)
        device = self.input_ids.device
        self.input_ids[:num_tokens] = torch.cat([pending.token_ids for pending in owed])
        self.hidden_states[:num_tokens] = torch.cat([pending.hidden_states for pending in owed])
        positions_cpu = torch.cat([torch.arange(pending.first_position, pending.end_position) for pending in owed])
        positions = positions_cpu.to(device)
        self._set_positions(num_tokens, positions)
        rows_on_device = torch.tensor(rows, device=device)
        block_table = cad.block_table_tensor[rows_on_device]
        request_of_token = torch.repeat_interleave(torch.arange(len(rows), device=device),
                                                   torch.tensor(lengths, device=device))
        blocks = block_table[request_of_token, positions // self.block_size].long()
        slot_mapping = blocks * self.block_size + positions % self.block_size
        query_start_loc_cpu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        seq_lens_cpu = torch.tensor([pending.end_position for pending in owed], dtype=torch.int32)

        def narrowed(value):  # per-request fields of cad, for the chosen rows
            return None if value is None else value[rows_on_device if value.device == device else rows]

        return dataclasses.replace(
            cad,
            query_start_loc=query_start_loc_cpu.to(device),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=seq_lens_cpu.to(device),
            seq_lens_cpu_upper_bound=seq_lens_cpu,
            num_reqs=len(rows),
            num_actual_tokens=num_tokens,
            max_query_len=max(lengths),
            max_seq_len=int(seq_lens_cpu.max()),
            block_table_tensor=block_table,
            slot_mapping=slot_mapping.to(cad.slot_mapping.dtype),
            positions=positions,
            is_prefilling=narrowed(cad.is_prefilling),
            req_idx=None if cad.req_idx is None else cad.req_idx[rows],
            rswa_prefix_lens=narrowed(cad.rswa_prefix_lens),
            logits_indices_padded=None,
            num_logits_indices=None,
            max_logits_per_req=None,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )

    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True, *args, **kwargs) -> None:
        super().dummy_run(num_tokens, use_cudagraphs, *args, **kwargs)  # the stages alone, as prefill chunks run them
        self.dummy_draft(num_tokens, use_cudagraphs)

    def dummy_draft(self, num_tokens: int, use_cudagraphs: bool = True) -> bool:
        """What a drafting step of num_tokens runs after the target: the heads on each request's
        last position, or, where they join the stages' graph, the stages and heads in one pass.
        Warms (and compiles, in a compiled engine) them at start-up, not at the first request.
        Returns whether the stages were in the pass."""
        batch = min(num_tokens, self.max_batch_size)
        cudagraph_runtime_mode, num_input_tokens, num_tokens_across_dp = self._determine_batch_execution_and_padding(
            num_tokens, use_cudagraphs=use_cudagraphs)
        if not self._heads_join_stages(cudagraph_runtime_mode):
            self.model.run_heads(self.hidden_states.new_zeros(batch, 2 * self.hidden_size))
            return False
        with set_forward_context(None, self.vllm_config, num_tokens=num_input_tokens,
                                 num_tokens_across_dp=num_tokens_across_dp):
            self.model.forward_and_draft(self.input_ids[:num_input_tokens], self._get_positions(num_input_tokens),
                                         self.hidden_states[:num_input_tokens],
                                         torch.arange(batch, device=self.input_ids.device))
        return True
