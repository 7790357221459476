"""Command line: python -m vllm_amphista.train {generate,fit,eval} --help

`fit` and `eval` flags mirror the fields of FitOptions / EvalOptions (one
flag per field, dashes for underscores; a boolean that defaults to True is
switched off with --no-<name>).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
import typing

from vllm_amphista.train.data import load_prompts
from vllm_amphista.train.evaluate import EvalOptions, evaluate
from vllm_amphista.train.fit import FitOptions, fit
from vllm_amphista.train.heads import METHODS
from vllm_amphista.train.target import DTYPES

FIT_HELP = {
    "target": "target model directory (or hub id) with a transformers checkpoint",
    "data": "samples JSONL written by `generate`",
    "out": "output directory: the drafter (config.json + model.safetensors) and training/ state",
    "method": "drafter to train",
    "num_heads": "K: heads (Amphista, Medusa) or chained steps evaluated (EAGLE)",
    "num_near_heads": "Amphista: heads reading stage 1, the rest read stage 2 (None = K//2)",
    "stage_layers": "Amphista: decoder layers per adaptation stage",
    "encoder_layers": "Amphista: Auto-embedding Block encoder layers",
    "no_encoder": "Amphista ablation: no bi-directional encoder (independent heads)",
    "no_stages": "Amphista ablation: no staged adaptation layers",
    "no_sampled_token": "Amphista ablation: do not fuse the sampled token's embedding",
    "train_lm_head": "Amphista: train an own lm_head instead of sharing the target's",
    "medusa_layers": "Medusa: residual layers per head",
    "eagle_ce_weight": "EAGLE: weight of the token cross-entropy next to the feature regression",
    "draft_vocab_size": "draft vocabulary: the N most frequent output tokens (0 = the full vocabulary)",
    "train_on_prompt": "also learn at prompt positions, not only on the target's outputs",
    "max_seq_len": "cut longer samples to this many tokens",
    "eval_fraction": "fraction of samples held out for accuracy evals (0 = none)",
    "loss_decay": "head k's loss weight is decay**k",
    "epochs": "passes over the training samples (ignored with --max-steps)",
    "max_steps": "optimiser steps (default: epochs x batches)",
    "batch_tokens": "padded tokens per training batch",
    "lr": "peak learning rate (AdamW)",
    "weight_decay": "AdamW weight decay",
    "warmup_ratio": "fraction of steps of linear warmup before the cosine decay",
    "grad_clip": "gradient-norm clip",
    "seed": "seed for the eval split, batch order and initialisation",
    "bf16_autocast": "bfloat16 autocast for the drafter's matmuls",
    "eval_every": "steps between held-out accuracy evals",
    "eval_batch_tokens": "padded tokens per eval batch (eval logits span the whole draft vocabulary)",
    "checkpoint_every": "steps between resumable checkpoints (training/state.pt)",
    "resume": "continue from OUT/training/state.pt when present",
    "max_minutes": "stop (saving everything) after this many minutes",
    "target_dtype": "dtype to run the target in for its hidden states",
    "cache_dir": "where hidden states are cached (keyed by data, target and dtype)",
    "cache_dtype": "dtype of the cached hidden states",
    "save_dtype": "dtype of the saved drafter weights",
    "device": "torch device to train on",
    "threads": "torch CPU threads (default: torch's choice)",
}
EVAL_HELP = {
    "target": "target model directory (or hub id)",
    "heads": "one or more heads directories (Amphista, Medusa or EAGLE)",
    "samples": "samples JSONL with the target's continuations (as written by `generate`)",
    "questions": "question files; their first turns are answered greedily by the target via vLLM",
    "prompt_field": "prompt field of the question files (default: auto-detected)",
    "max_questions": "use at most this many questions per file",
    "max_tokens": "tokens generated per question",
    "max_model_len": "vLLM max_model_len when generating",
    "generation_dtype": "dtype vLLM generates in",
    "enforce_eager": "vLLM enforce_eager when generating",
    "target_dtype": FIT_HELP["target_dtype"],
    "cache_dir": FIT_HELP["cache_dir"],
    "batch_tokens": FIT_HELP["eval_batch_tokens"],
    "eagle_steps": "chained steps to evaluate for EAGLE heads",
}
CHOICES = {"method": METHODS, **{name: sorted(DTYPES) for name in
                                  ("target_dtype", "cache_dtype", "save_dtype", "generation_dtype")}}


def add_dataclass_arguments(parser: argparse.ArgumentParser, options_class, helps: dict[str, str]) -> None:
    hints = typing.get_type_hints(options_class)
    for option in dataclasses.fields(options_class):
        name, hint = option.name, hints[option.name]
        flag = "--" + name.replace("_", "-")
        required = option.default is dataclasses.MISSING and option.default_factory is dataclasses.MISSING
        if hint is bool:
            if option.default:
                parser.add_argument("--no-" + name.replace("_", "-"), dest=name, action="store_false", help=helps[name])
            else:
                parser.add_argument(flag, dest=name, action="store_true", help=helps[name])
            continue
        # "int | None" -> int; "list[str]" stays a list.
        is_optional = isinstance(hint, types.UnionType)
        value_type = next(arg for arg in typing.get_args(hint) if arg is not type(None)) if is_optional else hint
        kwargs = {"dest": name, "help": helps[name], "required": required, "choices": CHOICES.get(name)}
        if typing.get_origin(value_type) is list:
            kwargs.update(nargs="+", type=typing.get_args(value_type)[0])
        else:
            kwargs["type"] = value_type
        if not required:
            has_factory = option.default_factory is not dataclasses.MISSING
            kwargs["default"] = option.default_factory() if has_factory else option.default
            if kwargs["default"] not in (None, []):
                kwargs["help"] += " (default: %(default)s)"
        parser.add_argument(flag, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vllm_amphista.train", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser(
        "generate", help="the target answers prompts via vLLM; writes prompt/output token ids as JSONL",
        description="Self-distillation data. Use training prompts (Alpaca, GSM8K train, ...), never the "
                    "benchmarks you will measure speed on (MT-Bench, Spec-Bench).",
    )
    generate.add_argument("--target", required=True, help="target model directory or hub id")
    generate.add_argument("--prompts", required=True, nargs="+",
                          help="Alpaca JSON (instruction+input), GSM8K JSONL (question), MT-Bench JSONL "
                               "(turns), or any JSON/JSONL with --prompt-field")
    generate.add_argument("--out", required=True, help="output samples JSONL")
    generate.add_argument("--prompt-field", help="record field holding the prompt (default: auto-detected)")
    generate.add_argument("--max-prompts", type=int, help="use at most this many prompts per file")
    generate.add_argument("--max-tokens", type=int, default=512, help="tokens per answer (default: %(default)s)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="default: %(default)s")
    generate.add_argument("--max-model-len", type=int, default=1024, help="default: %(default)s")
    generate.add_argument("--batch-size", type=int, default=256, help="prompts per vLLM call (default: %(default)s)")
    generate.add_argument("--enforce-eager", action="store_true", help="disable compilation / graphs in vLLM")
    generate.add_argument("--no-chat-template", dest="use_chat_template", action="store_false",
                          help="send raw prompts instead of applying the target's chat template")

    add_dataclass_arguments(
        commands.add_parser("fit", help="train Amphista heads or a Medusa/EAGLE baseline on generated samples"),
        FitOptions, FIT_HELP,
    )
    add_dataclass_arguments(
        commands.add_parser("eval", help="per-head top-1 accuracy of heads directories (markdown table)"),
        EvalOptions, EVAL_HELP,
    )
    return parser


def run_generate(args: argparse.Namespace) -> None:
    from vllm_amphista.train.generate import generate_samples

    prompts = [prompt for path in args.prompts for prompt in load_prompts(path, args.prompt_field, args.max_prompts)]
    written = generate_samples(
        args.target, prompts, args.out, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        dtype=args.dtype, max_model_len=args.max_model_len, batch_size=args.batch_size,
        enforce_eager=args.enforce_eager, use_chat_template=args.use_chat_template,
    )
    print(f"wrote {written} samples to {args.out}")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    options = {key: value for key, value in vars(args).items() if key != "command"}
    try:
        if args.command == "generate":
            run_generate(args)
        elif args.command == "fit":
            result = fit(FitOptions(**options))
            print(f"trained {result.steps} steps in {result.seconds:.0f} s; drafter saved to {args.out}")
        else:
            evaluate(EvalOptions(**options))
    except (ValueError, FileNotFoundError) as error:  # DataError is a ValueError
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
