"""`fit`: train a drafter on the target's own outputs (self-distillation).

Steps: read the samples, load the frozen target, cache its final-norm hidden
states on disk (shared by every method and run on the same data), hold out an
eval slice, then train with AdamW, linear warmup + cosine decay, gradient
clipping and bf16 autocast. Loss for Amphista and Medusa:
sum_k decay**k * CE(head k, x_{t+2+k}) over the target's output positions;
EAGLE uses its own feature-regression loss (see ``heads.py``).

Output directory: the drafter in its inference format (config.json +
model.safetensors, loadable by vLLM / the Amphista plugin) and ``training/``
with the resumable state (``state.pt``) and ``metrics.json``.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_amphista.train.data import DataError, check_token_ids, most_frequent_tokens, read_samples
from vllm_amphista.train.evaluate import HeadAccuracy, head_accuracy, make_batches
from vllm_amphista.train.heads import (
    METHOD_CLASSES,
    METHODS,
    AmphistaMethod,
    DraftMethod,
    EagleMethod,
    MedusaMethod,
)
from vllm_amphista.train.target import DTYPES, HiddenStateCache, load_target

STATE_NAME = "state.pt"
METRICS_NAME = "metrics.json"


@dataclass
class FitOptions:
    target: str
    data: str
    out: str
    method: str = "amphista"
    num_heads: int = 4
    # Amphista architecture
    num_near_heads: int | None = None
    stage_layers: int = 1
    encoder_layers: int = 1
    no_encoder: bool = False
    no_stages: bool = False
    no_sampled_token: bool = False
    train_lm_head: bool = False
    # Baselines
    medusa_layers: int = 1
    eagle_ce_weight: float = 0.1
    # Data
    draft_vocab_size: int = 0
    train_on_prompt: bool = False
    max_seq_len: int = 1024
    eval_fraction: float = 0.05
    # Optimisation
    loss_decay: float = 0.8
    epochs: int = 1
    max_steps: int | None = None
    batch_tokens: int = 2048
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    grad_clip: float = 1.0
    seed: int = 0
    bf16_autocast: bool = True
    # Bookkeeping
    eval_every: int = 200
    eval_batch_tokens: int = 512
    checkpoint_every: int = 200
    resume: bool = False
    max_minutes: float | None = None
    target_dtype: str = "bfloat16"
    cache_dir: str = ".cache/hidden_states"
    cache_dtype: str = "bfloat16"
    save_dtype: str = "bfloat16"
    device: str = "cpu"
    threads: int | None = None

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {METHODS}, got {self.method!r}")
        ablations = self.no_encoder or self.no_stages or self.no_sampled_token or self.train_lm_head
        if ablations and self.method != "amphista":
            raise ValueError(
                "--no-encoder/--no-stages/--no-sampled-token/--train-lm-head apply to --method amphista only"
            )
        if self.num_heads < 1:
            raise ValueError(f"--num-heads must be >= 1, got {self.num_heads}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        for name in ("target_dtype", "cache_dtype", "save_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {sorted(DTYPES)}")


@dataclass
class FitResult:
    steps: int
    train_losses: list[float]
    evals: list[tuple[int, HeadAccuracy]]
    stopped_early: bool
    seconds: float


def create_method(options: FitOptions, target, draft_to_target: torch.Tensor | None) -> DraftMethod:
    if options.method == "medusa":
        return MedusaMethod.create(target, draft_to_target, options.num_heads, options.medusa_layers)
    if options.method == "eagle":
        return EagleMethod.create(target, draft_to_target, options.num_heads, options.eagle_ce_weight)
    return AmphistaMethod.create(
        target, draft_to_target,
        num_draft_heads=options.num_heads,
        num_near_heads=options.num_near_heads,
        stage_num_layers=options.stage_layers,
        encoder_num_layers=options.encoder_layers,
        use_encoder=not options.no_encoder,
        use_stages=not options.no_stages,
        use_sampled_token=not options.no_sampled_token,
        share_lm_head=not options.train_lm_head,
    )


def split_indices(num_samples: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) sample indices; eval is a seeded random slice."""
    indices = list(range(num_samples))
    random.Random(seed).shuffle(indices)
    num_eval = max(1, round(eval_fraction * num_samples)) if eval_fraction > 0 else 0
    if num_samples - num_eval < 1:
        raise DataError(f"{num_samples} samples leave none for training after holding out {num_eval} for eval")
    return sorted(indices[num_eval:]), sorted(indices[:num_eval])


def warmup_cosine(total_steps: int, warmup_ratio: float):
    warmup_steps = max(1, round(warmup_ratio * total_steps))

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return lr_factor


