"""`python -m vllm_amphista.bench --quick` end to end on the random tiny Llama:
every method and category gets a row, float32 speculation is lossless, the
plots are PNGs, a method without weights is reported as skipped, and two
rounds of engine processes give two repeats; the runs interleave category by category."""

import json
import os
import subprocess
import sys

from conftest import REPO_ROOT, VLLM_CPU_TEST_ENV, write_jsonl

CATEGORIES = ("writing", "coding")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def spec_bench_questions(path):
    """Spec-Bench-format questions in the tiny tokenizer's words; repeated phrases give ANPD matches."""
    records = []
    for index in range(4):
        phrase = " ".join(f"w{(7 * index + step) % 280}" for step in range(4))
        records.append({"question_id": index, "category": CATEGORIES[index % 2],
                        "turns": [f"what is the answer to question ? {phrase} {phrase} {phrase}", "unused"]})
    return write_jsonl(path, records)


def test_quick_bench(tiny_llama_dir, random_heads_dir, tmp_path):
    heads = random_heads_dir
    out = tmp_path / "bench_out"
    command = [
        sys.executable, "-m", "vllm_amphista.bench", "--quick", "--target", str(tiny_llama_dir),
        "--methods", "vanilla,amphista,medusa,dflash", "--heads", str(heads),
        "--medusa-heads", str(tmp_path / "no-medusa-heads"), "--dtype", "float32", "--max-model-len", "256",
        "--questions", str(spec_bench_questions(tmp_path / "questions.jsonl")), "--out", str(out),
        "--engine", "eager",  # compiling each method's engine doubles the test's time (191 s against 98 s)
        "--draft-length", "adaptive", "off", "--rounds", "2",
    ]
    completed = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, **VLLM_CPU_TEST_ENV},
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]

    results = json.loads((out / "results.json").read_text())
    runs = {run["label"]: run for run in results["runs"]}
    assert runs["medusa"]["status"] == "skipped" and "no-medusa-heads" in runs["medusa"]["reason"]
    assert "medusa | skipped:" in completed.stdout
    assert runs["dflash"]["status"] == "skipped" and "--dflash-drafter" in runs["dflash"]["reason"]
    for label in ("vanilla", "amphista"):
        assert runs[label]["status"] == "ok"
        figures = runs[label]["figures"]
        assert set(figures) == {"all", *CATEGORIES}
        for category, figure in figures.items():
            assert figure["tau"] >= 1, (label, category)
            assert figure["differing_prompts"] == 0, (label, category)  # float32: lossless
    assert all(figure["tau"] == 1 for figure in runs["vanilla"]["figures"].values())
    for label in ("vanilla", "amphista"):  # each request's finish, within its generate call
        assert len(runs[label]["repeats"]) == 2  # --quick's one repeat in each of two engine processes
        for repeat in runs[label]["repeats"]:
            for result in repeat.values():
                assert len(result["request_seconds"]) == len(result["output_lengths"])
                assert 0 < min(result["request_seconds"]) <= max(result["request_seconds"]) <= result["seconds"]
    assert runs["vanilla"]["figures"]["all"]["latency_speedup"] == 1.0
    assert runs["amphista"]["figures"]["all"]["latency_speedup"] > 0
    assert runs["amphista"]["figures"]["all"]["vllm_mean_acceptance_length"] is not None  # it drafted
    # Drafting off: speculation configured, nothing drafted, the same tokens.
    assert runs["amphista[K=0]"]["status"] == "ok"
    for category, figure in runs["amphista[K=0]"]["figures"].items():
        assert figure["tau"] == 1 and figure["differing_prompts"] == 0, category
    for plot in ("acceptance_by_position.png", "speedup_by_category.png"):
        assert (out / plot).read_bytes().startswith(PNG_SIGNATURE)
    assert (out / "results.md").read_text().strip() in completed.stdout


def test_step_breakdown_with_drafting_forced_off(tiny_llama_dir, random_heads_dir, tmp_path):
    """`bench.steps --draft-length off`: speculation configured, K=0 at every step (tau exactly 1),
    and the drafter's weight-read floor printed for Amphista, with no ratio to it; requests batched
    two at a time, each row's runs taken from two engine processes."""
    command = [
        sys.executable, "-m", "vllm_amphista.bench.steps", "--target", str(tiny_llama_dir),
        "--heads", str(random_heads_dir), "--methods", "vanilla,anpd,amphista", "--engines", "eager",
        "--draft-length", "off", "--repeats", "1", "--rounds", "2", "--max-tokens", "8", "--dtype", "float32",
        "--concurrency", "2",
        "--max-model-len", "256", "--categories", ",".join(CATEGORIES),
        "--questions", str(spec_bench_questions(tmp_path / "questions.jsonl")),
    ]
    completed = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, **VLLM_CPU_TEST_ENV},
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    lines = completed.stdout.splitlines()
    header = [cell.strip() for cell in next(line for line in lines if line.startswith("| method"))[1:-1].split("|")]
    table = [[cell.strip() for cell in line[1:-1].split("|")] for line in lines
             if line.startswith("| ") and "eager" in line]
    rows = {cells[0]: dict(zip(header, cells)) for cells in table}
    assert set(rows) == {"vanilla", "anpd", "amphista"}
    for row in rows.values():
        assert row["tau"] == "1.00"  # nothing was ever drafted
        assert row["scheduling"] == "sync"  # vLLM-CPU schedules every engine synchronously
        # One at a time, the prompts would take 7 decode steps each (the first token comes from the prefill).
        assert int(row["steps"]) < 7 * len(CATEGORIES)
        assert float(row["decode s"]) > 0 and row["speedup"].endswith("x")
    assert rows["vanilla"]["speedup"] == "1.00x"
    assert "concurrency 2," in completed.stdout
    assert "median of 1 runs in each of 2 engine processes a row" in completed.stdout
    assert completed.stderr.count("round 2/2: building") == 3
    assert rows["amphista"]["drafter floor"] != "-"
    assert rows["amphista"]["drafter / floor"] == "-"  # per drafting step: there was none
    assert rows["anpd"]["drafter floor"] == "-"
    assert "drafter floor: weights read per drafting step against the target's (amphista " in completed.stdout


