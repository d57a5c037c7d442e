"""Plain PyTorch reference implementation of the litgpt.c model.

Follows the model semantics written down for litgpt.c (GPT-2 / Pythia / Llama /
Falcon style decoders, Llama 3.1's rope scaling).  Parameter names match the LitGPT names that litgpt.c uses,
so `model.named_parameters()` yields e.g. `transformer.h.0.attn.qkv.weight`.

Used by tests/make_reference.py (float64 reference data for the C gradient
tests) and tools/bench_torch.py (CPU speed comparison).  Run with the Debian
python (/usr/bin/python3), which has python3-torch installed.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------

INT_KEYS = {"n_layer", "n_head", "n_query_groups", "n_embd", "head_size",
            "intermediate_size", "block_size", "vocab_size", "padded_vocab_size"}
FLOAT_KEYS = {"norm_eps", "rotary_percentage", "rope_base"}
BOOL_KEYS = {"parallel_residual", "shared_attention_norm", "bias", "attn_bias",
             "lm_head_bias", "tie_embeddings", "learned_pos_embedding"}
# the optional nested block (LitGPT's model_config.yaml spells it so)
ROPE_ADJUSTMENT_KEYS = {"factor": float, "low_freq_factor": float, "high_freq_factor": float,
                        "original_max_seq_len": int}


def _parse_value(key, text):
    """Turn the text after 'key:' into an int, float, bool or string."""
    if key in INT_KEYS:
        return int(text)
    if key in FLOAT_KEYS:
        return float(text)
    if key in BOOL_KEYS:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{key}: expected true/false, got {text!r}")
        return text.lower() == "true"
    return text


def load_config(path):
    """Read a `key: value` YAML file ('#' starts a comment line); the one nested
    block, rope_adjustments, becomes a dict (absent or null: None)."""
    cfg = {"rope_adjustments": None}
    block = None
    with open(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0]
            if not line.strip():
                continue
            if ":" not in line:
                raise ValueError(f"{path}:{lineno}: expected 'key: value'")
            key, value = line.split(":", 1)
            key, value = key.strip(), value.strip()
            if line[0].isspace():
                if block is None:
                    raise ValueError(f"{path}:{lineno}: indented line outside a block")
                block[key] = ROPE_ADJUSTMENT_KEYS[key](value)
                continue
            block = None
            if key == "rope_adjustments":
                if value not in ("", "null"):
                    raise ValueError(f"{path}:{lineno}: rope_adjustments must be a block or null")
                block = cfg[key] = {} if value == "" else None
                continue
            cfg[key] = _parse_value(key, value)
    if cfg["rope_adjustments"] is not None:
        assert set(cfg["rope_adjustments"]) == set(ROPE_ADJUSTMENT_KEYS), path
    missing = (INT_KEYS | FLOAT_KEYS | BOOL_KEYS) - set(cfg)
    if missing:
        raise ValueError(f"{path}: missing keys {sorted(missing)}")
    assert cfg["n_head"] % cfg["n_query_groups"] == 0
    return cfg


# ---------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------

class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * w + b, biased variance over the last dim."""

    def __init__(self, size, eps, bias):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
        y = (x - mean) / torch.sqrt(var + self.eps) * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * w."""

    def __init__(self, size, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        ms = (x * x).mean(dim=-1, keepdim=True)
        return x / torch.sqrt(ms + self.eps) * self.weight


def make_norm(cfg):
    # LitGPT builds torch.nn.LayerNorm, which has a bias whatever cfg["bias"] says (Falcon's
    # linear layers have no bias, its LayerNorms do)
    if cfg["norm_class_name"] == "LayerNorm":
        return LayerNorm(cfg["n_embd"], cfg["norm_eps"], True)
    if cfg["norm_class_name"] == "RMSNorm":
        return RMSNorm(cfg["n_embd"], cfg["norm_eps"])
    raise ValueError(f"unknown norm_class_name {cfg['norm_class_name']}")


def gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if approximate == "none":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    raise ValueError(f"unknown gelu_approximate {approximate}")


class GptNeoxMLP(nn.Module):
    """proj(gelu(fc(x)))."""

    def __init__(self, cfg):
        super().__init__()
        C, I, b = cfg["n_embd"], cfg["intermediate_size"], cfg["bias"]
        self.fc = nn.Linear(C, I, bias=b)
        self.proj = nn.Linear(I, C, bias=b)
        self.approximate = cfg["gelu_approximate"]

    def forward(self, x):
        return self.proj(gelu(self.fc(x), self.approximate))


class LLaMAMLP(nn.Module):
    """proj(silu(fc_1(x)) * fc_2(x))."""

    def __init__(self, cfg):
        super().__init__()
        C, I, b = cfg["n_embd"], cfg["intermediate_size"], cfg["bias"]
        self.fc_1 = nn.Linear(C, I, bias=b)
        self.fc_2 = nn.Linear(C, I, bias=b)
        self.proj = nn.Linear(I, C, bias=b)

    def forward(self, x):
        a = self.fc_1(x)
        return self.proj(a * torch.sigmoid(a) * self.fc_2(x))


def make_mlp(cfg):
    if cfg["mlp_class_name"] == "GptNeoxMLP":
        return GptNeoxMLP(cfg)
    if cfg["mlp_class_name"] == "LLaMAMLP":
        return LLaMAMLP(cfg)
    raise ValueError(f"unknown mlp_class_name {cfg['mlp_class_name']}")


# ---------------------------------------------------------------------------
# Rotary position embedding (rotate-half convention)
# ---------------------------------------------------------------------------

def llama3_scaled(theta, adj):
    """Llama 3.1's frequency scaling, band by band: a frequency whose wavelength
    (2 pi / theta positions) is shorter than original / high_freq_factor is kept,
    one longer than original / low_freq_factor is divided by factor, and in
    between the two are mixed with weight w = (original / wavelength - low) /
    (high - low) on the kept one."""
    original, factor = adj["original_max_seq_len"], adj["factor"]
    low, high = adj["low_freq_factor"], adj["high_freq_factor"]
    out = []
    for f in theta.tolist():
        wavelength = 2 * math.pi / f
        if wavelength < original / high:
            out.append(f)
        elif wavelength > original / low:
            out.append(f / factor)
        else:
            w = (original / wavelength - low) / (high - low)
            out.append((1 - w) * f / factor + w * f)
    return torch.tensor(out, dtype=theta.dtype)


def rope_cos_sin(T, n_elem, base, dtype, adjustments=None):
    """cos, sin tables of shape (T, n_elem); dims j and j + n_elem/2 share an angle."""
    half = n_elem // 2
    j = torch.arange(half, dtype=torch.float64)
    theta = base ** (-2.0 * j / n_elem)                    # (half,)
    if adjustments is not None:
        theta = llama3_scaled(theta, adjustments)
    t = torch.arange(T, dtype=torch.float64)
    angle = torch.outer(t, theta)                          # (T, half)
    angle = torch.cat([angle, angle], dim=-1)              # (T, n_elem)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate the first n_elem dims of x (..., T, HS); leave the rest unchanged."""
    n_elem = cos.shape[-1]
    if n_elem == 0:
        return x
    xr, xpass = x[..., :n_elem], x[..., n_elem:]
    half = n_elem // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)  # rotate_half
    xr = xr * cos + rotated * sin
    return torch.cat([xr, xpass], dim=-1)


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nh, self.nqg, self.hs = cfg["n_head"], cfg["n_query_groups"], cfg["head_size"]
        C = cfg["n_embd"]
        qkv_out = (self.nh + 2 * self.nqg) * self.hs
        self.qkv = nn.Linear(C, qkv_out, bias=cfg["bias"] or cfg["attn_bias"])
        self.proj = nn.Linear(self.nh * self.hs, C, bias=cfg["bias"])
        self.n_elem = int(cfg["rotary_percentage"] * self.hs)
        self.rope_base = cfg["rope_base"]
        self.rope_adjustments = cfg["rope_adjustments"]

    def forward(self, x):
        B, T, _ = x.shape
        nh, nqg, hs = self.nh, self.nqg, self.hs
        qkv = self.qkv(x)
        # rows of W_qkv: all query heads, then all key heads, then all value heads
        q, k, v = qkv.split([nh * hs, nqg * hs, nqg * hs], dim=-1)
        q = q.view(B, T, nh, hs).transpose(1, 2)           # (B, nh, T, hs)
        k = k.view(B, T, nqg, hs).transpose(1, 2)          # (B, nqg, T, hs)
        v = v.view(B, T, nqg, hs).transpose(1, 2)

        cos, sin = rope_cos_sin(T, self.n_elem, self.rope_base, x.dtype, self.rope_adjustments)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # query head h reads key/value group h // (nh / nqg)
        if nqg != nh:
            k = k.repeat_interleave(nh // nqg, dim=1)
            v = v.repeat_interleave(nh // nqg, dim=1)

        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)    # (B, nh, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = att @ v                                        # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, nh * hs)       # heads concatenated
        return self.proj(y)


# ---------------------------------------------------------------------------
# Block and model
# ---------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        # attribute order = parameter order: norm_1, attn, norm_2, mlp
        self.norm_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.norm_2 = None if cfg["shared_attention_norm"] else make_norm(cfg)
        self.mlp = make_mlp(cfg)
        self.parallel_residual = cfg["parallel_residual"]

    def forward(self, x):
        n1 = self.norm_1(x)
        a = self.attn(n1)
        if self.parallel_residual:
            m_in = n1 if self.norm_2 is None else self.norm_2(x)
            return x + a + self.mlp(m_in)
        x = x + a
        m_in = n1 if self.norm_2 is None else self.norm_2(x)  # shared norm: MLP reads n1
        return x + self.mlp(m_in)


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        C, Vp = cfg["n_embd"], cfg["padded_vocab_size"]
        # module order = the spec's parameter order: wte, wpe, h, ln_f, lm_head
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(Vp, C)
        if cfg["learned_pos_embedding"]:
            self.transformer.wpe = nn.Embedding(cfg["block_size"], C)
        self.transformer.h = nn.ModuleList(Block(cfg) for _ in range(cfg["n_layer"]))
        self.transformer.ln_f = make_norm(cfg)
        # lm_head holds its own weight unless tied to wte, and a bias if lm_head_bias
        self.lm_head = nn.Module()
        if not cfg["tie_embeddings"]:
            self.lm_head.weight = nn.Parameter(torch.randn(Vp, C) * 0.02)
        if cfg["lm_head_bias"]:
            self.lm_head.bias = nn.Parameter(torch.zeros(Vp))

    def forward(self, idx):
        """idx (B, T) int64 -> logits (B, T, Vp)."""
        B, T = idx.shape
        assert T <= self.cfg["block_size"]
        x = self.transformer.wte(idx)
        if self.cfg["learned_pos_embedding"]:
            x = x + self.transformer.wpe.weight[:T]
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        w = self.transformer.wte.weight if self.cfg["tie_embeddings"] else self.lm_head.weight
        logits = x @ w.t()
        if self.cfg["lm_head_bias"]:
            logits = logits + self.lm_head.bias
        return logits


def loss_fn(logits, targets, vocab_size):
    """Mean cross-entropy over the first V logits; targets == -100 are ignored."""
    logits = logits[..., :vocab_size]
    return F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1),
                           ignore_index=-100, reduction="mean")


def count_params(model):
    return sum(p.numel() for p in model.parameters())
