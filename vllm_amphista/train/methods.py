"""The drafters the pipeline trains, by name and by saved directory."""

from __future__ import annotations

import os
from pathlib import Path

from vllm_amphista.checkpoint import CONFIG_NAME, load_weights
from vllm_amphista.train.amphista import AmphistaMethod
from vllm_amphista.train.dflash import DFlashMethod
from vllm_amphista.train.drafter import DraftMethod, read_json
from vllm_amphista.train.eagle import EagleMethod
from vllm_amphista.train.medusa import MedusaMethod
from vllm_amphista.train.target import Target

METHOD_CLASSES = {"amphista": AmphistaMethod, "medusa": MedusaMethod, "eagle": EagleMethod, "dflash": DFlashMethod}
METHODS = tuple(METHOD_CLASSES)


def detect_method(directory: str | os.PathLike) -> str:
    """Which of METHODS a saved heads directory holds."""
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no {CONFIG_NAME}: not a heads directory")
    config = read_json(config_path)
    model_type = config.get("model_type")
    if model_type in ("amphista", "medusa"):
        return model_type
    if config.get("architectures") == ["DFlashDraftModel"]:
        return "dflash"
    if "fc.weight" in load_weights(directory):
        return "eagle"
    raise ValueError(f"{directory} holds neither Amphista, Medusa, EAGLE nor DFlash heads (model_type {model_type!r})")


def load_heads(directory: str | os.PathLike, target: Target, eagle_steps: int = 4) -> DraftMethod:
    """Load any saved drafter for evaluation, checking it matches the target."""
    directory = Path(directory)
    method = detect_method(directory)
    if method == "eagle":
        return EagleMethod.load(directory, target, eagle_steps)
    return METHOD_CLASSES[method].load(directory, target)
