"""CPU training speed of the PyTorch reference model, for comparison with litgpt.c.

    /usr/bin/python3 tools/bench_torch.py [--threads 2] [-b 4] [-t 256] [--config configs/bench.yaml]

Trains tools/torch_model.py in float32 on random tokens with AdamW
(lr 3e-4, weight decay 0.1), init N(0, 0.02): 3 warm-up steps, then times 10
steps of forward + backward + optimizer step + zero_grad, and prints one line.
Attention is plain eager PyTorch: F.scaled_dot_product_attention is not used
(torch_model.py writes attention out as matmul + mask + softmax + matmul).
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
    return ap.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    cfg = load_config(args.config)
    V = cfg["vocab_size"]
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    def step():
        idx = torch.randint(0, V, (args.b, args.t))
        targets = torch.randint(0, V, (args.b, args.t))
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
    print(f"torch {torch.__version__} threads={args.threads} B={args.b} T={args.t} "
          f"params={count_params(model)} tokens/s={tokens / dt:.0f} ms/step={dt * 1000:.1f} "
          f"attention=eager(matmul+softmax)")


if __name__ == "__main__":
    main()
