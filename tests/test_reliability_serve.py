"""`vllm serve` with Amphista heads under real OpenAI-client traffic.

The fast test is the README's literal command: the venv's `vllm serve <demo
target> --speculative-model <shipped heads>`, one completion through the
`openai` client, equal to plain decoding, server stopped with nothing left
running. The slow test sends 64 concurrent greedy
requests (mixed prompt lengths, max_tokens, stop strings, streamed, and
streams closed by the client after a few chunks), then checks that every
answer equals plain decoding, that the server is idle and still answers, that
its /metrics counted drafts, and that stopping it leaves nothing running.

Requests send token ids as the prompt and ask for `return_token_ids`, so
answers are compared token for token with a plain in-process engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from vllm_amphista.assets import DEMO_TARGET as DEMO_TARGET_PATH
from vllm_amphista.assets import SHIPPED_HEADS

from conftest import (
    REPO_ROOT, TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE, TINY_WORDS, VLLM_CPU_TEST_ENV, kill_session, run_engine,
    run_llm, session_processes,
)

MAX_MODEL_LEN = 256
DEMO_TARGET = REPO_ROOT / DEMO_TARGET_PATH
STARTUP_TIMEOUT_S = 480
TRAFFIC_TIMEOUT_S = 480


@dataclass
class Server:
    base_url: str
    pid: int
    log_path: Path
    leftover_processes: list[int] = field(default_factory=list)

    def client(self) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_server(target_dir: Path, heads_dir: Path, log_path: Path):
    """`vllm serve` in its own session; on exit it is stopped (SIGTERM, then SIGKILL)
    and whatever it left running is recorded in `leftover_processes`, then killed."""
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "vllm"), "serve", str(target_dir),
        "--speculative-model", str(heads_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
    ]
    env = {**os.environ, **VLLM_CPU_TEST_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", process.pid, log_path)
    try:
        wait_until_healthy(server, process)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        deadline = time.monotonic() + 20  # the engine process exits after its parent
        while session_processes(server.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        server.leftover_processes = session_processes(server.pid)
        kill_session(server.pid)


def wait_until_healthy(server: Server, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
                return
        time.sleep(2)
    raise AssertionError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")


def prometheus_total(metrics_text: str, name: str) -> float:
    """Sum of every sample of metric `name` (all label sets) in Prometheus text format."""
    total = 0.0
    for line in metrics_text.splitlines():
        sample_name = line.split("{", 1)[0].split(" ", 1)[0]
        if sample_name == name:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def http_get(server: Server, path: str) -> str:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        return (await http.get(path)).text


async def complete(client: AsyncOpenAI, model: str, request: dict) -> dict:
    """Send one completion; returns {"token_ids", "text", "finish_reason", "chunks"}, streamed or not.
    A request with `close_after_chunks` stops reading and closes its stream after that many chunks."""
    options = dict(model=model, prompt=request["prompt_token_ids"], max_tokens=request["max_tokens"],
                   temperature=request["temperature"], stop=request.get("stop"),
                   extra_body={"return_token_ids": True})
    if not request.get("stream"):
        choice = (await client.completions.create(**options)).choices[0]
        return {"token_ids": choice.token_ids, "text": choice.text, "finish_reason": choice.finish_reason, "chunks": 1}
    answer = {"token_ids": [], "text": "", "finish_reason": None, "chunks": 0}
    stream = await client.completions.create(**options, stream=True)
    try:
        async for chunk in stream:
            choice = chunk.choices[0]
            answer["token_ids"] += choice.token_ids or []
            answer["text"] += choice.text
            answer["finish_reason"] = choice.finish_reason or answer["finish_reason"]
            answer["chunks"] += 1
            if answer["chunks"] == request.get("close_after_chunks"):
                break
    finally:
        await stream.close()
    return answer


def greedy_reference(target_dir: Path, requests: list[dict]) -> list[dict]:
    """Plain (no speculation) greedy answers for `requests`, with their stop strings."""
    return run_llm(target_dir, """
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], stop=r.get("stop"))
                  for r in args]
        outputs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in args], params)
        report([{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                 "finish_reason": o.outputs[0].finish_reason} for o in outputs])
    """, args=requests)


def test_readme_command_serves_the_shipped_heads(tmp_path):
    from transformers import AutoTokenizer

    from vllm_amphista.prompts import chat_prompt_ids

    if not (DEMO_TARGET / "model.safetensors").is_file():
        pytest.fail(f"demo target missing at {DEMO_TARGET}: run `make target`")
    prompt_ids = chat_prompt_ids(AutoTokenizer.from_pretrained(DEMO_TARGET), "What is the capital of France?")

    async def one_completion(server: Server):
        async with server.client() as client:
            response = await client.completions.create(model=str(DEMO_TARGET), prompt=prompt_ids, max_tokens=24,
                                                       temperature=0, extra_body={"return_token_ids": True})
        return response.choices[0]

    with running_server(DEMO_TARGET, Path(SHIPPED_HEADS), tmp_path / "server.log") as server:
        choice = asyncio.run(asyncio.wait_for(one_completion(server), 300))
        metrics = asyncio.run(http_get(server, "/metrics"))
    assert server.leftover_processes == []
    assert prometheus_total(metrics, "vllm:spec_decode_num_drafts_total") > 0

    plain = run_engine(DEMO_TARGET, [{"prompt_token_ids": prompt_ids, "max_tokens": 24}], max_model_len=MAX_MODEL_LEN)
    assert choice.token_ids == plain["token_ids"][0]
    assert "Paris" in choice.text


def concurrent_request_mix(seed: int = 0, count: int = 64) -> list[dict]:
    """`count` greedy requests cycling through plain, streamed, with stop strings, streamed
    with stop strings, and streams the client closes after 3 chunks; prompts of 1-150
    tokens, half repetitive (so drafts get accepted), max_tokens from 1 to 64.

    All greedy, so every answer can be compared with plain decoding; mixed greedy and
    sampled batches are test_reliability_edges.py's."""
    rng = random.Random(seed)
    first_word = len(TINY_SPECIAL_TOKENS)
    kinds = ["plain", "streamed", "with_stop", "closed_early",
             "streamed_with_stop", "plain", "streamed", "closed_early"]
    requests = []
    for index in range(count):
        if index % 2:
            phrase = [rng.randrange(first_word, TINY_VOCAB_SIZE) for _ in range(rng.randint(2, 6))]
            prompt = (phrase * 40)[: rng.randint(4, 150)]
        else:
            prompt = [rng.randrange(first_word, TINY_VOCAB_SIZE) for _ in range(rng.randint(1, 150))]
        kind = kinds[index % len(kinds)]
        request = {"kind": kind, "prompt_token_ids": prompt, "temperature": 0.0,
                   "max_tokens": 64 if kind == "closed_early" else rng.choice([1, 5, 16, 40, 64]),
                   "stream": kind in ("streamed", "streamed_with_stop", "closed_early")}
        if kind.endswith("with_stop"):
            request["stop"] = rng.sample(TINY_WORDS, 4)  # the API takes at most 4
        if kind == "closed_early":
            request["close_after_chunks"] = 3
        requests.append(request)
    return requests


