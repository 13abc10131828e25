"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention, tied or untied head) built from a
config: the model `python -m fsdp_graph train` trains. Random init, nothing downloaded.

Built on the meta device (`with torch.device("meta"): Llama(cfg)`) it costs no memory; `fully_shard(model,
param_init_fn=model.init_module)` then materialises one unit at a time with the same init as a model built on a
real device (the rotary tables are non-persistent buffers, recomputed by `init_module` too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


@dataclass(frozen=True)
class LlamaConfig:
    """Model shape. `kv_heads` < `heads` is grouped-query attention; `seq` is the longest sequence RoPE covers."""

    vocab: int = 256
    dim: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    hidden: int = 384  # SwiGLU width
    seq: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied: bool = True
    init_std: float = 0.02
    # Activation checkpointing: "none"; "selective", every block with torchtitan's per-op policy (keep attention's
    # output and every other matmul's, recompute the rest); "layer", every second block whole (torchtitan's
    # selective "layer" option 2, blocks 1, 3, 5, ...); "full", every block whole (keep only its input).
    checkpoint: str = "none"

    def __post_init__(self) -> None:
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"LlamaConfig: checkpoint={self.checkpoint!r}; use one of {', '.join(CHECKPOINT_MODES)}")
        if self.dim % self.heads or self.heads % self.kv_heads or (self.dim // self.heads) % 2:
            raise ValueError(
                f"LlamaConfig: dim ({self.dim}) must split into heads ({self.heads}) of even size, and heads into "
                f"kv_heads ({self.kv_heads}) groups."
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        block = attn + 3 * self.dim * self.hidden + 2 * self.dim
        head = 0 if self.tied else self.vocab * self.dim
        return self.layers * block + self.vocab * self.dim + head + self.dim


CHECKPOINT_MODES = ("none", "selective", "layer", "full")


# Byte-level vocabulary (256) everywhere; the larger shapes follow Llama 3.2 1B / 3B and Llama 3 / 3.1 8B, 70B and
# 405B otherwise (Llama 3's own vocabulary: `preset("70b", vocab=LLAMA3_VOCAB)`).
LLAMA3_VOCAB = 128256
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(dim=128, layers=4, heads=4, kv_heads=2, hidden=384, seq=128),
    "small": LlamaConfig(dim=512, layers=10, heads=8, kv_heads=4, hidden=1536, seq=256, tied=False),
    "1b": LlamaConfig(dim=2048, layers=16, heads=32, kv_heads=8, hidden=8192, seq=2048, rope_theta=500000.0),
    "3b": LlamaConfig(dim=3072, layers=28, heads=24, kv_heads=8, hidden=8192, seq=2048, rope_theta=500000.0),
    "8b": LlamaConfig(
        dim=4096, layers=32, heads=32, kv_heads=8, hidden=14336, seq=2048, rope_theta=500000.0, tied=False
    ),
    "70b": LlamaConfig(
        dim=8192, layers=80, heads=64, kv_heads=8, hidden=28672, seq=2048, rope_theta=500000.0, tied=False
    ),
    "405b": LlamaConfig(
        dim=16384, layers=126, heads=128, kv_heads=8, hidden=53248, seq=2048, rope_theta=500000.0, tied=False
    ),
}


def preset(name: str, **overrides) -> LlamaConfig:
    """`PRESETS[name]` with some fields replaced, e.g. `preset("tiny", seq=64)`."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class RMSNorm(nn.Module):
    """Normalised in fp32 whatever the input dtype (as Llama), then scaled by the weight in the compute dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Rotary(nn.Module):
    """cos/sin tables of rotary position embeddings ("rotate half" layout), as non-persistent buffers: they are
    not in state dicts, and `reset_parameters` recomputes them after meta-device construction."""

    def __init__(self, head_dim: int, seq: int, theta: float):
        super().__init__()
        self.head_dim, self.seq, self.theta = head_dim, seq, theta
        self.register_buffer("cos", torch.empty(seq, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(seq, head_dim), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        device = self.cos.device
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim)
        freqs = torch.outer(torch.arange(self.seq, device=device).float(), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq], self.sin[:seq]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) queries or keys by position, in fp32, back in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts from the projections' widths (-1): with tensor parallelism each rank holds heads / tp of them.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """`forward(idx)` maps (batch, seq) token ids to (batch, seq, vocab) logits. `blocks` is the ModuleList that
    fully_shard's default wrap policy makes units of; embedding, final norm and head stay with the root."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.rope = Rotary(cfg.head_dim, cfg.seq, cfg.rope_theta)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied:
            self.output.weight = self.tok_embeddings.weight
        # Residual projections start smaller so the residual stream's variance does not grow with depth (GPT-2).
        for block in self.blocks:
            block.attention.wo.init_std = block.feed_forward.w2.init_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        for module in self.modules():
            self.init_module(module)

    def init_module(self, module: nn.Module) -> None:
        """Initialise `module`'s own parameters and buffers: the `param_init_fn` for meta-device construction."""
        with torch.no_grad():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=getattr(module, "init_std", self.cfg.init_std))
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=self.cfg.init_std)
            elif isinstance(module, (RMSNorm, Rotary)):
                module.reset_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.cfg.seq:
            raise ValueError(f"Llama: sequence of {idx.shape[1]} tokens is longer than cfg.seq={self.cfg.seq}")
        x = self.tok_embeddings(idx)
        cos, sin = self.rope(idx.shape[1])
        for i, block in enumerate(self.blocks):
            if self.cfg.checkpoint == "none" or (self.cfg.checkpoint == "layer" and i % 2 == 0):
                x = block(x, cos, sin)
            elif self.cfg.checkpoint in ("full", "layer"):
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = checkpoint(block, x, cos, sin, use_reentrant=False, context_fn=_selective_context)
        return self.output(self.norm(x))


_aten = torch.ops.aten
# Kept under selective checkpointing: attention (every kernel a device may pick) and, of the matmuls, every other
# one in each block (the first, third, ...), as torchtitan's "op" policy.
_SAVED_ATTENTION = {
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_context():
    """A fresh per-block policy: counts the block's matmuls (forward and recompute apart) and keeps the odd ones."""
    matmuls = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op == _aten.mm.default:
            matmuls[ctx.is_recompute] += 1
            keep = matmuls[ctx.is_recompute] % 2 == 1
        else:
            keep = op in _SAVED_ATTENTION
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def tp_plan(cfg: LlamaConfig) -> dict:
    """torchtitan's tensor-parallel plan for the blocks (attention and SwiGLU: Colwise in, Rowwise out); the
    embedding, final norm and head stay replicated over tp (plain parameters)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(cfg.layers):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def check_tp(cfg: LlamaConfig, tp: int) -> str | None:
    """Why `cfg` cannot be split over `tp` ranks by `tp_plan` (None: it can)."""
    if cfg.kv_heads % tp or cfg.hidden % tp:
        return f"--tp {tp} must divide the preset's kv_heads ({cfg.kv_heads}) and SwiGLU width ({cfg.hidden})"
    return None


def llama_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross entropy of `model(inputs)` against `targets`, computed in fp32."""
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
