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
import os
import time
from dataclasses import dataclass, field

# In-process engine: starts in seconds instead of a minute on this CPU.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}

SHIPPED_HEADS_ROOT = os.path.join(os.path.dirname(__file__), "heads")
SHIPPED_HEADS = os.path.join(SHIPPED_HEADS_ROOT, "smollm2-135m-instruct")
# Baselines trained for the same target, for the benchmark.
SHIPPED_MEDUSA_HEADS = os.path.join(SHIPPED_HEADS_ROOT, "smollm2-135m-instruct-medusa")
SHIPPED_EAGLE_HEADS = os.path.join(SHIPPED_HEADS_ROOT, "smollm2-135m-instruct-eagle")


def set_engine_env(kv_cache_gib: int = 2) -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))


def speculative_config(method: str, num_speculative_tokens: int, heads_dir: str | None = None) -> dict | None:
    """vLLM's speculative_config for a method name of ours or vLLM's."""
    if method == "vanilla":
        return None
    config = {"method": method, "num_speculative_tokens": num_speculative_tokens}
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

    @classmethod
    def merged(cls, results: list[RunResult]) -> RunResult:
        """One result for several runs: outputs concatenated, seconds and counters summed."""
        return cls(
            [ids for result in results for ids in result.outputs],
            sum(result.seconds for result in results),
            sum((result.spec for result in results), SpecCounters()),
            sum(result.target_steps for result in results),
        )

    @property
    def generated(self) -> int:
        return sum(len(ids) for ids in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds

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
                max_model_len: int, concurrency: int = 1, **llm_options):
    """An in-process engine that runs `concurrency` requests at a time; `llm_options` go to vLLM's LLM."""
    from vllm import LLM

    return LLM(
        model=target,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=concurrency,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=speculative_config(method, num_speculative_tokens, heads_dir),
        **llm_options,
    )


def generate_counting_steps(llm, prompt_token_ids: list[list[int]], params) -> tuple[list[list[int]], list[int]]:
    """`llm.generate`, stepping the engine by hand: (output token ids, target
    forward steps) per prompt. `params`: one SamplingParams or one per prompt."""
    engine = llm.llm_engine
    if not isinstance(params, list):
        params = [params] * len(prompt_token_ids)
    request_ids = [f"measure-{next(_request_numbers)}" for _ in prompt_token_ids]
    for request_id, prompt, request_params in zip(request_ids, prompt_token_ids, params, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, request_params)
    row = {request_id: index for index, request_id in enumerate(request_ids)}
    outputs: list[list[int]] = [[] for _ in request_ids]
    steps = [0] * len(request_ids)
    while engine.has_unfinished_requests():
        for output in engine.step():
            index = row[output.request_id]
            token_ids = output.outputs[0].token_ids  # cumulative
            if len(token_ids) > len(outputs[index]):
                steps[index] += 1
                outputs[index] = list(token_ids)
    return outputs, steps


_request_numbers = itertools.count()


def run_prompts(llm, prompt_token_ids: list[list[int]], max_tokens: int, temperature: float = 0.0,
                seed: int = 0) -> RunResult:
    """Generate for every prompt (the engine's max_num_seqs sets how many run at once); time and count it."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    before = SpecCounters.read(llm)
    start = time.perf_counter()
    outputs, steps = generate_counting_steps(llm, prompt_token_ids, params)
    seconds = time.perf_counter() - start
    return RunResult(outputs, seconds, SpecCounters.read(llm) - before, sum(steps))