@pytest.mark.slow
def test_64_concurrent_requests(tiny_llama_dir, random_heads_dir, tmp_path):
    requests = concurrent_request_mix()
    reference = greedy_reference(tiny_llama_dir, requests)
    assert any(expected["finish_reason"] == "stop" and request.get("stop")
               for request, expected in zip(requests, reference)), "no stop string fired: the mix misses stop strings"

    async def traffic(server: Server):
        async with server.client() as client:
            answers = await asyncio.gather(*(complete(client, str(tiny_llama_dir), r) for r in requests))
            for _ in range(60):  # closed streams must be aborted server-side, not left running
                if prometheus_total(await http_get(server, "/metrics"), "vllm:num_requests_running") == 0:
                    break
                await asyncio.sleep(1)
            final_answer = await complete(client, str(tiny_llama_dir), requests[0])
        return answers, final_answer, await http_get(server, "/metrics")

    started = time.monotonic()
    with running_server(tiny_llama_dir, random_heads_dir, tmp_path / "server.log") as server:
        answers, final_answer, metrics_text = asyncio.run(asyncio.wait_for(traffic(server), TRAFFIC_TIMEOUT_S))
    elapsed = time.monotonic() - started
    assert server.leftover_processes == []

    closed_while_running = 0
    for index, (request, answer, expected) in enumerate(zip(requests, answers, reference)):
        where = f"request {index} ({request['kind']}, {len(request['prompt_token_ids'])} prompt tokens)"
        if request["kind"] == "closed_early" and answer["finish_reason"] is None:
            closed_while_running += 1
            assert answer["chunks"] == 3, where
            assert answer["token_ids"] == expected["token_ids"][: len(answer["token_ids"])], \
                f"{where}: not a prefix of plain decoding"
        else:
            assert answer["token_ids"] == expected["token_ids"], f"{where}: differs from plain decoding"
            assert answer["text"] == expected["text"], where
            assert answer["finish_reason"] == expected["finish_reason"], where
    assert closed_while_running > 0
    assert final_answer["token_ids"] == reference[0]["token_ids"]

    assert prometheus_total(metrics_text, "vllm:num_requests_running") == 0
    assert prometheus_total(metrics_text, "vllm:num_requests_waiting") == 0
    drafts = prometheus_total(metrics_text, "vllm:spec_decode_num_drafts_total")
    accepted = prometheus_total(metrics_text, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0
    print(f"64 concurrent requests ({closed_while_running} closed while running) + 1 final: {elapsed:.0f}s "
          f"including start-up; drafts={drafts:.0f}, accepted tokens={accepted:.0f}")
