"""Training Amphista: `modeling_amphista.AmphistaDrafter`, saved with its own `save_pretrained`
(config.json model_type "amphista", loaded by the plugin)."""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_amphista.configuration_amphista import AmphistaConfig
from vllm_amphista.modeling_amphista import AmphistaDrafter, DraftTokenMLP
from vllm_amphista.train.batch import Batch, DraftVocab, causal_attention_mask
from vllm_amphista.train.drafter import DraftMethod, id_list, id_tensor
from vllm_amphista.train.target import Target


class AmphistaMethod(DraftMethod):
    name = "amphista"

    def __init__(self, drafter: AmphistaDrafter):
        super().__init__()
        self.drafter = drafter
        self.num_heads = drafter.config.num_draft_heads
        self.vocab = self.loss_vocab = DraftVocab(drafter.draft_to_target, drafter.config.vocab_size)
        self.feature_layers = drafter.config.target_feature_layers
        if drafter.lm_head is not None and drafter.config.share_lm_head:
            # A draft-vocabulary slice of the target's lm_head stays the target's.
            drafter.lm_head.requires_grad_(False)

    @classmethod
    def create(cls, target: Target, draft_to_target: torch.Tensor | None, **config_overrides) -> AmphistaMethod:
        draft_vocab_size = 0 if draft_to_target is None else len(draft_to_target)
        config = AmphistaConfig.from_target_config(target.config, draft_vocab_size=draft_vocab_size, **config_overrides)
        drafter = AmphistaDrafter(config)
        drafter.init_from_target(target.lm_head_weight, draft_to_target)
        return cls(drafter)

    def build_spec(self) -> dict:
        return {"config": self.drafter.config.to_dict(), "draft_to_target": id_list(self.vocab.draft_to_target)}

    @classmethod
    def from_spec(cls, spec: dict, target: Target) -> AmphistaMethod:
        config = AmphistaConfig.from_dict(spec["config"])
        target.check_matches(config.hidden_size, config.vocab_size, "the Amphista checkpoint")
        drafter = AmphistaDrafter(config)
        drafter.init_from_target(target.lm_head_weight, id_tensor(spec["draft_to_target"]))
        return cls(drafter)

    def head_features(self, batch: Batch, target: Target, rows: torch.Tensor) -> torch.Tensor:
        stage1, stage2 = self.drafter.stage_outputs(batch.hidden, batch.next_token_ids, target.embed_weight,
                                                    batch.position_ids, causal_attention_mask(batch.segment_ids))
        # The Auto-embedding Block works on single positions: run it where drafts are needed only.
        heads = self.drafter.auto_embedding(stage1[rows], stage2[rows])
        # Head k reads x_{t+1+k}, what head k-1 drafts wherever a chain verifier reads head k.
        return self.drafter.read_true_drafts(heads, batch.next_token_ids, target.embed_weight, batch.segment_ids, rows)

    def deepen(self, stage_layers: int | None, encoder_layers: int | None) -> None:
        """Grow the stages / encoder to these depths (None: as they are), starting from the same function."""
        config = self.drafter.config
        self.drafter.deepen(stage_layers or config.stage_num_layers, encoder_layers or config.encoder_num_layers)

    def add_draft_token_mlp(self, size: int, reads: str = "previous") -> None:
        """Let heads that read no drafted tokens read them (`reads`: as `draft_token_mlp_reads`),
        starting from the same function."""
        config = self.drafter.config
        if config.draft_token_mlp_size:
            raise ValueError(f"these heads read drafted tokens already (draft_token_mlp_size "
                             f"{config.draft_token_mlp_size})")
        config.draft_token_mlp_size = size
        config.draft_token_mlp_reads = reads
        config.validate()
        block = self.drafter.auto_embedding
        block.draft_token_mlp = DraftTokenMLP(config).to(block.final_norm.weight.dtype)
        block.draft_token_mlp.reset_parameters()

    @torch.no_grad()
    def widen_draft_vocab(self, ranked_ids: torch.Tensor, target: Target) -> None:
        """Grow the draft vocabulary to len(ranked_ids) ids: the heads' own ids keep their rows and
        order, the best-ranked ids they lack follow with the target's lm_head rows (the rows a new
        drafter starts from). Until then the heads never learned at positions whose token they lack."""
        drafter, size = self.drafter, len(ranked_ids)
        current = drafter.draft_to_target
        if current is None:
            raise ValueError("these heads draft over the target's whole vocabulary already (draft_vocab_size 0)")
        if size < len(current):
            raise ValueError(f"--draft-vocab-size {size} is smaller than the heads' draft vocabulary of "
                             f"{len(current)}: a fine-tune can only widen it")
        kept = set(current.tolist())
        added = torch.tensor([token for token in ranked_ids.tolist() if token not in kept][:size - len(current)],
                             dtype=torch.int64, device=current.device)
        if not len(added):
            return
        old_head = drafter.lm_head
        new_head = torch.nn.Linear(old_head.in_features, size, bias=False, device=old_head.weight.device,
                                   dtype=old_head.weight.dtype)
        new_head.weight.copy_(torch.cat([old_head.weight, target.lm_head_weight[added].to(old_head.weight)]))
        new_head.requires_grad_(old_head.weight.requires_grad)
        drafter.lm_head = new_head
        drafter.draft_to_target = torch.cat([current, added])
        drafter.config.draft_vocab_size = size
        self.vocab = self.loss_vocab = DraftVocab(drafter.draft_to_target, drafter.config.vocab_size)

    def vocab_weight(self, target: Target) -> torch.Tensor:
        return self.drafter.vocab_weight(target.lm_head_weight)

    def loss_vocab_weight(self, target: Target) -> torch.Tensor:
        return self.vocab_weight(target)  # already the draft vocabulary's rows

    def save(self, directory, dtype=torch.bfloat16):
        self.drafter.save_pretrained(directory, dtype=dtype)

    @classmethod
    def load(cls, directory: Path, target: Target) -> AmphistaMethod:
        drafter = AmphistaDrafter.from_pretrained(directory, dtype=torch.float32)
        target.check_matches(drafter.config.hidden_size, drafter.config.vocab_size, str(directory))
        return cls(drafter)
