"""On CPU the Amphista proposer prepares the drafter's inputs in plain Python (`prepare_*_padded`,
and `_set_kept_inputs` for the first pass without the rows of rejected drafts): they must give what
vLLM's own (its C++ kernels on CPU) gives, value for value and dtype for dtype, for batches of
requests that accepted all, some or none of their drafts, drafted nothing (a prefill), or had their
sample discarded (a partial prefill chunk)."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.utils import CpuGpuBuffer

from vllm_amphista.vllm.amphista import AmphistaProposer

VOCAB_SIZE = 1000
MAX_REQS = 16

pytestmark = pytest.mark.skipif(not current_platform.is_cpu(), reason="the host-side path is vLLM-CPU's")


@pytest.fixture(scope="module", autouse=True)
def vllms_cpu_kernels():
    # What vLLM-CPU registers at engine start-up: its C++ stand-ins for the Triton kernels.
    current_platform.register_triton_kernel_overrides()


def _batch(rng: random.Random, num_reqs: int, num_spec_tokens: int):
    """A step's sampler output and runner state for `num_reqs` requests."""
    req_ids = [f"req-{i}" for i in range(num_reqs)]
    history = {req_id: [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(2, 30))] for req_id in req_ids}
    sampled = torch.full((num_reqs, num_spec_tokens + 1), -1, dtype=torch.int32)
    num_draft_tokens, discarded = [], torch.zeros(MAX_REQS, dtype=torch.bool)
    for row in range(num_reqs):
        kind = rng.choice(["decode", "decode", "prefill", "discarded"])
        drafted = rng.randrange(1, num_spec_tokens + 1) if kind == "decode" else 0
        num_draft_tokens.append(drafted)
        discarded[row] = kind == "discarded"
        if kind != "discarded":
            valid = rng.randrange(1, drafted + 2) if kind == "decode" else 1
            sampled[row, :valid] = torch.tensor([rng.randrange(VOCAB_SIZE) for _ in range(valid)], dtype=torch.int32)
    query_lengths = [drafted + 1 if drafted else rng.randrange(1, 9) for drafted in num_draft_tokens]
    query_start_loc = torch.tensor([0, *np.cumsum(query_lengths)], dtype=torch.int32)
    seq_lens = torch.tensor([len(history[req_id]) + length for req_id, length in zip(req_ids, query_lengths)],
                            dtype=torch.int32)
    num_tokens = int(query_start_loc[-1])
    cad = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc,
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens,
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lengths),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.zeros(num_reqs, 8, dtype=torch.int32),
        slot_mapping=torch.arange(num_tokens + 7, dtype=torch.int64),
    )
    input_batch = SimpleNamespace(
        num_reqs=num_reqs, req_ids=req_ids, vocab_size=VOCAB_SIZE,
        num_tokens_no_spec=np.array([len(history[req_id]) for req_id in req_ids]))
    requests = {req_id: SimpleNamespace(get_token_id=tokens.__getitem__) for req_id, tokens in history.items()}
    spec_decode_metadata = SimpleNamespace(cu_num_draft_tokens=torch.tensor(np.cumsum(num_draft_tokens),
                                                                            dtype=torch.int32))
    return sampled, requests, input_batch, discarded, cad, spec_decode_metadata


@pytest.mark.parametrize("seed", range(20))
def test_host_side_inputs_equal_vllms(seed):
    rng = random.Random(seed)
    num_reqs, num_spec_tokens = rng.randrange(1, 9), rng.randrange(1, 6)
    sampled, requests, input_batch, discarded, cad, spec_decode_metadata = _batch(rng, num_reqs, num_spec_tokens)
    vllms_self = SimpleNamespace(backup_next_token_ids=CpuGpuBuffer(MAX_REQS, dtype=torch.int32, device="cpu",
                                                                    pin_memory=False))
    ours_self = SimpleNamespace(host_side=True)

    expected = EagleProposer.prepare_next_token_ids_padded(vllms_self, sampled, requests, input_batch, discarded)
    got = AmphistaProposer.prepare_next_token_ids_padded(ours_self, sampled, requests, input_batch, discarded)
    for ours, vllms in zip(got, expected, strict=True):
        assert ours.dtype == vllms.dtype
        assert ours.tolist() == vllms.tolist()
    valid_counts = expected[1]

    expected_cad, *expected_tensors = EagleProposer.prepare_inputs_padded(None, cad, spec_decode_metadata,
                                                                          valid_counts)
    got_cad, *got_tensors = AmphistaProposer.prepare_inputs_padded(ours_self, cad, spec_decode_metadata,
                                                                   valid_counts)
    for ours, vllms in zip(got_tensors, expected_tensors, strict=True):
        assert ours.dtype == vllms.dtype
        assert ours.tolist() == vllms.tolist()
    for field in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "causal"):
        assert getattr(got_cad, field) == getattr(expected_cad, field), field
    for field in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "slot_mapping", "block_table_tensor"):
        assert torch.equal(getattr(got_cad, field), getattr(expected_cad, field)), field


