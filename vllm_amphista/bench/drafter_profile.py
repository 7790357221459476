"""Where the Amphista drafter's time goes, op by op, as it runs inside vLLM.

    python -m vllm_amphista.bench.drafter_profile --batch 1 8 --dtype float32 --engine eager

For each batch size an in-process engine (its own subprocess) decodes `batch`
Spec-Bench prompts at once with K fixed; every call of the drafter's `propose`
after the first few runs under torch.profiler, and the table sums each op's
self CPU time per drafter call, grouped (GEMMs, attention, the heads' argmax
and confidence, norms, copies and the rest). The floor beside it is the
heads' weights read once at the plain step's pace (`bench.steps`).
Instrumentation only: profiling adds overhead to every op, so read the shares,
and take absolute drafter times from `bench.steps`.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys

from vllm_amphista.assets import DEMO_TARGET, SHIPPED_HEADS, SPEC_BENCH_QUESTIONS
from vllm_amphista.bench.args import positive_int
from vllm_amphista.bench.engines import make_engine, run_prompts, set_engine_env, use_engine_core
from vllm_amphista.bench.report import markdown_table
from vllm_amphista.cpu_dtype import choose_cpu_dtype
from vllm_amphista.prompts import load_questions

# Op-name fragments -> group, first match wins.
GROUPS = (
    ("GEMM", ("mm", "linear", "onednn", "dnnl", "gemm", "matmul")),
    ("attention and KV writes", ("attention", "attn", "sdpa", "kv_cache")),
    ("argmax / confidence", ("max", "logsumexp", "exp", "softmax", "cumprod")),
    ("norms", ("rms_norm", "norm")),
    ("rotary", ("rotary", "rope")),
    ("elementwise", ("mul", "add", "sub", "div", "silu", "pow", "mean", "rsqrt", "neg", "sigmoid", "gelu")),
    ("copies / indexing", ("copy", "cat", "index", "gather", "slice", "select", "view", "reshape", "to", "contiguous",
                           "empty", "zeros", "fill", "clone", "stack", "chunk", "split")),
)
WARMUP_CALLS = 4


def group_of(op_name: str) -> str:
    name = op_name.lower()
    return next((group for group, fragments in GROUPS if any(fragment in name for fragment in fragments)), "other")


def profile_drafter(args, batch: int, prompts: list[list[int]]) -> dict:
    """Engine subprocess body: {"calls": n, "ops": {op: [self seconds, count]}} over profiled calls."""
    import torch

    use_engine_core("in-process")
    llm = make_engine(args.target, "amphista", args.num_speculative_tokens, args.heads, args.dtype,
                      args.max_model_len, concurrency=batch, enforce_eager=args.engine == "eager",
                      draft_length="fixed", enable_prefix_caching=False)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    propose = runner.drafter.propose
    ops: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    calls = [0, 0]  # all calls, profiled calls

    @functools.wraps(propose)
    def profiled(*call_args, **call_kwargs):
        calls[0] += 1
        if calls[0] <= WARMUP_CALLS:
            return propose(*call_args, **call_kwargs)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            result = propose(*call_args, **call_kwargs)
        calls[1] += 1
        for event in profiler.key_averages():
            ops[event.key][0] += event.self_cpu_time_total / 1e6
            ops[event.key][1] += event.count
        return result

    runner.drafter.propose = profiled
    run_prompts(llm, prompts[:batch], args.max_tokens)
    return {"calls": calls[1], "ops": dict(ops)}


def _child(connection, args, batch, prompts) -> None:
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    connection.send(profile_drafter(args, batch, prompts))


def main(argv: list[str] | None = None) -> None:
    import multiprocessing

    parser = argparse.ArgumentParser(prog="python -m vllm_amphista.bench.drafter_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEMO_TARGET)
    parser.add_argument("--heads", default=SHIPPED_HEADS)
    parser.add_argument("--questions", nargs="+", default=[SPEC_BENCH_QUESTIONS], metavar="JSONL")
    parser.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=positive_int, default=48)
    parser.add_argument("-k", "--num-speculative-tokens", type=positive_int, default=4)
    parser.add_argument("--dtype", default=None, help="default: what this CPU computes fastest (cpu_dtype.py)")
    parser.add_argument("--engine", choices=("eager", "compiled"), default="eager")
    parser.add_argument("--max-model-len", type=positive_int, default=2048)
    parser.add_argument("--top", type=positive_int, default=12, help="ops listed per batch size")
    args = parser.parse_args(argv)
    set_engine_env(kv_cache_gib=1)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args.dtype = args.dtype or choose_cpu_dtype().dtype

    from transformers import AutoTokenizer

    questions, _ = load_questions(args.questions, AutoTokenizer.from_pretrained(args.target), None, 2,
                                  args.max_model_len - args.max_tokens)
    prompts = [question.prompt_ids for items in questions.values() for question in items]
    context = multiprocessing.get_context("spawn")
    print(f"Amphista drafter, self CPU ms per drafter call under torch.profiler ({args.dtype}, {args.engine}, "
          f"K={args.num_speculative_tokens} fixed, in-process engine core; {choose_cpu_dtype().describe()})\n")
    for batch in args.batch:
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=_child, args=(sender, args, batch, prompts))
        process.start()
        profile = receiver.recv()
        process.join()
        calls = max(profile["calls"], 1)
        per_call = {op: (seconds * 1000 / calls, count / calls) for op, (seconds, count) in profile["ops"].items()}
        total = sum(ms for ms, _ in per_call.values())
        groups: dict[str, float] = collections.defaultdict(float)
        for op, (ms, _) in per_call.items():
            groups[group_of(op)] += ms
        print(f"### batch {batch}: {total:.2f} ms per drafter call ({profile['calls']} calls profiled)\n")
        print(markdown_table(["group", "ms", "share"],
                             [[group, f"{ms:.3f}", f"{100 * ms / total:.0f}%"]
                              for group, ms in sorted(groups.items(), key=lambda item: -item[1])]))
        print()
        top = sorted(per_call.items(), key=lambda item: -item[1][0])[:args.top]
        print(markdown_table(["op", "ms", "calls per drafter call", "group"],
                             [[op, f"{ms:.3f}", f"{count:.1f}", group_of(op)] for op, (ms, count) in top]))
        print()


if __name__ == "__main__":
    main()
