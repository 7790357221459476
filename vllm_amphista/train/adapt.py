"""`adapt`: fine-tune served heads on the traffic they recorded (`record_traffic`).

    python -m vllm_amphista.train adapt --target T --recording DIR --heads HEADS \
        --original-data .cache/data/all-layers --out runs/adapted

The recording holds each served request's prompt and output token ids: the target's own outputs
on the users' prompts, on-policy self-distillation data. `adapt` rebuilds the target's features
for them by prefill (the code of `features`, resumable by shards), then fine-tunes the heads from
their current weights (`fit --init-heads`), with a share of the data they learned from mixed in
(`--original-data`, `--original-share`) so they keep what they knew; the result is a heads dir
`vllm serve --speculative-model` loads. Everything it computes lives in --work-dir, so a stopped
run continues where it stopped. A recording that is empty, or whose ids do not fit the target's
vocabulary (made with another target), is refused before any work.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_amphista.prompts import DataError
from vllm_amphista.train.data import Sample, check_token_ids
from vllm_amphista.train.fit import STATE_NAME, FitOptions, state_directory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model directory (the one that served)")
    parser.add_argument("--recording", required=True, help="the record_traffic directory")
    parser.add_argument("--heads", required=True, help="the served Amphista heads dir to start from")
    parser.add_argument("--out", required=True, help="the fine-tuned heads dir")
    parser.add_argument("--original-data", nargs="+", help="feature dirs the heads learned from (mixed in)")
    parser.add_argument("--original-share", type=float, default=0.3,
                        help="share of training samples from --original-data (default: %(default)s)")
    parser.add_argument("--work-dir", help="features and resumable state (default: .cache/adapt/<name of --out>)")
    parser.add_argument("--dtype", help="engine dtype of the prefill (default: the one cpu_dtype chooses)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the training samples (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--row-tokens", type=int, default=1024)
    parser.add_argument("--eval-fraction", type=float, default=0.05,
                        help="share of recorded requests held out for the accuracy eval (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)


def recorded_samples(recording: str, vocab_size: int) -> list[Sample]:
    from vllm_amphista.traffic import read_recording

    samples = [Sample(record["prompt_ids"], record["output_ids"], f"traffic-{index}", "traffic")
               for index, record in enumerate(read_recording(recording))]
    try:
        check_token_ids(samples, vocab_size, recording)
    except DataError as error:
        raise DataError(f"{error}: was it recorded with another target?") from None
    return samples


def check_same_recording(work: Path, recording: str) -> None:
    """The work dir's features and state follow the recording's sample order: a recording that grew
    or changed since would silently mix them up, so it is refused."""
    from vllm_amphista.traffic import SHARD_GLOB

    shards = sorted((path.name, path.stat().st_size) for path in Path(recording).glob(SHARD_GLOB))
    fingerprint = work / "recording.json"
    if fingerprint.is_file():
        if [tuple(shard) for shard in json.loads(fingerprint.read_text())] != shards:
            raise ValueError(f"{recording} changed since {work} was made from it: give a new --work-dir")
        return
    work.mkdir(parents=True, exist_ok=True)
    fingerprint.write_text(json.dumps(shards))


def run_adapt(args: argparse.Namespace):
    from transformers import AutoConfig

    from vllm_amphista.configuration_amphista import AmphistaConfig
    from vllm_amphista.cpu_dtype import choose_cpu_dtype
    from vllm_amphista.train.fit import fit
    from vllm_amphista.train.generate import generate_dataset

    target_config = AutoConfig.from_pretrained(args.target).get_text_config()
    samples = recorded_samples(args.recording, target_config.vocab_size)
    heads_config = AmphistaConfig.from_pretrained(args.heads)
    work = Path(args.work_dir or Path(".cache/adapt") / Path(args.out).name)
    check_same_recording(work, args.recording)
    features = work / "features"
    generate_dataset(args.target, features, token_samples=samples, dtype=args.dtype or choose_cpu_dtype().dtype,
                     max_model_len=args.max_model_len, concurrency=64, shard_size=256,
                     feature_layers=heads_config.target_feature_layers)
    options = FitOptions(
        target=args.target, data=[str(features)], out=args.out, method="amphista",
        target_feature_layers=heads_config.target_feature_layers, init_heads=args.heads,
        mix_data=args.original_data, mix_fraction=args.original_share if args.original_data else 0.0,
        epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens, row_tokens=args.row_tokens,
        eval_fraction=args.eval_fraction,
        eval_every=10**9, seed=args.seed, state_dir=str(work / "fit"))
    if (state_directory(options) / STATE_NAME).is_file():
        options.resume = options.state_dir
    return fit(options)
