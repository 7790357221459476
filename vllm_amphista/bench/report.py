"""The benchmark's figures and report: tau, speedups, step cost, lossless checks, tables and plots."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_amphista.bench.engines import RunResult
from vllm_amphista.prompts import Question

ALL_CATEGORIES = "all"


@dataclass
class MethodRun:
    """One row of the tables at one concurrency: a method, its heads, and its timed repeats."""

    label: str
    method: str
    heads_dir: str | None
    draft_length: str | None = None  # for our methods: "adaptive", "fixed" or "off"
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
    latency_speedup: float | None = None  # vanilla's mean request latency over this row's, median over repeats
    differing_prompts: int | None = None
    first_differing_token: int | None = None
    differing_question_ids: list = field(default_factory=list)


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
    figures.latency_speedup = statistics.median(theirs.mean_request_seconds / mine.mean_request_seconds
                                                for mine, theirs in pairs)
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
                 "mean request latency: speedup", "outputs != vanilla"]


def detail_cells(label: str, category: str, figures: Figures, prompts: int, greedy: bool) -> list[str]:
    return [
        label, category, f"{figures.tau:.2f}", format_optional(figures.vllm_mean_acceptance_length),
        " / ".join(f"{rate:.2f}" for rate in figures.acceptance_rate_per_position) or "-",
        f"{figures.tokens_per_second:.1f}", format_speedup(figures), format_optional(figures.step_cost, "x"),
        format_optional(figures.latency_speedup, "x"),
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

    if len(levels) > 1:
        figure, axis = plt.subplots(figsize=(6.5, 4.5))
        labels = dict.fromkeys(label for concurrency in levels for label in by_concurrency[concurrency][1])
        for label in labels:
            if label == "vanilla":
                continue
            points = [(concurrency, by_concurrency[concurrency][1][label][ALL_CATEGORIES])
                      for concurrency in levels if label in by_concurrency[concurrency][1]]
            points = [(c, f) for c, f in points if f.speedup_median is not None]
            if points:
                axis.errorbar([c for c, _ in points], [f.speedup_median for _, f in points],
                              yerr=[[f.speedup_median - f.speedup_min for _, f in points],
                                    [f.speedup_max - f.speedup_median for _, f in points]],
                              marker="o", capsize=3, label=label)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(level) for level in levels])
        axis.set(title="Throughput vs plain decoding (all categories)", xlabel="concurrency",
                 ylabel="speedup (median, min-max)")
        axis.grid(alpha=0.3)
        if axis.has_data():
            axis.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(out / "speedup_by_concurrency.png", dpi=120)
        plt.close(figure)


def raw_record(concurrency: int, row: MethodRun, figures: dict | None, questions: dict) -> dict:
    """Everything measured for one row at one concurrency, for results.json."""
    return {
        "concurrency": concurrency, "label": row.label, "method": row.method, "heads_dir": row.heads_dir,
        "draft_length": row.draft_length,
        "status": "ok" if row.repeats else row.not_run.split(":")[0], "reason": row.not_run,
        "build_and_warmup_seconds": row.build_seconds,
        "repeats": [
            {category: {"seconds": result.seconds, "output_lengths": [len(ids) for ids in result.outputs],
                        "question_ids": [question.question_id for question in questions[category]],
                        "target_steps": result.target_steps, "request_seconds": result.request_seconds,
                        "spec": asdict(result.spec)}
             for category, result in repeat.items()}
            for repeat in row.repeats
        ],
        "figures": {category: asdict(f) for category, f in figures.items()} if figures else None,
    }
