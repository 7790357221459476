"""The hybrid inside vLLM (`method: "amphista_anpd"`): Amphista heads and ANPD tables in one proposer.

The heads run every step through the EAGLE path exactly as in `amphista.py`
(so their stage KV stays in sync), before vLLM's bookkeeping. Their chain is
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

from vllm_amphista.anpd import AnpdDrafter
from vllm_amphista.hybrid import hybrid_draft
from vllm_amphista.vllm.amphista import MIN_DRAFT_CONFIDENCE, AmphistaProposer
from vllm_amphista.vllm.anpd import MAX_CONTEXTS_PER_REQUEST
from vllm_amphista.vllm.config import draft_length_mode


class AmphistaAnpdProposer(AmphistaProposer):
    def __init__(self, vllm_config, device, runner):
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        spec = vllm_config.speculative_config
        self.max_model_len = vllm_config.model_config.max_model_len
        self.tables = AnpdDrafter(max_n=spec.prompt_lookup_max + 1, max_entries_per_request=MAX_CONTEXTS_PER_REQUEST,
                                  num_speculative_tokens=spec.num_speculative_tokens)
        self.min_confidence = MIN_DRAFT_CONFIDENCE if draft_length_mode(spec) == "adaptive" else 0.0
        self._heads_chains: dict[str, list[tuple[int, float]]] = {}

    def propose(self, num_speculative_tokens: int, *args, **kwargs) -> list[list[int]]:
        token_ids, confidence = self.draft_with_confidence(num_speculative_tokens, *args, **kwargs)
        req_ids = self.runner.input_batch.req_ids
        self._heads_chains = {req_id: list(zip(tokens, confidences))
                              for req_id, tokens, confidences in zip(req_ids, token_ids.tolist(), confidence.tolist())}
        return token_ids.tolist()

    def finalize_drafts(self, input_batch, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """After bookkeeping: each request's final draft from its heads' chain and its tables."""
        self.tables.retain_only(input_batch.req_ids)
        final = []
        for req_id, heads_draft in zip(req_ids, drafts):
            chain = self._heads_chains.get(req_id)
            row = input_batch.req_id_to_index.get(req_id)
            if chain is None or row is None or not heads_draft:  # a prefill chunk, or K=0 this step
                final.append([])
                continue
            num_tokens = int(input_batch.num_tokens_no_spec[row])
            room = min(len(chain), self.max_model_len - num_tokens)
            if room <= 0:
                final.append([])
                continue
            self.tables.sync(req_id, input_batch.token_ids_cpu[row, :num_tokens])
            scored = hybrid_draft(chain, lambda n, prefix: self.tables.scored_draft(req_id, n, prefix), room)
            draft, running = [], 1.0
            for token, confidence in scored:
                running *= confidence
                if running < self.min_confidence:
                    break
                draft.append(token)
            final.append(draft)
        return final

    def drop_finished(self, req_ids) -> None:
        for req_id in req_ids:
            self.tables.drop(req_id)

    @property
    def state_size(self) -> tuple[int, int]:
        """(requests tracked, N-gram contexts stored): for memory checks."""
        return self.tables.num_requests, self.tables.total_entries
