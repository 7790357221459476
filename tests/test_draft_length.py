"""The load-aware draft-length controller's maths (no vLLM)."""

import random

import pytest

from vllm_amphista.draft_length import AdaptiveDraftLength, DraftAcceptance, StepCost


def test_step_cost_interpolates_and_extrapolates_pessimistically():
    cost = StepCost()
    assert cost.predict(4) is None
    cost.observe(1, 0.010)
    cost.observe(5, 0.014)
    assert cost.predict(3) == pytest.approx(0.012)
    assert cost.predict(1) == pytest.approx(0.010)
    assert cost.predict(10) == pytest.approx(0.028)  # never measured: proportional to tokens
    cost.observe(5, 0.024)  # smoothed, not replaced
    assert 0.014 < cost.predict(5) < 0.024


def test_acceptance_by_position_and_early_stops():
    acceptance = DraftAcceptance(max_k=3, prior_weight=1e-9)
    for _ in range(100):
        acceptance.observe(num_asked=3, num_drafted=3, num_accepted=1)  # first accepted, second rejected
        acceptance.observe(num_asked=3, num_drafted=1, num_accepted=0)  # a draft that stopped after one token
    first, second, _ = acceptance.acceptance_by_position()
    assert first == pytest.approx(0.5, abs=0.01) and second == pytest.approx(0.0, abs=0.01)
    verified, accepted = acceptance.expected(3)
    # Position 1 is always drafted, positions 2 and 3 by half the requests.
    assert verified == pytest.approx(2.0, abs=0.02) and accepted == pytest.approx(0.5, abs=0.02)


def simulate(step_seconds, accept_probability: float, batch_size: int, steps: int = 400, max_k: int = 4) -> list[int]:
    """Run the controller against a step-time law and i.i.d. acceptance; return the K it chose."""
    rng = random.Random(0)
    controller = AdaptiveDraftLength(max_k)
    chosen = []
    for _ in range(steps):
        k = controller[batch_size]
        chosen.append(k)
        requests = []
        for _ in range(batch_size):
            accepted = 0
            while accepted < k and rng.random() < accept_probability:
                accepted += 1
            requests.append((1 + k, k, accepted))
        controller.observe_step(requests, step_seconds(sum(n for n, _, _ in requests)))
    return chosen[steps // 2:]


def test_full_drafts_when_verification_is_nearly_free():
    # One request: weights are read once, 5 tokens cost 10% more than 1.
    chosen = simulate(lambda tokens: 0.010 + 0.00025 * tokens, accept_probability=0.7, batch_size=1)
    assert sum(k == 4 for k in chosen) > 0.8 * len(chosen)


def test_no_drafts_when_the_cores_are_full_and_drafts_fail():
    # 16 requests, compute bound: time grows with every token verified.
    chosen = simulate(lambda tokens: 0.002 * tokens, accept_probability=0.2, batch_size=16)
    assert sum(k == 0 for k in chosen) > 0.8 * len(chosen)


def test_short_drafts_in_between():
    # Expected tokens/s by K: 333, 457, 490, 483, 462.
    chosen = simulate(lambda tokens: 0.020 + 0.0005 * tokens, accept_probability=0.6, batch_size=8)
    assert sorted(chosen)[len(chosen) // 2] in (2, 3)


def test_start_up_timings_are_shifted_by_the_first_real_step():
    cost = StepCost()
    cost.calibrate({1: 0.010, 5: 0.012, 10: 0.020})
    assert cost.sizes == [1, 5, 10] and cost.predict(3) == pytest.approx(0.011)
    cost.observe(5, 0.015)  # a real step costs 3 ms more than the model alone at every size
    assert cost.predict(1) == pytest.approx(0.013) and cost.predict(10) == pytest.approx(0.023)
    cost.observe(1, 0.033)  # from then on, smoothed as before
    assert cost.predict(1) == pytest.approx(0.013 + 0.2 * 0.020)


def test_calibration_sizes_cover_one_to_k_plus_one_tokens_per_request():
    controller = AdaptiveDraftLength(max_k=4)
    assert controller.calibration_sizes(max_batch_size=1, max_tokens=2048) == [1, 2, 3, 4, 5]
    sizes = controller.calibration_sizes(max_batch_size=256, max_tokens=2048)
    assert {4, 20, 16 * 5} <= set(sizes) and max(sizes) == 16 * 5
    assert max(controller.calibration_sizes(max_batch_size=256, max_tokens=32)) <= 32


def test_a_calibrated_controller_decides_from_the_first_step():
    cheap_verification = AdaptiveDraftLength(max_k=4, explore_every=0)
    assert cheap_verification.best(1) == 4  # nothing timed: as configured
    cheap_verification.cost.calibrate({1: 0.010, 5: 0.011})
    assert cheap_verification.best(1) > 0
    compute_bound = AdaptiveDraftLength(max_k=4, explore_every=0)
    compute_bound.cost.calibrate({n: 0.010 * n for n in range(1, 6)})  # emulated bf16: K+1 tokens cost K+1 steps
    assert compute_bound.best(1) == 0


def test_summary_counts_the_choices_since_the_last_one():
    controller = AdaptiveDraftLength(max_k=4, explore_every=0)
    controller.cost.calibrate({n: 0.010 * n for n in range(1, 6)})  # drafts never pay: K=0
    for _ in range(3):
        controller[2]
    controller[1]
    summary = controller.summary()
    assert "batch 1: K=0 x1; batch 2: K=0 x3" in summary
    assert "acceptance by position [0.50, 0.50, 0.50, 0.50]" in summary and "1: 10.0" in summary
    assert "draft length chosen (none)" in controller.summary()
