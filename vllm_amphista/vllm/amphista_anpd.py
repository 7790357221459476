"""The hybrid inside vLLM (`method: "amphista_anpd"`): Amphista heads and ANPD tables in one proposer.

The heads run through the EAGLE path exactly as in `amphista.py` (their
stages catch up after steps that draft nothing), before vLLM's bookkeeping. Their chain is
kept, and after bookkeeping, when the runner hands the drafts to the
scheduler (`take_draft_token_ids`, patch 12), each request's ANPD tables
absorb the tokens this step accepted and `hybrid.hybrid_draft` picks or
splices the final draft. Tables are dropped the step vLLM frees a request,
as for ANPD.

vLLM admits only its EAGLE-family methods to async scheduling, where drafts
never come back to the CPU before the next step; this method runs with
vLLM's synchronous scheduling, which is what vLLM picks for it.
"""

from __future__ import annotations

from vllm_amphista.anpd import confident_prefix
from vllm_amphista.hybrid import hybrid_draft
from vllm_amphista.vllm.amphista import MIN_DRAFT_CONFIDENCE, AmphistaProposer
from vllm_amphista.vllm.anpd import RequestTables
from vllm_amphista.vllm.config import draft_length_mode


class AmphistaAnpdProposer(AmphistaProposer):
    def __init__(self, vllm_config, device, runner):
        super().__init__(vllm_config, device, runner)
        self.tables = RequestTables(vllm_config)
        adaptive = draft_length_mode(vllm_config.speculative_config) == "adaptive"
        self.min_confidence = MIN_DRAFT_CONFIDENCE if adaptive else 0.0
        self._heads_chains: dict[str, list[tuple[int, float]]] = {}

    def propose(self, num_speculative_tokens: int, *args, **kwargs) -> list[list[int]]:
        token_ids, confidence = self.draft_with_confidence(num_speculative_tokens, *args, **kwargs)
        req_ids = self.runner.input_batch.req_ids
        self._heads_chains = {req_id: list(zip(tokens, confidences))
                              for req_id, tokens, confidences in zip(req_ids, token_ids.tolist(), confidence.tolist())}
        return token_ids.tolist()

    def finalize_drafts(self, input_batch, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """After bookkeeping: each request's final draft from its heads' chain and its tables."""
        drafter = self.tables.drafter
        drafter.retain_only(input_batch.req_ids)
        final = []
        for req_id, heads_draft in zip(req_ids, drafts):
            chain = self._heads_chains.get(req_id)
            row = input_batch.req_id_to_index.get(req_id)
            # A prefill chunk, K=0 this step, or no room left: no draft.
            has_draft = bool(heads_draft and chain) and row is not None
            room = self.tables.sync_for_draft(input_batch, row, req_id, len(chain)) if has_draft else 0
            if room <= 0:
                final.append([])
                continue
            scored = hybrid_draft(chain, lambda n, prefix: drafter.scored_draft(req_id, n, prefix), room)
            final.append(confident_prefix(scored, self.min_confidence))
        return final

    def drop_finished(self, req_ids) -> None:
        super().drop_finished(req_ids)
        self.tables.drop_finished(req_ids)

    @property
    def state_size(self) -> tuple[int, int]:
        return self.tables.state_size
