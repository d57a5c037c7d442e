"""Generate the LoRA reference data for litgpt.c's tests.

Rerun from the repository root with the Debian python (which has python3-torch):

    /usr/bin/python3 tests/make_lora_reference.py

For test-gpt2, test-pythia, test-llama and test-falcon it builds the model of tools/torch_model.py in float64
with the weights of tests/make_reference.py, then puts LoRA adapters on every target linear the
way LitGPT does: y = W x + b + (alpha / r) B A dropout(x), with separate adapters for the query,
key and value rows of the fused qkv (one dropout mask for the three, as they share the input),
and one each on attn.proj, the MLP's linears and lm_head (unless tied to the embeddings). A ~ N(0, 0.3) and B ~ N(0, 0.3) (not
LitGPT's B = 0, so that every gradient is non-zero); r 2, alpha 3.

Dropout uses litgpt.c's mask so that both sides drop the same elements: element i (row-major
over the linear's (B T, in) input) of linear k of block l (the head: l = n_layer, k = 0) is kept
when hash(key, i) >= p, with key = K ^ ((l * 7 + k + 1) * 0xD1B54A32D192ED03) mod 2^64 and hash
the splitmix64 finaliser of key + 0x9E3779B97F4A7C15 (i + 1), top 24 bits / 2^24 (litgpt.h's
lg_hash_uniform); kept elements are scaled by 1 / (1 - p). The files are written with dropout
off and with p = 0.25, K = 0x1234567.

Output: tests/reference/lora-<config>-p<0|25>.bin in tests/make_reference.py's format: every base
parameter, then every adapter (LitGPT-style names: transformer.h.0.attn.q.lora_A, ...,
lm_head.lora_B), idx, targets, loss, logits, then grad.<adapter> for every adapter. Before
writing, the float64 adapter gradients are checked against central finite differences.
"""

import os
import sys

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from torch_model import GPT, load_config, loss_fn  # noqa: E402
from make_reference import (MAGIC, SEED, B, T, finite_difference_check, init_params,  # noqa: E402
                            make_batch, write_tensor)

import struct  # noqa: E402

R, ALPHA, KEY = 2, 3.0, 0x1234567
MASK64 = (1 << 64) - 1
LINEARS_PER_BLOCK = 7  # q, k, v, proj, fc (fc_1), fc_2, mlp proj: litgpt.h's lg_lora_linear


def hash_uniform(key, index):
    """litgpt.h's lg_hash_uniform for a tensor of indices: uniform in [0, 1)."""
    z = (key + 0x9E3779B97F4A7C15 * (index + 1)) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return (z >> 40) / 16777216.0


def linear_key(layer, k):
    return KEY ^ (((layer * LINEARS_PER_BLOCK + k + 1) * 0xD1B54A32D192ED03) & MASK64)


class DropoutMask:
    """Keep-factors of one linear's input: 1 / (1 - p) where kept, 0 where dropped."""

    def __init__(self, p, key):
        self.p, self.key = p, key

    def __call__(self, x):
        if self.p == 0:
            return x
        n = x.numel()
        keep = torch.tensor([hash_uniform(self.key, i) >= self.p for i in range(n)],
                            dtype=x.dtype).view(x.shape)
        return x * keep / (1 - self.p)


class LoRALinear(nn.Module):
    """A frozen linear plus adapters; parts: (name suffix, first output row, rows) of each."""

    def __init__(self, base, parts, dropout):
        super().__init__()
        self.base, self.dropout, self.parts = base, dropout, parts
        self.scale = ALPHA / R
        for suffix, _, rows in parts:
            setattr(self, suffix + "_A", nn.Parameter(torch.zeros(R, base.in_features)))
            setattr(self, suffix + "_B", nn.Parameter(torch.zeros(rows, R)))

    def forward(self, x):
        y = self.base(x)
        u = self.dropout(x)
        extra = torch.zeros_like(y)
        for suffix, first, rows in self.parts:
            a, b = getattr(self, suffix + "_A"), getattr(self, suffix + "_B")
            extra[..., first:first + rows] = self.scale * (u @ a.t() @ b.t())
        return y + extra


class HeadLoRA(nn.Module):
    """The head's adapter: logits += (alpha / r) B A dropout(ln_f(x)) (GPT's head is a matmul)."""

    def __init__(self, C, Vp, dropout):
        super().__init__()
        self.A = nn.Parameter(torch.zeros(R, C))
        self.B = nn.Parameter(torch.zeros(Vp, R))
        self.dropout = dropout

    def forward(self, x):
        return ALPHA / R * (self.dropout(x) @ self.A.t() @ self.B.t())


