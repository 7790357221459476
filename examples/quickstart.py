"""Quickstart: the demo target answers a few prompts through vLLM, without and with speculative
decoding, and prints tokens/s, the speedup and tau for every method.

    make demo          # sets everything up, then runs this
    python examples/quickstart.py --target models/SmolLM2-135M-Instruct

Rows: plain decoding, vLLM's own ngram, and this plugin's anpd (training-free; and
falling back on the target's answer n-grams the heads dir ships), amphista (the heads
shipped in the package) and amphista_anpd (both), all in
the dtype this CPU computes fastest (vllm_amphista/cpu_dtype.py: float32 unless
the CPU has bf16 units), plus plain decoding in vLLM's default dtype, so the
table shows whether speculation beats the best plain configuration here.
Greedy decoding: in float32 every method prints exactly the plain answers.

Each engine is vLLM's default engine (engine core in its own process) in a
subprocess of its own, eager unless --engine compiled (compiling costs minutes
per engine on a 2-core CPU). Plain decoding's engine stays up throughout, and
each row answers right after it (`--repeats` such pairs): a drift in the
machine's speed between rows, minutes apart, does not land in a row's speedup,
the median over its pairs of its tok/s over plain decoding's. (Seven engines
at once would not fit in 24 GiB.)
"""

import argparse
import os
import statistics

PROMPTS = [
    "Explain in three sentences why the sky looks blue.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "List five tips for staying focused while studying, one line each.",
    "A shop sells pens at 3 dollars each. How much do 7 pens cost? Explain step by step.",
]
METHODS = ("vanilla", "ngram", "anpd", "amphista", "amphista_anpd")
# What vLLM runs when no dtype is given: the checkpoint's bf16 (vLLM-CPU keeps bf16 on every x86 CPU).
VLLM_DEFAULT_DTYPE = "bfloat16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/SmolLM2-135M-Instruct", help="target model dir")
    parser.add_argument("--heads", default=None, help="Amphista heads dir (default: the shipped heads)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--dtype", default=None, help="dtype of every method's row (default: this CPU's fastest)")
    parser.add_argument("--engine", choices=("eager", "compiled"), default="eager")
    parser.add_argument("--engine-core", choices=("separate", "in-process"), default="separate",
                        help="separate: vLLM's default; in-process: faster start-up, for quick runs")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed (plain decoding, row) pairs per row (default: %(default)s)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    from transformers import AutoTokenizer

    from vllm_amphista.answer_ngrams import ANSWER_NGRAMS_NAME
    from vllm_amphista.assets import SHIPPED_HEADS
    from vllm_amphista.bench.engines import EngineFailed, EngineProcess, engine_label, set_engine_env
    from vllm_amphista.cpu_dtype import choose_cpu_dtype, isa_cap_aborts_bf16_engine
    from vllm_amphista.prompts import chat_prompt_ids

    set_engine_env(kv_cache_gib=1)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    choice = choose_cpu_dtype()
    dtype = args.dtype or choice.dtype
    print(choice.describe() if args.dtype is None else f"dtype {dtype} (--dtype)", flush=True)
    heads = args.heads or SHIPPED_HEADS
    methods = list(METHODS)
    if not os.path.isfile(os.path.join(heads, "config.json")):
        print(f"No Amphista heads at {heads}: showing the drafters that exist.")
        methods = [method for method in methods if not method.startswith("amphista")]
    # (label, method, dtype, the dir vLLM gets as the method's model)
    rows = [(method, method, dtype, heads if method.startswith("amphista") else None) for method in methods]
    if os.path.isfile(os.path.join(heads, ANSWER_NGRAMS_NAME)):
        rows.insert(methods.index("anpd") + 1, ("anpd + answer n-grams", "anpd", dtype, heads))
    aborting_cap = isa_cap_aborts_bf16_engine()
    if dtype != VLLM_DEFAULT_DTYPE and aborting_cap:
        print(f"Not running plain {VLLM_DEFAULT_DTYPE}: on this AMX CPU vLLM-CPU packs bf16 weights for AMX and "
              f"{aborting_cap} makes oneDNN refuse the AMX kernel (the engine aborts).")
    elif dtype != VLLM_DEFAULT_DTYPE:
        rows.append((f"vanilla ({VLLM_DEFAULT_DTYPE}, vLLM's default)", "vanilla", VLLM_DEFAULT_DTYPE, None))

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompt_ids = [chat_prompt_ids(tokenizer, prompt) for prompt in PROMPTS]

    def build(label, method, row_dtype, model_dir):
        print(f"building {label} ({row_dtype}) ...", flush=True)
        engine_args = dict(target=args.target, method=method, num_speculative_tokens=args.num_speculative_tokens,
                           heads_dir=model_dir, dtype=row_dtype,
                           max_model_len=1024, enforce_eager=args.engine == "eager")
        return EngineProcess(engine_args, prompt_ids[0], engine_core=args.engine_core)

    # Per row: (its run, plain decoding's run just before it), one pair per repeat.
    pairs: dict[str, list[tuple]] = {}
    plain_runs = []
    plain = build(*rows[0])
    try:
        for row in rows[1:]:
            try:
                engine = build(*row)
            except EngineFailed as error:
                print(f"{row[0]}: {error}")
                continue
            try:
                for _ in range(args.repeats):
                    plain_runs.append(plain.run(prompt_ids, args.max_tokens, 0.0))
                    pairs.setdefault(row[0], []).append((engine.run(prompt_ids, args.max_tokens, 0.0), plain_runs[-1]))
            finally:
                engine.close()
        if not plain_runs:  # no other row built
            plain_runs.append(plain.run(prompt_ids, args.max_tokens, 0.0))
    finally:
        plain.close()
    pairs[rows[0][0]] = [(run, run) for run in plain_runs]

    vanilla = plain_runs[0]
    print("\n=== answers (greedy, plain decoding) ===")
    for prompt, ids in zip(PROMPTS, vanilla.outputs):
        print(f"\n> {prompt}\n{tokenizer.decode(ids, skip_special_tokens=True)}")
    print(f"\n=== speed: one request at a time, {engine_label(args.engine, args.engine_core)}, this machine; "
          f"each row timed right after plain decoding, median of {args.repeats} ===")
    print(f"{'method':<32}{'dtype':>10}{'tok/s':>8}{'speedup':>9}{'tau':>7}   same answers as plain {dtype}")
    for label, _, row_dtype, _ in rows:
        if label not in pairs:
            continue
        result = pairs[label][0][0]
        tokens_per_second = statistics.median(run.tokens_per_second for run, _ in pairs[label])
        speedup = statistics.median(run.tokens_per_second / before.tokens_per_second for run, before in pairs[label])
        same = sum(a == b for a, b in zip(result.outputs, vanilla.outputs))
        print(f"{label:<32}{row_dtype:>10}{tokens_per_second:>8.1f}"
              f"{speedup:>8.2f}x{result.tau:>7.2f}   {same}/{len(PROMPTS)}")
    print(f"speedup: over plain decoding in {dtype}. tau = generated tokens / target forward steps (1.00 without "
          "speculation). In float32 speculative answers equal the plain ones token for token; in bf16 rounding can "
          "make them drift after many tokens.")


if __name__ == "__main__":
    main()
