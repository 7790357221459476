"""Run a vLLM engine over prompts and read what speculation did.

Shared by the quickstart and the benchmark so that both count the same way:
- tau (Spec-Bench's mean accepted length): generated tokens / target forward
  steps, over ALL steps, whether or not the drafter proposed anything. The
  steps are counted, not derived from vLLM's counters: a request's steps are
  the engine steps in which it received tokens. (generated - accepted would
  undercount them: vLLM drafts past max_tokens and EOS and counts the
  accepted tokens it then cuts off.)
- vLLM's own figure, 1 + accepted / drafts, counts only steps that had drafts
  and so overstates sparse drafters; it is reported beside tau, labelled.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_amphista.bench.timers import StepTimers, StepTimes
from vllm_amphista.vllm.config import DRAFT_LENGTH_MODES

ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
# Where the engine core runs: "separate" is vLLM's default (`LLM(...)`, `vllm serve`: the core
# in its own process, so scheduling and output processing overlap the model's step); "in-process"
# starts faster and lets timers reach the model runner (tests, the step breakdown).
ENGINE_CORE_MODES = ("separate", "in-process")


def set_engine_env(kv_cache_gib: int = 2) -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))


def use_engine_core(mode: str) -> None:
    """Set, for engines built after this in this process, where their engine core runs."""
    if mode not in ENGINE_CORE_MODES:
        raise ValueError(f"engine core mode must be one of {ENGINE_CORE_MODES}, got {mode!r}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mode == "separate" else "0"


def engine_label(engine: str, engine_core: str) -> str:
    """How a table names an engine: compilation and where its core ran."""
    return f"{engine}, {'engine core in its own process' if engine_core == 'separate' else 'in-process engine core'}"


# The plugin's draft-length modes, and "off": K=0 at every step, for any speculative method.
BENCH_DRAFT_LENGTHS = (*DRAFT_LENGTH_MODES, "off")


def speculative_config(method: str, num_speculative_tokens: int, heads_dir: str | None = None,
                       draft_length: str | None = None) -> dict | None:
    """vLLM's speculative_config for a method name of ours or vLLM's; draft_length ("adaptive" or
    "fixed") for ours, None for the plugin's default, or "off" for any method: vLLM's own
    per-batch-size schedule with K=0 at every size (what drafting off costs)."""
    if method == "vanilla":
        return None
    config = {"method": method, "num_speculative_tokens": num_speculative_tokens}
    if draft_length == "off":
        config["num_speculative_tokens_per_batch_size"] = [(1, 1 << 20, 0)]
    elif draft_length is not None:
        config["draft_length"] = draft_length
    if method == "ngram":
        config.update(prompt_lookup_max=5, prompt_lookup_min=2)
    if heads_dir is not None:
        config["model"] = heads_dir
    return config


@dataclass
class SpecCounters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @classmethod
    def read(cls, llm) -> SpecCounters:
        counters = cls()
        for metric in llm.get_metrics():
            if metric.name == "vllm:spec_decode_num_drafts":
                counters.drafts = int(metric.value)
            elif metric.name == "vllm:spec_decode_num_draft_tokens":
                counters.draft_tokens = int(metric.value)
            elif metric.name == "vllm:spec_decode_num_accepted_tokens":
                counters.accepted = int(metric.value)
            elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                counters.accepted_per_position = [int(v) for v in metric.values]
        return counters

    def _combine(self, other: SpecCounters, sign: int) -> SpecCounters:
        positions = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0] * (positions - len(self.accepted_per_position))
        theirs = other.accepted_per_position + [0] * (positions - len(other.accepted_per_position))
        return SpecCounters(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted + sign * other.accepted,
            [a + sign * b for a, b in zip(mine, theirs)],
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, +1)

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        return self._combine(earlier, -1)


@dataclass
class RunResult:
    outputs: list[list[int]]
    seconds: float
    spec: SpecCounters
    target_steps: int  # target forward steps that produced tokens, summed over requests
    request_seconds: list[float] = field(default_factory=list)  # per prompt: from the call's start to its finish
    step_times: StepTimes | None = None  # where each decode step's time went, when timed

    @classmethod
    def merged(cls, results: list[RunResult]) -> RunResult:
        """One result for several runs: outputs concatenated, seconds and counters summed."""
        return cls(
            [ids for result in results for ids in result.outputs],
            sum(result.seconds for result in results),
            sum((result.spec for result in results), SpecCounters()),
            sum(result.target_steps for result in results),
            [seconds for result in results for seconds in result.request_seconds],
        )

    @property
    def generated(self) -> int:
        return sum(len(ids) for ids in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds

    @property
    def mean_request_seconds(self) -> float:
        """What a request waits on average, from the call's start to its last token."""
        return sum(self.request_seconds) / max(len(self.request_seconds), 1)

    @property
    def tau(self) -> float:
        """Generated tokens per target forward step, over all steps."""
        return self.generated / max(self.target_steps, 1)

    @property
    def vllm_mean_acceptance_length(self) -> float | None:
        """vLLM's figure: 1 + accepted / drafts, over steps that had drafts only."""
        return 1 + self.spec.accepted / self.spec.drafts if self.spec.drafts else None

    def acceptance_rate_per_position(self) -> list[float]:
        return [a / self.spec.drafts for a in self.spec.accepted_per_position] if self.spec.drafts else []


