"""The Reward Transformer (section 4.2 of "Streaming Looking Ahead with Token-level Self-reward",
Zhang et al., 2025): any HF causal LM plus a token-level reward channel.

The policy channel is the wrapped model, unchanged (Eq. 13, 15). The reward channel has one
block per transformer layer j and reads the policy's hidden state entering that layer, h_p^j,
from the same forward pass (Eq. 14):

    h_r^1     = Norm(FFN_0(h_p^0))                           (h_p^0: the token embeddings)
    h_r^{j+1} = Norm(h_r^j + FFN_j([h_p^j : h_r^j]))          j = 1 .. L-1

where FFN_j(x) = act(W_j RMSNorm(x)) as in the authors' ``TTLayer`` (training/scripts/RT_model.py
of CognitiveKernel/SLA: the input norm matters because h_p^j grows layer by layer). The first
block has no reward input yet: the paper starts h_r from a copy of the embeddings, the authors'
code projects h_p^0 without a residual; we follow the code. The reward head (Eq. 16) reads
[h_p^L : h_r^L], the final (normed) policy state concatenated with the last reward state: Eq. 16
writes only h_p, but the authors' code reads the concatenation, and so do we. Its output is
R'(x_{<=t}), the predicted final reward of the sequence so far, at every token t.

``LinearAdapter`` is the adapter baseline of section 5.3 (one linear head on the last hidden
state) behind the same interface, so training and AuTRC treat both alike.

On disk a Reward Transformer is a directory: the HF model and tokenizer (save_pretrained), plus
``reward_channel.safetensors`` and ``reward_channel.json``. A plain HF model directory loads with
a fresh, untrained channel (``trained`` is False).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.activations import ACT2FN

CHANNEL_WEIGHTS = "reward_channel.safetensors"
CHANNEL_CONFIG = "reward_channel.json"


@dataclass
class RewardChannelConfig:
    policy_hidden_size: int
    """d of the policy channel (the wrapped model's hidden_size)."""
    num_layers: int
    """Reward blocks: one per transformer layer of the policy."""
    hidden_size: int = 256
    """Width of the reward channel (the paper's 256)."""
    kind: str = "channel"
    """channel: the Reward Transformer's per-layer channel; adapter: one linear head on the last state."""
    activation: str = "silu"
    rms_norm_eps: float = 1e-6
    trained: bool = False
    """Set when the channel has been trained (SLA refuses an untrained one)."""


class _Block(nn.Module):
    """FFN_j(x) = act(W RMSNorm(x)) of the authors' TTLayer."""

    def __init__(self, in_size: int, out_size: int, config: RewardChannelConfig):
        super().__init__()
        self.norm = nn.RMSNorm(in_size, eps=config.rms_norm_eps)
        self.linear = nn.Linear(in_size, out_size, bias=False)
        self.act = ACT2FN[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(self.norm(x)))


class RewardChannel(nn.Module):
    """Eq. 14 and 16. forward(hidden_states) takes the policy's L+1 hidden states (embeddings,
    each layer's output, the last one after the final norm), each [B, T, d], and returns [B, T]."""

    def __init__(self, config: RewardChannelConfig):
        super().__init__()
        self.config = config
        d, r = config.policy_hidden_size, config.hidden_size
        self.blocks = nn.ModuleList([_Block(d if j == 0 else d + r, r, config) for j in range(config.num_layers)])
        self.norms = nn.ModuleList([nn.RMSNorm(r, eps=config.rms_norm_eps) for _ in range(config.num_layers)])
        self.head = nn.Linear(d + r, 1)

    def forward(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(hidden_states) != len(self.blocks) + 1:
            raise ValueError(f"reward channel has {len(self.blocks)} blocks, got {len(hidden_states)} hidden states")
        h_r = self.norms[0](self.blocks[0](hidden_states[0]))  # [B, T, r]
        for j in range(1, len(self.blocks)):
            h_r = self.norms[j](h_r + self.blocks[j](torch.cat([hidden_states[j], h_r], dim=-1)))
        return self.head(torch.cat([hidden_states[-1], h_r], dim=-1))[..., 0]  # [B, T]


class LinearAdapter(nn.Module):
    """The adapter baseline of section 5.3: R'(x_{<=t}) = w . h_p^L(t) + b."""

    def __init__(self, config: RewardChannelConfig):
        super().__init__()
        self.config = config
        self.head = nn.Linear(config.policy_hidden_size, 1)

    def forward(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.head(hidden_states[-1])[..., 0]  # [B, T]


CHANNELS = {"channel": RewardChannel, "adapter": LinearAdapter}


class RewardTransformer(nn.Module):
    """Policy (any HF causal LM, unchanged) plus a reward channel.

    ``forward`` is the policy's forward (the engine calls it exactly as it calls the bare model);
    ``with_rewards=True`` also returns ``rewards`` [B, T'] for the positions whose logits are kept,
    from the hidden states of the same pass. ``token_rewards`` gives R' at every token without the
    vocabulary projection (training).
    """

    def __init__(self, policy, channel: nn.Module):
        super().__init__()
        self.policy = policy
        self.channel = channel

    @property
    def config(self):
        return self.policy.config

    @property
    def generation_config(self):
        return self.policy.generation_config

    @property
    def channel_config(self) -> RewardChannelConfig:
        return self.channel.config

    def forward(self, *args, with_rewards: bool = False, logits_to_keep: int = 0, **kwargs):
        out = self.policy(*args, output_hidden_states=with_rewards or None, logits_to_keep=logits_to_keep, **kwargs)
        if with_rewards:
            keep = logits_to_keep or out.hidden_states[0].shape[1]
            out["rewards"] = self.channel(tuple(h[:, -keep:] for h in out.hidden_states))  # [B, keep]
        return out

    def token_rewards(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, train_policy: bool = False) -> torch.Tensor:
        """R' at every position, [B, T]. The policy runs without gradients unless ``train_policy``."""
        with torch.set_grad_enabled(train_policy and torch.is_grad_enabled()):
            out = self.policy.base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return self.channel(out.hidden_states)

    @classmethod
    def wrap(cls, policy, hidden_size: int = 256, kind: str = "channel", seed: int = 0) -> RewardTransformer:
        """Attach a fresh channel (seeded init) to a loaded policy."""
        if kind not in CHANNELS:
            raise ValueError(f"unknown reward channel kind {kind!r}; choose from {sorted(CHANNELS)}")
        config = RewardChannelConfig(policy_hidden_size=policy.config.hidden_size,
                                     num_layers=policy.config.num_hidden_layers, hidden_size=hidden_size, kind=kind,
                                     activation=getattr(policy.config, "hidden_act", "silu"),
                                     rms_norm_eps=getattr(policy.config, "rms_norm_eps", 1e-6))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            channel = CHANNELS[kind](config)
        param = next(policy.parameters())
        return cls(policy, channel.to(device=param.device, dtype=param.dtype))

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
                        hidden_size: int = 256, kind: str = "channel", load: dict | None = None) -> RewardTransformer:
        """A Reward Transformer directory, or any HF causal LM with a fresh channel. ``dtype`` "auto":
        the checkpoint's; ``load``: other ``from_pretrained`` keywords (models.hf)."""
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **(load or {})).to(device)
        dtype = next(policy.parameters()).dtype
        if not has_reward_channel(path):
            return cls.wrap(policy, hidden_size=hidden_size, kind=kind)
        raw = json.loads((Path(path) / CHANNEL_CONFIG).read_text())
        config = RewardChannelConfig(**raw)
        channel = CHANNELS[config.kind](config)
        channel.load_state_dict(load_file(str(Path(path) / CHANNEL_WEIGHTS)))
        return cls(policy, channel.to(device=device, dtype=dtype))

    def save_pretrained(self, path: str, tokenizer=None) -> None:
        path_ = Path(path)
        self.policy.save_pretrained(path_)
        if tokenizer is not None:
            tokenizer.save_pretrained(path_)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.channel.state_dict().items()}
        save_file(state, str(path_ / CHANNEL_WEIGHTS))
        (path_ / CHANNEL_CONFIG).write_text(json.dumps(asdict(self.channel.config), indent=2) + "\n")


def has_reward_channel(path: str) -> bool:
    """True for a local Reward Transformer directory (channel weights and config present)."""
    p = Path(path)
    return (p / CHANNEL_WEIGHTS).is_file() and (p / CHANNEL_CONFIG).is_file()


def has_trained_channel(path: str) -> bool:
    if not has_reward_channel(path):
        return False
    return bool(json.loads((Path(path) / CHANNEL_CONFIG).read_text()).get("trained"))
