"""Self-distillation datasets on disk: the target's answers, hidden states and top-k distributions.

A dataset is a directory of shards, each written whole by `generate` (and
never changed afterwards), so a stopped run resumes at the first missing shard:

    shard_00000.jsonl           one sample per line: {"id", "category", "prompt_ids", "output_ids"}
    shard_00000.safetensors     "hidden" [sum(L - 1), H]: the target's final-norm hidden state h_t at
                                every position t = 0 .. L-2 of each sample (L = prompt + output
                                tokens; the last token is never fed back), "hidden_offsets" [n + 1];
                                "topk_ids" / "topk_logprobs" [sum(outputs), k]: the target's top-k
                                next-token log-probabilities at each output token's position
                                (k = 0 when made with --top-k 0),
                                "output_offsets" [n + 1]; with `features --feature-layers`, also
                                "layer_hidden" [sum(L - 1), n*H]: the residual stream after each
                                listed number of target layers (metadata "feature_layers"), laid
                                out as "hidden"

The .jsonl is renamed into place last: a shard without it is incomplete and is
redone. A tokens file holds the same samples without the tensors, as
`export-tokens` writes it: JSONL (optionally gzipped, {"prompt_ids",
"output_ids"} per line), or the compact form the repository commits, a
directory of answers shards (one per dataset shard, same index):

    shard_00000.npz             "prompt_ids" / "output_ids": every sample's ids concatenated (uint16
                                when the vocabulary fits, else uint32), "prompt_lengths" /
                                "output_lengths" (int32), "ids" / "categories" (str)

`features` (`generate --tokens`) recomputes the tensors from either.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import os
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_amphista.prompts import DataError

SHARD_GLOB = "shard_*.jsonl"


@dataclass
class Sample:
    prompt_ids: list[int]
    output_ids: list[int]
    id: str = ""
    category: str = ""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def as_record(self) -> dict:
        return {"id": self.id, "category": self.category, "prompt_ids": self.prompt_ids,
                "output_ids": self.output_ids}


@dataclass
class SampleTensors:
    """What the target computed for one sample."""

    hidden: torch.Tensor  # [L - 1, H], or [L - 1, n*H] read with feature layers
    topk_ids: torch.Tensor  # [len(output_ids), k] int32
    topk_logprobs: torch.Tensor  # [len(output_ids), k]
    layer_hidden: torch.Tensor | None = None  # [L - 1, n*H] as computed, before it is written


def _is_id_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(token, int) and token >= 0 for token in value)


def sample_from_record(record: dict, where: str) -> Sample:
    prompt_ids, output_ids = record.get("prompt_ids"), record.get("output_ids")
    if not (_is_id_list(prompt_ids) and _is_id_list(output_ids)) or not prompt_ids:
        raise DataError(f"{where} must have non-empty integer lists 'prompt_ids' and 'output_ids' "
                        f"(it has {sorted(record)})")
    return Sample(prompt_ids, output_ids, str(record.get("id", "")), str(record.get("category", "")))


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


ANSWERS_GLOB = "shard_*.npz"


def write_answers_shard(path: str | os.PathLike, samples: list[Sample]) -> int:
    """One shard of compact answers (see the module docstring), written atomically; returns its bytes."""
    path = Path(path)
    prompt_ids = [token for sample in samples for token in sample.prompt_ids]
    output_ids = [token for sample in samples for token in sample.output_ids]
    id_dtype = np.uint16 if max(prompt_ids + output_ids, default=0) < 2**16 else np.uint32
    temporary = path.with_name(".tmp-" + path.name)  # outside ANSWERS_GLOB until complete
    np.savez_compressed(
        temporary,
        prompt_ids=np.asarray(prompt_ids, dtype=id_dtype), output_ids=np.asarray(output_ids, dtype=id_dtype),
        prompt_lengths=np.asarray([len(sample.prompt_ids) for sample in samples], dtype=np.int32),
        output_lengths=np.asarray([len(sample.output_ids) for sample in samples], dtype=np.int32),
        ids=np.asarray([sample.id for sample in samples], dtype=str),
        categories=np.asarray([sample.category for sample in samples], dtype=str))
    os.replace(temporary, path)
    return path.stat().st_size


def read_answers_shard(path: str | os.PathLike) -> list[Sample]:
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as arrays:
            prompt_lengths, output_lengths = arrays["prompt_lengths"], arrays["output_lengths"]
            prompts = np.split(arrays["prompt_ids"].astype(np.int64), np.cumsum(prompt_lengths)[:-1])
            outputs = np.split(arrays["output_ids"].astype(np.int64), np.cumsum(output_lengths)[:-1])
            ids, categories = arrays["ids"], arrays["categories"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        raise DataError(f"{path}: not an answers shard ({error})") from error
    if not len(prompt_lengths) == len(output_lengths) == len(ids) == len(categories):
        raise DataError(f"{path}: its arrays disagree on the number of samples")
    return [Sample(prompt.tolist(), output.tolist(), str(sample_id), str(category))
            for prompt, output, sample_id, category in zip(prompts, outputs, ids, categories, strict=True)]


def export_answers(dataset_dir: str | os.PathLike, answers_dir: str | os.PathLike) -> list[Path]:
    """Write an answers shard for every complete dataset shard that has none yet; returns the new files."""
    dataset_dir, answers_dir = Path(dataset_dir), Path(answers_dir)
    answers_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for index in complete_shards(dataset_dir):
        target = shard_stem(answers_dir, index).with_suffix(".npz")
        if target.exists():
            continue
        lines = shard_stem(dataset_dir, index).with_suffix(".jsonl").read_text().splitlines()
        samples = [sample_from_record(json.loads(line), f"{dataset_dir} shard {index}") for line in lines]
        write_answers_shard(target, samples)
        written.append(target)
    return written


def read_token_file(path: str | os.PathLike) -> list[Sample]:
    """Samples of a tokens file (JSONL, JSONL.gz, or a directory of answers shards); DataError if empty
    or malformed."""
    path = Path(path)
    if path.is_dir():
        shards = sorted(path.glob(ANSWERS_GLOB))
        samples = [sample for shard in shards for sample in read_answers_shard(shard)]
        if not samples:
            raise DataError(f"{path}: no answers shards ({ANSWERS_GLOB})")
        return samples
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    samples = []
    with _open_text(path) as file:
        for number, line in enumerate(file):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}: line {number + 1} is not JSON: {error}") from error
            if not isinstance(record, dict):
                raise DataError(f"{path}: line {number + 1} is not an object")
            samples.append(sample_from_record(record, f"{path}: line {number + 1}"))
    if not samples:
        raise DataError(f"{path}: the dataset is empty")
    return samples


def write_token_file(path: str | os.PathLike, samples: list[Sample]) -> None:
    path = Path(path)
    with (gzip.open(path, "wt", encoding="utf-8") if path.suffix == ".gz" else open(path, "w")) as file:
        for sample in samples:
            file.write(json.dumps(sample.as_record()) + "\n")


def shard_stem(directory: Path, index: int) -> Path:
    return directory / f"shard_{index:05d}"


FEATURE_LAYERS_KEY = "feature_layers"


def write_shard(directory: str | os.PathLike, index: int, samples: list[Sample], tensors: list[SampleTensors],
                hidden_dtype: torch.dtype, feature_layers: list[int] | None = None) -> int:
    """Write one complete shard atomically (with each sample's `layer_hidden` when `feature_layers` are
    given); returns its size in bytes."""
    stem = shard_stem(Path(directory), index)
    for sample, computed in zip(samples, tensors, strict=True):
        if computed.hidden.shape[0] != len(sample.token_ids) - 1 or computed.topk_ids.shape[0] != len(sample.output_ids):
            raise ValueError(f"sample {sample.id}: tensors do not match its {len(sample.token_ids)} tokens")

    def offsets(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)

    arrays = {
        "hidden": torch.cat([t.hidden for t in tensors]).to(hidden_dtype).contiguous(),
        "hidden_offsets": offsets([t.hidden.shape[0] for t in tensors]),
        "topk_ids": torch.cat([t.topk_ids for t in tensors]).to(torch.int32).contiguous(),
        "topk_logprobs": torch.cat([t.topk_logprobs for t in tensors]).to(torch.float16).contiguous(),
        "output_offsets": offsets([t.topk_ids.shape[0] for t in tensors]),
    }
    metadata = None
    if feature_layers:
        arrays["layer_hidden"] = torch.cat([t.layer_hidden for t in tensors]).to(hidden_dtype).contiguous()
        metadata = {FEATURE_LAYERS_KEY: ",".join(str(layer) for layer in feature_layers)}
    tensors_path, samples_path = stem.with_suffix(".safetensors"), stem.with_suffix(".jsonl")
    save_file(arrays, str(tensors_path) + ".tmp", metadata=metadata)
    os.replace(str(tensors_path) + ".tmp", tensors_path)
    with open(str(samples_path) + ".tmp", "w") as file:
        file.writelines(json.dumps(sample.as_record()) + "\n" for sample in samples)
    os.replace(str(samples_path) + ".tmp", samples_path)
    return tensors_path.stat().st_size + samples_path.stat().st_size


def _shard_index(path: Path) -> int:
    return int(path.stem.removeprefix("shard_"))


def complete_shards(directory: str | os.PathLike) -> list[int]:
    """Indices of the shards a directory holds in full."""
    directory = Path(directory)
    return sorted(_shard_index(path) for path in directory.glob(SHARD_GLOB)
                  if path.with_suffix(".safetensors").is_file())


def shard_feature_layers(directory: str | os.PathLike, index: int) -> list[int]:
    """The target layers whose streams a complete shard holds (none: h_t alone)."""
    with safe_open(str(shard_stem(Path(directory), index).with_suffix(".safetensors")), framework="pt") as handle:
        return _stored_feature_layers(handle)


def _check_feature_layers(path: Path, feature_layers: list[int], handle=None) -> list[int]:
    """The layers a shard's tensors file stores; DataError if `feature_layers` are not all there."""
    if handle is None:
        with safe_open(str(path), framework="pt") as opened:
            return _check_feature_layers(path, feature_layers, opened)
    stored = _stored_feature_layers(handle)
    missing = [layer for layer in feature_layers if layer not in stored]
    if missing:
        raise DataError(f"{path}: has the streams of target layers {stored or 'none'}, not {missing}: "
                        f"rebuild it with `train features --feature-layers ...`")
    return stored


