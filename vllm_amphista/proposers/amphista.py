"""Amphista inside vLLM: K drafts from one drafter pass, verified by vLLM.

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
"""

from __future__ import annotations

import torch
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.eagle import EagleProposer


class AmphistaProposer(EagleProposer):
    def propose(
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
    ) -> torch.Tensor:
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
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
            return torch.empty(last_positions.shape[0], 0, dtype=torch.int64, device=last_positions.device)
        return self.model.draft_token_ids(last_positions, num_speculative_tokens)
