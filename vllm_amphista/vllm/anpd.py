"""ANPD inside vLLM: per-request adaptive N-gram tables, drafts verified by vLLM.

Synchronous scheduling: runs after the runner's bookkeeping, like vLLM's ngram
proposer, on the CPU copy of each request's tokens. Async scheduling (vLLM's
default where the platform allows it): that copy holds placeholders, so every
step the tables absorb the sampler's tokens before bookkeeping
(`absorb_sampled`, as the hybrid's do), which also gives vLLM each request's
last token and count of valid tokens for its next step (what EAGLE-type
drafters hand it); the drafts go back as one [B, K] tensor, and the next step
verifies only each request's real draft (`draft_lengths`: patch 5 trims the
scheduled placeholders, as vLLM trims its `ngram_gpu` drafts; the scheduler, and
so the load-aware draft length, counts the cut positions as rejected, which
makes it draft more cautiously than under synchronous scheduling). Either way the
tables (vllm_amphista/anpd.py) absorb only the tokens added since the last
step, so a step costs what was accepted, not the context length. Finished and
aborted requests are dropped the step vLLM frees them (`drop_finished`, called
from the runner's state update); a request the scheduler skips or preempts
leaves the batch but not the runner, and keeps its tables until it returns.
Given a directory as `model` (a heads dir that ships `answer_ngrams.npz`, or `train ngrams`'
output), the tables fall back on the target's answer n-grams where no context of the request
matches.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_amphista.anpd import AnpdDrafter
from vllm_amphista.answer_ngrams import AnswerNgrams, load_from_dir
from vllm_amphista.draft_length import ConfidenceCut
from vllm_amphista.vllm.config import anpd_answer_ngrams_dir, draft_length_mode

# Contexts kept per request: a 4k-token request needs about 5 x 4k at N=6.
MAX_CONTEXTS_PER_REQUEST = 65536
# With a load-aware draft length, a request's draft stops where the n-gram chain's confidence
# (anpd.NgramTables._predict) falls below this, at batch sizes where verifying drafts costs the step
# (draft_length.ConfidenceCut): weak matches are not verified for nothing.
MIN_DRAFT_CONFIDENCE = 0.1


class RequestTables:
    """Each live request's N-gram tables, kept in step with vLLM's input batch: shared by the
    ANPD and hybrid proposers."""

    def __init__(self, vllm_config, fallback: AnswerNgrams | None = None):
        spec = vllm_config.speculative_config
        self.max_model_len = vllm_config.model_config.max_model_len
        self.drafter = AnpdDrafter(
            max_n=spec.prompt_lookup_max + 1,
            max_entries_per_request=MAX_CONTEXTS_PER_REQUEST,
            num_speculative_tokens=spec.num_speculative_tokens,
            fallback=fallback,
        )

    def sync_for_draft(self, input_batch, row: int, req_id: str, k: int) -> int:
        """Tokens a request may draft (k, less where max_model_len leaves no room); when any,
        its tables have absorbed its tokens so far."""
        num_tokens = int(input_batch.num_tokens_no_spec[row])
        room = min(k, self.max_model_len - num_tokens)
        if room > 0:
            self.drafter.sync(req_id, input_batch.token_ids_cpu[row, :num_tokens])
        return room

    def absorb_sampled(self, runner, sampled_rows: list[list[int]], length_known: bool
                       ) -> tuple[dict[str, int], list[list[int]]]:
        """Each request that gained tokens this step absorbs them, from the sampler's [B, 1+K]
        output read before bookkeeping (-1 where rejected); returns those requests' lengths, and
        each row's valid tokens (none for a prefill chunk). `length_known`: the runner's count of
        tokens before this step holds no placeholders (synchronous scheduling), so tables that
        missed a step are noticed and rebuilt."""
        batch = runner.input_batch
        discarded = runner.discard_request_mask.np
        # Requests the scheduler skips for a step leave the batch, not the runner: keep their tables.
        self.drafter.retain_only(runner.requests)
        lengths, valid_rows = {}, []
        for row, sampled in enumerate(sampled_rows):
            # A prefill chunk samples nothing real.
            new = [] if discarded[row] else [token for token in sampled if 0 <= token < batch.vocab_size]
            valid_rows.append(new)
            if not new:
                continue
            req_id, before = batch.req_ids[row], int(batch.num_tokens_no_spec[row])
            length = before + len(new) if length_known else None
            # A view: read only when the request's tables start.
            lengths[req_id] = self.absorb_step(req_id, new, batch.token_ids_cpu[row, :before], length)
        return lengths, valid_rows

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
        spec = vllm_config.speculative_config
        self.tables = RequestTables(vllm_config, load_from_dir(anpd_answer_ngrams_dir(spec.model)))
        # Fixed draft lengths draft every match; the start-up timing calibrates the cut.
        self.confidence_cut = ConfidenceCut(MIN_DRAFT_CONFIDENCE if draft_length_mode(spec) == "adaptive" else 0.0,
                                            spec.num_speculative_tokens)
        self.async_scheduling = vllm_config.scheduler_config.async_scheduling
        # Async scheduling only: the requests that gained tokens this step -> their length; each
        # request's last token and count of valid sampled tokens, for vLLM's next step; and the
        # length of each request's real draft, to which the next step's placeholders are trimmed.
        self._lengths: dict[str, int] = {}
        self._next_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None
        self.draft_lengths: dict[str, int] = {}

    def propose(self, num_speculative_tokens: int, input_batch, sampled_token_ids: list[list[int]]
                ) -> list[list[int]] | torch.Tensor:
        if self.async_scheduling:
            return self._propose_padded(num_speculative_tokens, input_batch)
        req_ids = input_batch.req_ids
        self.tables.drafter.retain_only(self.runner.requests)
        min_confidence = self.confidence_cut(input_batch.num_reqs)
        drafts: list[list[int]] = []
        for row, (req_id, sampled) in enumerate(zip(req_ids, sampled_token_ids)):
            # A prefill chunk, K=0 this step, or no room left: no draft.
            room = self.tables.sync_for_draft(input_batch, row, req_id, num_speculative_tokens) if sampled else 0
            drafts.append(self.tables.drafter.draft(req_id, room, min_confidence) if room > 0 else [])
        return drafts

    def _propose_padded(self, k: int, input_batch) -> torch.Tensor:
        """[B, k] drafts for async scheduling; a row's tokens past its real draft are never verified."""
        drafts = torch.zeros((input_batch.num_reqs, k), dtype=torch.int64)
        self.draft_lengths = {}
        min_confidence = self.confidence_cut(input_batch.num_reqs)
        for row, req_id in enumerate(input_batch.req_ids):
            length = self._lengths.get(req_id)
            room = min(k, self.tables.max_model_len - length) if length else 0
            draft = self.tables.drafter.draft(req_id, room, min_confidence) if room > 0 else []
            if draft:
                drafts[row, :len(draft)] = torch.tensor(draft)
                self.draft_lengths[req_id] = len(draft)
        return drafts.to(self.runner.device)

    def absorb_sampled(self, sampled_token_ids: torch.Tensor) -> None:
        """Async scheduling only, every step before bookkeeping: the tables absorb the sampler's
        tokens, and each row's last token (vLLM's backup token where a prefill chunk's sample is
        discarded) and count of valid tokens are kept for `take_next_token_ids`."""
        if not self.async_scheduling:
            return
        self._lengths, valid_rows = self.tables.absorb_sampled(self.runner, sampled_token_ids.tolist(),
                                                               length_known=False)
        self.draft_lengths = {}  # no draft unless this step's propose runs
        batch = self.runner.input_batch
        next_ids, counts = [], []
        for row, valid in enumerate(valid_rows):
            if valid:
                next_ids.append(valid[-1])
            else:
                req_id = batch.req_ids[row]
                next_ids.append(self.runner.requests[req_id].get_token_id(int(batch.num_tokens_no_spec[row]) - 1))
            counts.append(len(valid))
        device = sampled_token_ids.device
        self._next_token_ids = (torch.tensor(next_ids, dtype=torch.int32, device=device),
                                torch.tensor(counts, dtype=torch.int32, device=device))

    def take_next_token_ids(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """([B] each row's last token, [B] its count of valid sampled tokens) from this step's
        sampler, once; None under synchronous scheduling."""
        next_token_ids, self._next_token_ids = self._next_token_ids, None
        return next_token_ids

    def drop_finished(self, req_ids) -> None:
        self.tables.drop_finished(req_ids)

    def load_model(self, *args, **kwargs) -> None:
        pass  # training-free

    @property
    def state_size(self) -> tuple[int, int]:
        return self.tables.state_size