def _stored_feature_layers(handle) -> list[int]:
    stored = (handle.metadata() or {}).get(FEATURE_LAYERS_KEY, "")
    return [int(layer) for layer in stored.split(",")] if stored else []


def answered_shards(answers_dir: str | os.PathLike) -> list[int]:
    """Indices of the answers shards a directory holds (written whole, so present means complete)."""
    return sorted(_shard_index(path) for path in Path(answers_dir).glob(ANSWERS_GLOB))


class Dataset:
    """The samples of one or more dataset directories, with their tensors read on demand.

    With `feature_layers`, a sample's `hidden` is the concatenation of those layers' streams
    (shards made by `features --feature-layers` with at least these layers) instead of h_t."""

    def __init__(self, directories: list[str | os.PathLike], feature_layers: list[int] | None = None):
        self.feature_layers = feature_layers
        self.samples: list[Sample] = []
        self._locations: list[tuple[Path, int]] = []  # (tensors file, row in shard)
        self.directory_sizes: list[int] = []  # samples of each directory, in order
        for directory in directories:
            directory = Path(directory)
            first = len(self.samples)
            shards = complete_shards(directory)
            if not shards:
                raise DataError(f"{directory}: no complete shard (run `python -m vllm_amphista.train generate`)")
            for index in shards:
                stem = shard_stem(directory, index)
                if feature_layers:
                    _check_feature_layers(stem.with_suffix(".safetensors"), feature_layers)
                lines = stem.with_suffix(".jsonl").read_text().splitlines()
                for row, line in enumerate(lines):
                    self.samples.append(sample_from_record(json.loads(line), f"{stem}.jsonl: line {row + 1}"))
                    self._locations.append((stem.with_suffix(".safetensors"), row))
            self.directory_sizes.append(len(self.samples) - first)
        # tensors file -> (handle, hidden offsets, output offsets, columns of the asked layers or None)
        self._open: dict[Path, tuple] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def with_feature_layers(self, feature_layers: list[int] | None) -> Dataset:
        """The same samples, read with other feature layers."""
        view = copy.copy(self)
        view.feature_layers, view._open = feature_layers, {}
        return view

    def _shard(self, path: Path):
        if path not in self._open:
            handle = safe_open(str(path), framework="pt")
            columns = None
            if self.feature_layers:
                stored = _check_feature_layers(path, self.feature_layers, handle)
                width = handle.get_slice("hidden").get_shape()[-1]
                columns = torch.cat([torch.arange(width) + stored.index(layer) * width
                                     for layer in self.feature_layers])
            self._open[path] = (handle, handle.get_tensor("hidden_offsets"), handle.get_tensor("output_offsets"),
                                columns)
        return self._open[path]

    def tensors(self, index: int) -> SampleTensors:
        path, row = self._locations[index]
        handle, hidden_offsets, output_offsets, columns = self._shard(path)
        rows = slice(int(hidden_offsets[row]), int(hidden_offsets[row + 1]))
        hidden = handle.get_slice("hidden")[rows] if columns is None else handle.get_slice("layer_hidden")[rows][:, columns]
        start, end = int(output_offsets[row]), int(output_offsets[row + 1])
        return SampleTensors(hidden, handle.get_slice("topk_ids")[start:end],
                             handle.get_slice("topk_logprobs")[start:end])

    @functools.cached_property
    def top_k(self) -> int:
        """The fewest target log-probabilities a shard keeps per output position (0: made with --top-k 0)."""
        widths = []
        for path in dict.fromkeys(path for path, _ in self._locations):
            with safe_open(str(path), framework="pt") as handle:
                widths.append(handle.get_slice("topk_ids").get_shape()[-1])
        return min(widths)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(sample.output_ids) for sample in self.samples)


def check_token_ids(samples: list[Sample], vocab_size: int, source: str) -> None:
    """DataError if a sample holds an id outside the target's vocabulary."""
    largest = max(max(sample.token_ids) for sample in samples)
    if largest >= vocab_size:
        raise DataError(f"{source}: token id {largest} is outside the target's vocabulary of {vocab_size}")


def most_frequent_tokens(samples: list[Sample], draft_vocab_size: int, vocab_size: int) -> torch.Tensor:
    """The draft vocabulary: the `draft_vocab_size` most frequent ids of the
    target's outputs (the tokens the drafter must predict), ties broken by id,
    topped up with the lowest unused ids if the outputs have fewer distinct ids."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"--draft-vocab-size must be in [1, {vocab_size}] (the target's vocabulary; 0 drafts "
                         f"over all of it), got {draft_vocab_size}")
    counts = Counter(token for sample in samples for token in sample.output_ids)
    ranked = sorted(counts, key=lambda token: (-counts[token], token))[:draft_vocab_size]
    if len(ranked) < draft_vocab_size:
        seen = set(ranked)
        ranked += [token for token in range(vocab_size) if token not in seen][: draft_vocab_size - len(ranked)]
    return torch.tensor(ranked, dtype=torch.int64)
