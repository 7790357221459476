"""Serve the demo target with Amphista and query it with the OpenAI client.

Start the server (CPU build; on CUDA `vllm serve` takes the same flags), in the dtype
this CPU computes fastest (float32 unless it has bf16 units), with vLLM-CPU's recommended
preloads (Intel OpenMP from the venv, tcmalloc when installed: faster here, BENCHMARKS.md 9)
and glibc's malloc on transparent huge pages (BENCHMARKS.md 56e):

    DTYPE=$(python -c "from vllm_amphista.cpu_dtype import choose_cpu_dtype; print(choose_cpu_dtype().dtype)")
    LD_PRELOAD="$(scripts/cpu_preload.sh .venv)" GLIBC_TUNABLES=glibc.malloc.hugetlb=1 \
        vllm serve models/SmolLM2-135M-Instruct --dtype $DTYPE \
        --speculative-model vllm_amphista/heads/smollm2-135m-instruct --port 8000

then run this script:

    python examples/serve_openai_client.py --base-url http://127.0.0.1:8000/v1
"""

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct", help="the served model name")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="unused")
    reply = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=64,
        temperature=0.0,
    )
    print(reply.choices[0].message.content)
    stream = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": "Count from one to ten in words."}],
        max_tokens=64,
        temperature=0.0,
        stream=True,
    )
    for chunk in stream:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()


if __name__ == "__main__":
    main()
