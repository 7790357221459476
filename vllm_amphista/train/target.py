"""The frozen target model and the on-disk cache of its hidden states.

Which hidden state drafters get: vLLM's GPU/CPU model runner hands its
proposers (EAGLE, Medusa, ...) the model's forward output at each position
(``hidden_states`` in ``vllm/v1/worker/gpu_model_runner.py``, the same tensor
the sampler's logits come from). For Llama that output is taken after the
final norm (``vllm/model_executor/models/llama.py``, ``LlamaModel.forward``
ends with ``hidden_states, _ = self.norm(hidden_states, residual)``). The
transformers equivalent is the base model's ``last_hidden_state``
(``LlamaModel.forward`` applies ``self.norm`` last), i.e. exactly what the
lm_head multiplies, so the drafters are trained on that.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, PreTrainedModel

from vllm_amphista.train.data import Sample

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CACHE_SHARD_SIZE = 256
CACHE_FORMAT_VERSION = 1


@dataclass
class Target:
    """A frozen causal LM and the pieces drafters share with it."""

    path: str
    model: PreTrainedModel

    @property
    def config(self):
        return self.model.config.get_text_config()

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @torch.inference_mode()
    def final_hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] right-padded ids -> [B, T, H] final-norm outputs (what vLLM gives drafters)."""
        return self.model.base_model(input_ids=input_ids.to(self.model.device)).last_hidden_state

    def check_matches(self, hidden_size: int, vocab_size: int, source: str) -> None:
        """ValueError if heads built for another model are used with this target."""
        if (hidden_size, vocab_size) != (self.hidden_size, self.vocab_size):
            raise ValueError(
                f"{source} was built for hidden size {hidden_size} and vocab {vocab_size}, but the target "
                f"{self.path} has hidden size {self.hidden_size} and vocab {self.vocab_size}"
            )


def load_target(path: str, dtype: str = "bfloat16") -> Target:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
    model.requires_grad_(False)
    return Target(path=str(path), model=model)


def pack_by_tokens(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group indices, sorted by length, into batches of at most `batch_tokens`
    padded tokens (a longer sequence gets a batch of its own)."""
    batches: list[list[int]] = []
    current: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        # Sorted ascending, so this sequence is the longest in the batch.
        if current and (len(current) + 1) * lengths[index] > batch_tokens:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def right_pad(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ([B, T] ids padded with 0, [B, T] bool mask of real tokens)."""
    max_len = max(len(sequence) for sequence in sequences)
    ids = torch.zeros(len(sequences), max_len, dtype=torch.long)
    mask = torch.zeros(len(sequences), max_len, dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = True
    return ids, mask


class HiddenStateCache:
    """Per-sample final-norm hidden states [L, H], in safetensors shards of
    CACHE_SHARD_SIZE samples under a directory named by a hash of the samples
    file, the target and the dtypes. Shards already on disk are reused, so an
    interrupted build resumes and every fit on the same data shares it."""

    def __init__(self, directory: Path, num_samples: int):
        self.directory = directory
        self.num_samples = num_samples
        self._shards: dict[int, object] = {}

    @staticmethod
    def cache_key(samples_path: str | os.PathLike, target: Target, cache_dtype: str) -> str:
        digest = hashlib.sha256()
        digest.update(Path(samples_path).read_bytes())
        digest.update(json.dumps(target.model.config.to_dict(), sort_keys=True, default=str).encode())
        for weights in sorted(Path(target.path).glob("*.safetensors")):
            stat = weights.stat()
            digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        digest.update(f"{target.model.dtype}:{cache_dtype}:v{CACHE_FORMAT_VERSION}".encode())
        return digest.hexdigest()[:20]

    @classmethod
    def build(
        cls,
        target: Target,
        samples: list[Sample],
        samples_path: str | os.PathLike,
        cache_root: str | os.PathLike,
        cache_dtype: str = "bfloat16",
        batch_tokens: int = 4096,
    ) -> HiddenStateCache:
        directory = Path(cache_root) / cls.cache_key(samples_path, target, cache_dtype)
        directory.mkdir(parents=True, exist_ok=True)
        cache = cls(directory, len(samples))
        missing = [
            start for start in range(0, len(samples), CACHE_SHARD_SIZE) if not cache._shard_path(start).exists()
        ]
        for start in tqdm(missing, desc="hidden states", unit="shard", disable=not missing):
            shard = samples[start:start + CACHE_SHARD_SIZE]
            tensors = {}
            for batch in pack_by_tokens([len(sample.token_ids) for sample in shard], batch_tokens):
                ids, mask = right_pad([shard[i].token_ids for i in batch])
                hidden = target.final_hidden_states(ids).to(device="cpu", dtype=DTYPES[cache_dtype])
                for row, i in enumerate(batch):
                    tensors[str(start + i)] = hidden[row, : int(mask[row].sum())].contiguous()
            # Written under a temporary name so a killed run leaves no half shard.
            temporary = cache._shard_path(start).with_suffix(".tmp")
            save_file(tensors, temporary)
            temporary.replace(cache._shard_path(start))
        return cache

    def _shard_path(self, start: int) -> Path:
        return self.directory / f"shard_{start // CACHE_SHARD_SIZE:06d}.safetensors"

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index - index % CACHE_SHARD_SIZE
        if start not in self._shards:
            self._shards[start] = safe_open(self._shard_path(start), framework="pt")
        return self._shards[start].get_tensor(str(index))
