"""Choose ANPD's N: replay the target's greedy answers through every n-gram drafter.

    python -m vllm_amphista.tune_anpd --target models/SmolLM2-135M-Instruct --out bench_out/tune_anpd

Under greedy decoding a chain drafter's acceptance is fixed by the context and
the target's greedy continuation alone: at each verification step the target
accepts the longest prefix of the draft that equals its own next tokens, then
adds one token of its own. So once the target's greedy answers are known (one
batched vLLM run, cached in `--out`), tau (generated tokens / target steps,
Spec-Bench's definition) of ANPD at every N, and of vLLM's `ngram` proposer
(its own matching function, called here), follows exactly and cheaply for all
questions, with no engine per setting. This is how the default N was chosen;
`python -m vllm_amphista.bench` then measures the chosen setting's speed in
vLLM. (bf16 answers drift slightly between batch shapes, so the engine's tau
can differ from the replay's by a little.)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vllm_amphista.answer_ngrams import ANSWER_NGRAMS_NAME, load_from_dir
from vllm_amphista.assets import SPEC_BENCH_QUESTIONS
from vllm_amphista.bench.greedy_answers import greedy_answers
from vllm_amphista.replay import anpd_steps, replay, tau_by_category

def vllm_ngram_steps(prompt_ids: list[int], output_ids: list[int], k: int, min_n: int, max_n: int) -> int:
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

    def draft(context: list[int], room: int) -> list[int]:
        tokens = np.asarray(context, dtype=np.int32)
        return _find_longest_matched_ngram_and_propose_tokens(tokens, min_n, max_n, 1 << 30, room).tolist()

    return replay(prompt_ids, output_ids, k, draft)


def drafters(args) -> dict[str, Callable[[list[int], list[int]], int]]:
    rows = {f"anpd N={n}": (lambda p, o, n=n: anpd_steps(p, o, args.k, n)) for n in args.anpd_n}
    if args.answer_ngrams:
        fallback = load_from_dir(args.answer_ngrams)
        if fallback is None:
            raise SystemExit(f"no {ANSWER_NGRAMS_NAME} in {args.answer_ngrams}")
        rows.update({f"anpd N={n} + answer n-grams": (lambda p, o, n=n: anpd_steps(p, o, args.k, n, fallback))
                     for n in args.anpd_n})
    for min_n, max_n in args.ngram:
        rows[f"vLLM ngram {min_n}..{max_n}"] = lambda p, o, lo=min_n, hi=max_n: vllm_ngram_steps(p, o, args.k, lo, hi)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="target model directory")
    parser.add_argument("--questions", nargs="+", default=[SPEC_BENCH_QUESTIONS],
                        help="Spec-Bench / MT-Bench JSONL files (default: %(default)s)")
    parser.add_argument("--per-category", type=int, help="questions per category (default: all)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per answer (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="default: %(default)s")
    parser.add_argument("--dtype", default="bfloat16", help="target dtype for the answers (default: %(default)s)")
    parser.add_argument("-k", type=int, default=4, help="draft tokens per step (default: %(default)s)")
    parser.add_argument("--anpd-n", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8, 10, 12, 16],
                        help="ANPD's largest n-gram order N to try (default: %(default)s)")
    parser.add_argument("--ngram", type=lambda v: tuple(int(x) for x in v.split("..")), nargs="*",
                        default=[(2, 5), (1, 3), (1, 5)], metavar="MIN..MAX",
                        help="vLLM ngram windows to compare (default: 2..5 (the benchmark's), 1..3, 1..5)")
    parser.add_argument("--answer-ngrams", metavar="DIR",
                        help="also replay every N falling back on the answer n-grams in DIR (answer_ngrams.npz)")
    parser.add_argument("--tolerance", type=float, default=0.005,
                        help="recommend the smallest N whose overall tau is within this fraction of the best "
                             "N tried (default: %(default)s): each level stores one more context per token")
    parser.add_argument("--out", required=True, help="directory for the cached answers and the table")
    args = parser.parse_args(argv)

    records = greedy_answers(args)
    categories = list(dict.fromkeys(record["category"] for record in records))
    rows = drafters(args)
    taus = {label: tau_by_category(records, lambda record, steps_of=steps_of: steps_of(record["prompt_ids"],
                                                                                  record["output_ids"]))
            for label, steps_of in rows.items()}
    columns = [*categories, "all"]
    counts = {category: sum(record["category"] == category for record in records) for category in categories}
    lines = ["| drafter | " + " | ".join(f"{c} ({counts.get(c, len(records))})" for c in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    best = {c: max(by_category[c] for by_category in taus.values()) for c in columns}
    for label, by_category in taus.items():
        cells = [f"**{by_category[c]:.3f}**" if by_category[c] == best[c] else f"{by_category[c]:.3f}" for c in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    table = f"tau by category (K={args.k}, greedy replay, questions per category in brackets)\n\n" + "\n".join(lines)
    anpd_all = {n: taus[f"anpd N={n}"]["all"] for n in args.anpd_n}
    best_tau = max(anpd_all.values())
    chosen = min(n for n, tau in anpd_all.items() if tau >= (1 - args.tolerance) * best_tau)
    table += (f"\n\nRecommended ANPD N = {chosen} (prompt_lookup_max {chosen - 1}): overall tau {anpd_all[chosen]:.4f}, "
              f"best tried {best_tau:.4f} (N = {max(anpd_all, key=anpd_all.get)}), tolerance {args.tolerance:.1%}")
    print(table)
    (Path(args.out) / "tune_anpd.md").write_text(table + "\n")
    (Path(args.out) / "tune_anpd.json").write_text(json.dumps(taus, indent=1))


if __name__ == "__main__":
    main()
