"""`fit`: train a drafter on the target's own outputs (self-distillation).

Steps: read the dataset (`generate` made it: answers, hidden states, top-k),
hold out an eval slice, pack the rest into batches, then train with AdamW,
linear warmup + cosine decay and gradient clipping. Loss for Amphista and
Medusa: sum_k decay**k * loss(head k), the loss being cross-entropy with the
target's token (`--objective hard`) or with its top-k distribution
(`--objective distill`); EAGLE adds its feature regression (see ``eagle.py``).

Output directory: the drafter in its inference format (config.json +
model.safetensors, loadable by vLLM / the Amphista plugin). The resumable state
(``state.pt``: weights, optimizer, scheduler, step, losses, RNG) and
``metrics.json`` live in a state directory (default ``.cache/fit/<out name>``,
never committed), written every ``--checkpoint-minutes`` and when the process
gets SIGTERM or SIGINT; ``--resume DIR`` continues from it. The batch order
is a function of (seed, epoch), so a resumed run visits the same batches as an
uninterrupted one, none twice in an epoch. Progress shows the training tokens
per second (real, not padded, tokens) and, at the end, that rate against this
machine's GEMM roofline in the training dtype.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_amphista.configuration_amphista import DRAFT_TOKEN_MLP_READS
from vllm_amphista.cpu_dtype import has_native_units
from vllm_amphista.prompts import DataError
from vllm_amphista.train.amphista import AmphistaMethod
from vllm_amphista.train.batch import OBJECTIVES, build_batch, make_batches
from vllm_amphista.train.dflash import DFlashMethod, unused_token_id
from vllm_amphista.train.data import Dataset, check_token_ids, most_frequent_tokens
from vllm_amphista.train.drafter import DraftMethod
from vllm_amphista.train.eagle import EagleMethod
from vllm_amphista.train.evaluate import HeadAccuracy, head_accuracy
from vllm_amphista.train.generate import DTYPES
from vllm_amphista.train.medusa import MedusaMethod
from vllm_amphista.train.methods import METHOD_CLASSES, METHODS, detect_method, load_heads
from vllm_amphista.train.target import load_target

STATE_NAME = "state.pt"
METRICS_NAME = "metrics.json"
# auto: bf16 autocast on a GPU or a CPU with bf16 units (cpu_dtype), float32 elsewhere.
PRECISIONS = ("auto", "bfloat16", "float32")
# auto: the training step compiled (torch.compile) when at least COMPILE_MIN_STEPS steps are left to
# pay for the compile; eager otherwise.
COMPILE_MODES = ("auto", "on", "off")
COMPILE_MIN_STEPS = 100
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class FitOptions:
    target: str
    data: list[str]
    out: str
    method: str = "amphista"
    num_heads: int = 4
    # Amphista architecture
    num_near_heads: int | None = None
    stage_layers: int | None = None  # None: 1, or the --init-heads' depth
    encoder_layers: int | None = None
    no_encoder: bool = False
    no_stages: bool = False
    no_sampled_token: bool = False
    train_lm_head: bool = False
    target_feature_layers: list[int] | None = None
    draft_token_mlp: int = 0
    draft_token_mlp_reads: str = "previous"
    init_heads: str | None = None
    # Baselines
    medusa_layers: int = 1
    eagle_ce_weight: float = 0.1
    dflash_layers: int = 2
    dflash_anchors: int = 256
    # Data
    objective: str = "hard"
    valid_prefix: bool = False
    draft_vocab_size: int = 0
    max_output_tokens: int | None = None
    mix_data: list[str] | None = None
    mix_fraction: float = 0.3
    train_on_prompt: bool = False
    row_tokens: int = 1024
    eval_fraction: float = 0.02
    max_eval_samples: int = 400
    # Optimisation
    loss_decay: float = 0.8
    epochs: int = 1
    max_steps: int | None = None
    batch_tokens: int = 4096
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.03
    grad_clip: float = 1.0
    seed: int = 0
    precision: str = "auto"
    compile: str = "auto"
    # Bookkeeping
    eval_every: int = 500
    checkpoint_minutes: float = 10.0
    state_dir: str | None = None
    resume: str | None = None
    max_minutes: float | None = None
    save_dtype: str = "bfloat16"
    device: str = "cpu"
    threads: int | None = None

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {METHODS}, got {self.method!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective must be one of {OBJECTIVES}, got {self.objective!r}")
        amphista_only = (self.no_encoder or self.no_stages or self.no_sampled_token or self.train_lm_head
                         or self.draft_token_mlp or self.stage_layers or self.encoder_layers)
        if amphista_only and self.method != "amphista":
            raise ValueError("--no-encoder/--no-stages/--no-sampled-token/--train-lm-head/--draft-token-mlp/"
                             "--stage-layers/--encoder-layers apply to --method amphista only")
        if self.target_feature_layers and self.method not in ("amphista", "dflash"):
            raise ValueError("--target-feature-layers applies to --method amphista and dflash only")
        if self.method == "dflash" and not self.target_feature_layers:
            raise ValueError("--method dflash reads several target layers: give --target-feature-layers")
        if self.draft_token_mlp_reads not in DRAFT_TOKEN_MLP_READS:
            raise ValueError(f"--draft-token-mlp-reads must be one of {DRAFT_TOKEN_MLP_READS}, "
                             f"got {self.draft_token_mlp_reads!r}")
        if self.draft_token_mlp_reads != "previous" and not self.draft_token_mlp:
            raise ValueError("--draft-token-mlp-reads applies to heads with --draft-token-mlp")
        for flag, layers in (("--stage-layers", self.stage_layers), ("--encoder-layers", self.encoder_layers)):
            if layers is not None and layers < 1:
                raise ValueError(f"{flag} must be >= 1, got {layers}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"--draft-vocab-size must be >= 0 (0: the target's whole vocabulary), "
                             f"got {self.draft_vocab_size}")
        if self.num_heads < 1:
            raise ValueError(f"--num-heads must be >= 1, got {self.num_heads}")
        if not 0.0 <= self.mix_fraction < 1.0:
            raise ValueError(f"--mix-fraction must be in [0, 1), got {self.mix_fraction}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.save_dtype not in DTYPES:
            raise ValueError(f"--save-dtype must be one of {sorted(DTYPES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"--compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.batch_tokens < self.row_tokens:
            raise ValueError(f"--batch-tokens ({self.batch_tokens}) must be at least --row-tokens ({self.row_tokens})")


@dataclass
class FitResult:
    steps: int
    train_losses: list[float]
    evals: list[tuple[int, HeadAccuracy]]
    stopped_early: bool
    seconds: float
    tokens_per_second: float
    flops_per_token: float | None  # forward + backward, counted on this process's first step
    precision: str  # "bfloat16" (autocast) or "float32"
    compile_seconds: float | None  # compiling the training step (None: it ran eager)


def create_method(options: FitOptions, target, draft_to_target: torch.Tensor | None, samples) -> DraftMethod:
    if options.method == "dflash":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target.path)
        ends = {tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id}
        special_ids = [token for token in tokenizer.all_special_ids if token not in ends]
        return DFlashMethod.create(target, draft_to_target, options.target_feature_layers, options.num_heads,
                                   options.dflash_layers, unused_token_id(samples, target.vocab_size, special_ids),
                                   options.dflash_anchors)
    if options.method == "medusa":
        return MedusaMethod.create(target, draft_to_target, options.num_heads, options.medusa_layers)
    if options.method == "eagle":
        return EagleMethod.create(target, draft_to_target, options.num_heads, options.eagle_ce_weight)
    return AmphistaMethod.create(
        target, draft_to_target,
        num_draft_heads=options.num_heads,
        num_near_heads=options.num_near_heads,
        stage_num_layers=options.stage_layers or 1,
        encoder_num_layers=options.encoder_layers or 1,
        use_encoder=not options.no_encoder,
        use_stages=not options.no_stages,
        use_sampled_token=not options.no_sampled_token,
        share_lm_head=not options.train_lm_head,
        target_feature_layers=options.target_feature_layers,
        draft_token_mlp_size=options.draft_token_mlp,
        draft_token_mlp_reads=options.draft_token_mlp_reads,
    )


def split_indices(num_samples: int, eval_fraction: float, seed: int, max_eval: int | None = None
                  ) -> tuple[list[int], list[int]]:
    """(train, eval) sample indices; eval is a seeded random slice."""
    indices = list(range(num_samples))
    random.Random(seed).shuffle(indices)
    num_eval = max(1, round(eval_fraction * num_samples)) if eval_fraction > 0 else 0
    num_eval = min(num_eval, max_eval) if max_eval is not None else num_eval
    if num_samples - num_eval < 1:
        raise DataError(f"{num_samples} samples leave none for training after holding out {num_eval} for eval")
    return sorted(indices[num_eval:]), sorted(indices[:num_eval])


def leading_samples(dataset: Dataset, indices: list[int], max_output_tokens: int) -> list[int]:
    """The first of `indices` (the data's own order: the mix's, every category in proportion) whose
    output tokens add up to at most `max_output_tokens`: the same held-out slice, less training data."""
    kept, total = [], 0
    for index in indices:
        total += len(dataset.samples[index].output_ids)
        if total > max_output_tokens:
            break
        kept.append(index)
    if not kept:
        raise DataError(f"--max-output-tokens {max_output_tokens} keeps no training sample")
    return kept


def warmup_cosine(total_steps: int, warmup_ratio: float):
    warmup_steps = max(1, round(warmup_ratio * total_steps))

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return lr_factor


def state_directory(options: FitOptions) -> Path:
    """Where the run's resumable state lives: --resume DIR, else --state-dir, else .cache/fit/<out name>."""
    return Path(options.resume or options.state_dir or Path(".cache") / "fit" / Path(options.out).resolve().name)


