"""Offline inference with Amphista: vLLM's `LLM` with the shipped heads.

    python examples/offline_inference.py --target models/SmolLM2-135M-Instruct
"""

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--heads", default=None, help="Amphista heads dir (default: the shipped heads)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_amphista.assets import SHIPPED_HEADS
    from vllm_amphista.cpu_dtype import choose_cpu_dtype

    dtype = choose_cpu_dtype()  # on a CPU: float32 unless it has bf16 units
    print(dtype.describe())
    llm = LLM(
        model=args.target,
        dtype=dtype.dtype,
        max_model_len=2048,
        speculative_config={"method": "amphista", "model": args.heads or SHIPPED_HEADS, "num_speculative_tokens": 4},
        disable_log_stats=False,
    )
    conversations = [
        [{"role": "user", "content": "Give me three facts about the Moon."}],
        [{"role": "user", "content": "Write a haiku about autumn rain."}],
    ]
    for output in llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=128)):
        print(f"{output.outputs[0].text}\n---")
    stats = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    drafts, accepted = stats["vllm:spec_decode_num_drafts"], stats["vllm:spec_decode_num_accepted_tokens"]
    print(f"vLLM's mean acceptance length: {1 + accepted / max(drafts, 1):.2f}")


if __name__ == "__main__":
    main()
