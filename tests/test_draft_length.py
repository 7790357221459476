"""The load-aware draft-length controller's maths (no vLLM)."""

import random

import pytest

from vllm_amphista.draft_length import (AdaptiveDraftLength, ConfidenceCut, DraftAcceptance, StepCost,
                                        calibration_sizes)


# Start-up timings of a drafter with stages that wait at K=0 (Amphista's), seconds by step size.
STAGES = {n: 0.001 for n in range(1, 41)}


def batch(request: tuple[int, int, int], size: int, first: int = 0) -> dict[str, tuple[int, int, int]]:
    """`size` requests alike, by id: (tokens scheduled, drafted, accepted)."""
    return {str(first + i): request for i in range(size)}


def test_step_cost_interpolates_and_extrapolates_pessimistically():
    cost = StepCost()
    assert cost.predict(4) is None
    cost.observe(1, 0.010)
    cost.observe(5, 0.014)
    assert cost.predict(3) == pytest.approx(0.012)
    assert cost.predict(1) == pytest.approx(0.010)
    assert cost.predict(10) == pytest.approx(0.028)  # never measured: proportional to tokens


def test_step_cost_reads_a_size_low_among_its_recent_steps():
    cost = StepCost()
    for seconds in (0.014, 0.024, 0.100, 0.090):  # two of four slowed by something else running
        cost.observe(5, seconds)
    assert cost.predict(5) == pytest.approx(0.014)
    for _ in range(30):  # a spell of 30 slow steps: the second fastest of the last 64 holds
        cost.observe(5, 0.100)
    assert cost.predict(5) == pytest.approx(0.024)
    for _ in range(63):  # the step itself got dearer (longer contexts): followed within a window
        cost.observe(5, 0.030)
    assert cost.predict(5) == pytest.approx(0.030)
    cost.observe(5, 0.020)  # cheaper again (new requests, short contexts): read after two steps
    cost.observe(5, 0.021)
    assert cost.predict(5) == pytest.approx(0.021)


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


def simulate(step_seconds, accept_probability: float, batch_size: int, steps: int = 400, max_k: int = 4,
             drafter_seconds: float = 0.0) -> list[int]:
    """Run the controller against a step-time law (plus drafter_seconds in steps that propose
    drafts, timed at start-up) and i.i.d. acceptance; return the K it chose. A step verifies the drafts the step
    before it proposed."""
    rng = random.Random(0)
    controller = AdaptiveDraftLength(max_k)
    if drafter_seconds:  # timed at start-up
        sizes = range(1, batch_size * (max_k + 1) + 1)
        controller.calibrate({n: step_seconds(n) + drafter_seconds for n in sizes},
                             {n: drafter_seconds for n in sizes})
    chosen = []
    pending = 0  # the draft length of the drafts the next step verifies
    for _ in range(steps):
        k = controller[batch_size]
        chosen.append(k)
        requests = {}
        for req_id in range(batch_size):
            accepted = 0
            while accepted < pending and rng.random() < accept_probability:
                accepted += 1
            requests[str(req_id)] = (1 + pending, pending, accepted)
        seconds = step_seconds(sum(n for n, _, _ in requests.values())) + (drafter_seconds if k else 0.0)
        controller.observe_step(requests, seconds, k_proposed=k)
        pending = k
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


def test_no_drafts_when_only_the_drafter_makes_drafting_lose():
    # Verification nearly free, but the drafter costs as much as a step: K=1 gives 1.6x the
    # tokens for 2x the time.
    chosen = simulate(lambda tokens: 0.010 + 0.0001 * tokens, accept_probability=0.6, batch_size=4,
                      drafter_seconds=0.010)
    assert sum(k == 0 for k in chosen) > 0.8 * len(chosen)


def test_a_step_without_drafts_is_timed_again_after_a_slow_spell_made_drafting_look_better():
    # Batch 8 on a CPU where verifying is dear: a step of 8 tokens takes 48 ms, one of 16 takes 75
    # plus 15 of drafter, so K=1 (1.6 tokens a request) loses to K=0. While the engine starts and
    # for its first steps something else running slows the steps of 8 tokens, so the controller
    # turns to K=1; it must find its way back, though a step of 8 tokens then runs only when it
    # tries K=0.
    timings = [0]

    def step_seconds(tokens: int) -> float:
        timings[0] += 1
        if tokens == 8 and timings[0] <= 50:  # 16 timed at start-up, then the first steps
            return 0.150
        return 0.048 + 0.027 * (tokens - 8) / 8

    chosen = simulate(step_seconds, accept_probability=0.6, batch_size=8, max_k=1, drafter_seconds=0.015)
    assert sum(k == 0 for k in chosen) > 0.8 * len(chosen)


