"""The serving benchmark: each method behind `vllm serve`, driven by `vllm bench serve`.

    python -m vllm_amphista.bench.serve --num-prompts 32 --concurrency 1 4

For every method the server runs as users run it (multi-process engine,
vLLM's default compiled mode, OpenAI API on 127.0.0.1); `vllm bench serve`
sends Spec-Bench's first turns through the chat endpoint (the target's chat
template) at each concurrency, greedy, and reports throughput, time to first
token, time per output token and vLLM's acceptance length (1 + accepted /
drafts, over steps that had a draft). One table, speedups against plain
decoding measured in the same invocation.

What recording served traffic costs: `--record-traffic DIR` adds, after each of the plugin's
methods, the same server with `record_traffic` on (a fresh directory under DIR per run), and
`--repeats N` runs the whole list N times in turn (interleaved; every other repeat in reverse
order, so a drift of the machine over the run does not favour the rows listed first) and reports
each row's medians:

    python -m vllm_amphista.bench.serve --methods amphista --record-traffic .cache/record-bench \
        --repeats 3 --concurrency 1 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_amphista.assets import DEMO_TARGET, SHIPPED_HEADS, SPEC_BENCH_QUESTIONS
from vllm_amphista.bench.engines import alternating_order, speculative_config
from vllm_amphista.cpu_dtype import choose_cpu_dtype
from vllm_amphista.vllm.config import PLUGIN_METHODS

METHODS = ("vanilla", "ngram", "anpd", "amphista", "amphista_anpd")
RECORDING = "+recording"  # a row's suffix: the method's server with record_traffic on
# The client's figures a row reports (medians over repeats).
FIGURES = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "spec_decode_acceptance_length", "failed")


def vllm_command() -> str:
    """The `vllm` script beside this interpreter (on the CPU build, the plugin's working copy)."""
    script = Path(sys.executable).with_name("vllm")
    if script.exists():
        return str(script)
    found = shutil.which("vllm-amphista") or shutil.which("vllm")
    if found is None:
        raise SystemExit("no `vllm` or `vllm-amphista` command found")
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(port: int, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s")


def serve_and_bench(args, row: str, repeat: int, out: Path) -> dict[int, dict]:
    """Start one server for a row (a method, or a method recording into a fresh directory under
    --record-traffic) for its `repeat`-th run, run the client at every concurrency; results by
    concurrency."""
    method = row.removesuffix(RECORDING)
    run_name = f"{method}{'_recording' if row.endswith(RECORDING) else ''}_r{repeat}"
    port = free_port()
    command = [vllm_command(), "serve", args.target, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(max(args.concurrency)), "--no-enable-prefix-caching"]
    heads_dir = args.heads if method.startswith("amphista") else None
    config = speculative_config(method, args.num_speculative_tokens, heads_dir)
    if row.endswith(RECORDING):
        record_dir = Path(args.record_traffic) / run_name
        shutil.rmtree(record_dir, ignore_errors=True)  # every run records from empty
        config["record_traffic"] = str(record_dir)
    if config is not None:
        command += ["--speculative-config", json.dumps(config)]
    log = open(out / f"server_{run_name}.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    results = {}
    try:
        wait_healthy(port, server, args.startup_timeout)
        for concurrency in args.concurrency:
            name = f"{run_name}_c{concurrency}.json"
            client = [vllm_command(), "bench", "serve", "--backend", "openai-chat",
                      "--endpoint", "/v1/chat/completions",
                      "--host", "127.0.0.1", "--port", str(port), "--model", args.target,
                      "--dataset-name", "spec_bench", "--dataset-path", args.questions,
                      "--spec-bench-output-len", str(args.max_tokens), "--num-prompts", str(args.num_prompts),
                      "--max-concurrency", str(concurrency), "--temperature", "0", "--seed", "0",
                      "--num-warmups", "1", "--save-result", "--result-dir", str(out), "--result-filename", name]
            subprocess.run(client, check=True, stdout=sys.stderr)
            results[concurrency] = json.loads((out / name).read_text())
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    return results


def median_figures(runs: list[dict]) -> dict:
    """Each figure's median over the repeats of one row at one concurrency (None if a run lacks it)."""
    figures = {}
    for figure in FIGURES:
        values = [run.get(figure) for run in runs]
        figures[figure] = statistics.median(values) if values and None not in values else None
    return figures


def table(results: dict[str, list[dict[int, dict]]], concurrency: int) -> str:
    lines = [f"### concurrency {concurrency}", "",
             "| method | output tok/s | speedup | vs no recording | median TTFT ms | median TPOT ms "
             "| acceptance length | failed |",
             "|---|---|---|---|---|---|---|---|"]
    figures = {row: median_figures([run[concurrency] for run in runs if concurrency in run])
               for row, runs in results.items()}
    plain = figures.get("vanilla", {}).get("output_throughput")
    for row, row_figures in figures.items():
        throughput = row_figures["output_throughput"]
        if throughput is None:
            continue
        speedup = f"{throughput / plain:.2f}x" if plain else "-"
        unrecorded = figures.get(row.removesuffix(RECORDING), {}).get("output_throughput")
        versus = f"{throughput / unrecorded:.3f}x" if row.endswith(RECORDING) and unrecorded else "-"
        acceptance = row_figures["spec_decode_acceptance_length"]
        lines.append(f"| {row} | {throughput:.1f} | {speedup} | {versus} | {row_figures['median_ttft_ms']:.0f} | "
                     f"{row_figures['median_tpot_ms']:.1f} | {f'{acceptance:.2f}' if acceptance else '-'} | "
                     f"{row_figures['failed']:g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_amphista.bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEMO_TARGET)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--heads", default=SHIPPED_HEADS, help="Amphista heads dir (default: the shipped heads)")
    parser.add_argument("--questions", default=SPEC_BENCH_QUESTIONS, help="Spec-Bench question file")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--dtype", default=None, help="default: what this CPU computes fastest (cpu_dtype.py)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--out", default=None, help="dir for the raw results and server logs (default: a temp dir)")
    parser.add_argument("--record-traffic", default=None, metavar="DIR",
                        help="also run each plugin method with record_traffic on, recording under DIR")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the list this many times in turn, every other time reversed; medians")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    rows = list(args.methods)
    if args.record_traffic:
        rows = [variant for method in args.methods
                for variant in ((method, method + RECORDING) if method in PLUGIN_METHODS else (method,))]
    dtype_choice = choose_cpu_dtype()
    args.dtype = args.dtype or dtype_choice.dtype
    out = Path(args.out or tempfile.mkdtemp(prefix="serve_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    results: dict[str, list[dict[int, dict]]] = {row: [] for row in rows}
    for repeat, row in alternating_order(range(args.repeats), rows):
        results[row].append(serve_and_bench(args, row, repeat, out))
    report = "\n\n".join([
        "## Serving benchmark",
        f"`vllm serve {args.target}` per method (compiled, multi-process, {args.dtype}, K={args.num_speculative_tokens}"
        f" -- adaptive for the plugin's methods), `vllm bench serve` with {args.num_prompts} Spec-Bench first turns "
        f"(chat endpoint, greedy, {args.max_tokens} tokens); {os.cpu_count()} CPUs ({dtype_choice.describe()}), "
        f"started {started}; medians of {args.repeats} interleaved run(s) per row "
        "(every other repeat in reverse order).",
        *[table(results, concurrency) for concurrency in args.concurrency],
    ])
    print(report)
    (out / "results.md").write_text(report + "\n")
    print(f"\nraw results and server logs in {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
