"""CPU training speed of the PyTorch reference model, for comparison with litgpt.c.

    /usr/bin/python3 tools/bench_torch.py [--threads 2] [-b 4] [-t 256] [--config configs/bench.yaml]

Trains tools/torch_model.py in float32 on random tokens with AdamW
(lr 3e-4, weight decay 0.1), init N(0, 0.02): 3 warm-up steps, then times 10
steps of forward + backward + optimizer step + zero_grad, and prints one line.
Attention is plain eager PyTorch: F.scaled_dot_product_attention is not used
(torch_model.py writes attention out as matmul + mask + softmax + matmul).

--ops first times torch.matmul (OpenBLAS's sgemm for float32) on the step's matmuls, the
same rows as ./tools/bench --ops (median of 7 calls), in float32 and bfloat16;
--bf16 trains under torch.autocast("cpu", dtype=torch.bfloat16) instead of float32.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_model import GPT, count_params, load_config, loss_fn  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP, STEPS = 3, 10


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-b", type=int, default=4, help="batch size")
    ap.add_argument("-t", type=int, default=256, help="sequence length")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "bench.yaml"))
    ap.add_argument("--ops", action="store_true", help="time the step's matmuls first")
    ap.add_argument("--bf16", action="store_true", help="train under bfloat16 autocast")
    return ap.parse_args()


def step_matmuls(cfg, B, T):
    """(name, trans_a, trans_b, M, N, K, per_step): as step_matmuls in tools/bench.c"""
    N, C, HS, NH, L = B * T, cfg["n_embd"], cfg["head_size"], cfg["n_head"], cfg["n_layer"]
    QKV = (NH + 2 * cfg["n_query_groups"]) * HS
    I = cfg["intermediate_size"]
    n_fc = 2 if cfg["mlp_class_name"] == "LLaMAMLP" else 1
    rows = []
    for name, ic, oc, per_step in [("qkv", C, QKV, L), ("attn.proj", NH * HS, C, L),
                                   ("mlp.fc", C, I, n_fc * L), ("mlp.proj", I, C, L),
                                   ("lm_head", C, cfg["padded_vocab_size"], 1)]:
        rows.append((name, 0, 1, N, oc, ic, per_step))
        rows.append((name + " dinp", 0, 0, N, ic, oc, per_step))
        rows.append((name + " dweight", 1, 0, oc, ic, N, per_step))
    return rows


def time_matmuls(cfg, B, T):
    print(f"  {'matmul':22s} {'M x N x K':18s} {'float32':>9s} {'bfloat16':>9s} "
          f"{'GFLOP/s':>7s} {'GFLOP/s':>7s} {'/step':>5s}")
    total = [0.0, 0.0]
    flops_total = 0.0
    for name, ta, tb, M, N, K, per_step in step_matmuls(cfg, B, T):
        ms = []
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(K, M, dtype=dtype).t() if ta else torch.randn(M, K, dtype=dtype)
            b = torch.randn(N, K, dtype=dtype).t() if tb else torch.randn(K, N, dtype=dtype)
            torch.matmul(a, b)
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                torch.matmul(a, b)
                times.append((time.perf_counter() - t0) * 1000)
            ms.append(sorted(times)[3])
        f = 2.0 * M * N * K
        kind = " tn" if ta else " nt" if tb else " nn"
        print(f"  {name:22s} {f'{M}x{N}x{K}{kind}':18s} {ms[0]:9.3f} {ms[1]:9.3f} "
              f"{f / ms[0] / 1e6:7.1f} {f / ms[1] / 1e6:7.1f} {per_step:5d}")
        total = [total[i] + ms[i] * per_step for i in range(2)]
        flops_total += f * per_step
    print(f"  {'all linears':22s} {'':18s} {total[0]:9.3f} {total[1]:9.3f} "
          f"{flops_total / total[0] / 1e6:7.1f} {flops_total / total[1] / 1e6:7.1f}")


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    cfg = load_config(args.config)
    if args.ops:
        time_matmuls(cfg, args.b, args.t)
    V = cfg["vocab_size"]
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    def step():
        idx = torch.randint(0, V, (args.b, args.t))
        targets = torch.randint(0, V, (args.b, args.t))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = loss_fn(model(idx), targets, V)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(WARMUP):
        step()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    dt = (time.perf_counter() - t0) / STEPS

    tokens = args.b * args.t
    print(f"torch {torch.__version__} {'bf16-autocast' if args.bf16 else 'float32'} threads={args.threads} B={args.b} T={args.t} "
          f"params={count_params(model)} tokens/s={tokens / dt:.0f} ms/step={dt * 1000:.1f} "
          f"attention=eager(matmul+softmax)")


if __name__ == "__main__":
    main()