def test_tries_of_other_draft_lengths_thin_out_while_they_change_nothing():
    # A drafter with stages that wait at K=0 (timed at start-up): its tries make them catch up.
    controller = AdaptiveDraftLength(max_k=4, explore_every=16, max_explore_every=256)
    controller.calibrate({n: 0.010 * n for n in range(1, 41)}, STAGES)  # compute bound: K=0 is best
    tries = [controller[8] for _ in range(1000)]
    # Gaps doubling from 16 to 256: tries at choices 16, 48, 112, 240, 496 and 752 (every 32nd: 31).
    assert tries.count(1) == 6 and set(tries) == {0, 1}
    controller.calibrate({n: 0.010 for n in range(1, 41)}, STAGES)  # verifying became free: K=4 is best
    after = [controller[8] for _ in range(300)]
    # Within the current gap (at most 256 choices) the best has moved: gaps start again at 16.
    first_try = next(i for i, k in enumerate(after) if k != 4)
    assert first_try < 256 and after[first_try + 1:].count(3) >= 2


def test_when_the_best_moves_the_next_try_goes_back_soon():
    # A best K read from one slow spell may be wrong: the K it left is tried again within
    # explore_every choices, not after the long gap the tries had thinned out to.
    controller = AdaptiveDraftLength(max_k=4, explore_every=16, max_explore_every=256)
    controller.calibrate({n: 0.010 * n for n in range(1, 41)}, STAGES)  # compute bound: K=0 is best
    tries = [controller[8] for _ in range(760)]  # the try at choice 752 starts a gap of 256
    assert tries[751] == 1 and tries.count(1) == 6
    controller.calibrate({n: 0.010 for n in range(1, 41)}, STAGES)  # verifying became free: K=4 is best
    after = [controller[8] for _ in range(64)]
    first_try = next(i for i, k in enumerate(after) if k != 4)
    assert first_try <= 16 and after[first_try] == 3


def test_a_host_side_drafters_tries_do_not_thin_out():
    controller = AdaptiveDraftLength(max_k=4, explore_every=16, max_explore_every=256)
    controller.calibrate({n: 0.010 * n for n in range(1, 41)}, {})  # compute bound: K=0 is best
    tries = [controller[8] for _ in range(1000)]
    assert tries.count(1) == 1000 // 16


def test_a_host_side_drafter_keeps_drafting_through_slow_spells():
    # Batch 1, verifying nearly free, an n-gram match 60% of the time and its first token accepted
    # 25% of the time: drafting pays. Slow spells (twice the time, 20 steps) start at 3% of steps,
    # so a size that verifies drafts is often read slow, K=0 looks best, and only tries time it
    # again: spaced out, a try lands in a spell as often as not and K=0 stays.
    def run(seed: int) -> float:
        rng = random.Random(seed)
        controller = AdaptiveDraftLength(max_k=4)
        controller.calibrate({n: 0.025 * (1 + 0.02 * (n - 1)) for n in range(1, 6)}, {})
        pending = spell = idle = 0
        for _ in range(520):
            k = controller[1]
            idle += k == 0
            drafted = pending if rng.random() < 0.6 else 0
            accepted = 0
            while accepted < drafted and rng.random() < 0.25:
                accepted += 1
            spell = 20 if not spell and rng.random() < 0.03 else max(spell - 1, 0)
            seconds = (2.0 if spell else 1.0) * 0.025 * (1 + 0.02 * drafted) * (1 + 0.1 * rng.random())
            controller.observe_step({"0": (1 + drafted, drafted, accepted)}, seconds, k)
            pending = k
        return idle / 520

    assert max(run(seed) for seed in range(30)) < 0.5


def test_a_step_that_proposes_nothing_is_spared_the_drafters_time():
    controller = AdaptiveDraftLength(max_k=1, explore_every=0)
    controller.calibrate({8: 0.030, 16: 0.040}, {8: 0.010, 16: 0.012})
    # At the prior acceptance of 0.5: K=1 gives 12 tokens in 40 ms, K=0 8 tokens in 30 - 10 ms.
    assert controller.best(8) == 0
    without_the_drafter = AdaptiveDraftLength(max_k=1, explore_every=0)
    without_the_drafter.calibrate({8: 0.030, 16: 0.040}, {})
    assert without_the_drafter.best(8) == 1
    controller.observe_step({}, None, k_proposed=0)
    controller.observe_step(batch((1, 0, 0), 8), 0.050, k_proposed=0)  # the first real step: an idle one
    # It is stored as the step it would have been with the drafter, 60 ms: twice the start-up time.
    assert controller.cost.predict(8) == pytest.approx(0.060) and controller.cost.predict(16) == pytest.approx(0.080)
    assert controller.best(8) == 0  # K=0: 8 tokens in 50 ms beat 12 in 80


