"""What an engine of ours does at start-up, before the first request: the load-aware draft
length's step-cost table is timed, and a 16-bit dtype the CPU emulates draws one warning.

The CPU without bf16 units is imitated by handing the plugin's dtype chooser an AVX2-only flag
list (`VLLM_AMPHISTA_CPU_FLAGS`), never by capping oneDNN under a live bf16 engine: on an AMX CPU
vLLM-CPU packs weights for AMX and a capped oneDNN aborts the engine. vLLM itself runs on the real
CPU whatever the override says, so the test holds on every CPU kind."""

import textwrap

from conftest import report_of, run_python

from vllm_amphista.cpu_dtype import FLAGS_OVERRIDE

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
            expected = controller.calibration_sizes(scheduler.max_num_running_reqs,
                                                    scheduler.max_num_scheduled_tokens)
            llm.generate([{{"prompt_token_ids": [7, 8, 9, 7, 8, 9, 7, 8]}}], SamplingParams(max_tokens=8))
            print("REPORT=" + json.dumps({{"before": before, "expected": expected}}))
    """)
    completed = run_python(script, extra_env={FLAGS_OVERRIDE: "sse4_2 avx avx2 fma"})
    report = report_of(completed)
    sizes = sorted(int(size) for size in report["before"])
    assert sizes == report["expected"] == [1, 2, 3, 4, 6, 8, 12, 16]
    assert all(seconds > 0 for seconds in report["before"].values())
    logs = completed.stdout + completed.stderr  # vLLM's logger writes to stdout
    assert logs.count(WARNING_START) == 1, logs[-3000:]
