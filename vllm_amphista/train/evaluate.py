"""Per-head draft accuracy against the target's own greedy continuations.

Head k at position t is right when its guess equals x_{t+2+k}, the token the
target actually produced there. Only positions inside the target's outputs
count, and tokens outside a draft vocabulary count as misses. EAGLE is
chained (each step feeds its own previous draft), as in vLLM.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_amphista.prompts import load_conversations
from vllm_amphista.train.batch import IGNORE_INDEX, build_batch, make_batches
from vllm_amphista.train.data import Dataset
from vllm_amphista.train.drafter import DraftMethod
from vllm_amphista.train.methods import load_heads
from vllm_amphista.train.target import Target, load_target

TOP_K = 5


@dataclass
class HeadAccuracy:
    top1: list[float]
    top5: list[float]
    # Mean number of leading heads that are right, over positions where all
    # K heads have a label: the tokens one verification step would accept
    # from a single chain of top-1 drafts (the bonus token not counted).
    mean_accepted: float
    num_positions: int = 0

    def as_dict(self) -> dict:
        return {"top1": self.top1, "top5": self.top5, "mean_accepted": self.mean_accepted,
                "num_positions": self.num_positions}


@torch.no_grad()
def head_accuracy(method: DraftMethod, target: Target, dataset: Dataset, batch_plans: list, row_tokens: int,
                  device: str = "cpu") -> HeadAccuracy:
    was_training = method.training
    method.eval()
    num_heads = method.num_heads
    top1 = torch.zeros(num_heads, dtype=torch.long)
    top5 = torch.zeros(num_heads, dtype=torch.long)
    labelled_count = torch.zeros(num_heads, dtype=torch.long)
    accepted, full_positions = 0.0, 0
    for plan in batch_plans:
        batch = build_batch(dataset, plan, num_heads, row_tokens).to(device)
        rows = (batch.labels != IGNORE_INDEX).any(dim=-1)
        labels = batch.labels[rows]
        logits = method.head_logits(batch, target, rows)
        guesses = method.vocab.to_target_ids(logits.topk(min(TOP_K, logits.shape[-1]), dim=-1).indices)
        labelled = labels != IGNORE_INDEX
        right_top1 = (guesses[..., 0] == labels) & labelled
        top1 += right_top1.sum(dim=0).cpu()
        top5 += ((guesses == labels.unsqueeze(-1)).any(dim=-1) & labelled).sum(dim=0).cpu()
        labelled_count += labelled.sum(dim=0).cpu()
        fully_labelled = labelled.all(dim=-1)
        accepted += right_top1.long().cumprod(dim=-1).sum(dim=-1)[fully_labelled].sum().item()
        full_positions += int(fully_labelled.sum())
    method.train(was_training)
    denominator = labelled_count.clamp(min=1)
    return HeadAccuracy(
        top1=(top1 / denominator).tolist(),
        top5=(top5 / denominator).tolist(),
        mean_accepted=accepted / max(full_positions, 1),
        num_positions=int(labelled_count[0]),
    )


def markdown_table(results: dict[str, HeadAccuracy]) -> str:
    num_heads = max(len(result.top1) for result in results.values())
    header = ["heads"] + [f"head {k + 1} top-1" for k in range(num_heads)] + ["mean accepted", "positions"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, result in results.items():
        cells = [f"{accuracy:.3f}" for accuracy in result.top1] + [""] * (num_heads - len(result.top1))
        lines.append("| " + " | ".join([name, *cells, f"{result.mean_accepted:.2f}", str(result.num_positions)]) + " |")
    return "\n".join(lines)


@dataclass
class EvalOptions:
    target: str
    heads: list[str]
    data: list[str] = field(default_factory=list)
    questions: list[str] = field(default_factory=list)
    prompt_field: str | None = None
    max_questions: int | None = None
    max_tokens: int = 256
    max_model_len: int = 1024
    generation_dtype: str = "float32"
    enforce_eager: bool = False
    cache_dir: str = ".cache/eval"
    batch_tokens: int = 2048
    row_tokens: int = 1024
    eagle_steps: int = 4


def evaluate(options: EvalOptions) -> dict[str, HeadAccuracy]:
    """Accuracy of each heads directory; prints and returns it."""
    if bool(options.data) == bool(options.questions):
        raise ValueError("give either --data (generated already) or --questions (answered now), not both")
    target = load_target(options.target)
    # Load every heads directory first: a mismatch fails before any compute.
    methods = {str(path): load_heads(path, target, options.eagle_steps) for path in options.heads}
    feature_layers = sorted({layer for method in methods.values() for layer in method.feature_layers or []})
    dataset = Dataset(options.data or [_answer_questions(options, feature_layers)])
    indices = list(range(len(dataset)))
    results = {}
    for name, method in methods.items():
        plans = make_batches(dataset, indices, method.num_heads, options.batch_tokens, options.row_tokens)
        results[name] = head_accuracy(method, target, dataset.with_feature_layers(method.feature_layers), plans,
                                      options.row_tokens)
    print(markdown_table(results))
    return results


def _answer_questions(options: EvalOptions, feature_layers: list[int]) -> Path:
    """A dataset of the target's greedy answers to the questions' first turns (with the streams of
    `feature_layers`), made once per setting."""
    from vllm_amphista.train.generate import generate_dataset

    key = hashlib.sha256(json.dumps({
        "questions": [hashlib.sha256(Path(path).read_bytes()).hexdigest() for path in options.questions],
        "settings": [options.target, options.prompt_field, options.max_questions, options.max_tokens,
                     options.max_model_len, options.generation_dtype, feature_layers],
    }).encode()).hexdigest()[:16]
    out = Path(options.cache_dir) / f"answers-{key}"
    conversations = [(f"{Path(path).stem}-{index}", Path(path).stem, conversation)
                     for path in options.questions
                     for index, conversation in enumerate(load_conversations(path, options.prompt_field,
                                                                             options.max_questions))]
    generate_dataset(options.target, out, conversations=conversations, max_tokens=options.max_tokens,
                     dtype=options.generation_dtype, max_model_len=options.max_model_len,
                     enforce_eager=options.enforce_eager, concurrency=64, feature_layers=feature_layers or None)
    return out
