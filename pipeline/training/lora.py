"""LoRA surgery on a Llama sequence classifier: the reward model as a frozen bottom, a top of K
decoder layers whose projections get LoRA factors (Hu et al., 2021, "LoRA: Low-Rank Adaptation of
Large Language Models", eq. 3: h = W x + (alpha / r) B A x, W frozen, A Kaiming-uniform as peft
initialises it, B zero), and the score head ``score.weight`` ([1, H], no bias), which learns in full.
Rank 0 trains the top K layers' projections in full instead (FullLinear: a full-rank update beside
each frozen weight, merged the same way). ``merge_lora`` folds trained factors into the weights, and
``save_reward_model`` writes the merged model as a plain LlamaForSequenceClassification directory."""

from __future__ import annotations

import math
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
"""The projections of a Llama decoder layer that get LoRA factors."""


# -- the model: frozen bottom, LoRA top, score head ---------------------------------------------

class LoRALinear(nn.Module):
    """``base`` (frozen) plus the low-rank update (alpha / rank) B A (LoRA, eq. 3)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base = base.requires_grad_(False)
        bound = 1 / math.sqrt(base.in_features)  # peft: kaiming_uniform_(a=sqrt(5)) on A
        self.lora_A = nn.Parameter((torch.rand(rank, base.in_features, generator=generator) * 2 - 1) * bound)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T * self.scale

    def delta(self) -> torch.Tensor:
        """The weight update the factors stand for: [out, in]."""
        return self.lora_B @ self.lora_A * self.scale


class FullLinear(nn.Module):
    """``base`` (frozen) plus a full-rank update ``delta`` ([out, in], zero at start): training
    ``delta`` is training the weight itself (a full fine-tune of the projection), and it merges
    the same way as LoRA's B A. What ``split_reward_model(rank=0)`` puts in the top layers."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.delta = nn.Parameter(torch.zeros_like(base.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.base.weight + self.delta, self.base.bias)


@dataclass
class SplitRewardModel:
    """The reward model in two parts: ``bottom`` (embeddings and the frozen layers 0 .. L-K-1, no
    final norm: it returns the residual stream) and ``top`` (layers L-K .. L-1 with LoRA, and the
    final norm; fed the bottom's states), then ``score``. Both parts are LlamaModels, so every
    pass runs transformers' own attention, masks and rotary positions."""

    bottom: nn.Module
    top: nn.Module
    score: nn.Linear
    lora: dict[str, LoRALinear | FullLinear]
    """"model.layers.{i}.{target}" (the full model's names) -> its LoRA (or full-rank) module in
    ``top``."""
    first_top_layer: int

    def _trained(self) -> dict[str, nn.Parameter]:
        """``{name}.lora_A`` / ``.lora_B`` (LoRA) or ``{name}.delta`` (full rank) -> the parameter."""
        return {f"{name}.{part}": p for name, m in self.lora.items() for part, p in m.named_parameters(recurse=False)}

    def parameters(self) -> list[nn.Parameter]:
        """What training updates: the LoRA factors (or full-rank updates) and the score head."""
        return list(self._trained().values()) + [self.score.weight]

    def factors(self) -> dict[str, torch.Tensor]:
        """The trained tensors by name (``...q_proj.lora_A``, ``score.weight``), detached copies."""
        out = {k: p.detach().clone() for k, p in self._trained().items()}
        out["score.weight"] = self.score.weight.detach().clone()
        return out

    def load_factors(self, factors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, p in self._trained().items():
                p.copy_(factors[key])
            self.score.weight.copy_(factors["score.weight"].reshape(1, -1))


def split_reward_model(backbone: str | Path, top_layers: int, rank: int, alpha: float, seed: int) -> SplitRewardModel:
    """The generator directory ``backbone`` as a SplitRewardModel with ``top_layers`` LoRA layers
    (rank ``rank``, scale alpha / rank, A drawn from ``seed``) and a zero score head. Rank 0
    trains the top layers' projections in full instead (FullLinear; ``alpha`` is unused)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaModel

    config = AutoConfig.from_pretrained(str(backbone))
    layers = config.num_hidden_layers
    if not 1 <= top_layers <= layers:
        raise ValueError(f"top_layers must be in 1..{layers} (the model has {layers} layers), got {top_layers}")
    source = AutoModelForCausalLM.from_pretrained(str(backbone), dtype=torch.float32).model.state_dict()
    cut = layers - top_layers
    parts = []
    for count, first in ((cut, 0), (top_layers, cut)):
        part_config = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": count})
        part_config._attn_implementation = "sdpa"
        part = LlamaModel(part_config)
        state = {k: v for k, v in source.items() if not k.startswith("layers.")}
        state.update({f"layers.{int(k.split('.')[1]) - first}.{k.split('.', 2)[2]}": v for k, v in source.items()
                      if k.startswith("layers.") and first <= int(k.split(".")[1]) < first + count})
        part.load_state_dict(state)
        parts.append(part.eval().requires_grad_(False))
    bottom, top = parts
    bottom.norm = nn.Identity()
    top.embed_tokens = None  # fed hidden states only
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for i, layer in enumerate(top.layers):
        for target in LORA_TARGETS:
            parent_name, name = target.split(".")
            parent = getattr(layer, parent_name)
            base = getattr(parent, name)
            module = FullLinear(base) if rank == 0 else LoRALinear(base, rank, alpha, generator)
            setattr(parent, name, module)
            lora[f"model.layers.{cut + i}.{target}"] = module
    score = nn.Linear(config.hidden_size, 1, bias=False)
    nn.init.zeros_(score.weight)
    return SplitRewardModel(bottom, top, score, lora, cut)


def merge_lora(model, factors: dict[str, torch.Tensor], scale: float) -> None:
    """Writes ``factors`` (SplitRewardModel.factors) into a LlamaForSequenceClassification: each
    projection's weight += scale * B A (LoRA) or += delta (full rank), and ``score.weight``; the
    result is a plain model."""
    with torch.no_grad():
        modules = dict(model.named_modules())
        for key, a in factors.items():
            if key.endswith(".lora_A"):
                name = key[: -len(".lora_A")]
                modules[name].weight += factors[f"{name}.lora_B"] @ a * scale
            elif key.endswith(".delta"):
                modules[key[: -len(".delta")]].weight += a
        model.score.weight.copy_(factors["score.weight"].reshape(1, -1))


def save_reward_model(backbone: str | Path, factors: dict[str, torch.Tensor], scale: float, output: str | Path) -> Path:
    """An AutoModelForSequenceClassification directory at ``output``: the backbone's weights (a
    causal LM directory) with the LoRA factors merged in and ``score`` set, and the backbone's
    tokenizer (chat template included), written to a temp dir and renamed into place."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging

    from pipeline.engines.hf import load_tokenizer

    output = Path(output)
    tokenizer = load_tokenizer(str(backbone))
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the score head is new by design: no "newly initialized" warning
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(backbone), num_labels=1, dtype=torch.float32)
    finally:
        logging.set_verbosity(verbosity)
    merge_lora(model, factors, scale)
    model.config.pad_token_id = tokenizer.pad_token_id
    tmp = output.with_name(f"{output.name}.tmp-{uuid.uuid4().hex[:8]}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(output, ignore_errors=True)
    tmp.rename(output)
    return output
