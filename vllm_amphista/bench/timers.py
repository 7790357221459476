"""Timers around an in-process engine's step and its model runner's parts (see `bench.steps`).

Instrumentation only: nothing here changes what vLLM computes.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

PARTS = ("target forward", "drafter", "drafter glue", "sampling", "input prep", "other")
# The model runner's methods timed for each part ("drafter glue" and "other" are what remains).
RUNNER_PARTS = {
    "input prep": ("_update_states", "_prepare_inputs", "_build_attention_metadata", "_preprocess"),
    "target forward": ("_model_forward",),
    "sampling": ("_sample",),
}


@dataclass
class StepTimes:
    """Seconds per part, summed over the decode steps timed."""

    scheduling: str  # the engine's: "async" (vLLM's async scheduling) or "sync"
    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def ms_per_step(self) -> dict[str, float]:
        return {part: 1000 * value / max(self.steps, 1) for part, value in self.seconds.items()}


class StepTimers:
    """Timers around an in-process engine's step and its model runner's parts."""

    def __init__(self, llm):
        engine_core = llm.llm_engine.engine_core.engine_core
        runner = engine_core.model_executor.driver_worker.worker.model_runner
        self.scheduling = "async" if llm.llm_engine.vllm_config.scheduler_config.async_scheduling else "sync"
        self.times = StepTimes(scheduling=self.scheduling)
        self._current: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self._scheduled = {}

        def timed(part: str, function):
            @functools.wraps(function)
            def wrapper(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return function(*args, **kwargs)
                finally:
                    self._current[part] += time.perf_counter() - started
            return wrapper

        for part, names in RUNNER_PARTS.items():
            for name in names:
                setattr(runner, name, timed(part, getattr(runner, name)))
        runner.model.compute_logits = timed("target forward", runner.model.compute_logits)
        drafter = getattr(runner, "drafter", None)
        if drafter is not None:
            # Timed as glue first, then the drafter's own part moved out of it.
            runner.propose_draft_token_ids = timed("drafter glue", runner.propose_draft_token_ids)
            propose = drafter.propose

            @functools.wraps(propose)
            def timed_propose(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return propose(*args, **kwargs)
                finally:
                    elapsed = time.perf_counter() - started
                    self._current["drafter"] += elapsed
                    self._current["drafter glue"] -= elapsed

            drafter.propose = timed_propose
        scheduler = engine_core.scheduler
        schedule = scheduler.schedule

        @functools.wraps(schedule)
        def remembered_schedule(*args, **kwargs):
            self._scheduled["output"] = output = schedule(*args, **kwargs)
            return output

        scheduler.schedule = remembered_schedule
        # The engine core binds `step_fn` (its plain step, or the batch-queue one) at start-up.
        step = engine_core.step_fn

        @functools.wraps(step)
        def timed_step(*args, **kwargs):
            self._current = dict.fromkeys(PARTS, 0.0)
            started = time.perf_counter()
            result = step(*args, **kwargs)
            total = time.perf_counter() - started
            output = self._scheduled.pop("output", None)
            if output is not None and output.total_num_scheduled_tokens and not output.scheduled_new_reqs:
                self._current["other"] = total - sum(self._current.values())
                for part, seconds in self._current.items():
                    self.times.seconds[part] += seconds
                self.times.steps += 1
            return result

        engine_core.step_fn = timed_step

    def take(self) -> StepTimes:
        times, self.times = self.times, StepTimes(scheduling=self.scheduling)
        return times
