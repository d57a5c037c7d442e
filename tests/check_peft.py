"""Reads a LoRA checkpoint's PEFT files the way a Python user's tools do, independently of
litgpt.c: applies adapter_model.safetensors (with adapter_config.json's r, lora_alpha,
rank_pattern, alpha_pattern and fan_in_fan_out) to the base model's Hugging Face weights and
compares the result with the checkpoint's merged model.safetensors.

    python3 tests/check_peft.py BASE_DIR CHECKPOINT_DIR

Python's standard library only (safetensors is a JSON header and raw little-endian arrays).
Prints one line; exit 0 when every tensor matches within the tolerance of the run's precision
(training_state.safetensors records it), relative to the tensor's largest value, else 1.
"""

import json
import os
import struct
import sys


# The run's precision -> the tolerance of the merged model, relative to a tensor's scale. The
# half-precision runs hold the frozen base in half precision and write the merged model in it:
# up to three roundings (the base, the adapters, the merged sum) of the format's unit roundoff
# (bf16: 2^-8, fp16: 2^-11). 32-true merges in fp32.
TOLERANCES = {
    "32-true": 1e-5,
    "bf16-mixed": 3 * 2.0**-8, "bf16-true": 3 * 2.0**-8,
    "16-mixed": 3 * 2.0**-11, "16-true": 3 * 2.0**-11,
}


def run_precision(checkpoint):
    """The precision training_state.safetensors' metadata records."""
    with open(os.path.join(checkpoint, "training_state.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        metadata = json.loads(f.read(n)).get("__metadata__", {})
    precision = metadata.get("precision")
    if precision not in TOLERANCES:
        raise ValueError(f"{checkpoint}/training_state.safetensors: precision {precision!r} "
                         f"is not one of {', '.join(TOLERANCES)}")
    return precision


def read_safetensors(path):
    """name -> (shape, list of floats) for F32, BF16 and F16 tensors."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[begin:end]
        if info["dtype"] == "F32":
            values = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        elif info["dtype"] == "BF16":
            values = [struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)]
        elif info["dtype"] == "F16":
            values = list(struct.unpack(f"<{len(raw) // 2}e", raw))
        else:
            raise ValueError(f"{path}: {name} is {info['dtype']}")
        out[name] = (info["shape"], values)
    return out


def read_model(directory):
    """Every tensor of model.safetensors, or of the shards an index lists."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(directory, "model.safetensors"))
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(directory, name)))
    return tensors


def pattern_value(patterns, module, default):
    """PEFT's rank_pattern / alpha_pattern: a key matches a module name ending in it."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key):
            return value
    return default


def merge(base, adapters, config):
    """base tensors with every adapter applied: W += (alpha / r) B A (transposed for Conv1D)."""
    merged = {name: (shape, list(values)) for name, (shape, values) in base.items()}
    prefix = "base_model.model."
    modules = sorted({name[len(prefix):name.index(".lora_")] for name in adapters})
    for module in modules:
        a_shape, a = adapters[f"{prefix}{module}.lora_A.weight"]
        b_shape, b = adapters[f"{prefix}{module}.lora_B.weight"]
        r = pattern_value(config.get("rank_pattern", {}), module, config["r"])
        alpha = pattern_value(config.get("alpha_pattern", {}), module, config["lora_alpha"])
        assert a_shape[0] == r and b_shape[1] == r, f"{module}: rank {r} vs {a_shape}, {b_shape}"
        scale = alpha / r
        shape, w = merged[module + ".weight"]
        rows, cols = b_shape[0], a_shape[1]
        transposed = config.get("fan_in_fan_out", False)
        for o in range(rows):
            for i in range(cols):
                delta = scale * sum(b[o * r + k] * a[k * cols + i] for k in range(r))
                at = i * rows + o if transposed else o * cols + i
                w[at] += delta
    return merged, modules


def main():
    base_dir, checkpoint = sys.argv[1], sys.argv[2]
    with open(os.path.join(checkpoint, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["peft_type"] == "LORA", config["peft_type"]
    adapters = read_safetensors(os.path.join(checkpoint, "adapter_model.safetensors"))
    base = read_model(base_dir)
    expected, modules = merge(base, adapters, config)
    moved = 0.0  # the adapters' largest change of a weight, relative to its tensor's scale
    for module in modules:
        before, after = base[module + ".weight"][1], expected[module + ".weight"][1]
        scale = max(max(abs(v) for v in after), 1e-6)
        moved = max(moved, max(abs(x - y) for x, y in zip(before, after)) / scale)
    got = read_safetensors(os.path.join(checkpoint, "model.safetensors"))
    worst, worst_name = 0.0, ""
    for name, (shape, values) in got.items():
        want_shape, want = expected[name]
        assert shape == want_shape, f"{name}: {shape} vs {want_shape}"
        scale = max(max(abs(v) for v in want), 1e-6)
        err = max(abs(x - y) for x, y in zip(values, want)) / scale
        if err > worst:
            worst, worst_name = err, name
    precision = run_precision(checkpoint)
    tolerance = TOLERANCES[precision]
    # a merge that forgot the adapters would pass unless they moved the weights past the tolerance
    ok = worst < tolerance and len(modules) > 0 and moved > tolerance
    print(f"{'ok' if ok else 'FAIL'}: {len(modules)} adapted modules of {checkpoint} applied to "
          f"{base_dir} by PEFT's rules = the merged model.safetensors ({len(got)} tensors): "
          f"worst rel err {worst:.1e} in {worst_name or '-'} (tolerance {tolerance:.1e} "
          f"for {precision}; the adapters moved the weights by up to {moved:.1e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