def autocast_dtype(options: FitOptions) -> torch.dtype | None:
    """bfloat16 when the drafter's matmuls should run in it, None for float32."""
    if options.precision == "auto":
        native = options.device.startswith("cuda") or has_native_units("bfloat16")
        return torch.bfloat16 if native else None
    return torch.bfloat16 if options.precision == "bfloat16" else None


class StopRequest:
    """Turns SIGTERM/SIGINT into a request to save and stop after the current step, and notes SIGCONT:
    a run paused with SIGSTOP (to leave the CPU to another job) must not count the pause as training."""

    def __init__(self):
        self.signal: int | None = None
        self._continued = False
        self._previous = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals there only
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
            self._previous[signal.SIGCONT] = signal.signal(signal.SIGCONT, self._handle_continue)
        return self

    def _handle(self, number, frame) -> None:
        self.signal = number

    def _handle_continue(self, number, frame) -> None:
        self._continued = True

    def paused_since_asked(self) -> bool:
        """Whether the process was stopped and continued since the last call."""
        paused, self._continued = self._continued, False
        return paused

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


GLIBC_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def map_large_allocations() -> None:
    """Each batch's tensors have another size. After the first large free glibc raises its mmap
    threshold, later batches are carved from the heap and fragment it: a fit's resident memory grew to
    5.5 GB in 40 steps and 11.5 GB in 500, crowding the memory-mapped features out of the page cache.
    A fixed 1 MiB threshold maps each large tensor and gives it back when freed (2 GB, as fast)."""
    libc_name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(libc_name).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc: its allocator is not this one
        return
    mallopt(GLIBC_M_MMAP_THRESHOLD, 1 << 20)


