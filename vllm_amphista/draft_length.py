"""Load-aware draft length: how many tokens to draft next step, learned online.

Speculation pays when the tokens it adds per step outweigh what verifying
the drafts costs. Both sides change at run time: a step of the target costs
little more for 5 tokens than for 1 when one request runs (weights are read
once), but about 5x as much when 16 requests already fill the cores; and
acceptance depends on the text. So each step the scheduler asks for the K
that maximises expected tokens per second for the batch it is scheduling:

    rate(K) = B * (1 + sum_{i<=K} f_i * P_i) / T(B * (1 + sum_{i<=K} f_i))

with B the batch size, f_i the share of requests whose draft reaches
position i when K >= i (drafters stop early: no n-gram match, a low-
confidence head), P_i the chance that drafted position i is accepted
(product of per-position acceptance), and T(n) the step time for n tokens
verified. K=0 wins when no draft pays.

A step in which the drafter proposes costs more than one in which it does
not (Amphista's stages and heads run; at K=0 the stages wait for the next
drafting step's catch-up pass): T(n) is the time of a step that proposes,
and a step that proposes nothing costs T(n) - D(n), D the drafter's own time.
D starts from start-up timings (none for ANPD, whose drafting is host-side:
its D stays 0) and is learned as T(n) - I(n) wherever real steps that propose
(T) and real steps that propose nothing (I) both ran at n tokens; elsewhere it is the
start-up D scaled by real over start-up D at the nearest such size. A real
drafter costs more than its start-up timing (its glue, the catch-up pass), so
unlearned, K=0 would be priced too high.

T starts from a table timed at engine start-up (the target's forward and
logits, and the drafter's stages and heads, for 1..K+1 tokens per request at
a few batch sizes), so the first requests do not pay for exploring an empty
table. Those timings lack what a real step adds around the model
(scheduling, sampling, output processing, per-request work): a size not yet
run for real is read as its start-up time scaled by real over start-up time
at the nearest size that was. T is learned from the engine's own decode
steps (seconds per step against tokens scheduled, D added back to steps that
proposed nothing, steps that also caught up left out; per size the second
fastest of its last 64 steps, interpolated between sizes; sizes never timed
are extrapolated as if compute bound, which is pessimistic), acceptance from
the tokens the rejection sampler accepted. To keep both current where the
best K is not being run, every `explore_every`-th choice at a batch size tries
one K away from the best; a try of K=0 lasts three steps, since the first
still verifies the last drafts and only the others time what a step without
drafts costs. Amphista's tries cost something (a try of K=1 after K=0 makes
every request catch its stages up), so while they leave the best K where it
was, the choices between them double, up to `max_explore_every`; a host-side
drafter's (ANPD's) stay every `explore_every`th. When the best K moves, the
next try, within `explore_every` choices, goes back to the K it left (a size
read once more may have read slow).

Leaving K=0 has a price of its own where the drafter's stages wait at K=0:
the first drafting step runs them over every position they skipped, a
prefill of up to hundreds of positions a request (at batch 8, three or four
steps' time). The controller follows each request's backlog (positions
stepped at K=0 since its stages last ran) and learns the catch-up's seconds
a position from the steps that ran one (start: the drafter's start-up time a
token at its largest timed size); a K>0 is charged the catch-up of the
current backlog spread over `CATCH_UP_HORIZON` steps. So a batch that
shrinks late in a K=0 stretch, its requests near their end, does not start
drafting for a gain smaller than what catching up costs.

Pure Python, no vLLM: the patches feed it the scheduler's outputs.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque


class StepCost:
    """Seconds per decode step against the number of tokens the target verifies.

    Start-up timings, if any, give the table's shape; real steps its level: a size never run
    for real is read as its start-up time scaled by real over start-up time at the nearest size
    that was (what a real step adds, scheduling, sampling, per-request work, grows with the
    batch as the model's time does)."""

    def __init__(self, window: int = 64) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._startup: dict[int, float] = {}
        # Per size, the second fastest of its last `window` real steps (the fastest of fewer than
        # nine): what else runs on the machine (the engine's front end, the OS) only ever adds time
        # to a step, in spells of up to two dozen steps at twice the time, so a step's own cost sits
        # low among its recent times; a real rise (longer contexts) is followed within a window.
        self._recent: dict[int, deque[float]] = {}
        self._recent_sorted: dict[int, list[float]] = {}  # the same times, kept sorted
        self._measured: dict[int, float] = {}
        # (sizes, seconds) as `predict` reads them, sorted, built once after each change: the
        # controller reads the table for every K at every step.
        self._table: tuple[list[int], list[float]] | None = None

    def calibrate(self, seconds_by_size: dict[int, float]) -> None:
        """Start from model-only timings taken at start-up (tokens -> seconds)."""
        for num_tokens, seconds in seconds_by_size.items():
            if num_tokens >= 1 and seconds > 0.0:
                self._startup[num_tokens] = seconds
        self._table = None

    @property
    def sizes(self) -> list[int]:
        return sorted(self._startup.keys() | self._measured.keys())

    @property
    def timed(self) -> bool:
        """Whether any size has a time (start-up or real)."""
        return bool(self._startup or self._measured)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 1 or seconds <= 0.0:
            return
        recent = self._recent.setdefault(num_tokens, deque(maxlen=self.window))
        ordered = self._recent_sorted.setdefault(num_tokens, [])
        if len(recent) == self.window:
            del ordered[bisect.bisect_left(ordered, recent[0])]
        recent.append(seconds)
        bisect.insort(ordered, seconds)
        measured = ordered[1 if len(ordered) > 8 else 0]
        if self._measured.get(num_tokens) != measured:
            self._measured[num_tokens] = measured
            self._table = None

    def measured(self, num_tokens: int) -> float | None:
        """The second fastest of the last real steps of exactly num_tokens (None if none ran)."""
        return self._measured.get(num_tokens)

    def learn(self, num_tokens: int, seconds: float) -> None:
        """A size's real time found from other tables (it replaces what that size had)."""
        if num_tokens >= 1 and seconds >= 0.0:
            self._recent.pop(num_tokens, None)
            self._recent_sorted.pop(num_tokens, None)
            self._measured[num_tokens] = seconds
            self._table = None

    def predict(self, num_tokens: float) -> float | None:
        """Step time for num_tokens (None before any step was timed)."""
        if self._table is None:
            self._table = self._sorted_table()
        return _interpolate(*self._table, num_tokens)

    def _sorted_table(self) -> tuple[list[int], list[float]]:
        measured = sorted(self._measured)
        startup_sizes = sorted(self._startup)
        startup = (startup_sizes, [self._startup[size] for size in startup_sizes])

        def seconds(size: int) -> float:
            if size in self._measured:
                return self._measured[size]
            if not measured:
                return self._startup[size]
            right = bisect.bisect_left(measured, size)
            near = min(measured[max(right - 1, 0):right + 1], key=lambda m: abs(m - size))
            return self._startup[size] * self._measured[near] / _interpolate(*startup, near)

        sizes = self.sizes
        return sizes, [seconds(size) for size in sizes]


def _interpolate(sizes: list[int], seconds: list[float], num_tokens: float) -> float | None:
    """Linear between sizes (sorted, with their seconds); below the smallest, its time; above the
    largest, in proportion to tokens (never timed this large: as if compute bound)."""
    if not sizes:
        return None
    if num_tokens <= sizes[0]:
        return seconds[0]
    if num_tokens >= sizes[-1]:
        return seconds[-1] * num_tokens / sizes[-1]
    right = bisect.bisect_left(sizes, num_tokens)
    lo, hi = sizes[right - 1], sizes[right]
    return seconds[right - 1] + (seconds[right] - seconds[right - 1]) * (num_tokens - lo) / (hi - lo)


class DraftAcceptance:
    """Per draft position: how often a draft reaches it, and how often it is accepted there.

    Counts decay geometrically so the estimates follow the text being
    generated; a prior keeps positions never tried optimistic enough to be explored.
    """

    def __init__(self, max_k: int, decay: float = 0.995, prior_accept: float = 0.5, prior_weight: float = 2.0):
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.max_k = max_k
        self.decay = decay
        self._reached = [prior_weight] * max_k  # drafts asked to reach position i that did
        self._asked = [prior_weight] * max_k  # drafts asked to reach position i
        self._accepted = [prior_weight * prior_accept] * max_k  # accepted at i, given reached and i-1 accepted
        self._tried = [prior_weight] * max_k  # reached i with i-1 accepted

    def observe(self, num_asked: int, num_drafted: int, num_accepted: int) -> None:
        """One request's verified draft: asked for num_asked tokens, drafted num_drafted, accepted num_accepted."""
        decay = self.decay
        for i in range(min(num_asked, self.max_k)):
            self._asked[i] = self._asked[i] * decay + 1.0
            self._reached[i] = self._reached[i] * decay + (1.0 if i < num_drafted else 0.0)
        for i in range(min(num_drafted, num_accepted + 1, self.max_k)):
            self._tried[i] = self._tried[i] * decay + 1.0
            self._accepted[i] = self._accepted[i] * decay + (1.0 if i < num_accepted else 0.0)

    def expected(self, k: int) -> tuple[float, float]:
        """(expected draft tokens verified, expected draft tokens accepted) per request at draft length k."""
        return self.expected_by_k()[min(k, self.max_k)]

    def expected_by_k(self) -> list[tuple[float, float]]:
        """`expected(k)` for k = 0..max_k."""
        verified = accepted = 0.0
        reach = keep = 1.0
        by_k = [(0.0, 0.0)]
        for i in range(self.max_k):
            # A draft that stopped early stays stopped.
            reach = min(reach, self._reached[i] / self._asked[i])
            keep *= self._accepted[i] / self._tried[i]
            verified += reach
            accepted += reach * keep
            by_k.append((verified, accepted))
        return by_k

    def acceptance_by_position(self) -> list[float]:
        return [a / t for a, t in zip(self._accepted, self._tried)]


def calibration_sizes(max_k: int, max_batch_size: int, max_tokens: int) -> list[int]:
    """Tokens per step worth timing at start-up: 1..max_k+1 tokens per request at batch sizes
    1, 2, 4, ... up to max_batch_size (at most 16: larger sizes are extrapolated, then measured)."""
    sizes = set()
    batch_size = 1
    while batch_size <= min(max_batch_size, 16):
        sizes.update(batch_size * tokens for tokens in range(1, max_k + 2))
        batch_size *= 2
    return sorted(size for size in sizes if size <= max_tokens)


# A draft token that costs a step at most this share of it to verify is worth verifying even at the
# confidence at which the per-request cut drops it (mostly 2-gram matches, accepted ~20% of the time).
# Replayed on the target's answers (BENCHMARKS 46a), the cut lost 4% where a token cost ~1.5% of a
# step and won 2% where it cost 7%.
CHEAP_DRAFT_TOKEN = 0.03


class ConfidenceCut:
    """The running confidence below which a request's draft stops, by batch size: `min_confidence`
    where verifying max_k draft tokens per request costs a step more than CHEAP_DRAFT_TOKEN of it a
    token, nothing where it costs less. Read from start-up timings of whole steps (tokens ->
    seconds, as `calibration_sizes` times them) at the smallest timed batch size at or above the
    live one; where none was timed, or before `calibrate`, the cut holds. A `min_confidence` of 0
    never cuts (fixed draft lengths)."""

    def __init__(self, min_confidence: float, max_k: int) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.min_confidence = min_confidence
        self.max_k = max_k
        self._cheap: dict[int, bool] = {}  # timed batch size -> whether a full draft is cheap to verify there
        self._cut: dict[int, float] = {}  # batch size -> its cut, as read so far

    def calibrate(self, step_seconds: dict[int, float]) -> None:
        self._cheap, self._cut = {}, {}
        for batch_size in sorted(step_seconds):
            plain, verified = step_seconds[batch_size], step_seconds.get(batch_size * (1 + self.max_k))
            if verified is not None and plain > 0.0:
                self._cheap[batch_size] = verified / plain - 1.0 <= CHEAP_DRAFT_TOKEN * self.max_k

    @property
    def timed_batch_sizes(self) -> list[int]:
        """Batch sizes whose steps with and without a full draft were both timed."""
        return sorted(self._cheap)

    def __call__(self, batch_size: int) -> float:
        cut = self._cut.get(batch_size)
        if cut is None:
            timed = [size for size in self._cheap if size >= batch_size]
            cut = self._cut[batch_size] = 0.0 if timed and self._cheap[min(timed)] else self.min_confidence
        return cut


# Steps over which a switch from K=0 to drafting must pay back the stages' catch-up: a regime
# shorter than the controller's tries (every 16th choice or rarer) is not worth a switch.
CATCH_UP_HORIZON = 16


class _Exploration:
    """When a batch size next tries a K other than its best, and which side."""

    __slots__ = ("every", "choices_left", "best", "upward")

    def __init__(self, every: int, best: int) -> None:
        self.every = self.choices_left = every
        self.best = best  # at the last try
        self.upward = False


class AdaptiveDraftLength:
    """The scheduler's draft length for a batch size: `controller[batch_size]`, as vLLM's
    per-batch-size schedule is read; fed each finished step through `observe_step`."""

    def __init__(self, max_k: int, explore_every: int = 16, max_explore_every: int = 256,
                 max_backlog: int | None = None) -> None:
        """max_backlog: positions a request's stages may fall behind at K=0 before the drafter
        catches them up anyway (None: no bound)."""
        self.max_k = max_k
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.cost = StepCost()  # steps whose drafter proposes drafts (those that do not, with D added)
        self.drafter_cost = StepCost()  # D: the drafter's part of them
        # Real steps apart by whether they proposed, to learn D where both ran.
        self._proposing_steps = StepCost()
        self._idle_steps = StepCost()
        self.acceptance = DraftAcceptance(max_k)
        self.max_backlog = max_backlog
        # Per running request, positions its stages owe (stepped at K=0 since they last ran).
        self._backlog: dict[str, int] = {}
        self._catch_up_per_position: deque[float] = deque(maxlen=8)  # seconds, from real catch-ups
        self._exploration: dict[int, _Exploration] = {}  # by batch size
        self._idle_choices_left = 0  # steps of a try of K=0 still to run
        self._recent_choices: Counter[tuple[int, int]] = Counter()  # (batch size, K) since the last summary
        # The K the drafts of the next step to be observed were proposed with.
        self._k_of_pending_drafts = max_k
        self._best_by_batch: dict[int, int] = {}  # `best`, until the next observation or calibration

    def calibrate(self, step_seconds: dict[int, float], drafter_seconds: dict[int, float]) -> None:
        """Start from model-only timings taken at start-up (tokens -> seconds): whole steps, and
        the drafter's part of them."""
        self.cost.calibrate(step_seconds)
        self.drafter_cost.calibrate(drafter_seconds)
        self._best_by_batch = {}

    def _drafter_seconds(self, num_tokens: float) -> float:
        return self.drafter_cost.predict(num_tokens) or 0.0

    @property
    def _skips_stages_at_k0(self) -> bool:
        """Whether start-up timing found a part of the drafter that steps without drafts skip
        (Amphista's stages, caught up later): a host-side drafter (ANPD) has none."""
        return self.drafter_cost.timed

    def catch_up_seconds(self) -> float:
        """What the stages' catch-up over the running requests' backlogs would cost now (0 for a
        drafter with no stages to skip)."""
        if not self._skips_stages_at_k0 or not self._backlog:
            return 0.0
        per_position = self._learned_catch_up_per_position()
        if per_position is None:
            largest = self.drafter_cost.sizes[-1]
            per_position = self._drafter_seconds(largest) / largest
        return per_position * sum(self._backlog.values())

    def _learned_catch_up_per_position(self) -> float | None:
        """The median seconds a position of the last real catch-ups (None before one ran)."""
        recent = sorted(self._catch_up_per_position)
        return recent[len(recent) // 2] if recent else None

    def best(self, batch_size: int) -> int:
        """The K of the highest expected rate; worked out once per batch size between
        observations, so that working it out ahead (`patches`: while the worker runs a step) leaves
        the scheduler's lookup a dict read."""
        k = self._best_by_batch.get(batch_size)
        if k is None:
            k = self._best_by_batch[batch_size] = self._work_out_best(batch_size)
        return k

    def _work_out_best(self, batch_size: int) -> int:
        catch_up = self.catch_up_seconds()
        rates = [self._rate(batch_size, k, expected, catch_up)
                 for k, expected in enumerate(self.acceptance.expected_by_k())]
        if any(rate is None for rate in rates):
            return self.max_k  # nothing measured yet: run as configured until steps are timed
        return max(range(self.max_k + 1), key=lambda k: rates[k])

    def rate(self, batch_size: int, k: int) -> float | None:
        """Expected tokens per second for a batch of batch_size decoding requests at draft length k."""
        return self._rate(batch_size, k, self.acceptance.expected(k), self.catch_up_seconds())

    def _rate(self, batch_size: int, k: int, expected: tuple[float, float], catch_up: float) -> float | None:
        """`rate`, given `acceptance.expected(k)` and `catch_up_seconds()`."""
        verified, accepted = expected
        num_tokens = batch_size * (1.0 + verified)
        seconds = self.cost.predict(num_tokens)
        if seconds is None:
            return None
        if k == 0:
            seconds = max(seconds - self._drafter_seconds(num_tokens), 1e-6)
        else:
            seconds += catch_up / CATCH_UP_HORIZON
        return batch_size * (1.0 + accepted) / seconds

    def __getitem__(self, batch_size: int) -> int:
        k = self.best(batch_size)
        if self._idle_choices_left:
            self._idle_choices_left -= 1
            k = 0
        elif self.explore_every:
            exploration = self._exploration.setdefault(batch_size, _Exploration(self.explore_every, k))
            exploration.choices_left -= 1
            moved = k != exploration.best
            if moved:
                exploration.choices_left = min(exploration.choices_left, self.explore_every)
            if exploration.choices_left <= 0:
                # Only tries that make the stages catch up cost enough to thin out; a host-side
                # drafter's try costs one step's few extra tokens, and spaced out they would leave
                # a size read once in a slow spell deciding for hundreds of steps.
                thin = not moved and self._skips_stages_at_k0
                exploration.every = min(2 * exploration.every, self.max_explore_every) if thin else self.explore_every
                left, exploration.best = exploration.best, k
                exploration.choices_left = exploration.every
                exploration.upward = not exploration.upward
                if moved:  # back towards the K the best left
                    step = 1 if left > k else -1
                else:  # above and below the best in turn, so both neighbours stay measured
                    step = 1 if k == 0 or (exploration.upward and k < self.max_k) else -1
                if k + step == 0:
                    # The first step without drafts still verifies the last ones: time two more.
                    self._idle_choices_left = 2
                k += step
        self._recent_choices[batch_size, k] += 1
        return k

    def summary(self) -> str:
        """One line for a log: the K chosen at each batch size since the last summary (the counts
        then restart), acceptance by draft position, and the learned step times."""
        by_batch: dict[int, dict[int, int]] = {}
        for (batch_size, k), count in sorted(self._recent_choices.items()):
            by_batch.setdefault(batch_size, {})[k] = count
        self._recent_choices.clear()
        choices = "; ".join(f"batch {batch_size}: " + ", ".join(f"K={k} x{count}" for k, count in counts.items())
                            for batch_size, counts in by_batch.items()) or "none"
        acceptance = ", ".join(f"{rate:.2f}" for rate in self.acceptance.acceptance_by_position())
        return f"draft length chosen ({choices}); acceptance by position [{acceptance}]; {self.step_times()}"

    def step_times(self) -> str:
        def table(cost: StepCost) -> str:
            return ", ".join(f"{size}: {1000 * cost.predict(size):.1f}" for size in cost.sizes) or "none timed"

        per_position = self._learned_catch_up_per_position()
        catch_up = "" if per_position is None else f"; the stages' catch-up {1e6 * per_position:.0f} us a position"
        return (f"ms per step by tokens verified {{{table(self.cost)}}}, of them the drafter's "
                f"{{{table(self.drafter_cost)}}}{catch_up}")

    def observe_step(self, requests: dict[str, tuple[int, int, int]], seconds: float | None,
                     k_proposed: int) -> None:
        """A finished step: per decoding request, by id, (tokens scheduled, draft tokens scheduled,
        draft tokens accepted); seconds is the step's wall time, None when it was not a pure decode
        step; k_proposed the draft length its drafter proposed for the next step. Steps arrive in
        order."""
        self._best_by_batch = {}
        asked, self._k_of_pending_drafts = self._k_of_pending_drafts, k_proposed
        for _, num_drafted, num_accepted in requests.values():
            self.acceptance.observe(asked, num_drafted, num_accepted)
        num_tokens = sum(num_tokens for num_tokens, _, _ in requests.values())
        backlog = sum(self._backlog.get(req_id, 0) for req_id in requests)
        self._follow_backlog(requests, deferred=not k_proposed and seconds is not None)
        # The first step that proposes after one that did not also runs Amphista's stages over the
        # positions they skipped (the catch-up pass): a cost of switching K=0 to K>0 once, priced
        # apart (per position caught up); read as the price of drafting it would keep the
        # controller at K=0 once there.
        if seconds is None:
            return
        if k_proposed and not asked:
            predicted = self.cost.predict(num_tokens)
            if backlog and predicted is not None and self._skips_stages_at_k0:
                self._catch_up_per_position.append(max(seconds - predicted, 0.0) / backlog)
            return
        (self._proposing_steps if k_proposed else self._idle_steps).observe(num_tokens, seconds)
        proposing, idle = self._proposing_steps.measured(num_tokens), self._idle_steps.measured(num_tokens)
        # Only a drafter with stages to skip has a D to learn: for one that drafts on the host (ANPD),
        # T(n) - I(n) is two steps' noise, and a few ms of it would price K=0 below a plain step.
        if proposing is not None and idle is not None and self._skips_stages_at_k0:
            self.drafter_cost.learn(num_tokens, max(proposing - idle, 0.0))
        self.cost.observe(num_tokens, seconds if k_proposed else seconds + self._drafter_seconds(num_tokens))

    def _follow_backlog(self, requests: dict[str, tuple[int, int, int]], deferred: bool) -> None:
        """Each request's stage backlog after a step, as the drafter keeps it: a decode step that
        proposes nothing adds the positions it kept (its sampled token and accepted drafts); any
        other step runs the stages (a prefill chunk in the step makes them run for every request);
        a backlog at its bound is caught up at once; requests not decoding are dropped."""
        if not deferred:
            self._backlog = {}
            return
        backlog = {}
        for req_id, (_, _, num_accepted) in requests.items():
            behind = self._backlog.get(req_id, 0) + 1 + num_accepted
            backlog[req_id] = 0 if self.max_backlog is not None and behind >= self.max_backlog else behind
        self._backlog = backlog