def make_engine(target: str, method: str, num_speculative_tokens: int, heads_dir: str | None, dtype: str,
                max_model_len: int, concurrency: int = 1, enforce_eager: bool = False,
                draft_length: str | None = None, **llm_options):
    """An engine that runs `concurrency` requests at a time, compiled as vLLM's default engine is
    unless `enforce_eager`; `llm_options` go to vLLM's LLM."""
    from vllm import LLM

    return LLM(
        model=target,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=concurrency,
        enforce_eager=enforce_eager,
        disable_log_stats=False,
        speculative_config=speculative_config(method, num_speculative_tokens, heads_dir, draft_length),
        **llm_options,
    )


def generate_counting_steps(llm, prompt_token_ids: list[list[int]], params
                            ) -> tuple[list[list[int]], list[int], list[float]]:
    """`llm.generate`, stepping the engine by hand: (output token ids, target
    forward steps, seconds from the start to the request's finish) per prompt.
    `params`: one SamplingParams or one per prompt."""
    engine = llm.llm_engine
    if not isinstance(params, list):
        params = [params] * len(prompt_token_ids)
    request_ids = [f"measure-{next(_request_numbers)}" for _ in prompt_token_ids]
    start = time.perf_counter()
    for request_id, prompt, request_params in zip(request_ids, prompt_token_ids, params, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, request_params)
    row = {request_id: index for index, request_id in enumerate(request_ids)}
    outputs: list[list[int]] = [[] for _ in request_ids]
    steps = [0] * len(request_ids)
    finished = [0.0] * len(request_ids)
    while engine.has_unfinished_requests():
        for output in engine.step():
            index = row[output.request_id]
            token_ids = output.outputs[0].token_ids  # cumulative
            if len(token_ids) > len(outputs[index]):
                steps[index] += 1
                outputs[index] = list(token_ids)
            if output.finished:
                finished[index] = time.perf_counter() - start
    return outputs, steps, finished


_request_numbers = itertools.count()


def run_prompts(llm, prompt_token_ids: list[list[int]], max_tokens: int, temperature: float = 0.0,
                seed: int = 0) -> RunResult:
    """Generate for every prompt (the engine's max_num_seqs sets how many run at once); time and count it."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    before = SpecCounters.read(llm)
    outputs, steps, finished = generate_counting_steps(llm, prompt_token_ids, params)
    # One clock: the run lasts until its last request finishes.
    return RunResult(outputs, max(finished, default=0.0), SpecCounters.read(llm) - before, sum(steps), finished)


# Tokens generated to warm an engine up before it is timed.
WARMUP_TOKENS = 8


class EngineFailed(RuntimeError):
    pass


def engine_worker(connection, engine_args: dict, warmup_prompt_ids: list[int], time_steps: bool,
                  engine_core: str) -> None:
    """Subprocess body: build one engine, warm it up, then answer run requests until told to stop."""
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # engine chatter to stderr; stdout is the tables
    try:
        use_engine_core(engine_core)
        started = time.perf_counter()
        # Off so every repeat does the same prefill work (repeats reuse the same prompts).
        llm = make_engine(**engine_args, enable_prefix_caching=False)
        run_prompts(llm, [warmup_prompt_ids], WARMUP_TOKENS)
        timers = StepTimers(llm) if time_steps else None
        connection.send(("ready", time.perf_counter() - started))
        while (request := connection.recv()) is not None:
            result = run_prompts(llm, **request)
            if timers is not None:
                result.step_times = timers.take()
            connection.send(("result", result))
        # Stop a separate engine core now: left to interpreter exit, its shutdown waits out a timeout.
        llm.llm_engine.engine_core.shutdown()
    except Exception as error:  # reported as a "failed" row; the other methods go on
        traceback.print_exc()
        connection.send(("failed", f"{type(error).__name__}: {error}"))


class EngineProcess:
    """A vLLM engine living in its own spawned process, driven over a pipe."""

    def __init__(self, engine_args: dict, warmup_prompt_ids: list[int], time_steps: bool = False,
                 engine_core: str = "separate"):
        if time_steps and engine_core != "in-process":
            raise ValueError("step timers reach into the model runner: they need the in-process engine core")
        context = multiprocessing.get_context("spawn")
        self.connection, child_connection = context.Pipe()
        self.process = context.Process(target=engine_worker,
                                       args=(child_connection, engine_args, warmup_prompt_ids, time_steps,
                                             engine_core))
        self.process.start()
        child_connection.close()
        self.build_seconds = self._reply("ready")

    def _reply(self, expected: str):
        try:
            kind, payload = self.connection.recv()
        except EOFError:
            self.process.join()
            raise EngineFailed(f"engine process died (exit code {self.process.exitcode}); see stderr") from None
        if kind != expected:  # the worker has given up and is exiting
            self.process.join()
            raise EngineFailed(" ".join(payload.split())[:300])  # one line: it goes into a table cell
        return payload

    def run(self, prompt_ids: list[list[int]], max_tokens: int, temperature: float) -> RunResult:
        self.connection.send({"prompt_token_ids": prompt_ids, "max_tokens": max_tokens, "temperature": temperature})
        return self._reply("result")

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.connection.send(None)
            except OSError:
                pass
            self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


def alternating_order(outer: Sequence, rows: Sequence) -> list[tuple]:
    """(item of `outer`, row) in the order they run: every row in turn for each item, every other
    item in reverse, so that no row always runs right after another."""
    return [(item, row) for index, item in enumerate(outer) for row in (rows if index % 2 == 0 else rows[::-1])]


def round_order(rows: list, round_index: int) -> list:
    """The rows in the order round `round_index` (from 0) builds and runs their engines: each round
    starts one row later, so that no row is always built first or timed after the same one."""
    shift = round_index % len(rows)
    return rows[shift:] + rows[:shift]