def test_drafter_floor_counts_the_weights_each_drafting_step_reads(tmp_path):
    """A drafter without an lm_head reads the target's too, and EAGLE reads its weights once per
    chained pass; a drafter with its own lm_head reads only its dir, once."""
    import argparse

    import torch
    from safetensors.torch import save_file

    from vllm_amphista.bench.steps import drafter_weights_per_step

    def model_dir(name, tensors, config=None):
        directory = tmp_path / name
        directory.mkdir()
        save_file(tensors, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(config or {}))
        return str(directory)

    target = model_dir("target", {"embed_tokens.weight": torch.zeros(10, 4), "layer.weight": torch.zeros(4, 4)},
                       {"vocab_size": 10, "hidden_size": 4})
    shares_lm_head = model_dir("eagle", {"layer.weight": torch.zeros(4, 4)})
    own_lm_head = model_dir("amphista", {"layer.weight": torch.zeros(4, 4), "lm_head.weight": torch.zeros(5, 4),
                                         "draft_to_target": torch.zeros(5, dtype=torch.int64)})
    args = argparse.Namespace(target=target, heads=own_lm_head, eagle_heads=shares_lm_head, medusa_heads=shares_lm_head,
                              dflash_drafter=None, num_speculative_tokens=3)
    assert drafter_weights_per_step(args, "amphista") == 16 + 20
    assert drafter_weights_per_step(args, "medusa") == 16 + 40
    assert drafter_weights_per_step(args, "eagle") == 3 * (16 + 40)


def test_drafter_profile_groups_the_drafters_ops(tiny_llama_dir, random_heads_dir, tmp_path):
    command = [
        sys.executable, "-m", "vllm_amphista.bench.drafter_profile", "--target", str(tiny_llama_dir),
        "--heads", str(random_heads_dir), "--batch", "2", "--max-tokens", "12", "--dtype", "float32",
        "--max-model-len", "256", "--questions", str(spec_bench_questions(tmp_path / "questions.jsonl")),
    ]
    completed = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, **VLLM_CPU_TEST_ENV},
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    assert "### batch 2:" in completed.stdout and "calls profiled" in completed.stdout
    groups = {line.split("|")[1].strip() for line in completed.stdout.splitlines() if line.startswith("| ")}
    assert {"GEMM", "attention and KV writes"} <= groups  # the stage layers ran under the profiler


def test_serve_table_reports_medians_and_the_cost_of_recording():
    from vllm_amphista.bench.serve import table

    def run(throughput, acceptance=None):
        return {1: {"output_throughput": throughput, "median_ttft_ms": 10.0, "median_tpot_ms": 5.0,
                    "spec_decode_acceptance_length": acceptance, "failed": 0}}

    results = {"vanilla": [run(100.0), run(90.0), run(110.0)],
               "amphista": [run(150.0, 1.5), run(160.0, 1.5), run(140.0, 1.5)],
               "amphista+recording": [run(147.0, 1.5), run(100.0, 1.5), run(160.0, 1.5)]}
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in table(results, 1).splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["vanilla"][:3] == ["100.0", "1.00x", "-"]
    assert rows["amphista"][:3] == ["150.0", "1.50x", "-"]
    assert rows["amphista+recording"][:3] == ["147.0", "1.47x", "0.980x"]
    assert rows["amphista+recording"][5] == "1.50"


def test_serve_repeats_alternate_the_order_of_the_rows():
    from vllm_amphista.bench.engines import alternating_order

    order = alternating_order(range(3), ["amphista", "amphista+recording"])
    assert order == [(0, "amphista"), (0, "amphista+recording"), (1, "amphista+recording"), (1, "amphista"),
                     (2, "amphista"), (2, "amphista+recording")]


def test_bench_runs_interleave_category_by_category():
    from vllm_amphista.bench.engines import alternating_order

    assert alternating_order(["writing", "coding", "math"], ["vanilla", "anpd"]) == [
        ("writing", "vanilla"), ("writing", "anpd"), ("coding", "anpd"), ("coding", "vanilla"),
        ("math", "vanilla"), ("math", "anpd")]
