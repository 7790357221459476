"""Choose the hybrid rule: replay the target's greedy answers through heads, ANPD and every hybrid rule.

    python -m vllm_amphista.tune_hybrid --target models/SmolLM2-135M-Instruct --out bench_out/tune_hybrid
    python -m vllm_amphista.tune_hybrid --target models/SmolLM2-135M-Instruct --out bench_out/tune_hybrid \
        --answers data/answers/smollm2-135m-instruct/self-seed9/shard_0000{6,7}.npz --per-shard 120 -k 8

As in `tune_anpd` (same cached answers), greedy acceptance follows from the
target's own continuation, so tau of each rule follows exactly from a replay
(`vllm_amphista/replay.py`).
The heads need the target's hidden states: one float32 forward of each
answered question (transformers), then the reference drafter gives every
position's K drafts and their probabilities at once. Prints tau by Spec-Bench
category for the heads alone, ANPD alone, the better of the two per category,
and each rule (`hybrid.RULES`) at several ANPD weights and caps; ANPD's tables fall back
on the heads dir's answer n-grams where it ships them, as in vLLM. With `--answers`, the
answers are committed training answers (greedy, float32: `train generate`) instead of
Spec-Bench's, one column per shard: choosing weights there keeps the benchmarks out of it, as
long as neither the heads nor their answer n-grams learned from those shards.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm_amphista.answer_ngrams import load_from_dir
from vllm_amphista.assets import SHIPPED_HEADS, SPEC_BENCH_QUESTIONS
from vllm_amphista.bench.greedy_answers import greedy_answers
from vllm_amphista.hybrid import NGRAM_CONFIDENCE_CAP
from vllm_amphista.modeling_amphista import AmphistaDrafter
from vllm_amphista.replay import head_chains, hybrid_steps, tau_by_category
from vllm_amphista.train.data import read_answers_shard
from vllm_amphista.vllm.config import ANPD_DEFAULT_MAX_CONTEXT


def answer_records(shards: list[str], per_shard: int | None) -> list[dict]:
    """Replay records of committed answer shards, each shard its own category."""
    records = []
    for shard in shards:
        category = f"{Path(shard).parent.name}/{Path(shard).stem}"
        records += [{"category": category, "prompt_ids": sample.prompt_ids, "output_ids": sample.output_ids}
                    for sample in read_answers_shard(shard)[:per_shard]]
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="target model directory")
    parser.add_argument("--heads", default=SHIPPED_HEADS, help="Amphista heads dir (default: the shipped heads)")
    parser.add_argument("--questions", nargs="+", default=[SPEC_BENCH_QUESTIONS])
    parser.add_argument("--per-category", type=int, default=10, help="questions per category (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", help="target dtype for the answers (default: %(default)s)")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--ngram-weights", type=float, nargs="+", default=[1.0, 1.25, 1.5, 2.0])
    parser.add_argument("--ngram-caps", type=float, nargs="+", default=[NGRAM_CONFIDENCE_CAP, float("inf")],
                        help="caps on ANPD's weighted confidences (inf: none; default: %(default)s)")
    parser.add_argument("--answers", nargs="+", help="answer shards (.npz) to replay instead of Spec-Bench's")
    parser.add_argument("--per-shard", type=int, help="with --answers: each shard's first N answers (default: all)")
    parser.add_argument("--out", required=True, help="directory for the cached answers and the table")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    records = answer_records(args.answers, args.per_shard) if args.answers else greedy_answers(args)
    target = AutoModelForCausalLM.from_pretrained(args.target, torch_dtype=torch.float32).eval()
    drafter = AmphistaDrafter.from_pretrained(args.heads, dtype=torch.float32).eval()
    max_n = ANPD_DEFAULT_MAX_CONTEXT + 1
    rows = {"heads": ("heads", 1.0, 1.0), "anpd": ("ngram", 1.0, 1.0)}
    rows.update({f"{rule} w={weight:g} cap={cap:g}": (rule, weight, cap) for rule in ("longer", "splice")
                 for weight in args.ngram_weights for cap in args.ngram_caps})
    categories = list(dict.fromkeys(record["category"] for record in records))
    chains = [head_chains(target, drafter, record["prompt_ids"] + record["output_ids"]) for record in records]
    chains_of = {id(record): record_chains for record, record_chains in zip(records, chains)}
    fallback = load_from_dir(args.heads)
    taus = {label: tau_by_category(records, lambda record, rule=rule, weight=weight, cap=cap: hybrid_steps(
                record, chains_of[id(record)], rule, args.k, max_n, fallback, ngram_weight=weight, ngram_cap=cap))
            for label, (rule, weight, cap) in rows.items()}
    columns = [*categories, "all"]
    better = {c: max(taus["heads"][c], taus["anpd"][c]) for c in columns}
    lines = ["| drafter | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for label, by_category in taus.items():
        cells = [f"{by_category[c]:.3f}" + (" ≥" if label not in ("heads", "anpd") and by_category[c] >= better[c]
                                            else "") for c in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| max(heads, anpd) per category | " + " | ".join(f"{better[c]:.3f}" for c in columns) + " |")
    table = (f"tau by category (K={args.k}, greedy replay of {len(records)} answers, ANPD N={max_n}; "
             "≥ marks a hybrid at least as good as the better single drafter)\n\n" + "\n".join(lines))
    print(table)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tune_hybrid.md").write_text(table + "\n")
    (Path(args.out) / "tune_hybrid.json").write_text(json.dumps(taus, indent=1))


if __name__ == "__main__":
    main()
