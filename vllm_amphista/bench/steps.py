"""Where a speculative step's time goes: ms per decode step, split by part, per method and engine.

    python -m vllm_amphista.bench.steps                       # every method, eager and compiled
    python -m vllm_amphista.bench.steps --methods vanilla,amphista --engines compiled

Each engine runs in its own process with an in-process engine core (the timers
must reach the model runner; the benchmark runs vLLM's default separate core),
is warmed up, then answers the prompts (one at a time by default; `--concurrency N`
batches up to N) while timers wrapped around the model runner's parts record every
engine step. With `--rounds N` each row gets N such processes, one round of all
rows after another (each round starting one row later), and the median runs over
all of them:

- target forward: the target model's forward and its logits;
- drafter: the proposer's `propose` (Amphista: stage layers and heads; ANPD:
  its tables; vLLM ngram: its matcher);
- drafter glue: the rest of the runner's `propose_draft_token_ids` (EAGLE-path
  input preparation for hidden-state drafters);
- sampling: the runner's `_sample` (the rejection sampler under speculation);
- input prep: state update, input and attention-metadata preparation;
- other: the rest of the engine step (scheduler, bookkeeping, output processing).

"scheduling" names how the engine scheduled its steps: "async" (vLLM's async
scheduling, the next step prepared while this one runs) or "sync" (what vLLM-CPU
sets for every engine).

For rows that draft with trained weights (Amphista, Medusa, EAGLE, DFlash),
"drafter floor" is what reading the weights a drafting step needs costs at the
plain step's pace: (weights read per step / target's weights) x the plain step
in the same engine mode and run; "drafter / floor" is the drafter's time over
it, shown with `--draft-length fixed` only, where every step drafts (elsewhere
steps that draft nothing dilute the drafter's time per step). Weights read per
step: the drafter dir's weights, plus the target's lm_head where the drafter
shares it (no lm_head in its dir), once per drafter pass: one pass for
Amphista, Medusa and DFlash, K chained passes for EAGLE.

"decode s" is the time all decode steps took, and "speedup" plain's over the
method's (greedy: the same tokens). One request at a time that is tau over the
step's cost; with requests batched it is not, as the steps mix batch sizes.

Only decode steps count (a step that admits a new request is its prefill).
The timers read wall-clock time around Python calls, so what runs inside a
part (compiled code included) is attributed to it; they add a few
microseconds per call. Instrumentation only: nothing here changes what vLLM
computes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

from vllm_amphista.assets import DEMO_TARGET, SPEC_BENCH_QUESTIONS
from vllm_amphista.bench.args import add_drafter_dir_flags, drafter_dir, parse_methods, positive_int
from vllm_amphista.bench.engines import BENCH_DRAFT_LENGTHS, EngineProcess, round_order, set_engine_env
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
    add_drafter_dir_flags(parser)
    parser.add_argument("--questions", nargs="+", default=[SPEC_BENCH_QUESTIONS], metavar="JSONL")
    parser.add_argument("--categories", default="writing,coding,math_reasoning",
                        type=lambda value: [c.strip() for c in value.split(",") if c.strip()],
                        help="question categories to ask (default: %(default)s)")
    parser.add_argument("--per-category", type=positive_int, default=1, metavar="N")
    parser.add_argument("--max-tokens", type=positive_int, default=96)
    parser.add_argument("--concurrency", type=positive_int, default=1,
                        help="requests decoded at a time (vLLM's max_num_seqs; give at least as many prompts)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed runs per engine, interleaved across engines; the median is shown")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="fresh engine processes per row, one after another, the median taken over all their "
                             "runs: a process's target forward can sit a few percent off another's for its whole "
                             "life, which repeats within it do not average out")
    parser.add_argument("-k", "--num-speculative-tokens", type=positive_int, default=4)
    parser.add_argument("--draft-length", choices=BENCH_DRAFT_LENGTHS, default="fixed",
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
    runs: dict[tuple[str, str], list] = {row: [] for row in rows}
    for round_number in range(1, args.rounds + 1):
        order = round_order(rows, round_number - 1)
        engines = {}
        try:
            for method, engine in order:
                print(f"round {round_number}/{args.rounds}: building {method} ({engine}) ...", file=sys.stderr)
                engines[method, engine] = EngineProcess(
                    dict(target=args.target, method=method, num_speculative_tokens=args.num_speculative_tokens,
                         heads_dir=drafter_dir(args, method), dtype=args.dtype, max_model_len=args.max_model_len,
                         concurrency=args.concurrency, enforce_eager=engine == "eager",
                         draft_length=args.draft_length if method in PLUGIN_METHODS or args.draft_length == "off"
                         else None),
                    prompts[0], time_steps=True, engine_core="in-process")
            for _ in range(args.repeats):
                for row in order:
                    runs[row].append(engines[row].run(prompts, args.max_tokens, 0.0))
        finally:
            for engine_process in engines.values():
                engine_process.close()

    body = []
    plain = {engine: _median_ms(runs["vanilla", engine])["total"] for engine in args.engines
             if ("vanilla", engine) in runs}
    plain_decode = {engine: _median_decode_seconds(runs["vanilla", engine]) for engine in plain}
    target_weights = weight_count(args.target)
    drafter_share = {method: drafter_weights_per_step(args, method) / target_weights for method in args.methods
                     if method != "anpd" and drafter_dir(args, method) is not None}  # ANPD reads no weights
    for method, engine in rows:
        ms = _median_ms(runs[method, engine])
        tau = statistics.median(result.tau for result in runs[method, engine])
        decode = _median_decode_seconds(runs[method, engine])
        cost = f"{ms['total'] / plain[engine]:.2f}x" if engine in plain else "-"
        floor = drafter_share[method] * plain[engine] if engine in plain and method in drafter_share else None
        body.append([method, engine, "/".join(sorted({result.step_times.scheduling for result in runs[method, engine]})),
                     f"{ms['total']:.2f}", cost, *(f"{ms[part]:.2f}" for part in PARTS),
                     f"{ms['drafter'] + ms['drafter glue']:.2f}",
                     "-" if floor is None else f"{floor:.2f}",
                     "-" if floor is None or args.draft_length != "fixed" else f"{ms['drafter'] / floor:.2f}x",
                     f"{tau:.2f}", str(runs[method, engine][0].step_times.steps), f"{decode:.2f}",
                     f"{plain_decode[engine] / decode:.2f}x" if engine in plain else "-"])
    print(f"ms per decode step (median of {args.repeats} runs in each of {args.rounds} engine processes a row; "
          f"{len(prompts)} prompts, {args.max_tokens} tokens, "
          f"concurrency {args.concurrency}, {args.dtype}, K={args.num_speculative_tokens} ({args.draft_length} for "
          f"the plugin's methods), {os.cpu_count()} CPUs; in-process engine core; {dtype_choice.describe()})\n")
    shares = ", ".join(f"{method} {100 * share:.1f}%" for method, share in drafter_share.items())
    print(f"drafter floor: weights read per drafting step against the target's ({shares}) times the plain step "
          "(same engine, same run)\n")
    print(markdown_table(["method", "engine", "scheduling", "step", "vs plain", *PARTS, "drafter + glue", "drafter floor",
                          "drafter / floor", "tau", "steps", "decode s", "speedup"], body))


def drafter_weights_per_step(args, method: str) -> int:
    """Weights a drafting step of `method` reads: its dir's, plus the target's lm_head if it shares
    it, once per drafter pass (EAGLE chains K passes)."""
    directory = drafter_dir(args, method)
    weights = weight_count(directory)
    if not any("lm_head" in name for name in weight_shapes(directory)):
        config = json.loads((Path(args.target) / "config.json").read_text())
        weights += config["vocab_size"] * config["hidden_size"]
    return weights * (args.num_speculative_tokens if method == "eagle" else 1)


def weight_shapes(model_dir: str) -> dict[str, list[int]]:
    """Name -> shape of the floating-point tensors in a model dir's safetensors files."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as tensors:
            for name in tensors.keys():
                piece = tensors.get_slice(name)
                if piece.get_dtype().startswith(("F", "BF")):
                    shapes[name] = piece.get_shape()
    if not shapes:
        raise FileNotFoundError(f"no floating-point safetensors weights in {model_dir}")
    return shapes


def weight_count(model_dir: str) -> int:
    """Floating-point weights in a model dir's safetensors files (tied weights are stored once)."""
    return sum(math.prod(shape) for shape in weight_shapes(model_dir).values())


def _median_decode_seconds(results) -> float:
    """Seconds all decode steps took, median over runs (the "decode s" column)."""
    return statistics.median(sum(result.step_times.seconds.values()) for result in results)


def _median_ms(results) -> dict[str, float]:
    per_run = [result.step_times.ms_per_step() for result in results]
    medians = {part: statistics.median(run[part] for run in per_run) for part in PARTS}
    medians["total"] = statistics.median(sum(run.values()) for run in per_run)
    return medians


if __name__ == "__main__":
    main()
