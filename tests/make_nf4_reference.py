"""Reference data for litgpt.c's NF4 tests (tests/test_nf4.c): bitsandbytes' NF4 and nf4-dq
storage, written here from the published description, independently of litgpt.h.

Rerun from the repository root (numpy; Python 3):

    /usr/bin/python3 tests/make_nf4_reference.py

It writes tests/reference/nf4.bin, which is committed, so the C tests need no Python. Where
torch is installed the script also checks its dynamic map against one built with
torch.linspace, as bitsandbytes builds it.

The format (bitsandbytes' quantize_4bit with blocksize 64 and quant_storage uint8, and
compress_statistics=True for nf4-dq, read in its 0.42.0 release, LitGPT's pin, and in its main
branch of 2026, which agree on every point below):
- Blocks of 64 consecutive elements; absmax = max |x| in fp32; each x becomes
  fp32(x * fp32(1 / absmax)) and takes the code of the nearest of the 16 NF4 values below,
  through thresholds at the midpoints of neighbouring values (computed exactly, rounded to
  fp32); a value on a threshold goes to the lower code (bitsandbytes compares x > threshold).
- Two codes a byte, the even element in the high nibble; an odd count pads the last low
  nibble with the code of 0.0 (bitsandbytes loads the missing element as 0).
- nf4-dq: offset = the mean of the absmax values; the differences fp32(absmax - offset) are
  quantized in groups of 256 blocks with bitsandbytes' signed dynamic 8-bit map: scale = max
  |difference| of the group, x = fp32(difference * fp32(1 / scale)), the nearest map entry,
  where the decision between neighbours a < b is x against fp32(fp32(a + b) * 0.5), a value
  exactly on it going to the even index (how bitsandbytes' binary search over the map ends).
- Dequantized: value = fp32(code value * absmax); nf4-dq's absmax is
  fp32(fp32(map[code] * scale) + offset).
- litgpt.c's two departures, both documented in litgpt.h: a block whose absmax is 0 (a group
  whose scale is 0) takes the code of 0.0 for every element (bitsandbytes multiplies by 1/0 and
  its NaN falls to code 0, i.e. -1.0 x 0); the mean is summed in double in block order
  (bitsandbytes sums in fp32 on the GPU).
- Storage of one tensor: packed codes, then (each part from a 4-byte boundary, gaps zero)
  nf4: fp32 absmax per block; nf4-dq: uint8 code per block, fp32 scale per group of 256
  blocks, fp32 offset.

The signed dynamic map (bitsandbytes' create_dynamic_map(signed=True)): for e = 0..6, the
means of neighbouring points of linspace(0.1, 1, 2^e + 1) in fp32, times fp32(10^(e-6)), and
their negatives; then 0 and 1.0 (256 values, sorted). torch.linspace in fp32 on the CPU
computes point j as fma(step, j, 0.1) for j < n/2, else fma(-step, n-1-j, 1.0), step =
fp32(0.9f / (n - 1)), except in its vectorised part (the first n // 16 * 16 points, vectors of
8): there a vector's first point is as above and the others are that point plus fp32(k step).

File format: as tests/make_reference.py (b"LGREF001", uint32 tensor count, then per tensor
uint32 name length, name, uint32 dtype (0 float32, 1 int32), uint32 ndim, uint32 dims, data).
Tensors:
  nf4.values (16), nf4.thresholds (15), dynamic.map (256)
  dynamic.input (float32), dynamic.codes (int32): normalized values and their 8-bit codes
  <case>.input (count float32) for each case, and for q in nf4, nf4-dq:
  <case>.<q> the stored bytes as little-endian int32 words (the storage is a multiple of 4),
  <case>.<q>.dequantized (count float32)
"""

import os
import struct
import sys
from fractions import Fraction

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "reference", "nf4.bin")

f32 = np.float32
BLOCK = 64        # elements per absmax
DQ_BLOCK = 256    # absmax values per fp32 scale (nf4-dq)

# The 16 NF4 values (bitsandbytes' table; the QLoRA paper's normal quantiles), code 0..15.
NF4 = [f32(v) for v in (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)]


def to_f32_exact(value):
    """A Fraction rounded to fp32 once (asserting the double in between is exact)."""
    d = float(value)
    assert Fraction(d) == value, "double rounding"
    return f32(d)


