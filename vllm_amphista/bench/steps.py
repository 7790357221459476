"""Where a speculative step's time goes: ms per decode step, split by part, per method and engine.

    python -m vllm_amphista.bench.steps                       # every method, eager and compiled
    python -m vllm_amphista.bench.steps --methods vanilla,amphista --engines compiled

Each engine runs in its own process with an in-process engine core (the timers
must reach the model runner; the benchmark runs vLLM's default separate core),
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

For Amphista rows, "drafter floor" is what reading the heads' weights once
costs at the plain step's pace: (heads' weights / target's weights) x the plain
step in the same engine mode and run; "drafter / floor" is the drafter's time
over it. (Heads that share the target's lm_head also read that: not counted.)

Only decode steps count (a step that admits a new request is its prefill).
The timers read wall-clock time around Python calls, so what runs inside a
part (compiled code included) is attributed to it; they add a few
microseconds per call. Instrumentation only: nothing here changes what vLLM
computes.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

from vllm_amphista.assets import DEMO_TARGET, SHIPPED_HEADS, SPEC_BENCH_QUESTIONS
from vllm_amphista.bench.args import parse_methods, positive_int
from vllm_amphista.bench.engines import EngineProcess, set_engine_env
from vllm_amphista.bench.report import markdown_table
from vllm_amphista.bench.timers import PARTS
from vllm_amphista.cpu_dtype import choose_cpu_dtype
from vllm_amphista.prompts import load_questions
from vllm_amphista.vllm.config import PLUGIN_METHODS

# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
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
    parser.add_argument("--draft-length", choices=("fixed", "adaptive", "off"), default="fixed",
                        help="fixed K (the cost of a full K-token step, the default) or the load-aware default, "
                             "for the plugin's methods; off: K=0 forced for every speculative method "
                             "(vLLM's per-batch-size schedule), what drafting off costs")
    parser.add_argument("--dtype", default=None, help="default: what this CPU computes fastest (cpu_dtype.py)")
    parser.add_argument("--max-model-len", type=positive_int, default=2048)
    args = parser.parse_args(argv)
    unknown = set(args.engines) - {"eager", "compiled"}
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}: choose eager and/or compiled")
    set_engine_env(kv_cache_gib=1)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    dtype_choice = choose_cpu_dtype()
    args.dtype = args.dtype or dtype_choice.dtype

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
                     draft_length=args.draft_length if method in PLUGIN_METHODS or args.draft_length == "off"
                     else None),
                prompts[0], time_steps=True, engine_core="in-process")
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
    # The drafter's weights against the target's: reading them once is its floor, at the plain step's pace.
    drafter_share = weight_count(args.heads) / weight_count(args.target)
    for method, engine in rows:
        ms = _median_ms(runs[method, engine])
        tau = statistics.median(result.tau for result in runs[method, engine])
        cost = f"{ms['total'] / plain[engine]:.2f}x" if engine in plain else "-"
        floor = drafter_share * plain[engine] if engine in plain and method.startswith("amphista") else None
        body.append([method, engine, f"{ms['total']:.2f}", cost, *(f"{ms[part]:.2f}" for part in PARTS),
                     f"{ms['drafter'] + ms['drafter glue']:.2f}",
                     "-" if floor is None else f"{floor:.2f}",
                     "-" if floor is None else f"{ms['drafter'] / floor:.2f}x",
                     f"{tau:.2f}", str(runs[method, engine][0].step_times.steps)])
    print(f"ms per decode step (median of {args.repeats} runs; {len(prompts)} prompts, {args.max_tokens} tokens, "
          f"concurrency 1, {args.dtype}, K={args.num_speculative_tokens} ({args.draft_length} for the plugin's "
          f"methods), {os.cpu_count()} CPUs; in-process engine core; {dtype_choice.describe()})\n")
    print(f"drafter floor: the heads' weights are {100 * drafter_share:.1f}% of the target's, so reading them "
          "once costs that share of a plain step (same engine, same run)\n")
    print(markdown_table(["method", "engine", "step", "vs plain", *PARTS, "drafter + glue", "drafter floor",
                          "drafter / floor", "tau", "steps"], body))


def weight_count(model_dir: str) -> int:
    """Floating-point weights in a model dir's safetensors files (tied weights are stored once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as tensors:
            for name in tensors.keys():
                piece = tensors.get_slice(name)
                if piece.get_dtype().startswith(("F", "BF")):
                    total += math.prod(piece.get_shape())
    if not total:
        raise FileNotFoundError(f"no floating-point safetensors weights in {model_dir}")
    return total


def _median_ms(results) -> dict[str, float]:
    per_run = [result.step_times.ms_per_step() for result in results]
    medians = {part: statistics.median(run[part] for run in per_run) for part in PARTS}
    medians["total"] = statistics.median(sum(run.values()) for run in per_run)
    return medians


if __name__ == "__main__":
    main()
