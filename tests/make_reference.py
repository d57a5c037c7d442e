"""Generate the reference data for litgpt.c's gradient tests.

Rerun from the repository root with the Debian python (which has python3-torch):

    /usr/bin/python3 tests/make_reference.py

It writes tests/reference/<config-name>.bin for configs/test-gpt2.yaml,
test-pythia.yaml, test-llama.yaml, test-falcon.yaml and test-llama31.yaml.  The output is committed, so the C tests
need no Python; rerun this only when the model semantics or this file change.

For each config the model (tools/torch_model.py) is built in float64 with fixed
random weights (weights N(0, 0.3), norm weights 1 + N(0, 0.1), biases
N(0, 0.1), padded vocabulary rows included), run forward and backward on a
random batch B=2, T=8 whose targets contain exactly two -100 (ignored)
positions, and everything is written as float32 / int32.  Before writing, the
float64 autograd gradients are checked against central finite differences.

File format (little-endian):
    8 bytes magic b"LGREF001"
    uint32 tensor count
    per tensor: uint32 name_len, name bytes (no NUL), uint32 dtype
                (0 = float32, 1 = int32), uint32 ndim, uint32 dims[ndim],
                data (row-major)
Tensors, in order: every parameter under its LitGPT name (model order), idx
(B,T) int32, targets (B,T) int32, loss (0-dim) float32, logits (B,T,Vp)
float32, then grad.<param name> for every parameter.
"""

import os
import struct
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from torch_model import GPT, load_config, loss_fn  # noqa: E402

CONFIGS = ["test-gpt2", "test-pythia", "test-llama", "test-falcon", "test-llama31"]
B, T = 2, 8
SEED = 1337
MAGIC = b"LGREF001"


# ---------------------------------------------------------------------------
# Weights and batch
# ---------------------------------------------------------------------------

def is_norm_weight(name):
    return name.endswith(("norm_1.weight", "norm_2.weight", "ln_f.weight"))


def init_params(model, gen):
    """Fill every parameter from gen, in model order."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if is_norm_weight(name):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.3 * noise)


def make_batch(V, gen):
    """Random idx and targets in [0, V), with exactly two targets set to -100."""
    idx = torch.randint(0, V, (B, T), generator=gen)
    targets = torch.randint(0, V, (B, T), generator=gen)
    ignored = torch.randperm(B * T, generator=gen)[:2]
    targets.view(-1)[ignored] = -100
    return idx, targets


# ---------------------------------------------------------------------------
# Finite-difference self-check
# ---------------------------------------------------------------------------

def finite_difference_check(model, idx, targets, V, gen, per_param=3, h=1e-6, params=None):
    """Compare autograd grads (already in p.grad) with central differences.

    Checks `per_param` random entries of every parameter (or of the (name, parameter) pairs
    `params`).  Returns the worst absolute error and asserts it is small relative to the
    gradient scale.
    """
    worst = 0.0
    with torch.no_grad():
        for name, p in (params if params is not None else model.named_parameters()):
            flat, gflat = p.view(-1), p.grad.view(-1)
            scale = max(gflat.abs().max().item(), 1e-3)
            picks = torch.randint(0, flat.numel(), (per_param,), generator=gen)
            for i in picks.tolist():
                orig = flat[i].item()
                flat[i] = orig + h
                lp = loss_fn(model(idx), targets, V).item()
                flat[i] = orig - h
                lm = loss_fn(model(idx), targets, V).item()
                flat[i] = orig
                fd = (lp - lm) / (2 * h)
                err = abs(fd - gflat[i].item())
                assert err <= 1e-6 * scale + 1e-8, (
                    f"{name}[{i}]: autograd {gflat[i].item():.10g} vs finite diff {fd:.10g}")
                worst = max(worst, err / scale)
    return worst


# ---------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------

def write_tensor(f, name, t):
    """Write one tensor record: float tensors as float32, integer ones as int32."""
    t = t.detach().cpu()
    if t.dtype.is_floating_point:
        code, arr = 0, t.numpy().astype("<f4")
    else:
        code, arr = 1, t.numpy().astype("<i4")
    nb = name.encode()
    f.write(struct.pack("<I", len(nb)))
    f.write(nb)
    f.write(struct.pack("<II", code, arr.ndim))
    f.write(struct.pack(f"<{arr.ndim}I", *arr.shape))
    f.write(np.ascontiguousarray(arr).tobytes())


def write_reference(path, model, idx, targets, loss, logits):
    params = list(model.named_parameters())
    records = [(n, p) for n, p in params]
    records += [("idx", idx), ("targets", targets), ("loss", loss), ("logits", logits)]
    records += [("grad." + n, p.grad) for n, p in params]
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<I", len(records)))
        for name, t in records:
            write_tensor(f, name, t)


# ---------------------------------------------------------------------------

def make_one(name, outdir):
    cfg = load_config(os.path.join(ROOT, "configs", name + ".yaml"))
    V = cfg["vocab_size"]
    gen = torch.Generator().manual_seed(SEED)

    model = GPT(cfg).double()
    init_params(model, gen)
    idx, targets = make_batch(V, gen)

    logits = model(idx)
    loss = loss_fn(logits, targets, V)
    loss.backward()

    # padded vocabulary logits must get no gradient
    for n, p in model.named_parameters():
        if n in ("lm_head.weight", "lm_head.bias"):
            assert p.grad[V:].abs().max().item() == 0.0

    worst = finite_difference_check(model, idx, targets, V, gen)

    path = os.path.join(outdir, name + ".bin")
    write_reference(path, model, idx, targets, loss, logits)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"{name}: params={nparams} loss={loss.item():.6f} "
          f"fd-check worst rel err={worst:.2e} -> {path} ({os.path.getsize(path)} bytes)")


def main():
    torch.set_default_dtype(torch.float64)
    outdir = os.path.join(ROOT, "tests", "reference")
    os.makedirs(outdir, exist_ok=True)
    for name in CONFIGS:
        make_one(name, outdir)


if __name__ == "__main__":
    main()
