"""Shared test helpers: a random tiny Llama target with an offline tokenizer,
self-distillation samples from it, and runners for short vLLM engines in a
subprocess.

The tiny Llama has vLLM-CPU-compatible shapes (attention head dim 32, the
smallest the CPU attention backend supports) and ties its embeddings like
SmolLM2, the real target. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

# Tests share two CPU cores with other jobs; with two intra-op threads,
# OpenMP spin-waiting under contention made tiny training steps ~20x slower.
torch.set_num_threads(1)

TINY_SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
TINY_VOCAB_SIZE = 320
TINY_WORDS = ["what", "is", "the", "answer", "to", "question", "?"]
TINY_WORDS += [f"w{i}" for i in range(TINY_VOCAB_SIZE - len(TINY_SPECIAL_TOKENS) - len(TINY_WORDS))]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Environment for an in-process vLLM engine on this CPU-only machine.
VLLM_CPU_TEST_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


def build_tiny_tokenizer():
    """A word-level PreTrainedTokenizerFast with a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(TINY_SPECIAL_TOKENS + TINY_WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=TINY_SPECIAL_TOKENS[4:],
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def build_tiny_llama(
    directory: str | os.PathLike, seed: int = 0, tie_word_embeddings: bool = True, hidden_size: int = 128
) -> Path:
    """Save a random tiny Llama (by default hidden 128, 2 layers, 4 heads of
    dim 32, 2 KV heads, vocab 320, every id a word of the tokenizer) and its
    tokenizer to `directory`, in float32."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB_SIZE,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    # A wider init than the default 0.02 gives peaked, input-dependent
    # next-token distributions, so greedy text is not one repeated token.
    config.initializer_range = 0.2
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, do_sample=False
    ).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_samples(
    target_dir: str | os.PathLike, num_samples: int, prompt_len: int = 6, output_len: int = 40, seed: int = 0
):
    """Self-distillation data from the tiny target: random word prompts and the
    target's greedy continuations, as {"prompt_ids", "output_ids"} dicts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    first_word_id = len(TINY_SPECIAL_TOKENS)
    prompts = torch.randint(
        first_word_id, first_word_id + len(TINY_WORDS), (num_samples, prompt_len), generator=generator
    )
    with torch.inference_mode():
        sequences = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=output_len,
            min_new_tokens=output_len, do_sample=False, pad_token_id=0,
        )
    return [
        {"prompt_ids": prompt.tolist(), "output_ids": sequence[prompt_len:].tolist()}
        for prompt, sequence in zip(prompts, sequences, strict=True)
    ]


