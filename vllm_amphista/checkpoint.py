"""Checkpoint files: the heads dir's config.json and model.safetensors, read, checked and written.

Every reader here fails with one clear error naming the file and what is wrong,
so a bad heads dir never half-starts an engine or a training run. Imports no vLLM.
"""

from __future__ import annotations

import json
import os
import struct

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class HeadsDirError(ValueError):
    pass


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as config.json files spell it."""
    return str(dtype).removeprefix("torch.")


def save_weights(tensors: dict[str, torch.Tensor], directory: str | os.PathLike, dtype: torch.dtype) -> None:
    """Write `directory`/model.safetensors, floating tensors cast to `dtype`
    (integer buffers such as id maps keep their dtype)."""
    tensors = {
        name: (tensor.to(dtype) if tensor.is_floating_point() else tensor).detach().cpu().contiguous()
        for name, tensor in tensors.items()
    }
    save_file(tensors, os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})


def load_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read `directory`/model.safetensors; FileNotFoundError if absent,
    ValueError if truncated or corrupt."""
    path = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {directory}")
    try:
        return load_file(path)
    except SafetensorError as error:
        raise ValueError(f"{path} is truncated or corrupt: {error}") from error


def check_weights_match(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], source: str) -> None:
    """One ValueError listing every missing, unexpected or misshapen tensor."""
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    misshapen = [
        f"{name}: {list(tensors[name].shape)} (expected {list(expected[name].shape)})"
        for name in sorted(expected.keys() & tensors.keys())
        if tensors[name].shape != expected[name].shape
    ]
    if missing or unexpected or misshapen:
        raise ValueError(
            f"{source} does not match the model: missing {missing}, unexpected {unexpected}, wrong shapes {misshapen}"
        )


def read_heads_config(path: str) -> dict:
    """The heads dir's config.json as a dict, or a HeadsDirError saying what is wrong."""
    if not os.path.exists(path):
        raise HeadsDirError(f"speculative model path does not exist: {path}")
    if not os.path.isdir(path):
        raise HeadsDirError(f"speculative model must be a heads directory, got a file: {path}")
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise HeadsDirError(f"heads dir has no config.json: {config_path}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadsDirError(f"cannot read {config_path}: {e}") from e
    if not isinstance(config, dict):
        raise HeadsDirError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    return config


def check_safetensors_complete(path: str) -> None:
    """Raise if a safetensors file is missing, unreadable or shorter than its header says."""
    if not os.path.isfile(path):
        raise HeadsDirError(f"heads dir has no weights file: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise HeadsDirError(f"{path} is truncated ({size} bytes): no safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if 8 + header_len > size:
            raise HeadsDirError(f"{path} is truncated: header needs {header_len} bytes, file has {size}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HeadsDirError(f"{path} has a corrupt safetensors header: {e}") from e
    data_end = max(
        (entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
        default=0,
    )
    if 8 + header_len + data_end > size:
        raise HeadsDirError(
            f"{path} is truncated: tensors need {8 + header_len + data_end} bytes, file has {size}"
        )