def fit(options: FitOptions) -> FitResult:
    options.validate()
    started = time.monotonic()
    if options.threads:
        torch.set_num_threads(options.threads)
    torch.manual_seed(options.seed)

    samples = read_samples(options.data)
    target = load_target(options.target, options.target_dtype)
    target.model.to(options.device)
    check_token_ids(samples, target.vocab_size, options.data)
    train_indices, eval_indices = split_indices(len(samples), options.eval_fraction, options.seed)

    out = Path(options.out)
    state_path = out / "training" / STATE_NAME
    state = torch.load(state_path, weights_only=False) if options.resume and state_path.exists() else None
    if state is not None:
        if state["method"] != options.method:
            raise ValueError(f"{state_path} holds a {state['method']} run, not {options.method}")
        target.check_matches(state["hidden_size"], state["vocab_size"], str(state_path))
        method = METHOD_CLASSES[options.method].from_spec(state["spec"], target)
        method.load_state_dict(state["model"])
    else:
        draft_to_target = None
        if options.draft_vocab_size:
            draft_to_target = most_frequent_tokens(
                [samples[i] for i in train_indices], options.draft_vocab_size, target.vocab_size
            )
        method = create_method(options, target, draft_to_target)
    method.to(options.device).train()

    cache = HiddenStateCache.build(target, samples, options.data, options.cache_dir, options.cache_dtype)
    train_batches = make_batches(samples, cache, train_indices, options.batch_tokens,
                                 options.train_on_prompt, options.max_seq_len)
    eval_batches = [batch.to(options.device) for batch in make_batches(
        samples, cache, eval_indices, options.eval_batch_tokens, max_seq_len=options.max_seq_len)]
    total_steps = options.max_steps or options.epochs * len(train_batches)

    parameters = [parameter for parameter in method.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=options.lr, weight_decay=options.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total_steps, options.warmup_ratio))
    head_weights = torch.tensor([options.loss_decay ** k for k in range(method.num_heads)], device=options.device)
    train_losses: list[float] = []
    evals: list[tuple[int, HeadAccuracy]] = []
    step = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, train_losses = state["step"], state["train_losses"]
        evals = [(at, HeadAccuracy(**accuracy)) for at, accuracy in state["evals"]]
        torch.set_rng_state(state["rng"])

    def save_state() -> None:
        state_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({
            "method": options.method, "spec": method.build_spec(), "model": method.state_dict(),
            "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
            "train_losses": train_losses, "evals": [(at, result.as_dict()) for at, result in evals],
            "rng": torch.get_rng_state(), "options": asdict(options),
        }, state_path)

    def run_eval() -> None:
        if eval_batches:
            result = head_accuracy(method, target, eval_batches)
            evals.append((step, result))
            tqdm.write(f"step {step}: top-1 {_fmt(result.top1)} top-5 {_fmt(result.top5)} "
                       f"accepted {result.mean_accepted:.2f}")

    stopped_early = False
    progress = tqdm(total=total_steps, initial=step, desc=f"fit {options.method}", unit="step")
    while step < total_steps:
        epoch, position = divmod(step, len(train_batches))
        # Each epoch visits the length-packed batches in a fresh seeded order.
        order = torch.randperm(len(train_batches), generator=torch.Generator().manual_seed(options.seed + epoch))
        batch = train_batches[int(order[position])].to(options.device)
        with torch.autocast(device_type=torch.device(options.device).type, dtype=torch.bfloat16,
                            enabled=options.bf16_autocast):
            loss, head_ce = method.training_loss(batch, target, head_weights)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, options.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        train_losses.append(loss.item())
        progress.update()
        progress.set_postfix(loss=f"{loss.item():.3f}", ce=_fmt(head_ce.tolist()))
        if step % options.eval_every == 0:
            run_eval()
        if step % options.checkpoint_every == 0:
            save_state()
        if options.max_minutes is not None and time.monotonic() - started > 60 * options.max_minutes:
            stopped_early = step < total_steps
            tqdm.write(f"--max-minutes {options.max_minutes} reached at step {step}/{total_steps}")
            break
    progress.close()

    if not evals or evals[-1][0] != step:
        run_eval()
    save_state()
    method.save(out, dtype=DTYPES[options.save_dtype])
    seconds = time.monotonic() - started
    (out / "training" / METRICS_NAME).write_text(json.dumps({
        "method": options.method, "steps": step, "total_steps": total_steps, "stopped_early": stopped_early,
        "seconds": seconds, "train_losses": train_losses,
        "evals": [{"step": at, **result.as_dict()} for at, result in evals],
    }, indent=1))
    return FitResult(step, train_losses, evals, stopped_early, seconds)


def _fmt(values: list[float]) -> str:
    return "/".join(f"{value:.2f}" for value in values)
