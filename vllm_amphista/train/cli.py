"""Command line: python -m vllm_amphista.train {mix,generate,features,export-tokens,fit,eval,curve,adapt,
ngrams,stdlib-prompts,self-prompts} --help

`fit` and `eval` flags mirror the fields of FitOptions / EvalOptions (one
flag per field, dashes for underscores; a boolean that defaults to True is
switched off with --no-<name>).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing
from pathlib import Path

import torch

from vllm_amphista.answer_ngrams import ANSWER_NGRAMS_NAME, DEFAULT_MAX_CONTEXT, DEFAULT_MIN_COUNT, AnswerNgrams
from vllm_amphista.configuration_amphista import DRAFT_TOKEN_MLP_READS
from vllm_amphista.prompts import load_conversations, read_records
from vllm_amphista.train import generate as generate_module
from vllm_amphista.train import prompt_mix
from vllm_amphista.train.evaluate import EvalOptions, evaluate
from vllm_amphista.train.fit import COMPILE_MIN_STEPS, COMPILE_MODES, PRECISIONS, FitOptions, autocast_dtype, fit
from vllm_amphista.train.batch import OBJECTIVES
from vllm_amphista.train.generate import DTYPES
from vllm_amphista.train.methods import METHODS

FIT_HELP = {
    "target": "target model directory with a transformers checkpoint",
    "data": "dataset directories written by `generate`",
    "out": "output directory: the drafter (config.json + model.safetensors) and training/ state",
    "method": "drafter to train",
    "num_heads": "K: heads (Amphista, Medusa), chained steps evaluated (EAGLE) or block drafts (DFlash)",
    "num_near_heads": "Amphista: heads reading stage 1, the rest read stage 2 (None = K//2)",
    "stage_layers": "Amphista: decoder layers per adaptation stage (default 1); with --init-heads, deepen each "
                    "stage to N (the new layers start as identities)",
    "encoder_layers": "Amphista: Auto-embedding Block encoder layers (default 1); with --init-heads, deepen "
                      "the encoder to N",
    "no_encoder": "Amphista ablation: no bi-directional encoder (independent heads)",
    "no_stages": "Amphista ablation: no staged adaptation layers",
    "no_sampled_token": "Amphista ablation: do not fuse the sampled token's embedding",
    "train_lm_head": "Amphista: train an own lm_head instead of sharing the target's",
    "target_feature_layers": "Amphista, DFlash: read the residual streams after these numbers of target layers "
                             "(Amphista: instead of the final-norm output; data from `features --feature-layers`)",
    "medusa_layers": "Medusa: residual layers per head",
    "eagle_ce_weight": "EAGLE: weight of the token loss next to the feature regression",
    "dflash_layers": "DFlash: decoder layers of the block drafter",
    "dflash_anchors": "DFlash: anchors (drafted blocks) trained per packed row and step",
    "objective": "hard: cross-entropy with the target's token; distill: with its top-k distribution",
    "valid_prefix": "head k learns only where heads 1..k-1 draft the target's tokens (the chain a verifier "
                    "accepts; SpecBlock's valid-prefix mask)",
    "draft_vocab_size": "draft vocabulary: the N most frequent output tokens (0 = the full vocabulary); with "
                        "--init-heads, widen the heads' vocabulary to N (their ids, then the most frequent others)",
    "mix_data": "dataset directories mixed into the training samples (not the held-out slice): fine-tuning "
                "keeps a share of the data the heads learned from",
    "mix_fraction": "share of the training samples drawn from --mix-data",
    "draft_token_mlp": "Amphista: inner size of an MLP through which heads 2..K read the token drafted before "
                       "them (0 = they do not; needs a draft vocabulary)",
    "draft_token_mlp_reads": "which drafted token heads 2..K read: each the one drafted just before it (head by "
                             "head), or all the first head's (two vocabulary passes in all)",
    "init_heads": "start from these heads (same method, their shape and vocabulary): fine-tuning",
    "max_output_tokens": "train on the leading samples up to this many output tokens (learning curves; "
                         "the held-out slice is unchanged)",
    "train_on_prompt": "also learn at prompt positions, not only on the target's outputs (hard objective)",
    "row_tokens": "tokens per packed row (longer samples are cut)",
    "eval_fraction": "fraction of samples held out for accuracy evals (0 = none)",
    "max_eval_samples": "at most this many held-out samples",
    "loss_decay": "head k's loss weight is decay**k",
    "epochs": "passes over the training samples (ignored with --max-steps)",
    "max_steps": "optimiser steps (default: epochs x batches)",
    "batch_tokens": "packed tokens per training batch",
    "lr": "peak learning rate (AdamW)",
    "weight_decay": "AdamW weight decay",
    "warmup_ratio": "fraction of steps of linear warmup before the cosine decay",
    "grad_clip": "gradient-norm clip",
    "seed": "seed for the eval split, batch order and initialisation",
    "precision": "auto: bfloat16 autocast on a GPU or a CPU with bf16 units, float32 elsewhere",
    "compile": (f"torch.compile the training step; auto: when at least {COMPILE_MIN_STEPS} steps are left "
                "(the compile takes ~10-40 s on a 2-core CPU, the steps then run ~1.8-2x faster)"),
    "eval_every": "steps between held-out accuracy evals",
    "checkpoint_minutes": "minutes between resumable checkpoints (also written on SIGTERM/SIGINT)",
    "state_dir": "where the resumable state and metrics.json go (default: .cache/fit/<name of --out>)",
    "resume": "continue the run whose state directory this is",
    "max_minutes": "stop (saving everything) after this many minutes",
    "save_dtype": "dtype of the saved drafter weights",
    "device": "torch device to train on (cpu, cuda)",
    "threads": "torch CPU threads (default: torch's choice)",
}
EVAL_HELP = {
    "target": "target model directory",
    "heads": "one or more heads directories (Amphista, Medusa or EAGLE)",
    "data": "dataset directories with the target's answers (as written by `generate`)",
    "questions": "question files; their first turns are answered greedily by the target via vLLM",
    "prompt_field": "prompt field of the question files (default: auto-detected)",
    "max_questions": "use at most this many questions per file",
    "max_tokens": "tokens generated per question",
    "max_model_len": "vLLM max_model_len when generating",
    "generation_dtype": "dtype vLLM generates in",
    "enforce_eager": "vLLM enforce_eager when generating",
    "cache_dir": "where the answers to --questions are kept (keyed by questions and settings)",
    "batch_tokens": "packed tokens per eval batch",
    "row_tokens": FIT_HELP["row_tokens"],
    "eagle_steps": "chained steps to evaluate for EAGLE heads",
}
CHOICES = {"method": METHODS, "objective": OBJECTIVES, "precision": PRECISIONS, "compile": COMPILE_MODES,
           "draft_token_mlp_reads": DRAFT_TOKEN_MLP_READS,
           **{name: sorted(DTYPES) for name in ("save_dtype", "generation_dtype")}}


FEATURE_LAYERS_HELP = ("also record the residual stream after each of these numbers of target layers "
                       "(for `fit --target-feature-layers`; the engine runs eager)")
TOP_K_HELP = ("the target's log-probabilities kept per output position, for `fit --objective distill` "
              "(default: %(default)s); 0 keeps none, which the hard objective does not need, and a recompute "
              "(`features`) then skips the lm_head and its log-softmax at every position: ~1.5x faster")


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

    mix = commands.add_parser(
        "mix", help="build the self-distillation prompt mix (JSONL of conversations)",
        description=prompt_mix.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mix.add_argument("--out", required=True, help="output JSONL of {id, category, messages}")
    mix.add_argument("--alpaca", help="Alpaca JSON (instruction, input, output): first-turn mix")
    mix.add_argument("--gsm8k", help="GSM8K JSONL (question, answer): first-turn mix")
    mix.add_argument("--second-turns-from", nargs="+", metavar="ANSWERS_OR_DATASET_DIR",
                     help="answers directories (data/answers/...) or datasets of first-turn answers: build "
                          "follow-ups to them instead")
    mix.add_argument("--first-turns", help="the first-turn mix those datasets answered")
    mix.add_argument("--target", help="target model dir (its tokenizer decodes the first answers)")
    mix.add_argument("--exclude", nargs="+", default=[], metavar="MIX",
                     help="first turns: leave out conversations these earlier mixes hold (with another --seed)")
    mix.add_argument("--count", type=int, default=2500, help="second turns to build (default: %(default)s)")
    mix.add_argument("--seed", type=int, default=0)

    generate = commands.add_parser(
        "generate", help="the target answers prompts via vLLM; writes a dataset dir (answers, hidden states, top-k)",
        description=generate_module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    generate.add_argument("--target", required=True, help="target model directory")
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", nargs="+",
                        help="prompt files: a `mix` JSONL, Alpaca JSON, GSM8K JSONL, or any JSON/JSONL with "
                             "--prompt-field. Never the benchmarks you measure speed on (MT-Bench, Spec-Bench)")
    source.add_argument("--tokens", help="a tokens file (`export-tokens`): recompute its hidden states and top-k")
    generate.add_argument("--out", required=True, help="output dataset directory (resumes where it stopped)")
    generate.add_argument("--prompt-field", help="record field holding the prompt (default: auto-detected)")
    generate.add_argument("--max-prompts", type=int, help="use at most this many prompts per file")
    generate.add_argument("--max-tokens", type=int, default=256, help="tokens per answer (default: %(default)s)")
    generate.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                          help="engine dtype (default: %(default)s, the fastest on CPUs without bf16 units)")
    generate.add_argument("--hidden-dtype", default="bfloat16", choices=sorted(DTYPES),
                          help="dtype the hidden states are stored in (default: %(default)s)")
    generate.add_argument("--top-k", type=int, default=8, help=TOP_K_HELP)
    generate.add_argument("--max-model-len", type=int, default=1024, help="default: %(default)s")
    generate.add_argument("--concurrency", type=int, default=256, help="requests in flight (default: %(default)s)")
    generate.add_argument("--shard-size", type=int, default=512, help="samples per shard (default: %(default)s)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--skip-answered", metavar="ANSWERS_DIR",
                          help="skip the shards this answers directory (`export-tokens`) already holds")
    generate.add_argument("--enforce-eager", action="store_true", help="disable vLLM's compilation")
    generate.add_argument("--feature-layers", type=int, nargs="+",
                          help=FEATURE_LAYERS_HELP)
    generate.add_argument("--no-chat-template", dest="use_chat_template", action="store_false",
                          help="send raw prompts instead of applying the target's chat template")

    features = commands.add_parser(
        "features", help="rebuild the hidden-state / top-k cache from committed answers (one teacher-forced "
                         "prefill of the target per sample; resumable), and print tokens/s against the roofline")
    features.add_argument("--target", required=True, help="target model directory")
    features.add_argument("--answers", required=True, help="answers directory (data/answers/...) or tokens file")
    features.add_argument("--out", required=True, help="output dataset directory (resumes where it stopped)")
    features.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                          help="engine dtype (default: %(default)s, the dtype the answers were generated in; "
                               "bfloat16 is ~1.7x faster where the CPU has bf16 units, and its hidden states "
                               "differ from float32's by bf16 rounding)")
    features.add_argument("--hidden-dtype", default="bfloat16", choices=sorted(DTYPES))
    features.add_argument("--feature-layers", type=int, nargs="+",
                          help=FEATURE_LAYERS_HELP)
    features.add_argument("--top-k", type=int, default=8, help=TOP_K_HELP)
    features.add_argument("--max-model-len", type=int, default=1024, help="default: %(default)s")
    features.add_argument("--concurrency", type=int, default=64, help="requests in flight (default: %(default)s)")
    features.add_argument("--shard-size", type=int, default=256, help="samples per shard (default: %(default)s)")
    features.add_argument("--enforce-eager", action="store_true", help="disable vLLM's compilation")

    export = commands.add_parser(
        "export-tokens", help="write a dataset's token ids (no tensors): a .jsonl(.gz) file, or a directory of "
                              "compact answers shards (uint16 .npz, one per dataset shard, only the new ones)")
    export.add_argument("--data", required=True, nargs="+", help="dataset directories (one for an answers directory)")
    export.add_argument("--out", required=True, help="tokens file (.jsonl or .jsonl.gz) or answers directory")

    ngrams = commands.add_parser(
        "ngrams", help="n-gram statistics of the target's answers (answer_ngrams.npz), what the per-request "
                       "N-gram tables of amphista_anpd (heads dir) and anpd ('model': the dir) fall back on")
    ngrams.add_argument("--target", required=True, help="target model directory (its vocabulary)")
    ngrams.add_argument("--answers", required=True, nargs="+",
                        help="answers directories (data/answers/...) or tokens files of the target's answers to "
                             "training prompts; never answers to the benchmarks you measure on")
    ngrams.add_argument("--out", required=True, help="directory to write answer_ngrams.npz into (a heads dir)")
    ngrams.add_argument("--max-context", type=int, default=DEFAULT_MAX_CONTEXT,
                        help="longest context in tokens (default: %(default)s)")
    ngrams.add_argument("--min-count", type=int, default=DEFAULT_MIN_COUNT,
                        help="keep contexts seen at least this often (default: %(default)s)")

    add_dataclass_arguments(
        commands.add_parser("fit", help="train Amphista heads or a Medusa/EAGLE baseline on generated samples"),
        FitOptions, FIT_HELP,
    )
    add_dataclass_arguments(
        commands.add_parser("eval", help="per-head top-1 accuracy of heads directories (markdown table)"),
        EvalOptions, EVAL_HELP,
    )
    from vllm_amphista.train import curve

    curve.add_arguments(commands.add_parser(
        "curve", help="tau of heads dirs trained on more and more data, by greedy replay on held-out "
                      "Spec-Bench answers (table and plot)"))
    from vllm_amphista.train import adapt, self_prompts, stdlib_prompts

    adapt.add_arguments(commands.add_parser(
        "adapt", help="fine-tune served heads on the traffic they recorded (record_traffic), resumable"))
    stdlib_prompts.add_arguments(commands.add_parser(
        "stdlib-prompts", help="a code domain from this Python's standard library, split by module into a "
                               "served half and a test half"))
    self_prompts.add_arguments(commands.add_parser(
        "self-prompts", help="user requests the target writes itself (Magpie): a question file for `generate`",
        description=self_prompts.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


def run_mix(args: argparse.Namespace) -> None:
    if args.second_turns_from:
        if not (args.target and args.first_turns):
            raise ValueError("--second-turns-from needs --first-turns (the mix it answered) and --target")
        if args.exclude:
            raise ValueError("--exclude applies to first-turn mixes (--alpaca, --gsm8k)")
        from transformers import AutoTokenizer

        from vllm_amphista.train.data import Dataset, answered_shards, read_token_file

        tokenizer = AutoTokenizer.from_pretrained(args.target)
        questions = {record["id"]: record for record in read_records(args.first_turns)}
        # Answers directories (what the repository commits) or datasets with their tensors.
        samples = [sample for path in args.second_turns_from
                   for sample in (read_token_file(path) if answered_shards(path) else Dataset([path]).samples)]
        first_turns = [{**questions[sample.id], "answer": tokenizer.decode(sample.output_ids, skip_special_tokens=True)}
                       for sample in samples if sample.id in questions]
        counts = prompt_mix.write_mix(args.out, prompt_mix.second_turn_mix(first_turns, args.count, args.seed))
    elif args.alpaca and args.gsm8k:
        counts = prompt_mix.build_first_turns(args.alpaca, args.gsm8k, args.out, seed=args.seed,
                                              exclude_paths=args.exclude)
    else:
        raise ValueError("give --alpaca and --gsm8k (first turns) or --second-turns-from (second turns)")
    for category, count in sorted(counts.items()):
        print(f"{category:40s} {count:6d}")
    print(f"{'total':40s} {sum(counts.values()):6d}  -> {args.out}")


def measure_roofline(target: str, dtype: torch.dtype = torch.float32) -> float:
    """This machine's matmul FLOP/s in `dtype` at the target's shapes, measured before any engine
    exists in this process (an engine's idle OpenMP threads would slow it)."""
    from transformers import AutoConfig

    from vllm_amphista.train.throughput import matmul_flops_per_second

    return matmul_flops_per_second(AutoConfig.from_pretrained(target).get_text_config(), dtype=dtype)


def print_roofline(stage: str, target: str, totals: dict, recompute: bool, top_k: int, roofline: float,
                   dtype_name: str) -> None:
    """The stage's tokens/s against the matmul roofline measured in the same command. The lm_head runs
    on every generated token, and in a recompute on every position when log-probabilities are kept,
    else on each sample's last."""
    from transformers import AutoConfig

    from vllm_amphista.train.throughput import roofline_line, target_flops_per_token

    if not totals.get("seconds") or not totals.get("tokens"):
        return
    config = AutoConfig.from_pretrained(target).get_text_config()
    body, with_logits = target_flops_per_token(config, with_logits=False), target_flops_per_token(config)
    logit_tokens = (totals["tokens"] if top_k else totals["samples"]) if recompute else totals["output_tokens"]
    flops = totals["tokens"] * body + logit_tokens * (with_logits - body)
    tokens_per_second = totals["tokens"] / totals["seconds"]
    print(roofline_line(stage, tokens_per_second, flops / totals["tokens"], roofline, dtype_name))


def run_features(args: argparse.Namespace) -> None:
    from vllm_amphista.train.data import read_token_file

    roofline = measure_roofline(args.target, DTYPES[args.dtype])
    totals = generate_module.generate_dataset(
        args.target, args.out, token_samples=read_token_file(args.answers), dtype=args.dtype,
        hidden_dtype=args.hidden_dtype, top_k=args.top_k, max_model_len=args.max_model_len,
        concurrency=args.concurrency, shard_size=args.shard_size, enforce_eager=args.enforce_eager,
        feature_layers=args.feature_layers)
    print(json.dumps(totals))
    print_roofline("features (teacher-forced prefill)", args.target, totals, True, args.top_k, roofline, args.dtype)


def run_generate(args: argparse.Namespace) -> None:
    from vllm_amphista.train.data import read_token_file

    roofline = measure_roofline(args.target, DTYPES[args.dtype])
    options = dict(max_tokens=args.max_tokens, dtype=args.dtype, hidden_dtype=args.hidden_dtype, top_k=args.top_k,
                   max_model_len=args.max_model_len, concurrency=args.concurrency, shard_size=args.shard_size,
                   enforce_eager=args.enforce_eager, use_chat_template=args.use_chat_template, seed=args.seed,
                   answered=args.skip_answered, feature_layers=args.feature_layers)
    if args.tokens:
        totals = generate_module.generate_dataset(args.target, args.out, token_samples=read_token_file(args.tokens),
                                                  **options)
    else:
        conversations = []
        for path in args.prompts:
            records = read_records(path)
            for index, conversation in enumerate(load_conversations(path, args.prompt_field, args.max_prompts)):
                record = records[index]
                conversations.append((str(record.get("id", f"{Path(path).stem}-{index}")),
                                      str(record.get("category", Path(path).stem)), conversation))
        totals = generate_module.generate_dataset(args.target, args.out, conversations=conversations, **options)
    print(json.dumps(totals))
    print_roofline("generate (prompts and answers)", args.target, totals, bool(args.tokens), args.top_k, roofline,
                   args.dtype)


def run_fit(options: FitOptions) -> None:
    options.validate()
    precision = autocast_dtype(options) or torch.float32
    roofline = measure_roofline(options.target, precision) if options.device == "cpu" else None
    result = fit(options)
    step_mode = "eager" if result.compile_seconds is None else f"compiled in {result.compile_seconds:.0f} s"
    print(f"trained {result.steps} steps in {result.seconds:.0f} s ({result.tokens_per_second:.0f} training "
          f"tokens/s, {result.precision}, {step_mode}); drafter saved to {options.out}")
    if roofline and result.flops_per_token:
        from vllm_amphista.train.throughput import roofline_line

        print(roofline_line(f"fit {options.method} (forward + backward, {result.precision})",
                            result.tokens_per_second, result.flops_per_token, roofline, result.precision))


def run_ngrams(args: argparse.Namespace) -> None:
    from transformers import AutoConfig

    from vllm_amphista.train.data import read_token_file

    vocab_size = AutoConfig.from_pretrained(args.target).get_text_config().vocab_size
    answers = [sample.output_ids for path in args.answers for sample in read_token_file(path)]
    ngrams = AnswerNgrams.build(answers, vocab_size, args.max_context, args.min_count)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / ANSWER_NGRAMS_NAME
    ngrams.save(path)
    print(f"{len(answers)} answers, {ngrams.num_tokens} tokens: {ngrams.num_entries} contexts of "
          f"1-{ngrams.max_context} tokens seen >= {args.min_count} times ({path.stat().st_size / 1e6:.1f} MB) "
          f"in {path}")


def run_export(args: argparse.Namespace) -> None:
    from vllm_amphista.train.data import Dataset, export_answers, read_token_file, write_token_file

    if not args.out.endswith((".jsonl", ".jsonl.gz")):
        if len(args.data) != 1:
            raise ValueError("an answers directory mirrors one dataset's shards: give one --data directory")
        written = export_answers(args.data[0], args.out)
        samples = read_token_file(args.out)
        print(f"wrote {len(written)} new answers shards; {args.out} holds {len(samples)} samples "
              f"({sum(len(sample.output_ids) for sample in samples)} output tokens)")
        return
    dataset = Dataset(args.data)
    write_token_file(args.out, dataset.samples)
    print(f"wrote {len(dataset)} samples ({dataset.num_output_tokens} output tokens) to {args.out}")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    options = {key: value for key, value in vars(args).items() if key != "command"}
    try:
        if args.command == "mix":
            run_mix(args)
        elif args.command == "generate":
            run_generate(args)
        elif args.command == "features":
            run_features(args)
        elif args.command == "export-tokens":
            run_export(args)
        elif args.command == "ngrams":
            run_ngrams(args)
        elif args.command == "fit":
            run_fit(FitOptions(**options))
        elif args.command == "curve":
            from vllm_amphista.train.curve import run_curve

            run_curve(args)
        elif args.command == "stdlib-prompts":
            from vllm_amphista.train.stdlib_prompts import build

            print(json.dumps(build(args.out_dir, args.per_module, args.max_docstring_lines)))
        elif args.command == "self-prompts":
            from vllm_amphista.train.self_prompts import write_self_prompts

            print(json.dumps(write_self_prompts(args.target, args.out, args.count, args.max_tokens, args.temperature,
                                                args.top_p, args.min_p, args.dtype, args.seed, args.exclude,
                                                args.eval_questions, args.openers_from, args.num_openers)))
        elif args.command == "adapt":
            from vllm_amphista.train.adapt import run_adapt

            result = run_adapt(args)
            print(f"fine-tuned {result.steps} steps in {result.seconds:.0f} s; heads saved to {args.out}")
        else:
            evaluate(EvalOptions(**options))
    except (ValueError, FileNotFoundError) as error:  # DataError is a ValueError
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