def fit(options: FitOptions) -> FitResult:
    options.validate()
    map_large_allocations()
    started = time.monotonic()
    if options.threads:
        torch.set_num_threads(options.threads)
    torch.manual_seed(options.seed)
    precision = autocast_dtype(options)
    precision_name = "float32" if precision is None else "bfloat16"

    init_method = None
    if options.init_heads:
        init_method = detect_method(options.init_heads)
        if init_method != options.method:
            raise ValueError(f"--init-heads {options.init_heads} holds {init_method} heads, not {options.method}")
    directories = options.data + (options.mix_data or [])
    dataset = Dataset(directories, options.target_feature_layers)
    if options.objective == "distill" and dataset.top_k == 0:
        raise DataError(f"--objective distill learns the target's top-k log-probabilities, and a dataset of "
                        f"{directories} keeps none (made with --top-k 0): use --objective hard or rebuild it "
                        f"with `features --top-k 8`")
    target = load_target(options.target)
    check_token_ids(dataset.samples, target.vocab_size, ", ".join(directories))
    target = target.to(options.device)
    num_own = sum(dataset.directory_sizes[:len(options.data)])
    train_indices, eval_indices = split_indices(num_own, options.eval_fraction, options.seed,
                                                options.max_eval_samples)
    if options.max_output_tokens is not None:
        train_indices = leading_samples(dataset, train_indices, options.max_output_tokens)
    if options.mix_data:
        # --mix-data samples make up mix_fraction of the training samples (a seeded choice).
        wanted = round(options.mix_fraction / (1 - options.mix_fraction) * len(train_indices))
        mixed = list(range(num_own, len(dataset)))
        random.Random(options.seed).shuffle(mixed)
        train_indices = sorted(train_indices + mixed[:wanted])

    out, state_dir = Path(options.out), state_directory(options)
    state_path = state_dir / STATE_NAME
    state = None
    if options.resume:
        if not state_path.is_file():
            raise FileNotFoundError(f"--resume {options.resume}: no {STATE_NAME} there to continue from")
        state = torch.load(state_path, weights_only=False)

    def ranked_outputs() -> torch.Tensor:
        """The draft vocabulary's ids: the training samples' most frequent output tokens."""
        return most_frequent_tokens([dataset.samples[i] for i in train_indices], options.draft_vocab_size,
                                    target.vocab_size)

    if state is not None:
        if state["method"] != options.method:
            raise ValueError(f"{state_path} holds a {state['method']} run, not {options.method}")
        target.check_matches(state["hidden_size"], state["vocab_size"], str(state_path))
        method = METHOD_CLASSES[options.method].from_spec(state["spec"], target)
        method.load_state_dict(state["model"])
    elif options.init_heads:
        method = load_heads(options.init_heads, target)
        if method.feature_layers != options.target_feature_layers:
            raise ValueError(f"--init-heads {options.init_heads} reads target layers {method.feature_layers}: "
                             f"give the same --target-feature-layers")
        if options.stage_layers or options.encoder_layers:
            method.deepen(options.stage_layers, options.encoder_layers)
        if options.draft_token_mlp:
            method.add_draft_token_mlp(options.draft_token_mlp, options.draft_token_mlp_reads)
        if options.draft_vocab_size:
            method.widen_draft_vocab(ranked_outputs(), target)
    else:
        draft_to_target = ranked_outputs() if options.draft_vocab_size else None
        method = create_method(options, target, draft_to_target, dataset.samples)
    method.to(options.device).train()

    train_plans = make_batches(dataset, train_indices, method.num_heads, options.batch_tokens, options.row_tokens,
                               options.train_on_prompt)
    eval_plans = make_batches(dataset, eval_indices, method.num_heads, options.batch_tokens, options.row_tokens)
    total_steps = options.max_steps or options.epochs * len(train_plans)
    if state is not None and state["num_batches"] != len(train_plans):
        raise ValueError(f"{state_path} was trained on {state['num_batches']} batches per epoch, these options "
                         f"give {len(train_plans)}: resume with the same data, --batch-tokens and --row-tokens")

    parameters = [parameter for parameter in method.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=options.lr, weight_decay=options.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total_steps, options.warmup_ratio))
    head_weights = torch.tensor([options.loss_decay ** k for k in range(method.num_heads)], device=options.device)
    train_losses: list[float] = []
    evals: list[tuple[int, HeadAccuracy]] = []
    step, trained_tokens, training_seconds = 0, 0, 0.0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, train_losses = state["step"], state["train_losses"]
        trained_tokens, training_seconds = state["trained_tokens"], state["training_seconds"]
        evals = [(at, HeadAccuracy(**accuracy)) for at, accuracy in state["evals"]]
        torch.set_rng_state(state["rng"])
        random.setstate(state["python_rng"])

    def save_state() -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        torch.save({
            "method": options.method, "spec": method.build_spec(), "model": method.state_dict(),
            "hidden_size": target.hidden_size, "vocab_size": target.vocab_size, "num_batches": len(train_plans),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
            "trained_tokens": trained_tokens, "training_seconds": training_seconds,
            "train_losses": train_losses, "evals": [(at, result.as_dict()) for at, result in evals],
            "rng": torch.get_rng_state(), "python_rng": random.getstate(), "options": asdict(options),
        }, str(state_path) + ".tmp")
        Path(str(state_path) + ".tmp").replace(state_path)

    def run_eval() -> None:
        if eval_plans:
            result = head_accuracy(method, target, dataset, eval_plans, options.row_tokens, options.device)
            evals.append((step, result))
            tqdm.write(f"step {step} ({trained_tokens} tokens): top-1 {_fmt(result.top1)} top-5 {_fmt(result.top5)} "
                       f"accepted {result.mean_accepted:.2f}")

    def train_step(batch, training_loss=method.training_loss) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(device_type=torch.device(options.device).type, dtype=torch.bfloat16,
                            enabled=precision is not None):
            loss, head_loss = training_loss(batch, target, head_weights, options.objective, options.valid_prefix)
        loss.backward()
        return loss, head_loss

    step_loss, compile_seconds = method.training_loss, None
    if options.compile == "on" or (options.compile == "auto" and total_steps - step >= COMPILE_MIN_STEPS):
        # Compiled (dynamic shapes: packed batches differ in length) and run once on the first batch
        # here, gradients dropped, so that the compile is timed apart from the training steps.
        compile_started = time.monotonic()
        step_loss = torch.compile(method.training_loss, dynamic=True)
        train_step(build_batch(dataset, train_plans[0], method.num_heads, options.row_tokens,
                               options.train_on_prompt).to(options.device), step_loss)
        optimizer.zero_grad(set_to_none=True)
        compile_seconds = time.monotonic() - compile_started
        tqdm.write(f"compiled the training step in {compile_seconds:.0f} s")

    stopped_early, flops_per_token = False, None
    last_checkpoint = time.monotonic()
    progress = tqdm(total=total_steps, initial=step, desc=f"fit {options.method}", unit="step", dynamic_ncols=True)
    with StopRequest() as stop:
        while step < total_steps:
            epoch, position = divmod(step, len(train_plans))
            # Each epoch visits the packed batches in a fresh seeded order.
            order = torch.randperm(len(train_plans), generator=torch.Generator().manual_seed(options.seed + epoch))
            stop.paused_since_asked()
            step_started = time.monotonic()
            batch = build_batch(dataset, train_plans[int(order[position])], method.num_heads, options.row_tokens,
                                options.train_on_prompt).to(options.device)
            if flops_per_token is None:  # counted once, on the first step this process runs
                from torch.utils.flop_counter import FlopCounterMode

                with FlopCounterMode(display=False) as counter:  # eager: compiled kernels are not counted
                    loss, head_loss = train_step(batch)
                flops_per_token = counter.get_total_flops() / max(batch.num_tokens, 1)
            else:
                loss, head_loss = train_step(batch, step_loss)
            torch.nn.utils.clip_grad_norm_(parameters, options.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            step_seconds = time.monotonic() - step_started
            if stop.paused_since_asked() and trained_tokens:  # timed at the pace so far instead
                step_seconds = batch.num_tokens * training_seconds / trained_tokens
            trained_tokens += batch.num_tokens
            training_seconds += step_seconds
            train_losses.append(loss.item())
            progress.update()
            progress.set_postfix(loss=f"{loss.item():.3f}", per_head=_fmt(head_loss.tolist()),
                                 tok_s=f"{trained_tokens / max(training_seconds, 1e-9):.0f}")
            if step % options.eval_every == 0:
                run_eval()
            if stop.signal is not None:
                stopped_early = step < total_steps
                tqdm.write(f"{signal.Signals(stop.signal).name} at step {step}/{total_steps}: state saved to "
                           f"{state_dir}; continue with --resume {state_dir}")
                break
            if time.monotonic() - last_checkpoint > 60 * options.checkpoint_minutes:
                save_state()
                last_checkpoint = time.monotonic()
            if options.max_minutes is not None and time.monotonic() - started > 60 * options.max_minutes:
                stopped_early = step < total_steps
                tqdm.write(f"--max-minutes {options.max_minutes} reached at step {step}/{total_steps}")
                break
        progress.close()
        if not stopped_early and (not evals or evals[-1][0] != step):
            run_eval()
        save_state()
    method.save(out, dtype=DTYPES[options.save_dtype])
    seconds = time.monotonic() - started
    tokens_per_second = trained_tokens / max(training_seconds, 1e-9)
    (state_dir / METRICS_NAME).write_text(json.dumps({
        "method": options.method, "objective": options.objective, "steps": step, "total_steps": total_steps,
        "stopped_early": stopped_early, "seconds": seconds, "trained_tokens": trained_tokens,
        "training_seconds": training_seconds, "train_tokens_per_second": tokens_per_second,
        "precision": precision_name, "flops_per_token": flops_per_token, "compile_seconds": compile_seconds,
        "train_losses": train_losses, "evals": [{"step": at, **result.as_dict()} for at, result in evals],
    }, indent=1))
    return FitResult(step, train_losses, evals, stopped_early, seconds, tokens_per_second, flops_per_token,
                     precision_name, compile_seconds)


def _fmt(values: list[float]) -> str:
    return "/".join(f"{value:.2f}" for value in values)