def write_jsonl(path: str | os.PathLike, records) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A random tiny Llama target directory, built once per test session."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def run_engine(target_dir, requests, speculative_config=None, extra_env=None, timeout=600,
               max_model_len: int = 256, dtype: str = "float32", max_num_seqs: int = 16) -> dict:
    """Generate `requests` ([{"prompt_token_ids", "max_tokens", "stop_token_ids"?}]) greedily in a
    fresh in-process engine in a subprocess (vLLM keeps global state: one engine per process);
    returns {"token_ids": [...], "target_steps": [...], "spec": {metric: value}}, target_steps
    being each request's target forward steps (`measure.generate_counting_steps`)."""
    script = textwrap.dedent(
        f"""
        import json
        from vllm import LLM, SamplingParams
        from vllm_amphista.bench.engines import generate_counting_steps

        if __name__ == "__main__":
            requests = json.loads({json.dumps(requests)!r})
            llm = LLM(model={str(target_dir)!r}, dtype={dtype!r}, max_model_len={max_model_len},
                      enforce_eager=True, seed=0, disable_log_stats=False, max_num_seqs={max_num_seqs},
                      speculative_config={speculative_config!r})
            params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"],
                                     stop_token_ids=r.get("stop_token_ids")) for r in requests]
            token_ids, steps, _ = generate_counting_steps(llm, [r["prompt_token_ids"] for r in requests], params)
            spec = {{m.name: getattr(m, "value", None) for m in llm.get_metrics()
                     if m.name.startswith("vllm:spec_decode")}}
            print("REPORT=" + json.dumps({{"token_ids": token_ids, "target_steps": steps, "spec": spec}}))
        """
    )
    env = {**os.environ, **VLLM_CPU_TEST_ENV, **(extra_env or {})}
    completed = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env,
                               capture_output=True, text=True, timeout=timeout)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("REPORT=")]
    if completed.returncode != 0 or not lines:
        raise AssertionError(f"engine failed ({completed.returncode}):\n{completed.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("REPORT="))


# ---------------------------------------------------------------------------
# Reliability helpers: random heads, and engines running arbitrary test code in a subprocess.
# ---------------------------------------------------------------------------


def build_random_heads(target_dir: str | os.PathLike, directory: str | os.PathLike,
                       num_draft_heads: int = 4, seed: int = 1, **config_overrides) -> Path:
    """Save random-but-initialised Amphista heads for `target_dir` to `directory` (float32):
    the default init moved by N(0, 0.02) noise, so every part of the drafter matters."""
    from transformers import AutoConfig

    from vllm_amphista.configuration_amphista import AmphistaConfig
    from vllm_amphista.modeling_amphista import AmphistaDrafter

    config = AmphistaConfig.from_target_config(AutoConfig.from_pretrained(target_dir), num_draft_heads=num_draft_heads,
                                               **config_overrides)
    torch.manual_seed(seed)
    drafter = AmphistaDrafter(config)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    drafter.save_pretrained(directory, dtype=torch.float32)
    return Path(directory)


@pytest.fixture(scope="session")
def random_heads_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """Random 4-head Amphista heads for the tiny Llama, built once per test session."""
    return build_random_heads(tiny_llama_dir, tmp_path_factory.mktemp("random_heads"))


def run_python(script: str, extra_env: dict | None = None, timeout: float = 600,
               spawns_workers: bool = False) -> subprocess.CompletedProcess:
    """Run `script` in a fresh Python process from the repo root, with the CPU test environment.

    The process leads its own session (its id is the session id): on timeout the
    whole session is killed, engine processes included, and `session_processes`
    can tell whether it left any behind.
    """
    env = {**os.environ, **VLLM_CPU_TEST_ENV, **(extra_env or {})}
    # The script comes on stdin: with its data inlined it can exceed the argument size limit. A
    # spawned engine-core or worker process re-imports a main script from its file, which stdin has
    # not: short scripts for vLLM's multi-process engine or executor come as an argument.
    spawns = spawns_workers or env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1"
    command = [sys.executable, "-c", script] if spawns else [sys.executable, "-"]
    with subprocess.Popen(command, cwd=REPO_ROOT, env=env, text=True, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(None if spawns else script, timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(process.pid)
            process.communicate()
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def session_processes(session_id: int) -> list[int]:
    """Ids of the live (not zombie) processes in a session."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # Fields after the parenthesised command: state, ppid, pgrp, session, ...
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if int(fields[3]) == session_id and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def kill_session(session_id: int) -> None:
    """SIGKILL every process left in a session started with start_new_session=True."""
    import signal

    for pid in session_processes(session_id):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def report_of(completed: subprocess.CompletedProcess) -> dict:
    """The JSON a script printed as its last `REPORT=` line; fails with its stderr if it crashed."""
    lines = [line for line in completed.stdout.splitlines() if line.startswith("REPORT=")]
    if completed.returncode != 0 or not lines:
        raise AssertionError(f"script failed ({completed.returncode}):\n{completed.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("REPORT="))


# A `run_llm` prelude: vLLM-CPU's platform hook turns async scheduling off for every engine after
# vLLM has decided it ("not required on CPU"); this keeps vLLM's decision, so the async path the
# CUDA build takes by default (or asks for) runs on CPU.
KEEP_VLLMS_ASYNC_DECISION = """
from vllm.platforms.cpu import CpuPlatform

check_and_update_config = CpuPlatform.check_and_update_config.__func__

def keep_async_decision(cls, vllm_config):
    decided = vllm_config.scheduler_config.async_scheduling
    check_and_update_config(cls, vllm_config)
    vllm_config.scheduler_config.async_scheduling = decided

CpuPlatform.check_and_update_config = classmethod(keep_async_decision)
"""


# The start of a `run_llm` body: records, in `calls`, what each pass of the Amphista drafter's stages
# is fed ("stages": token ids, positions, target features, and the rows the heads draft from, None
# on passes that draft nothing) and each chain it drafts ("chain": [B, K] token ids), in order.
RECORD_AMPHISTA_PASSES = """
import torch
drafter = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.drafter
calls = []
run_stages, chain = drafter._run_stages, drafter.model.chain

def recorded_run_stages(num_tokens, cad, rows_to_draft=None):
    calls.append(("stages", drafter.input_ids[:num_tokens].clone(), drafter.positions[:num_tokens].clone(),
                  drafter.hidden_states[:num_tokens].clone(), None if rows_to_draft is None else rows_to_draft.clone()))
    return run_stages(num_tokens, cad, rows_to_draft)

def recorded_chain(heads_out, num_tokens):
    token_ids, confidence = chain(heads_out, num_tokens)
    calls.append(("chain", token_ids.clone()))
    return token_ids, confidence

drafter._run_stages, drafter.model.chain = recorded_run_stages, recorded_chain
"""


def drafted_rows(calls) -> list[tuple[tuple, int, list[int]]]:
    """`RECORD_AMPHISTA_PASSES`' calls of one request -> (its drafting pass, the row drafted from,
    the chain drafted) per drafting step. On CPU the drafted row is the pass's last; where vLLM's
    padded pass runs (CUDA), rows after it were rejected drafts."""
    drafted, stage_pass = [], None
    for call in calls:
        if call[0] == "stages":
            stage_pass = call
            continue
        (row,) = stage_pass[4].tolist()
        drafted.append((stage_pass, row, call[1][0].tolist()))
    return drafted


def run_llm(target_dir, body: str, speculative_config: dict | None = None, llm_kwargs: dict | None = None,
            args=None, extra_env: dict | None = None, timeout: float = 600, prelude: str = "") -> dict:
    """Run test code against a fresh in-process engine in a subprocess; return what it reported.

    `body` (Python source) runs after `llm = LLM(model=target_dir, dtype="float32",
    max_model_len=256, enforce_eager=True, seed=0, disable_log_stats=False,
    speculative_config=..., **llm_kwargs)`, with `llm`, `SamplingParams`, `json`,
    `args` (JSON round-tripped) and `metrics(prefix) -> {name: value}` in scope; it
    ends by calling `report(dict)`. `prelude` (Python source) runs before the engine
    is built, in the engine's process (the engine is in-process unless `extra_env`
    turns multiprocessing on).
    """
    llm_kwargs = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "seed": 0,
                  "disable_log_stats": False, **(llm_kwargs or {})}
    script = textwrap.dedent(
        """
        import json
        from vllm import LLM, SamplingParams

        def report(value):
            print("REPORT=" + json.dumps(value), flush=True)

        if __name__ == "__main__":
        {prelude}
            args = json.loads({args!r})
            llm = LLM(model={model!r}, speculative_config={speculative_config!r}, **{llm_kwargs!r})

            def metrics(prefix):
                return {{m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith(prefix)}}

        {body}
        """
    ).format(args=json.dumps(args), model=str(target_dir), speculative_config=speculative_config,
             llm_kwargs=llm_kwargs, body=textwrap.indent(textwrap.dedent(body), " " * 4),
             prelude=textwrap.indent(textwrap.dedent(prelude), " " * 4))
    spawns_workers = llm_kwargs.get("distributed_executor_backend") == "mp"
    return report_of(run_python(script, extra_env, timeout, spawns_workers))
