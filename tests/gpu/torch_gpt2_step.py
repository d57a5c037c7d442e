"""The GPT-2 124M training step in PyTorch on GPU 0, beside test_cuda --bench (tests/gpu/run.sh).

    python3 tests/gpu/torch_gpt2_step.py [-b 16] [-t 1024] [--mode eager|compile|both]

The same step as litgpt.c's benchmark: GPT-2 124M (configs/gpt2.yaml: 12 layers, 12 heads,
768 channels, vocabulary 50257 padded to 50304, tied embeddings), bf16 autocast over fp32
weights (litgpt.c's bf16-mixed), AdamW (fused), random tokens; attention through
F.scaled_dot_product_attention (causal). 3 warm-up steps, then 10 timed ones; one line a mode:
"torch <mode> B <b> T <t> tokens/s <n>".
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

LAYERS, HEADS, C, V, VP = 12, 12, 768, 50257, 50304
WARMUP, STEPS = 3, 10


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
        q, k, v = (z.view(B, T, HEADS, C // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, T):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VP, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)[..., :V]  # tied embeddings
        return F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1))


def init(model):
    residual_std = 0.02 / math.sqrt(2 * LAYERS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "ln" in name and name.endswith("weight") else 0.0)
            else:
                p.normal_(0.0, residual_std if name.endswith(("proj.weight",)) else 0.02)


def tokens_per_second(mode, B, T):
    torch.manual_seed(0)
    model = GPT2(T).cuda()
    init(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    forward = torch.compile(model) if mode == "compile" else model
    idx = torch.randint(0, V, (B, T), device="cuda")
    targets = torch.randint(0, V, (B, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    return STEPS * B * T / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-b", type=int, default=16)
    ap.add_argument("-t", type=int, default=1024)
    ap.add_argument("--mode", choices=["eager", "compile", "both"], default="both")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    for mode in ["eager", "compile"] if args.mode == "both" else [args.mode]:
        rate = tokens_per_second(mode, args.b, args.t)
        print(f"torch {mode} B {args.b} T {args.t} tokens/s {rate:.0f}", flush=True)


if __name__ == "__main__":
    main()
