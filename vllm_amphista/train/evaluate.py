"""Per-head draft accuracy against the target's own greedy continuations.

Head k at position t is right when its guess equals x_{t+2+k}, the token the
target actually produced there. Only positions inside the target's outputs
count, and tokens outside a draft vocabulary count as misses. EAGLE is
chained (each step feeds its own previous draft), as in vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_amphista.train.data import Sample, load_prompts, read_samples
from vllm_amphista.train.heads import IGNORE_INDEX, Batch, DraftMethod, load_heads
from vllm_amphista.train.target import HiddenStateCache, Target, load_target, pack_by_tokens

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


@dataclass
class _Counts:
    top1: torch.Tensor
    top5: torch.Tensor
    labelled: torch.Tensor
    accepted: float = 0.0
    full_positions: int = 0

    @classmethod
    def zeros(cls, num_heads: int) -> _Counts:
        return cls(*(torch.zeros(num_heads, dtype=torch.long) for _ in range(3)))


@torch.no_grad()
def head_accuracy(method: DraftMethod, target: Target, batches: list[Batch]) -> HeadAccuracy:
    was_training = method.training
    method.eval()
    counts = _Counts.zeros(method.num_heads)
    for batch in batches:
        labels = batch.target_labels(method.num_heads)
        logits = method.head_logits(batch, target)
        guesses = method.vocab.to_target_ids(logits.topk(min(TOP_K, logits.shape[-1]), dim=-1).indices)
        labelled = labels != IGNORE_INDEX
        right_top1 = (guesses[..., 0] == labels) & labelled
        right_top5 = (guesses == labels.unsqueeze(-1)).any(dim=-1) & labelled
        counts.top1 += right_top1.sum(dim=(0, 1)).cpu()
        counts.top5 += right_top5.sum(dim=(0, 1)).cpu()
        counts.labelled += labelled.sum(dim=(0, 1)).cpu()
        fully_labelled = labelled.all(dim=-1)
        counts.accepted += right_top1.long().cumprod(dim=-1).sum(dim=-1)[fully_labelled].sum().item()
        counts.full_positions += int(fully_labelled.sum())
    method.train(was_training)
    labelled = counts.labelled.clamp(min=1)
    return HeadAccuracy(
        top1=(counts.top1 / labelled).tolist(),
        top5=(counts.top5 / labelled).tolist(),
        mean_accepted=counts.accepted / max(counts.full_positions, 1),
        num_positions=int(counts.labelled[0]),
    )


def make_batches(samples: list[Sample], cache: HiddenStateCache, indices: list[int], batch_tokens: int,
                 train_on_prompt: bool = False, max_seq_len: int | None = None) -> list[Batch]:
    """Batches of the given sample indices, packed by length."""
    lengths = [min(len(samples[i].token_ids), max_seq_len or len(samples[i].token_ids)) for i in indices]
    batches = []
    for group in pack_by_tokens(lengths, batch_tokens):
        chosen = [indices[position] for position in group]
        batches.append(Batch.from_samples([samples[i] for i in chosen], [cache[i] for i in chosen],
                                          train_on_prompt, max_seq_len))
    return batches


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
    samples: str | None = None
    questions: list[str] = field(default_factory=list)
    prompt_field: str | None = None
    max_questions: int | None = None
    max_tokens: int = 256
    max_model_len: int = 1024
    generation_dtype: str = "bfloat16"
    enforce_eager: bool = False
    target_dtype: str = "bfloat16"
    cache_dir: str = ".cache/hidden_states"
    batch_tokens: int = 512
    eagle_steps: int = 4


def evaluate(options: EvalOptions) -> dict[str, HeadAccuracy]:
    """Accuracy of each heads directory; prints and returns it."""
    if bool(options.samples) == bool(options.questions):
        raise ValueError("give either --samples (generated already) or --questions (generated now), not both")
    target = load_target(options.target, options.target_dtype)
    # Load every heads directory first: a mismatch fails before any compute.
    methods = {str(path): load_heads(path, target, options.eagle_steps) for path in options.heads}
    samples_path = options.samples or _generate_eval_samples(options)
    samples = read_samples(samples_path)
    cache = HiddenStateCache.build(target, samples, samples_path, options.cache_dir, batch_tokens=options.batch_tokens)
    batches = make_batches(samples, cache, list(range(len(samples))), options.batch_tokens)
    results = {name: head_accuracy(method, target, batches) for name, method in methods.items()}
    print(markdown_table(results))
    return results


def _generate_eval_samples(options: EvalOptions) -> Path:
    """The target's greedy answers to the questions' first turns, via vLLM."""
    from vllm_amphista.train.generate import generate_samples

    prompts = [prompt for path in options.questions
               for prompt in load_prompts(path, options.prompt_field, options.max_questions)]
    output_path = Path(options.cache_dir) / "eval_samples.jsonl"
    os.makedirs(output_path.parent, exist_ok=True)
    generate_samples(options.target, prompts, output_path, max_tokens=options.max_tokens,
                     dtype=options.generation_dtype, max_model_len=options.max_model_len,
                     enforce_eager=options.enforce_eager)
    return output_path
