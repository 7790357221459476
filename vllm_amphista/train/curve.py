"""`curve`: tau of several heads dirs on the same held-out answers, by greedy replay, and a plot.

    python -m vllm_amphista.train curve --target models/SmolLM2-135M-Instruct \
        --heads runs/a runs/b --output-tokens 300000 3307246 --out bench_out/curve --plot docs/curve.png

The held-out set is the target's greedy answers to Spec-Bench first turns (10 per
category by default: its first 8 categories are MT-Bench's), never trained on,
made once through vLLM and cached in --out (`bench/greedy_answers.py`). Each
heads dir is replayed alone ("heads") and in the deployed hybrid rule with ANPD
("hybrid": `hybrid.hybrid_draft`'s defaults), as `tune_hybrid` replays them; the
tables fall back on the heads dir's own answer n-grams where it ships them (as
in vLLM), so compare hybrid points made with and without them apart.
The x axis is what the run learned from (--output-tokens); the table also gives
any note passed per run (--notes), such as its steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_amphista.answer_ngrams import load_from_dir
from vllm_amphista.assets import SPEC_BENCH_QUESTIONS
from vllm_amphista.bench.greedy_answers import greedy_answers
from vllm_amphista.modeling_amphista import AmphistaDrafter
from vllm_amphista.replay import head_chains, hybrid_steps, tau_by_category
from vllm_amphista.vllm.config import ANPD_DEFAULT_MAX_CONTEXT

# Spec-Bench's first 8 categories are MT-Bench's 80 first turns.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
HYBRID_RULE = "splice"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model directory")
    parser.add_argument("--heads", nargs="+", required=True, help="Amphista heads dirs, one per point")
    parser.add_argument("--output-tokens", type=int, nargs="+", required=True,
                        help="output tokens each heads dir learned from (the x axis), one per --heads")
    parser.add_argument("--notes", nargs="+", help="a note per heads dir for the table (e.g. its steps)")
    parser.add_argument("--questions", nargs="+", default=[SPEC_BENCH_QUESTIONS])
    parser.add_argument("--per-category", type=int, default=10, help="questions per category (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", help="target dtype for the answers (default: %(default)s)")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--out", required=True, help="directory for the cached answers, curve.md and curve.json")
    parser.add_argument("--plot", help="PNG to draw the curve to")


def run_curve(args: argparse.Namespace) -> dict:
    if len(args.output_tokens) != len(args.heads) or (args.notes and len(args.notes) != len(args.heads)):
        raise ValueError("give one --output-tokens (and --notes, if any) per --heads")
    from transformers import AutoModelForCausalLM

    records = greedy_answers(args)
    target = AutoModelForCausalLM.from_pretrained(args.target, torch_dtype=torch.float32).eval()
    max_n = ANPD_DEFAULT_MAX_CONTEXT + 1
    points = []
    for heads, tokens, note in zip(args.heads, args.output_tokens, args.notes or [""] * len(args.heads)):
        drafter = AmphistaDrafter.from_pretrained(heads, dtype=torch.float32).eval()
        chains = {id(record): head_chains(target, drafter, record["prompt_ids"] + record["output_ids"])
                  for record in tqdm(records, desc=f"replaying {heads}", unit="answer")}
        fallback = load_from_dir(heads)
        taus = {rule: tau_by_category(records, lambda record, rule=rule: hybrid_steps(
                    record, chains[id(record)], rule, args.k, max_n, fallback))
                for rule in ("heads", HYBRID_RULE)}
        points.append({"heads": heads, "output_tokens": tokens, "note": note,
                       "heads_tau": taus["heads"], "hybrid_tau": taus[HYBRID_RULE],
                       "heads_tau_mt_bench": _mt_bench(records, taus["heads"]),
                       "hybrid_tau_mt_bench": _mt_bench(records, taus[HYBRID_RULE])})
    table = _table(points, len(records), args.k)
    print(table)
    out = Path(args.out)
    (out / "curve.md").write_text(table + "\n")
    (out / "curve.json").write_text(json.dumps(points, indent=1))
    if args.plot:
        _plot(points, args.plot, args.k)
    return {"points": points}


def _mt_bench(records: list[dict], taus: dict[str, float]) -> float:
    """tau over the MT-Bench categories together (weighted by tokens, as "all" is); NaN without them."""
    present = [c for c in MT_BENCH_CATEGORIES if c in taus]
    tokens = {c: sum(len(r["output_ids"]) for r in records if r["category"] == c) for c in present}
    steps = sum(tokens[c] / taus[c] for c in present)
    return sum(tokens.values()) / steps if steps else float("nan")


def _table(points: list[dict], num_records: int, k: int) -> str:
    lines = [f"tau by greedy replay of {num_records} Spec-Bench first-turn answers (K={k}; hybrid: the deployed "
             f"{HYBRID_RULE!r} rule)", "",
             "| heads | output tokens | note | heads, MT-Bench | heads, all | hybrid, MT-Bench | hybrid, all |",
             "|---|---|---|---|---|---|---|"]
    for point in points:
        lines.append(f"| `{point['heads']}` | {point['output_tokens']:,} | {point['note']} | "
                     f"{point['heads_tau_mt_bench']:.3f} | {point['heads_tau']['all']:.3f} | "
                     f"{point['hybrid_tau_mt_bench']:.3f} | {point['hybrid_tau']['all']:.3f} |")
    return "\n".join(lines)


def _plot(points: list[dict], path: str, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    points = sorted(points, key=lambda point: point["output_tokens"])
    tokens = [point["output_tokens"] for point in points]
    figure, axis = plt.subplots(figsize=(6, 4))
    for key, label in (("heads_tau_mt_bench", "heads, MT-Bench"), ("heads_tau", "heads, Spec-Bench"),
                       ("hybrid_tau_mt_bench", "hybrid, MT-Bench"), ("hybrid_tau", "hybrid, Spec-Bench")):
        values = [point[key] if isinstance(point[key], float) else point[key]["all"] for point in points]
        axis.plot(tokens, values, marker="o", label=label)
    axis.set_xscale("log")
    # Ticks at the points themselves: log-scale minor labels overlap between 1e5 and 1e7.
    axis.set_xticks(tokens, [f"{count / 1e6:.1f}M" for count in tokens])
    axis.xaxis.set_minor_formatter(NullFormatter())
    axis.set_xlabel("output tokens trained on")
    axis.set_ylabel(f"tau (greedy replay, K={k})")
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
