"""Where a speculative step's time goes: ms per decode step, split by part, per method and engine.

    python -m vllm_amphista.bench.steps                       # every method, eager and compiled
    python -m vllm_amphista.bench.steps --methods vanilla,amphista --engines compiled

Each engine runs in its own process (in-process vLLM, as the benchmark's),
is warmed up, then answers the prompts one at a time (concurrency 1) while
timers wrapped around the model runner's parts record every engine step:

- target forward: the target model's forward and its logits;
- drafter: the proposer's `propose` (Amphista: stage layers and heads; ANPD:
  its tables; vLLM ngram: its matcher);
- drafter glue: the rest of the runner's `propose_draft_token_ids` (EAGLE-path
  input preparation for hidden-state drafters);
- sampling: the runner's `_sample` (the rejection sampler under speculation);
- input prep: state update, input and attention-metadata preparation;
- other: the rest of the engine step (scheduler, bookkeeping, output processing).

Only decode steps count (a step that admits a new request is its prefill).
The timers read wall-clock time around Python calls, so what runs inside a
part (compiled code included) is attributed to it; they add a few
microseconds per call. Instrumentation only: nothing here changes what vLLM
computes.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

from vllm_amphista.assets import DEMO_TARGET, SHIPPED_HEADS, SPEC_BENCH_QUESTIONS
from vllm_amphista.bench.engines import EngineProcess, set_engine_env
from vllm_amphista.bench.report import markdown_table
from vllm_amphista.prompts import load_questions
from vllm_amphista.vllm.config import PLUGIN_METHODS

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

    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def ms_per_step(self) -> dict[str, float]:
        return {part: 1000 * value / max(self.steps, 1) for part, value in self.seconds.items()}


class StepTimers:
    """Timers around an in-process engine's step and its model runner's parts."""

    def __init__(self, llm):
        engine_core = llm.llm_engine.engine_core.engine_core
        runner = engine_core.model_executor.driver_worker.worker.model_runner
        self.times = StepTimes()
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
        times, self.times = self.times, StepTimes()
        return times


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    from vllm_amphista.bench.cli import parse_methods, positive_int

    parser = argparse.ArgumentParser(prog="python -m vllm_amphista.bench.steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEMO_TARGET, help="target model dir (default: %(default)s)")
    parser.add_argument("--methods", type=parse_methods, default=["vanilla", "ngram", "anpd", "amphista"],
                        help="comma-separated methods (default: vanilla,ngram,anpd,amphista)")
    parser.add_argument("--engines", default="eager,compiled",
                        type=lambda value: [engine.strip() for engine in value.split(",")],
                        help="eager and/or compiled (vLLM's default) engines (default: %(default)s)")
    parser.add_argument("--heads", default=SHIPPED_HEADS, help="Amphista heads dir (default: the shipped heads)")
    parser.add_argument("--questions", nargs="+", default=[SPEC_BENCH_QUESTIONS], metavar="JSONL")
    parser.add_argument("--categories", default="writing,coding,math_reasoning",
                        type=lambda value: [c.strip() for c in value.split(",") if c.strip()],
                        help="question categories to ask (default: %(default)s)")
    parser.add_argument("--per-category", type=positive_int, default=1, metavar="N")
    parser.add_argument("--max-tokens", type=positive_int, default=96)
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed runs per engine, interleaved across engines; the median is shown")
    parser.add_argument("-k", "--num-speculative-tokens", type=positive_int, default=4)
    parser.add_argument("--draft-length", choices=("fixed", "adaptive"), default="fixed",
                        help="for the plugin's methods: fixed K (the cost of a full K-token step, the default) "
                             "or the load-aware default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=positive_int, default=2048)
    args = parser.parse_args(argv)
    unknown = set(args.engines) - {"eager", "compiled"}
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}: choose eager and/or compiled")
    set_engine_env(kv_cache_gib=1)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from transformers import AutoTokenizer

    questions, _ = load_questions(args.questions, AutoTokenizer.from_pretrained(args.target), args.categories,
                                  args.per_category, args.max_model_len - args.max_tokens)
    prompts = [question.prompt_ids for items in questions.values() for question in items]
    rows = [(method, engine) for engine in args.engines for method in args.methods]
    engines = {}
    try:
        for method, engine in rows:
            print(f"building {method} ({engine}) ...", file=sys.stderr)
            engines[method, engine] = EngineProcess(
                dict(target=args.target, method=method, num_speculative_tokens=args.num_speculative_tokens,
                     heads_dir=args.heads if method.startswith("amphista") else None, dtype=args.dtype,
                     max_model_len=args.max_model_len, concurrency=1, enforce_eager=engine == "eager",
                     draft_length=args.draft_length if method in PLUGIN_METHODS else None),
                prompts[0], time_steps=True)
        runs: dict[tuple[str, str], list] = {row: [] for row in rows}
        for _ in range(args.repeats):
            for row in rows:
                runs[row].append(engines[row].run(prompts, args.max_tokens, 0.0))
    finally:
        for engine_process in engines.values():
            engine_process.close()

    body = []
    plain = {engine: _median_ms(runs["vanilla", engine])["total"] for engine in args.engines
             if ("vanilla", engine) in runs}
    for method, engine in rows:
        ms = _median_ms(runs[method, engine])
        tau = statistics.median(result.tau for result in runs[method, engine])
        cost = f"{ms['total'] / plain[engine]:.2f}x" if engine in plain else "-"
        body.append([method, engine, f"{ms['total']:.2f}", cost, *(f"{ms[part]:.2f}" for part in PARTS),
                     f"{ms['drafter'] + ms['drafter glue']:.2f}", f"{tau:.2f}",
                     str(runs[method, engine][0].step_times.steps)])
    print(f"ms per decode step (median of {args.repeats} runs; {len(prompts)} prompts, {args.max_tokens} tokens, "
          f"concurrency 1, {args.dtype}, K={args.num_speculative_tokens} ({args.draft_length} for the plugin's "
          f"methods), {os.cpu_count()} CPUs)\n")
    print(markdown_table(["method", "engine", "step", "vs plain", *PARTS, "drafter + glue", "tau", "steps"], body))


def _median_ms(results) -> dict[str, float]:
    per_run = [result.step_times.ms_per_step() for result in results]
    medians = {part: statistics.median(run[part] for run in per_run) for part in PARTS}
    medians["total"] = statistics.median(sum(run.values()) for run in per_run)
    return medians


if __name__ == "__main__":
    main()
