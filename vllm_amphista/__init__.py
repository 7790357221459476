"""Amphista and ANPD speculative decoding for vLLM, loaded as a vLLM plugin.

vLLM calls `register()` in every process it starts (entry point group
`vllm.general_plugins`), so `pip install` is all a user does.
"""

DRAFTER_ARCHITECTURE = "AmphistaDrafter"


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from vllm_amphista.configuration_amphista import AmphistaConfig
    from vllm_amphista.vllm import patches

    patches.apply()
    AutoConfig.register(AmphistaConfig.model_type, AmphistaConfig, exist_ok=True)
    if DRAFTER_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(
            DRAFTER_ARCHITECTURE, "vllm_amphista.vllm.amphista:AmphistaDrafterForVLLM"
        )
