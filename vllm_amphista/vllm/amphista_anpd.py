"""The hybrid inside vLLM (`method: "amphista_anpd"`): Amphista heads and ANPD tables in one proposer.

The heads run through the EAGLE path exactly as in `amphista.py` (their
stages catch up after steps that draft nothing), before vLLM's bookkeeping,
and so does the rest (patch 5): every step, each request's ANPD tables absorb
the tokens the sampler accepted (`absorb_sampled`, also on steps where vLLM
runs no drafter), and after the heads `finalize_drafts` picks or splices each
final draft from the heads' chain and the tables (`hybrid.hybrid_draft`). Nothing waits for the
CPU copy of the tokens, so the hybrid runs under async scheduling (patch 10),
where the drafts go back as one [B, K] tensor: a draft shorter than K is
padded with the heads' own later tokens (past the heads, their last one).
Synchronous scheduling keeps per-request lengths. K may exceed the number of
heads: the tables continue the heads' chain (or draft alone) up to K tokens. Where the heads dir
ships `answer_ngrams.npz` (n-gram statistics of the target's answers to its training
prompts), the tables fall back on it where no context of the request matches.
Tables are dropped the step vLLM frees a request, as for ANPD.
On a GPU, reading the sampled tokens waits for the sampler (the tables live on
the CPU): the one wait async scheduling otherwise avoids; what async scheduling
still gains there has not been measured (vLLM-CPU schedules synchronously).
"""

from __future__ import annotations

import torch

from vllm_amphista.anpd import confident_prefix
from vllm_amphista.answer_ngrams import load_from_dir
from vllm_amphista.hybrid import hybrid_draft
from vllm_amphista.vllm.amphista import AmphistaProposer
from vllm_amphista.vllm.anpd import RequestTables


class AmphistaAnpdProposer(AmphistaProposer):
    def __init__(self, vllm_config, device, runner):
        super().__init__(vllm_config, device, runner)
        # Where the heads dir ships the target's answer n-grams, the tables fall back on them.
        self.tables = RequestTables(vllm_config, load_from_dir(vllm_config.speculative_config.model))
        self.async_scheduling = vllm_config.scheduler_config.async_scheduling
        self._heads_chains: dict[str, list[tuple[int, float]]] = {}
        self._lengths: dict[str, int] = {}  # requests that gained tokens this step -> their length
        self._draft_length = 0  # this step's K
        self.with_confidence = True  # the hybrid rule weighs each head's token by it

    def propose(self, num_speculative_tokens: int, *args, **kwargs) -> torch.Tensor | list[list[int]]:
        token_ids, confidence = self.draft_with_confidence(num_speculative_tokens, *args, **kwargs)
        self._draft_length = num_speculative_tokens
        if not num_speculative_tokens:
            self._heads_chains = {}
            return token_ids if self.async_scheduling else [[] for _ in range(token_ids.shape[0])]
        req_ids = self.runner.input_batch.req_ids
        self._heads_chains = {req_id: list(zip(tokens, confidences))
                              for req_id, tokens, confidences in zip(req_ids, token_ids.tolist(), confidence.tolist())}
        if not self.async_scheduling:
            return token_ids.tolist()
        past_heads = num_speculative_tokens - token_ids.shape[1]
        if past_heads > 0:
            token_ids = torch.cat([token_ids, token_ids[:, -1:].expand(-1, past_heads)], dim=1)
        return token_ids

    def absorb_sampled(self, sampled_token_ids: torch.Tensor) -> None:
        """Every step, before bookkeeping and whether or not the drafter runs: each request's
        tables absorb the tokens it gained, from the sampler's [B, 1+K] output (-1 where rejected)."""
        # Async scheduling's bookkeeping counts placeholders: the length is known only without it.
        self._lengths, _ = self.tables.absorb_sampled(self.runner, sampled_token_ids.tolist(),
                                                      length_known=not self.async_scheduling)

    def finalize_drafts(self, drafts: torch.Tensor | list[list[int]]) -> torch.Tensor | list[list[int]]:
        """Each request's final draft from its heads' chain and its tables."""
        if not self._draft_length:
            return drafts
        final = drafts.clone() if torch.is_tensor(drafts) else []
        req_ids = self.runner.input_batch.req_ids
        min_confidence = self.confidence_cut(len(req_ids))
        for row, req_id in enumerate(req_ids):
            chain, length = self._heads_chains.get(req_id), self._lengths.get(req_id)
            room = min(self._draft_length, self.tables.max_model_len - length) if chain and length else 0
            draft = self._final_draft(req_id, chain, room, min_confidence) if room > 0 else []
            if torch.is_tensor(final):
                if draft:
                    final[row, :len(draft)] = torch.tensor(draft, dtype=final.dtype)
            else:
                final.append(draft)
        return final

    def _final_draft(self, req_id: str, chain: list[tuple[int, float]], room: int,
                     min_confidence: float) -> list[int]:
        drafter = self.tables.drafter
        scored = hybrid_draft(chain, lambda n, prefix: drafter.scored_draft(req_id, n, prefix), room)
        return confident_prefix(scored, min_confidence)

    def drop_finished(self, req_ids) -> None:
        super().drop_finished(req_ids)
        self.tables.drop_finished(req_ids)

    @property
    def state_size(self) -> tuple[int, int]:
        return self.tables.state_size
