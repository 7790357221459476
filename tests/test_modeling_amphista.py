"""The Amphista drafter module: shapes, information flow, ablations, checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from vllm_amphista.checkpoint import WEIGHTS_NAME
from vllm_amphista.configuration_amphista import AmphistaConfig
from vllm_amphista.modeling_amphista import AmphistaDrafter, AutoEmbeddingBlock, draft_logits, greedy_tokens
from vllm_amphista.train.batch import causal_attention_mask

HIDDEN, VOCAB, HEADS = 128, 320, 4


def make_config(**overrides) -> AmphistaConfig:
    fields = dict(hidden_size=HIDDEN, vocab_size=VOCAB, num_draft_heads=HEADS, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=256, max_position_embeddings=256)
    fields.update(overrides)
    return AmphistaConfig(**fields)


def randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere: the near-identity init zeroes the residual
    branches, which would hide cross-head and cross-position information flow."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return module.eval()


def make_inputs(batch=2, seq_len=7, seed=1):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq_len, HIDDEN, generator=generator)
    next_ids = torch.randint(0, VOCAB, (batch, seq_len), generator=generator)
    embed = torch.randn(VOCAB, HIDDEN, generator=generator)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.1
    return hidden, next_ids, embed, lm_head


def test_shapes():
    drafter = AmphistaDrafter(make_config())
    hidden, next_ids, embed, lm_head = make_inputs()
    assert drafter(hidden, next_ids, torch.nn.Embedding.from_pretrained(embed), lm_head).shape == (2, 7, HEADS, VOCAB)
    features = drafter.head_hidden_states(hidden, next_ids, embed)
    assert features.shape == (2, 7, HEADS, HIDDEN)
    assert draft_logits(features.flatten(0, 1), lm_head).shape == (14, HEADS, VOCAB)
    block = drafter.auto_embedding
    assert isinstance(block, AutoEmbeddingBlock)
    assert block(torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)).shape == (5, HEADS, HIDDEN)


def test_untrained_drafter_starts_from_the_target_head():
    """Near-identity init: without the sampled token, every head's features
    are the normalised target hidden state, so heads agree with each other."""
    torch.manual_seed(0)
    drafter = AmphistaDrafter(make_config(use_sampled_token=False, use_encoder=False)).eval()
    hidden, _, _, lm_head = make_inputs()
    logits = drafter(hidden, None, None, lm_head)
    for head in range(1, HEADS):
        assert torch.allclose(logits[:, :, head], logits[:, :, 0], atol=0.5)
    assert torch.equal(logits.argmax(-1)[:, :, 0], (hidden @ lm_head.T).argmax(-1))


def test_heads_attend_to_each_other_and_nothing_else():
    block = randomized(AutoEmbeddingBlock(make_config()))
    heads = torch.randn(3, HEADS, HIDDEN)
    base = block.encoder(heads)
    for changed in range(HEADS):
        perturbed = heads.clone()
        perturbed[0, changed] += 1.0
        out = block.encoder(perturbed)
        for other in range(HEADS):
            assert not torch.allclose(out[0, other], base[0, other]), (changed, other)
        # Other sequence positions never see it.
        assert torch.equal(out[1:], base[1:])


def test_near_heads_see_stage2_only_through_the_encoder():
    near = make_config().num_near_heads
    stage1, stage2 = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    for use_encoder in (True, False):
        block = randomized(AutoEmbeddingBlock(make_config(use_encoder=use_encoder)))
        base, changed = block(stage1, stage2), block(stage1, stage2 + 1.0)
        assert torch.equal(base[:, :near], changed[:, :near]) is not use_encoder
        assert not torch.allclose(base[:, near:], changed[:, near:])


def test_stages_are_causal():
    drafter = randomized(AmphistaDrafter(make_config()))
    hidden, next_ids, embed, lm_head = make_inputs()
    base = drafter(hidden, next_ids, embed, lm_head)
    t = 3
    later_hidden, later_ids = hidden.clone(), next_ids.clone()
    later_hidden[:, t + 1:] += 1.0
    later_ids[:, t + 1:] = (later_ids[:, t + 1:] + 1) % VOCAB
    changed = drafter(later_hidden, later_ids, embed, lm_head)
    assert torch.allclose(changed[:, : t + 1], base[:, : t + 1], atol=1e-5)
    assert not torch.allclose(changed[:, t + 1:], base[:, t + 1:])
    earlier_hidden = hidden.clone()
    earlier_hidden[:, t] += 1.0
    assert not torch.allclose(drafter(earlier_hidden, next_ids, embed, lm_head)[:, t + 1:], base[:, t + 1:])


def test_packed_samples_match_separate_runs():
    """Two samples packed in one row (own positions, attention within each) give what each gives alone."""
    drafter = randomized(AmphistaDrafter(make_config()))
    hidden, next_ids, embed, lm_head = make_inputs(batch=2)
    first, second = 4, 7
    packed_hidden = torch.cat([hidden[:1, :first], hidden[1:, :second]], dim=1)
    packed_ids = torch.cat([next_ids[:1, :first], next_ids[1:, :second]], dim=1)
    segments = torch.tensor([[1] * first + [2] * second])
    positions = torch.cat([torch.arange(first), torch.arange(second)])[None]
    packed = drafter(packed_hidden, packed_ids, embed, lm_head, position_ids=positions,
                     attention_mask=causal_attention_mask(segments))
    assert torch.allclose(packed[:, :first], drafter(hidden[:1, :first], next_ids[:1, :first], embed, lm_head),
                          atol=1e-5)
    assert torch.allclose(packed[:, first:], drafter(hidden[1:, :second], next_ids[1:, :second], embed, lm_head),
                          atol=1e-5)


def test_kernel_path_matches_training_path():
    """Inference (no grad) and training (the differentiable reference) compute the same thing; on
    CUDA inference calls amphista_kernels' Triton kernel (tested on a GPU by the kernel's tests)."""
    drafter = randomized(AmphistaDrafter(make_config()))
    hidden, next_ids, embed, lm_head = make_inputs()
    with torch.no_grad():
        inference = drafter(hidden, next_ids, embed, lm_head)
    training = drafter(hidden, next_ids, embed, lm_head)
    assert training.requires_grad
    assert torch.allclose(inference, training.detach(), atol=1e-5)


def parameter_names(config: AmphistaConfig) -> set[str]:
    return set(AmphistaDrafter(config).checkpoint_state_dict())


def test_checkpoint_names():
    names = parameter_names(make_config())
    assert {"fuse.weight", "near_proj.weight", "far_proj.weight", "position_embedding", "final_norm.weight",
            "encoder.layers.0.attn.qkv_proj.weight", "encoder.layers.0.attn.o_proj.weight",
            "encoder.layers.0.norm1.weight", "encoder.layers.0.norm2.weight",
            "encoder.layers.0.mlp.up_proj.weight", "encoder.layers.0.mlp.down_proj.weight"} <= names
    for stage in (0, 1):
        prefix = f"stages.{stage}.layers.0."
        assert {prefix + suffix for suffix in (
            "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")} <= names
    # The shared lm_head belongs to the target: never saved.
    assert not any(name.startswith("lm_head") for name in names)
    assert not any(name.startswith("auto_embedding") for name in names)
    # The block's own state dict uses the checkpoint names as they are.
    block_names = set(AutoEmbeddingBlock(make_config()).state_dict())
    assert block_names <= names


def test_ablation_switches_change_structure():
    full = parameter_names(make_config())
    no_encoder = parameter_names(make_config(use_encoder=False))
    assert not any(name.startswith("encoder.") for name in no_encoder)
    assert no_encoder == {name for name in full if not name.startswith("encoder.")}
    no_stages = parameter_names(make_config(use_stages=False))
    assert no_stages == {name for name in full if not name.startswith("stages.")}

    no_token = AmphistaDrafter(make_config(use_sampled_token=False))
    assert no_token.fuse.weight.shape == (HIDDEN, HIDDEN)
    hidden, _, _, lm_head = make_inputs()
    assert no_token(hidden, None, None, lm_head).shape == (2, 7, HEADS, VOCAB)
    with pytest.raises(ValueError, match="next_token_ids and embed_tokens"):
        AmphistaDrafter(make_config())(hidden, None, None, lm_head)

    # Without stages, stage 1 and stage 2 are both the fused input.
    flat = randomized(AmphistaDrafter(make_config(use_stages=False, use_encoder=False)))
    hidden, next_ids, embed, lm_head = make_inputs()
    features = flat.head_hidden_states(hidden, next_ids, embed)
    fused = flat.fuse_inputs(hidden, next_ids, embed).reshape(-1, HIDDEN)
    assert torch.allclose(features.reshape(-1, HEADS, HIDDEN), flat.auto_embedding(fused, fused))


def test_own_lm_head_and_draft_vocabulary():
    hidden, next_ids, embed, lm_head = make_inputs()
    own = AmphistaDrafter(make_config(share_lm_head=False))
    own.init_from_target(lm_head)
    assert torch.equal(own.lm_head.weight, lm_head)
    assert "lm_head.weight" in own.checkpoint_state_dict()

    draft_ids = torch.tensor([5, 9, 2, 300, 17, 64, 1, 0])
    drafter = AmphistaDrafter(make_config(draft_vocab_size=len(draft_ids)))
    drafter.init_from_target(lm_head, draft_ids)
    assert torch.equal(drafter.lm_head.weight, lm_head[draft_ids])
    assert drafter.checkpoint_state_dict()["draft_to_target"].dtype == torch.int64
    logits = drafter(hidden, next_ids, embed, None)
    assert logits.shape == (2, 7, HEADS, len(draft_ids))
    assert set(drafter.draft_to_target[logits.argmax(-1)].unique().tolist()) <= set(draft_ids.tolist())
    with pytest.raises(ValueError, match="distinct"):
        drafter.init_from_target(lm_head, torch.tensor([1, 1, 2, 3, 4, 5, 6, 7]))
    with pytest.raises(ValueError, match="expects"):
        drafter.init_from_target(lm_head[:, :64], draft_ids)


@pytest.mark.parametrize("overrides", [{}, {"draft_vocab_size": 8, "use_stages": False},
                                       {"target_feature_layers": [1, 3]},
                                       {"draft_vocab_size": 8, "draft_token_mlp_size": 64},
                                       {"draft_vocab_size": 8, "draft_token_mlp_size": 64,
                                        "draft_token_mlp_reads": "first"}])
def test_save_load_round_trip(tmp_path, overrides):
    drafter = randomized(AmphistaDrafter(make_config(**overrides)))
    hidden, next_ids, embed, lm_head = make_inputs()
    if "draft_vocab_size" in overrides:
        drafter.init_from_target(lm_head, torch.arange(8) * 3)
    if "target_feature_layers" in overrides:
        hidden = torch.cat([hidden, 3 * hidden.flip(-1)], dim=-1)
    drafter.save_pretrained(tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "amphista" and config["architectures"] == ["AmphistaDrafter"]
    assert AmphistaConfig.from_pretrained(tmp_path).to_dict() == drafter.config.to_dict()
    loaded = AmphistaDrafter.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(hidden, next_ids, embed, lm_head), drafter(hidden, next_ids, embed, lm_head))


DRAFT_IDS = torch.tensor([5, 9, 2, 300, 17, 64, 1, 0, 33, 250, 101, 7])


def draft_token_drafter(seed: int = 0, reads: str = "previous") -> AmphistaDrafter:
    drafter = randomized(AmphistaDrafter(make_config(draft_vocab_size=len(DRAFT_IDS), draft_token_mlp_size=96,
                                                     draft_token_mlp_reads=reads)), seed)
    drafter.init_from_target(make_inputs()[3], DRAFT_IDS)
    return drafter


@pytest.mark.parametrize("reads", ["previous", "first"])
def test_heads_read_the_tokens_drafted_before_them(reads):
    """Head k's draft changes with the token head k-1 drafted (or head 0's, with reads="first"),
    head 0's does not; the chain `draft` returns is what the teacher-forced logits give once that
    chain is the text."""
    drafter = draft_token_drafter(reads=reads)
    hidden, next_ids, embed, _ = make_inputs(batch=1)
    next_ids = DRAFT_IDS[next_ids % len(DRAFT_IDS)]
    chain, log_probs = drafter.draft(hidden, next_ids, embed, None)
    assert chain.shape == log_probs.shape == (1, 7, HEADS)
    assert set(chain.unique().tolist()) <= set(DRAFT_IDS.tolist())
    last = chain[0, -1]
    # Append the chain's first K-1 tokens as the text after the last position (the stages are
    # causal, so the last position's stage outputs do not change): teacher forcing then feeds
    # each head the token the chain drafted before it.
    longer_hidden = torch.cat([hidden, torch.randn(1, HEADS - 1, HIDDEN)], dim=1)
    longer_ids = torch.cat([next_ids, last[None, :-1]], dim=1)
    with torch.no_grad():
        logits = drafter(longer_hidden, longer_ids, embed, None)[0, 6]
    assert torch.equal(drafter.draft_to_target[logits.argmax(dim=-1)], last)
    assert torch.allclose(torch.log_softmax(logits.float(), dim=-1).max(dim=-1).values, log_probs[0, -1], atol=1e-5)
    # Other drafted tokens before head k: head k's logits move, head 0's stay.
    other_ids = torch.cat([next_ids, (last[None, :-1] + 1) % VOCAB], dim=1)
    with torch.no_grad():
        other = drafter(longer_hidden, other_ids, embed, None)[0, 6]
    assert torch.equal(other[0], logits[0])
    assert not torch.allclose(other[1:], logits[1:])
    # Other tokens after head 0's: head 2 moves when it reads head 1's token, not when it reads head 0's.
    later_ids = torch.cat([next_ids, last[None, :1], (last[None, 1:-1] + 1) % VOCAB], dim=1)
    with torch.no_grad():
        later = drafter(longer_hidden, later_ids, embed, None)[0, 6]
    assert torch.equal(later[:2], logits[:2])
    assert torch.equal(later[2:], logits[2:]) == (reads == "first")


def test_adding_the_draft_token_mlp_keeps_what_the_heads_draft():
    """Its down projection starts at zero: trained heads given the MLP draft as before."""
    from vllm_amphista.train.amphista import AmphistaMethod

    plain = randomized(AmphistaDrafter(make_config(draft_vocab_size=len(DRAFT_IDS))))
    plain.init_from_target(make_inputs()[3], DRAFT_IDS)
    method = AmphistaMethod(plain)
    hidden, next_ids, embed, _ = make_inputs()
    with torch.no_grad():
        before = plain(hidden, next_ids, embed, None)
        method.add_draft_token_mlp(64)
        after = plain(hidden, next_ids, embed, None)
    assert plain.config.draft_token_mlp_size == 64 and plain.auto_embedding.draft_token_mlp is not None
    assert torch.equal(before, after)
    with pytest.raises(ValueError, match="already"):
        method.add_draft_token_mlp(64)


def test_deepening_keeps_what_the_heads_draft_and_the_new_layers_take_part(tmp_path):
    """New stage and encoder layers start as identities; saved, they load as a drafter of the new depth."""
    drafter = randomized(AmphistaDrafter(make_config(draft_vocab_size=len(DRAFT_IDS))))
    drafter.init_from_target(make_inputs()[3], DRAFT_IDS)
    hidden, next_ids, embed, _ = make_inputs()
    with torch.no_grad():
        before = drafter(hidden, next_ids, embed, None)
        drafter.deepen(stage_num_layers=2, encoder_num_layers=3)
        after = drafter(hidden, next_ids, embed, None)
    assert [len(stage.layers) for stage in drafter.stages] == [2, 2]
    assert len(drafter.auto_embedding.encoder.layers) == 3
    assert torch.equal(before, after)
    drafter.save_pretrained(tmp_path, dtype=torch.float32)
    loaded = AmphistaDrafter.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert (loaded.config.stage_num_layers, loaded.config.encoder_num_layers) == (2, 3)
    with torch.no_grad():
        assert torch.equal(loaded(hidden, next_ids, embed, None), after)
        new_layers = (drafter.stages[1].layers[1].self_attn.o_proj,
                      drafter.auto_embedding.encoder.layers[2].mlp.down_proj)
        for layer in new_layers:
            layer.weight.normal_(std=0.1)
            changed = drafter(hidden, next_ids, embed, None)
            assert not torch.allclose(changed, after)
            after = changed
    with pytest.raises(ValueError, match="only grow"):
        drafter.deepen(stage_num_layers=1, encoder_num_layers=3)
    no_encoder = AmphistaDrafter(make_config(use_encoder=False))
    with pytest.raises(ValueError, match="no Auto-embedding Block encoder"):
        no_encoder.deepen(stage_num_layers=1, encoder_num_layers=2)


def test_default_save_is_bfloat16(tmp_path):
    AmphistaDrafter(make_config(draft_vocab_size=8)).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / WEIGHTS_NAME)
    assert tensors["fuse.weight"].dtype == torch.bfloat16
    assert tensors["draft_to_target"].dtype == torch.int64
    assert AmphistaDrafter.from_pretrained(tmp_path).fuse.weight.dtype == torch.bfloat16


def test_truncated_or_incomplete_checkpoint_is_a_clear_error(tmp_path):
    AmphistaDrafter(make_config()).save_pretrained(tmp_path)
    weights = tmp_path / WEIGHTS_NAME
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        AmphistaDrafter.from_pretrained(tmp_path)

    weights.write_bytes(data)
    tensors = load_file(weights)
    del tensors["near_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match="missing.*near_proj.weight"):
        AmphistaDrafter.from_pretrained(tmp_path)

    weights.unlink()
    with pytest.raises(FileNotFoundError, match=WEIGHTS_NAME):
        AmphistaDrafter.from_pretrained(tmp_path)


@pytest.mark.parametrize("overrides, message", [
    ({"num_draft_heads": 0}, "num_draft_heads"),
    ({"num_near_heads": 5}, "num_near_heads"),
    ({"num_near_heads": -1}, "num_near_heads"),
    ({"draft_vocab_size": VOCAB + 1}, "draft_vocab_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"encoder_num_attention_heads": 8}, "encoder head dim"),
    ({"encoder_num_attention_heads": 3}, "divisible"),
    ({"hidden_act": "nope"}, "hidden_act"),
    ({"stage_num_layers": 0}, "stage_num_layers"),
    ({"target_feature_layers": []}, "target_feature_layers"),
    ({"target_feature_layers": [2, 2]}, "target_feature_layers"),
    ({"target_feature_layers": [0, 2]}, "target_feature_layers"),
    ({"target_feature_layers": [3, 1]}, "ascending"),
    ({"draft_token_mlp_size": -1}, "draft_token_mlp_size"),
    ({"draft_token_mlp_size": 64}, "need a draft vocabulary"),
    ({"draft_vocab_size": 8, "draft_token_mlp_size": 64, "draft_token_mlp_reads": "last"}, "draft_token_mlp_reads"),
])
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


def test_config_from_target():
    target = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5)
    config = AmphistaConfig.from_target_config(target, num_draft_heads=5)
    assert (config.hidden_size, config.vocab_size, config.head_dim) == (576, 49152, 64)
    assert (config.num_draft_heads, config.num_near_heads) == (5, 2)
    assert (config.rope_theta, config.rms_norm_eps, config.target_model_type) == (100000.0, 1e-5, "llama")
    assert (config.encoder_num_attention_heads, config.encoder_head_dim) == (9, 64)
    llama = config.to_llama_config()
    assert (llama.num_key_value_heads, llama.intermediate_size, llama.num_hidden_layers) == (3, 1536, 2)
    assert llama.rope_parameters["rope_theta"] == 100000.0
    assert config.target_feature_layers is None and config.feature_size == 576  # h_t alone
    layered = AmphistaConfig.from_target_config(target, target_feature_layers=[2, 15, 30])
    assert layered.feature_size == 3 * 576 and layered.eagle_aux_hidden_state_layer_ids == [2, 15, 30]
    with pytest.raises(ValueError, match="reach past the target's 30 layers"):
        AmphistaConfig.from_target_config(target, target_feature_layers=[2, 31])


def test_every_feature_layer_is_read_and_the_width_is_checked():
    drafter = randomized(AmphistaDrafter(make_config(target_feature_layers=[1, 2, 3])))
    hidden, next_ids, embed, lm_head = make_inputs()
    features = torch.cat([hidden, hidden.roll(1, dims=-1), hidden.roll(2, dims=-1)], dim=-1)
    with torch.no_grad():
        reference = drafter(features, next_ids, embed, lm_head)
        for layer in range(3):
            changed = features.clone()
            changed[..., layer * HIDDEN:(layer + 1) * HIDDEN] += 1.0
            assert not torch.allclose(drafter(changed, next_ids, embed, lm_head), reference)
        with pytest.raises(ValueError, match=r"width 128, this drafter reads 384 \(target_feature_layers=\[1, 2, 3\]\)"):
            drafter(hidden, next_ids, embed, lm_head)


def test_target_features_are_the_residual_streams_vllm_hands_drafters():
    """Layer i's features are the stream after i decoder layers; the last layer's is the final
    norm's input (transformers lists the norm's output there instead)."""
    from transformers import LlamaForCausalLM

    from vllm_amphista.modeling_amphista import target_features

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                          num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB)).eval()
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        outputs = target.model(ids, output_hidden_states=True)
        features = target_features(target, ids, [1, 3])
        assert torch.equal(target_features(target, ids, None), outputs.last_hidden_state)
        assert torch.equal(features[..., :64], outputs.hidden_states[1])
        assert torch.allclose(target.model.norm(features[..., 64:]), outputs.last_hidden_state, atol=1e-6)
        assert not torch.allclose(features[..., 64:], outputs.last_hidden_state)


@pytest.mark.parametrize("with_log_probs", [False, True])
def test_greedy_tokens_compiled_for_the_cpu_are_eager_max(with_log_probs):
    # In an Inductor graph on the CPU the argmax is two reductions; it must pick what `max` picks,
    # the first of tied maxima included, and the same log-probabilities.
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 8192).to(torch.bfloat16)
    logits[0, 0, [7, 900, 8191]] = 9.0  # a three-way tie: the first wins
    logits[1, 2, -1] = 9.0  # the last index
    logits[2, 1] = logits[2, 1].max()  # every entry the maximum
    compiled = torch.compile(greedy_tokens, backend="inductor", fullgraph=True, dynamic=False)
    token_ids, log_probs = compiled(logits, with_log_probs)
    eager_ids, eager_log_probs = greedy_tokens(logits, with_log_probs)
    assert torch.equal(token_ids, logits.max(dim=-1).indices)
    assert torch.equal(token_ids, eager_ids)
    assert token_ids[0, 0] == 7 and token_ids[1, 2] == 8191 and token_ids[2, 1] == 0
    if with_log_probs:
        torch.testing.assert_close(log_probs, eager_log_probs)
    else:
        assert log_probs is None and eager_log_probs is None
