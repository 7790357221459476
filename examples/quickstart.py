"""Quickstart: the demo target answers a few prompts through vLLM, without and
with speculative decoding, and prints tokens/s, the speedup and tau.

    make demo          # sets everything up, then runs this
    python examples/quickstart.py --target models/SmolLM2-135M-Instruct

Shows Amphista with the heads shipped in the package, and ANPD (training-free).
Greedy decoding: every method must print the same answers as plain decoding.
"""

import argparse
import gc
import os

PROMPTS = [
    "Explain in three sentences why the sky looks blue.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "List five tips for staying focused while studying, one line each.",
    "A shop sells pens at 3 dollars each. How much do 7 pens cost? Explain step by step.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/SmolLM2-135M-Instruct", help="target model dir")
    parser.add_argument("--heads", default=None, help="Amphista heads dir (default: the shipped heads)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    args = parser.parse_args()

    from vllm_amphista.assets import SHIPPED_HEADS
    from vllm_amphista.bench.engines import make_engine, run_prompts, set_engine_env
    from vllm_amphista.prompts import chat_prompt_ids

    set_engine_env()
    heads = args.heads or SHIPPED_HEADS
    methods = ["vanilla", "anpd"]
    if os.path.isfile(os.path.join(heads, "config.json")):
        methods.append("amphista")
    else:
        print(f"No Amphista heads at {heads}: showing the drafters that exist.")

    results = {}
    for method in methods:
        llm = make_engine(args.target, method, args.num_speculative_tokens,
                          heads if method == "amphista" else None, dtype="bfloat16", max_model_len=1024)
        tokenizer = llm.get_tokenizer()
        prompt_ids = [chat_prompt_ids(tokenizer, prompt) for prompt in PROMPTS]
        run_prompts(llm, prompt_ids[:1], max_tokens=8)  # warm-up
        results[method] = run_prompts(llm, prompt_ids, max_tokens=args.max_tokens)
        del llm
        gc.collect()

    vanilla = results["vanilla"]
    print("\n=== answers (greedy, plain decoding) ===")
    for prompt, ids in zip(PROMPTS, vanilla.outputs):
        print(f"\n> {prompt}\n{tokenizer.decode(ids, skip_special_tokens=True)}")
    print("\n=== speed (bf16, one request at a time, this machine) ===")
    print(f"{'method':<10}{'tok/s':>8}{'speedup':>9}{'tau':>7}   same answers as plain decoding")
    for method, result in results.items():
        same = sum(a == b for a, b in zip(result.outputs, vanilla.outputs))
        print(f"{method:<10}{result.tokens_per_second:>8.1f}{result.tokens_per_second / vanilla.tokens_per_second:>8.2f}x"
              f"{result.tau:>7.2f}   {same}/{len(PROMPTS)}")
    print("tau = generated tokens / target forward steps (1.00 without speculation). bf16 rounding can make a "
          "speculative answer drift from the plain one after many tokens; float32 runs match exactly (see tests).")


if __name__ == "__main__":
    main()
