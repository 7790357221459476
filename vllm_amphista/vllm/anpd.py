"""ANPD inside vLLM: per-request adaptive N-gram tables, drafts verified by vLLM.

Runs after the runner's bookkeeping, like vLLM's ngram proposer, on the CPU
copy of each request's tokens. The tables (vllm_amphista/anpd.py) absorb only
the tokens added since the last step, so a step costs what was accepted, not
the context length. Finished and aborted requests are dropped the step vLLM
frees them (`drop_finished`, called from the runner's state update); a request
the scheduler skips or preempts leaves the batch but not the runner, and keeps
its tables until it returns.
"""

from __future__ import annotations

import numpy as np

from vllm_amphista.anpd import AnpdDrafter
from vllm_amphista.vllm.config import draft_length_mode

# Contexts kept per request: a 4k-token request needs about 5 x 4k at N=6.
MAX_CONTEXTS_PER_REQUEST = 65536
# With a load-aware draft length, a request's draft stops where the n-gram chain's confidence
# (anpd.NgramTables._predict) falls below this: weak matches are not verified for nothing.
MIN_DRAFT_CONFIDENCE = 0.1


class RequestTables:
    """Each live request's N-gram tables, kept in step with vLLM's input batch: shared by the
    ANPD and hybrid proposers."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.max_model_len = vllm_config.model_config.max_model_len
        self.drafter = AnpdDrafter(
            max_n=spec.prompt_lookup_max + 1,
            max_entries_per_request=MAX_CONTEXTS_PER_REQUEST,
            num_speculative_tokens=spec.num_speculative_tokens,
        )

    def sync_for_draft(self, input_batch, row: int, req_id: str, k: int) -> int:
        """Tokens a request may draft (k, less where max_model_len leaves no room); when any,
        its tables have absorbed its tokens so far."""
        num_tokens = int(input_batch.num_tokens_no_spec[row])
        room = min(k, self.max_model_len - num_tokens)
        if room > 0:
            self.drafter.sync(req_id, input_batch.token_ids_cpu[row, :num_tokens])
        return room

    def absorb_step(self, req_id: str, new_tokens: list[int], tokens_before: np.ndarray, length: int | None) -> int:
        """Absorb the tokens a request gained this step and return its length, for a drafter that
        runs before the runner's bookkeeping (with async scheduling the runner's copy of recent
        tokens holds placeholders, -1, so the tables follow the sampled tokens instead). A request
        seen for the first time, or whose tables missed a step (`length` known and not matched),
        starts again from `tokens_before`, its tokens up to this step, cut at a placeholder."""
        absorbed = self.drafter.num_tokens(req_id)
        if absorbed is None or (length is not None and absorbed + len(new_tokens) != length):
            placeholders = np.flatnonzero(tokens_before < 0)
            self.drafter.drop(req_id)
            self.drafter.extend(req_id, tokens_before[:placeholders[0]] if placeholders.size else tokens_before)
        return self.drafter.extend(req_id, new_tokens)

    def drop_finished(self, req_ids) -> None:
        for req_id in req_ids:
            self.drafter.drop(req_id)

    @property
    def state_size(self) -> tuple[int, int]:
        """(requests tracked, N-gram contexts stored): for memory checks."""
        return self.drafter.num_requests, self.drafter.total_entries


class AnpdProposer:
    def __init__(self, vllm_config, runner):
        self.runner = runner
        self.tables = RequestTables(vllm_config)
        adaptive = draft_length_mode(vllm_config.speculative_config) == "adaptive"
        self.min_confidence = MIN_DRAFT_CONFIDENCE if adaptive else 0.0

    def propose(self, num_speculative_tokens: int, input_batch, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        req_ids = input_batch.req_ids
        self.tables.drafter.retain_only(self.runner.requests)
        drafts: list[list[int]] = []
        for row, (req_id, sampled) in enumerate(zip(req_ids, sampled_token_ids)):
            # A prefill chunk, K=0 this step, or no room left: no draft.
            room = self.tables.sync_for_draft(input_batch, row, req_id, num_speculative_tokens) if sampled else 0
            drafts.append(self.tables.drafter.draft(req_id, room, self.min_confidence) if room > 0 else [])
        return drafts

    def drop_finished(self, req_ids) -> None:
        self.tables.drop_finished(req_ids)

    def load_model(self, *args, **kwargs) -> None:
        pass  # training-free

    @property
    def state_size(self) -> tuple[int, int]:
        return self.tables.state_size