def forward_with_head_lora(model, idx):
    """GPT.forward of tools/torch_model.py plus the head's adapter."""
    cfg = model.cfg
    x = model.transformer.wte(idx)
    if cfg["learned_pos_embedding"]:
        x = x + model.transformer.wpe.weight[:idx.shape[1]]
    for block in model.transformer.h:
        x = block(x)
    x = model.transformer.ln_f(x)
    w = model.transformer.wte.weight if cfg["tie_embeddings"] else model.lm_head.weight
    logits = x @ w.t()
    if model.head_lora is not None:
        logits = logits + model.head_lora(x)
    if cfg["lm_head_bias"]:
        logits = logits + model.lm_head.bias
    return logits


def add_lora(model, cfg, p):
    """Wraps every target linear; returns [(LitGPT adapter name, parameter)] in litgpt.c's
    layout order (head, then each block's q, k, v, proj, fc/fc_1, fc_2, proj)."""
    nh, nqg, hs = cfg["n_head"], cfg["n_query_groups"], cfg["head_size"]
    llama = cfg["mlp_class_name"] == "LLaMAMLP"
    C, Vp, L = cfg["n_embd"], cfg["padded_vocab_size"], cfg["n_layer"]
    adapters = []
    model.head_lora = None
    if not cfg["tie_embeddings"]:  # litgpt.c refuses a head adapter on tied embeddings
        model.head_lora = HeadLoRA(C, Vp, DropoutMask(p, linear_key(L, 0)))
        adapters = [("lm_head.lora_A", model.head_lora.A), ("lm_head.lora_B", model.head_lora.B)]
    for l, block in enumerate(model.transformer.h):
        attn = block.attn
        attn.qkv = LoRALinear(attn.qkv, [("q", 0, nh * hs), ("k", nh * hs, nqg * hs),
                                          ("v", (nh + nqg) * hs, nqg * hs)],
                              DropoutMask(p, linear_key(l, 0)))
        for part in ("q", "k", "v"):
            adapters += [(f"transformer.h.{l}.attn.{part}.lora_A", getattr(attn.qkv, part + "_A")),
                         (f"transformer.h.{l}.attn.{part}.lora_B", getattr(attn.qkv, part + "_B"))]
        attn.proj = LoRALinear(attn.proj, [("proj", 0, attn.proj.out_features)],
                               DropoutMask(p, linear_key(l, 3)))
        adapters += [(f"transformer.h.{l}.attn.proj.lora_A", attn.proj.proj_A),
                     (f"transformer.h.{l}.attn.proj.lora_B", attn.proj.proj_B)]
        mlp = block.mlp
        names = [("fc_1", 4), ("fc_2", 5), ("proj", 6)] if llama else [("fc", 4), ("proj", 6)]
        for name, k in names:
            lin = LoRALinear(getattr(mlp, name), [(name, 0, getattr(mlp, name).out_features)],
                             DropoutMask(p, linear_key(l, k)))
            setattr(mlp, name, lin)
            adapters += [(f"transformer.h.{l}.mlp.{name}.lora_A", getattr(lin, name + "_A")),
                         (f"transformer.h.{l}.mlp.{name}.lora_B", getattr(lin, name + "_B"))]
    return adapters


def make_one(name, p, outdir):
    cfg = load_config(os.path.join(ROOT, "configs", name + ".yaml"))
    V = cfg["vocab_size"]
    gen = torch.Generator().manual_seed(SEED)
    model = GPT(cfg).double()
    init_params(model, gen)
    base = [(n, prm.detach().clone()) for n, prm in model.named_parameters()]
    model.forward = lambda x: forward_with_head_lora(model, x)
    idx, targets = make_batch(V, gen)
    adapters = add_lora(model, cfg, p)
    with torch.no_grad():
        for _, prm in adapters:
            prm.copy_(0.3 * torch.randn(prm.shape, generator=gen, dtype=torch.float64))
    for prm in model.parameters():
        prm.requires_grad_(False)
    for _, prm in adapters:
        prm.requires_grad_(True)
    logits = model(idx)
    loss = loss_fn(logits, targets, V)
    loss.backward()
    worst = finite_difference_check(model, idx, targets, V, gen, per_param=2, params=adapters)
    records = base + adapters + [("idx", idx), ("targets", targets), ("loss", loss), ("logits", logits)]
    records += [("grad." + n, prm.grad) for n, prm in adapters]
    path = os.path.join(outdir, f"lora-{name}-p{int(p * 100)}.bin")
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<I", len(records)))
        for n, t in records:
            write_tensor(f, n, t)
    print(f"{name} dropout {p}: {len(adapters)} adapter tensors, loss={loss.item():.6f}, "
          f"fd-check worst rel err={worst:.2e} -> {path} ({os.path.getsize(path)} bytes)")


def main():
    torch.set_default_dtype(torch.float64)
    outdir = os.path.join(ROOT, "tests", "reference")
    for name in ("test-gpt2", "test-pythia", "test-llama", "test-falcon"):
        for p in (0.0, 0.25):
            make_one(name, p, outdir)


if __name__ == "__main__":
    main()