def fma32(a, b, c):
    return to_f32_exact(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


THRESHOLDS = [to_f32_exact((Fraction(float(NF4[k])) + Fraction(float(NF4[k + 1]))) / 2)
              for k in range(15)]


def nf4_code(x):
    """How many thresholds x is above."""
    return sum(1 for t in THRESHOLDS if x > t)


# --- bitsandbytes' signed dynamic map ---------------------------------------------------------

def linspace32(n):
    """torch.linspace(0.1, 1, n, dtype=float32) on the CPU (see the module's docstring)."""
    start, end = f32(0.1), f32(1.0)
    step = f32((end - start) / f32(n - 1))

    def scalar_point(j):
        if j < n // 2:
            return fma32(step, f32(j), start)
        return fma32(-step, f32(n - 1 - j), end)

    vectorised = n // 16 * 16
    points = []
    for j in range(n):
        if j < vectorised and j % 8:
            first = j - j % 8
            points.append(f32(scalar_point(first) + f32(f32(j - first) * step)))
        else:
            points.append(scalar_point(j))
    return points


def dynamic_map():
    values = []
    for e in range(7):
        points = linspace32(2 ** e + 1)
        power = f32(10.0 ** (e - 6))
        for a, b in zip(points[:-1], points[1:]):
            mean = f32(f32(a + b) / f32(2))
            values += [f32(power * mean), f32(-f32(power * mean))]
    values += [f32(0), f32(1)]
    assert len(values) == 256
    return sorted(values)


def check_map_against_torch(dmap):
    try:
        import torch
    except ImportError:
        print("torch not installed: the dynamic map is not checked against torch.linspace")
        return
    values = []
    for e in range(7):
        b = torch.linspace(0.1, 1, 2 ** e + 1, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0
        scaled = (10 ** (e - 6)) * means
        values += scaled.tolist() + (-scaled).tolist()
    values += [0.0, 1.0]
    expected = torch.tensor(sorted(values), dtype=torch.float32).numpy()
    got = np.array(dmap, dtype=f32)
    assert np.array_equal(expected, got), "dynamic map differs from torch's"
    print("dynamic map equals the one built with torch %s's linspace" % torch.__version__)


DYNAMIC = dynamic_map()


def dynamic_code(x):
    """The nearest entry; on the fp32 midpoint, the even index."""
    if x <= DYNAMIC[0]:
        return 0
    if x > DYNAMIC[255]:
        return 255
    hi = next(i for i in range(256) if DYNAMIC[i] >= x)
    lo = hi - 1
    mid = f32(f32(DYNAMIC[lo] + DYNAMIC[hi]) * f32(0.5))
    if x > mid:
        return hi
    if x < mid:
        return lo
    return lo if lo % 2 == 0 else hi


def dynamic_code_by_search(x):
    """The same from a descent as bitsandbytes' kernel makes it: pivot 127, steps 64 .. 1
    towards x, then the midpoint to the neighbour on x's side."""
    pivot, lower_pivot, upper_pivot = 127, 0, 255
    step = 64
    while step:
        if x > DYNAMIC[pivot]:
            lower_pivot, pivot = pivot, pivot + step
        else:
            upper_pivot, pivot = pivot, pivot - step
        step //= 2
    value = DYNAMIC[pivot]
    if x > value:
        upper = DYNAMIC[upper_pivot]
        return upper_pivot if x > f32(f32(upper + value) * f32(0.5)) else pivot
    lower = DYNAMIC[lower_pivot]
    return lower_pivot if x < f32(f32(lower + value) * f32(0.5)) else pivot


# --- quantize and dequantize ------------------------------------------------------------------

def quantize_blocks(x):
    """Packed codes (bytes) and the fp32 absmax of each block."""
    count = len(x)
    codes = [0] * count
    absmax = []
    for first in range(0, count, BLOCK):
        block = x[first:first + BLOCK]
        m = f32(max(abs(v) for v in block))
        absmax.append(m)
        inverse = f32(f32(1) / m) if m > 0 else f32(0)
        for i, v in enumerate(block):
            codes[first + i] = nf4_code(f32(v * inverse))
    if count % 2:
        codes.append(nf4_code(f32(0)))
    packed = bytes((codes[i] << 4) | codes[i + 1] for i in range(0, len(codes), 2))
    return packed, absmax


def quantize_absmax(absmax):
    total = 0.0
    for a in absmax:
        total += float(a)
    offset = f32(total / len(absmax))
    codes, scales = [], []
    for first in range(0, len(absmax), DQ_BLOCK):
        diffs = [f32(a - offset) for a in absmax[first:first + DQ_BLOCK]]
        scale = f32(max(abs(d) for d in diffs))
        inverse = f32(f32(1) / scale) if scale > 0 else f32(0)
        for d in diffs:
            x = f32(d * inverse)
            code = dynamic_code(x)
            assert code == dynamic_code_by_search(x) or scale == 0
            codes.append(code)
        scales.append(scale)
    return codes, scales, offset


def pad4(b):
    return b + bytes(-len(b) % 4)


def quantize(x, dq):
    packed, absmax = quantize_blocks(x)
    if not dq:
        return pad4(packed) + np.array(absmax, dtype="<f4").tobytes(), absmax
    codes, scales, offset = quantize_absmax(absmax)
    stored = pad4(packed) + pad4(bytes(codes)) + np.array(scales, dtype="<f4").tobytes()
    stored += np.array([offset], dtype="<f4").tobytes()
    restored = [f32(f32(DYNAMIC[c] * scales[b // DQ_BLOCK]) + offset) for b, c in enumerate(codes)]
    return stored, restored


def dequantize(x, absmax):
    codes, _ = quantize_blocks(x)
    out = []
    for i in range(len(x)):
        byte = codes[i // 2]
        code = byte >> 4 if i % 2 == 0 else byte & 15
        out.append(f32(NF4[code] * absmax[i // BLOCK]))
    return np.array(out, dtype=f32)


# --- the cases --------------------------------------------------------------------------------

def next_up(v):
    return np.nextafter(f32(v), f32(np.inf))


def next_down(v):
    return np.nextafter(f32(v), f32(-np.inf))


def cases(rng):
    normal = lambda n, std=1.0: (rng.standard_normal(n) * std).astype(f32)
    out = []
    out.append(("zeros", np.concatenate([np.zeros(BLOCK, f32), normal(BLOCK)])))
    huge = normal(3 * BLOCK)
    huge[17] = f32(1e6)
    huge[BLOCK:2 * BLOCK] *= f32(1e-3)
    huge[BLOCK + 5] = f32(-3e4)
    huge[2 * BLOCK + 40] = f32(2.0 ** 100)
    out.append(("huge", huge))
    out.append(("negative", -np.abs(normal(2 * BLOCK))))
    # absmax 1: the codes themselves, the thresholds and their fp32 neighbours; absmax 2 (an
    # exact inverse) and 3 (an inexact one) of the same
    on_grid = list(NF4) + THRESHOLDS + [next_up(t) for t in THRESHOLDS] + \
        [next_down(t) for t in THRESHOLDS]
    on_grid += [f32(0)] * (BLOCK - len(on_grid))
    on_grid = np.array(on_grid, dtype=f32)
    grid3 = np.concatenate([on_grid, on_grid * f32(2), on_grid * f32(3)])
    out.append(("codes_and_midpoints", grid3))
    for n in (1, 63, 65, 1007):
        out.append(("count%d" % n, normal(n, 0.02)))
    # more than 256 blocks: nf4-dq's groups (301 blocks: two groups, the last short and its
    # last block short), block scales that vary, two zero blocks
    blocks, n = 301, 300 * BLOCK + 7
    block_scales = np.exp(rng.standard_normal(blocks) * 0.7).astype(f32)
    many = normal(n) * np.repeat(block_scales, BLOCK)[:n]
    many = many.astype(f32)
    many[3 * BLOCK:4 * BLOCK] = 0
    many[280 * BLOCK:281 * BLOCK] = 0
    out.append(("blocks301", many))
    out.append(("blocks513", normal(513 * BLOCK, 0.05)))  # three groups, the last of one block
    return out


def dynamic_inputs():
    xs = list(DYNAMIC)
    for a, b in zip(DYNAMIC[:-1], DYNAMIC[1:]):
        mid = f32(f32(a + b) * f32(0.5))
        xs += [mid, next_up(mid), next_down(mid)]
    xs += [f32(-1), f32(1), next_up(f32(1)), f32(-2), f32(2)]
    return np.array(xs, dtype=f32)


def write(path, tensors):
    with open(path, "wb") as f:
        f.write(b"LGREF001")
        f.write(struct.pack("<I", len(tensors)))
        for name, dtype, data in tensors:
            data = np.ascontiguousarray(data, dtype="<f4" if dtype == 0 else "<i4")
            f.write(struct.pack("<I", len(name)) + name.encode())
            f.write(struct.pack("<III", dtype, 1, data.size))
            f.write(data.tobytes())


def main():
    check_map_against_torch(DYNAMIC)
    rng = np.random.RandomState(15)
    tensors = [("nf4.values", 0, NF4), ("nf4.thresholds", 0, THRESHOLDS),
               ("dynamic.map", 0, DYNAMIC)]
    xs = dynamic_inputs()
    codes = [dynamic_code(x) for x in xs]
    assert codes == [dynamic_code_by_search(x) for x in xs]
    tensors += [("dynamic.input", 0, xs), ("dynamic.codes", 1, codes)]
    for name, x in cases(rng):
        x = [f32(v) for v in x]
        tensors.append((name + ".input", 0, x))
        for q, dq in (("nf4", False), ("nf4-dq", True)):
            stored, absmax = quantize(x, dq)
            assert len(stored) % 4 == 0
            tensors.append(("%s.%s" % (name, q), 1, np.frombuffer(stored, dtype="<i4")))
            tensors.append(("%s.%s.dequantized" % (name, q), 0, dequantize(x, absmax)))
    write(OUT, tensors)
    print("wrote %s (%d tensors)" % (os.path.relpath(OUT, ROOT), len(tensors)))


if __name__ == "__main__":
    sys.exit(main())