def _first_pass_stand_in(num_tokens: int, hidden_size: int):
    """What `set_inputs_first_pass` and `_set_kept_inputs` read and write of a proposer."""
    stand_in = SimpleNamespace(
        input_ids=torch.zeros(num_tokens + 8, dtype=torch.int32),
        positions=torch.zeros(num_tokens + 8, dtype=torch.int64),
        hidden_states=torch.zeros(num_tokens + 8, hidden_size), needs_extra_input_slots=False,
        use_heterogeneous_vocab=False, target_uses_mrope=False)
    stand_in._set_positions = lambda count, positions: AmphistaProposer._set_positions(stand_in, count, positions)
    stand_in.set_inputs_first_pass = lambda *args: EagleProposer.set_inputs_first_pass(stand_in, *args)
    return stand_in


@pytest.mark.parametrize("seed", range(20))
def test_kept_inputs_are_vllms_without_the_rejected_rows(seed):
    """`_set_kept_inputs` gives vLLM's first-pass inputs (`set_inputs_first_pass`) with each request's
    rows of rejected drafts left out: the same tokens, positions and features in the rows kept, each
    request's last row the one to draft from, and attention metadata for those rows."""
    rng = random.Random(seed)
    num_reqs, num_spec_tokens = rng.randrange(1, 9), rng.randrange(1, 6)
    sampled, requests, input_batch, discarded, cad, spec_decode_metadata = _batch(rng, num_reqs, num_spec_tokens)
    next_token_ids, valid_counts = AmphistaProposer.prepare_next_token_ids_padded(
        SimpleNamespace(host_side=True), sampled, requests, input_batch, discarded)
    cad, token_indices_to_sample, num_rejected = AmphistaProposer.prepare_inputs_padded(
        SimpleNamespace(host_side=True), cad, spec_decode_metadata, valid_counts)
    num_tokens = cad.num_actual_tokens
    target_token_ids = torch.randint(VOCAB_SIZE, (num_tokens,), dtype=torch.int32)
    target_positions = torch.randint(1000, (num_tokens,), dtype=torch.int64)
    target_hidden_states = torch.randn(num_tokens, 6)
    inputs = (target_token_ids, next_token_ids, target_positions, target_hidden_states, token_indices_to_sample, cad,
              num_rejected)

    vllms = _first_pass_stand_in(num_tokens, 6)
    EagleProposer.set_inputs_first_pass(vllms, *inputs)
    starts, rejected = cad.query_start_loc_cpu.tolist(), num_rejected.tolist()
    kept = [row for start, end, dropped in zip(starts, starts[1:], rejected) for row in range(start, end - dropped)]
    ours = _first_pass_stand_in(num_tokens, 6)
    got_tokens, got_last_rows, got_cad = AmphistaProposer._set_kept_inputs(ours, *inputs)

    assert got_tokens == len(kept) == got_cad.num_actual_tokens
    assert ours.input_ids[:got_tokens].tolist() == vllms.input_ids[kept].tolist()
    assert ours.positions[:got_tokens].tolist() == vllms.positions[kept].tolist()
    assert torch.equal(ours.hidden_states[:got_tokens], vllms.hidden_states[kept])
    assert got_cad.slot_mapping.tolist() == cad.slot_mapping[kept].tolist()
    # Each request's last kept row is the one vLLM drafts from, now in the closed-up rows.
    assert [kept[row] for row in got_last_rows.tolist()] == token_indices_to_sample.tolist()
    assert got_last_rows.dtype == token_indices_to_sample.dtype
    assert got_cad.seq_lens.tolist() == (cad.seq_lens - num_rejected).tolist()
    lengths = [end - start - dropped for start, end, dropped in zip(starts, starts[1:], rejected)]
    assert got_cad.query_start_loc_cpu.tolist() == [0, *np.cumsum(lengths).tolist()]
    assert got_cad.max_query_len == max(lengths)
