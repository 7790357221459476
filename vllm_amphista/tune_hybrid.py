"""Choose the hybrid rule: replay the target's greedy answers through heads, ANPD and every hybrid rule.

    python -m vllm_amphista.tune_hybrid --target models/SmolLM2-135M-Instruct --out bench_out/tune_hybrid

As in `tune_anpd` (same cached answers), greedy acceptance follows from the
target's own continuation, so tau of each rule follows exactly from a replay.
The heads need the target's hidden states: one float32 forward of each
answered question (transformers), then the reference drafter gives every
position's K drafts and their probabilities at once. Prints tau by Spec-Bench
category for the heads alone, ANPD alone, the better of the two per category,
and each rule (`hybrid.RULES`) at several ANPD weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm_amphista.anpd import NgramTables
from vllm_amphista.assets import SHIPPED_HEADS, SPEC_BENCH_QUESTIONS
from vllm_amphista.hybrid import hybrid_draft
from vllm_amphista.modeling_amphista import AmphistaDrafter
from vllm_amphista.tune_anpd import greedy_answers, replay
from vllm_amphista.vllm.config import ANPD_DEFAULT_MAX_CONTEXT


@torch.no_grad()
def head_chains(target, drafter: AmphistaDrafter, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """([L-1, K] draft ids, [L-1, K] probabilities): row t is what the heads draft once x_{t+1} is sampled."""
    ids = torch.tensor([token_ids])
    hidden = target.model(ids, output_hidden_states=True).hidden_states[-1][:, :-1]  # final-norm h_t
    embed = target.get_input_embeddings().weight
    logits = drafter(hidden, ids[:, 1:], embed, target.get_output_embeddings().weight)[0].float()
    best, draft_ids = logits.max(dim=-1)
    probabilities = torch.exp(best - torch.logsumexp(logits, dim=-1))
    if drafter.draft_to_target is not None:
        draft_ids = drafter.draft_to_target[draft_ids]
    return draft_ids, probabilities


def rule_steps(record: dict, chains: tuple[torch.Tensor, torch.Tensor], rule: str, ngram_weight: float, k: int,
               max_n: int) -> int:
    draft_ids, probabilities = chains
    draft_ids, probabilities = draft_ids.tolist(), probabilities.tolist()
    tables = NgramTables(max_n, max_entries=1 << 30)

    def draft(context: list[int], room: int) -> list[int]:
        position = len(context) - 2  # h_{L-2} and the last token x_{L-1} give the next drafts
        heads = list(zip(draft_ids[position], probabilities[position]))
        chain = hybrid_draft(heads, tables.scored_draft, k, rule, ngram_weight)
        return [token for token, _ in chain][:room]

    return replay(record["prompt_ids"], record["output_ids"], k, draft, tables.extend)


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
    parser.add_argument("--ngram-weights", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0, 4.0])
    parser.add_argument("--out", required=True, help="directory for the cached answers and the table")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    records = greedy_answers(args)
    target = AutoModelForCausalLM.from_pretrained(args.target, torch_dtype=torch.float32).eval()
    drafter = AmphistaDrafter.from_pretrained(args.heads, dtype=torch.float32).eval()
    max_n = ANPD_DEFAULT_MAX_CONTEXT + 1
    rows = {"heads": ("heads", 1.0), "anpd": ("ngram", 1.0)}
    rows.update({f"{rule} w={weight:g}": (rule, weight) for rule in ("longer", "splice") for weight in args.ngram_weights})
    categories = list(dict.fromkeys(record["category"] for record in records))
    totals = {label: {category: [0, 0] for category in categories} for label in rows}
    for record in records:
        chains = head_chains(target, drafter, record["prompt_ids"] + record["output_ids"])
        for label, (rule, weight) in rows.items():
            steps = rule_steps(record, chains, rule, weight, args.k, max_n)
            totals[label][record["category"]][0] += len(record["output_ids"])
            totals[label][record["category"]][1] += steps
    taus = {}
    for label, by_category in totals.items():
        overall = [sum(t[0] for t in by_category.values()), sum(t[1] for t in by_category.values())]
        taus[label] = {c: tokens / steps for c, (tokens, steps) in {**by_category, "all": overall}.items()}
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
    (Path(args.out) / "tune_hybrid.md").write_text(table + "\n")
    (Path(args.out) / "tune_hybrid.json").write_text(json.dumps(taus, indent=1))


if __name__ == "__main__":
    main()