def test_the_drafters_real_cost_is_learned_where_steps_with_and_without_it_ran():
    controller = AdaptiveDraftLength(max_k=1, explore_every=0)
    controller.calibrate({8: 0.030, 16: 0.040}, {8: 0.010, 16: 0.012})
    one_draft_each = batch((2, 1, 1), 4) | batch((2, 1, 0), 4, first=4)  # 16 tokens verified
    controller.observe_step(one_draft_each, 0.060, k_proposed=1)
    controller.observe_step(one_draft_each, 0.042, k_proposed=0)  # the drafter cost 18 ms here, not 12
    assert controller.drafter_cost.predict(16) == pytest.approx(0.018)
    assert controller.drafter_cost.predict(8) == pytest.approx(0.015)  # start-up D scaled as at 16
    assert controller.cost.predict(16) == pytest.approx(0.060)  # the idle step, with its real D added back
    # The first step to propose after an idle one also catches the stages up: not a drafting step's price.
    controller.observe_step(batch((1, 0, 0), 8), 0.100, k_proposed=1)
    assert controller.cost.predict(8) == pytest.approx(0.045)  # still start-up T(8) scaled as at 16
    controller.observe_step(batch((1, 0, 0), 8), 0.050, k_proposed=1)
    # A step of 8 tokens that proposes nothing never ran: 50 - 15 ms, not 50 - 10.
    assert 8 / controller.rate(8, 0) == pytest.approx(0.035)


def test_acceptance_is_counted_against_the_draft_length_the_drafts_were_proposed_with():
    controller = AdaptiveDraftLength(max_k=4, explore_every=0)
    controller.observe_step({}, None, k_proposed=2)  # a step that only proposed (after a prefill)
    # Two draft tokens asked, two drafted: position 3 was not asked for, so it keeps its prior count.
    controller.observe_step(batch((3, 2, 2), 1), None, k_proposed=4)
    asked = controller.acceptance._asked
    assert asked[1] > 2.0 and asked[2] == pytest.approx(2.0)


def test_start_up_timings_are_scaled_by_the_nearest_real_step():
    cost = StepCost()
    cost.calibrate({1: 0.010, 5: 0.012, 10: 0.020})
    assert cost.sizes == [1, 5, 10] and cost.predict(3) == pytest.approx(0.011)
    cost.observe(5, 0.018)  # a real step costs 1.5x the model alone
    assert cost.predict(1) == pytest.approx(0.015) and cost.predict(10) == pytest.approx(0.030)
    cost.observe(10, 0.040)  # each size not run for real follows its nearest real one
    assert cost.predict(1) == pytest.approx(0.015) and cost.predict(10) == pytest.approx(0.040)
    assert cost.predict(20) == pytest.approx(0.080)  # beyond the table: in proportion to tokens
    cost.observe(3, 0.022)  # between start-up sizes: 2x the start-up time interpolated there
    assert cost.predict(1) == pytest.approx(0.020)
    cost.observe(10, 0.050)  # from then on, low among the last few
    assert cost.predict(10) == pytest.approx(0.040)


def test_calibration_sizes_cover_one_to_k_plus_one_tokens_per_request():
    assert calibration_sizes(4, max_batch_size=1, max_tokens=2048) == [1, 2, 3, 4, 5]
    sizes = calibration_sizes(4, max_batch_size=256, max_tokens=2048)
    assert {4, 20, 16 * 5} <= set(sizes) and max(sizes) == 16 * 5
    assert max(calibration_sizes(4, max_batch_size=256, max_tokens=32)) <= 32


def test_a_calibrated_controller_decides_from_the_first_step():
    cheap_verification = AdaptiveDraftLength(max_k=4, explore_every=0)
    assert cheap_verification.best(1) == 4  # nothing timed: as configured
    cheap_verification.calibrate({1: 0.010, 5: 0.011}, {})
    assert cheap_verification.best(1) > 0
    compute_bound = AdaptiveDraftLength(max_k=4, explore_every=0)
    steps = {n: 0.010 * n for n in range(1, 6)}  # emulated bf16: K+1 tokens cost K+1 steps
    compute_bound.calibrate(steps, {})
    assert compute_bound.best(1) == 0


def test_summary_counts_the_choices_since_the_last_one():
    controller = AdaptiveDraftLength(max_k=4, explore_every=0)
    controller.calibrate({n: 0.010 * n for n in range(1, 6)}, {1: 0.002})  # drafts never pay: K=0
    for _ in range(3):
        controller[2]
    controller[1]
    summary = controller.summary()
    assert "batch 1: K=0 x1; batch 2: K=0 x3" in summary
    assert "acceptance by position [0.50, 0.50, 0.50, 0.50]" in summary and "verified {1: 10.0, 2: 20.0" in summary
    assert "of them the drafter's {1: 2.0}" in summary
    assert "draft length chosen (none)" in controller.summary()


def test_weak_drafts_are_cut_only_where_verifying_them_costs_the_step():
    cut = ConfidenceCut(min_confidence=0.1, max_k=4)
    assert cut(1) == 0.1 and cut.timed_batch_sizes == []  # not calibrated: cut
    # Batch 1: 5 tokens cost what 1 does (bf16 oneDNN on a Zen 4); batch 2: 1% a token; batch 4: 12%.
    cut.calibrate({1: 0.020, 2: 0.020, 4: 0.021, 5: 0.019, 8: 0.022, 10: 0.0208, 20: 0.0308})
    assert cut.timed_batch_sizes == [1, 2, 4]
    assert [cut(b) for b in (1, 2, 3, 4)] == [0.0, 0.0, 0.1, 0.1]  # batch 3 read at 4, the next timed size
    assert cut(5) == 0.1  # above every batch size with a full draft timed
    cut.calibrate({1: 0.020, 5: 0.030})  # 12.5% a token
    assert cut(1) == 0.1


def test_a_host_side_drafter_is_never_priced_from_two_steps_noise():
    controller = AdaptiveDraftLength(max_k=1, explore_every=0)
    controller.calibrate({1: 0.020, 2: 0.021}, {})  # ANPD: no part of the step is the drafter's
    controller.observe_step(batch((1, 0, 0), 1), 0.023, k_proposed=1)
    controller.observe_step(batch((1, 0, 0), 1), 0.020, k_proposed=0)  # 3 ms of noise apart
    assert controller.drafter_cost.sizes == []
    assert 1 / controller.rate(1, 0) >= 0.020  # K=0 costs a real step, not 3 ms less


def test_leaving_k0_is_charged_the_catch_up_of_the_stages_backlog():
    # Batch 2, the drafter's stages 2 ms a token: K=1 gives 3 tokens in 60 ms, K=0 2 in 44 (10% less).
    controller = AdaptiveDraftLength(max_k=1, explore_every=0, max_backlog=256)
    sizes = range(1, 17)
    controller.calibrate({n: 0.036 + 0.006 * n for n in sizes}, {n: 0.002 * n for n in sizes})
    assert controller.best(2) == 1
    for _ in range(40):
        controller.observe_step(batch((1, 0, 0), 2), 0.044, k_proposed=0)
    # 80 positions owed at the start-up 2 ms a token: 160 ms, 10 ms a step over 16 steps: K=0 stays.
    assert controller.catch_up_seconds() == pytest.approx(0.160)
    assert controller.best(2) == 0
    controller.observe_step(batch((1, 0, 0), 2), 0.048 + 0.040, k_proposed=1)  # the catch-up: 0.5 ms a position
    assert controller.catch_up_seconds() == 0.0 and controller.best(2) == 1
    controller.observe_step(batch((2, 1, 1), 2), 0.052, k_proposed=0)  # both drafts accepted: 2 positions each
    for _ in range(39):
        controller.observe_step(batch((1, 0, 0), 2), 0.044, k_proposed=0)
    assert controller.catch_up_seconds() == pytest.approx(0.041)  # learned: 2.6 ms a step, drafting still pays
    assert controller.best(2) == 1
    # Requests that left are no longer owed; at the bound the drafter catches up by itself.
    controller.observe_step(batch((1, 0, 0), 1), 0.040, k_proposed=0)
    assert controller.catch_up_seconds() == pytest.approx(42 * 0.0005)
    for _ in range(214):
        controller.observe_step(batch((1, 0, 0), 1), 0.040, k_proposed=0)
    assert controller.catch_up_seconds() == 0.0


def test_a_host_side_drafter_owes_no_catch_up():
    controller = AdaptiveDraftLength(max_k=1, explore_every=0, max_backlog=256)
    controller.calibrate({1: 0.020, 2: 0.021}, {})  # ANPD: nothing of its own skipped at K=0
    for _ in range(40):
        controller.observe_step(batch((1, 0, 0), 1), 0.020, k_proposed=0)
    assert controller.catch_up_seconds() == 0.0 and controller.best(1) == 1
