"""Write small Hugging Face model directories from the reference weights.

Run from the repository root with any Python 3 (standard library only):

    python3 tests/make_hf_dirs.py

For each of test-gpt2, test-pythia, test-llama, test-falcon and test-llama31
it reads the LitGPT-named
weights of tests/reference/<name>.bin (format in tests/make_reference.py) and
writes tests/hf/<family>/ as the Hugging Face library lays such a model out:
config.json plus model.safetensors (the Llama one split into two shards with
model.safetensors.index.json).  The C test loads each directory through
--load's code and must reproduce the reference logits; the output is committed
so the tests need no Python.

The conversion is written here from the Hugging Face conventions, separately
from litgpt.h's:

* GPT2LMHeadModel: Conv1D layers (c_attn, c_proj, c_fc, mlp.c_proj) keep their
  weight as (in_features, out_features), the transpose of a Linear weight.
  c_attn's output columns are q, then k, then v, as in LitGPT.  The head is
  tied to wte and not stored.
* GPTNeoXForCausalLM: query_key_value's output rows are grouped by head: for
  each head its q rows, its k rows, its v rows (the model views the output as
  (heads, 3 * head_size) and splits the last dimension).  LitGPT's fused qkv
  holds all query heads, then all key heads, then all value heads.  Rotary
  embeddings rotate the first rotary_pct * head_size dims of each head in the
  rotate-half convention.
* LlamaForCausalLM: separate q_proj, k_proj, v_proj; gate_proj is LitGPT's
  fc_1 (the one passed through SiLU), up_proj is fc_2, down_proj is proj.
  Its rotary embedding is rotate-half (x1 = x[:d/2], x2 = x[d/2:]) with
  inv_freq = base^(-2j/d), the same convention as LitGPT's: the weights need no
  permutation.  (The permutation people mention is for Meta's original
  checkpoints, whose rotary pairs adjacent dims (2j, 2j+1).)
  Llama 3.1/3.2 add "rope_scaling": {"rope_type": "llama3", "factor",
  "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}.
* FalconForCausalLM (Falcon-7B's layout: new_decoder_architecture false,
  multi_query true, parallel_attn true, alibi false, bias false): blocks under
  transformer.h.N with one input_layernorm (weight and bias) feeding both
  self_attention and mlp; self_attention.query_key_value holds n_head query
  heads, then the one key head, then the one value head (the model views its
  output as (n_head + 2, head_dim) and takes [:-2], [-2], [-1]);
  self_attention.dense, mlp.dense_h_to_4h, mlp.dense_4h_to_h;
  transformer.word_embeddings, transformer.ln_f, lm_head.  The head is tied
  unless tie_word_embeddings is false.

Hugging Face's vocab_size is the number of embedding rows, LitGPT's padded
vocabulary (32 here).
"""

import json
import os
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_reference(path):
    """LGREF001 -> {name: (shape, flat list of floats)} for the float tensors."""
    tensors = {}
    with open(path, "rb") as f:
        assert f.read(8) == b"LGREF001"
        (count,) = struct.unpack("<I", f.read(4))
        for _ in range(count):
            (name_len,) = struct.unpack("<I", f.read(4))
            name = f.read(name_len).decode()
            dtype, ndim = struct.unpack("<II", f.read(8))
            shape = list(struct.unpack(f"<{ndim}I", f.read(4 * ndim)))
            n = 1
            for d in shape:
                n *= d
            data = f.read(4 * n)
            if dtype == 0:
                tensors[name] = (shape, list(struct.unpack(f"<{n}f", data)))
    return tensors


def read_yaml(path):
    cfg = {}
    for line in open(path):
        line = line.split("#")[0]
        if ":" in line and not line[0].isspace():
            key, value = line.split(":", 1)
            cfg[key.strip()] = value.strip()
    return cfg


def transpose(shape, data):
    rows, cols = shape
    return [cols, rows], [data[r * cols + c] for c in range(cols) for r in range(rows)]


def rows_of(shape, data, first, count):
    cols = shape[1] if len(shape) == 2 else 1
    out_shape = [count, shape[1]] if len(shape) == 2 else [count]
    return out_shape, data[first * cols:(first + count) * cols]


def neox_qkv(shape, data, n_head, head_size):
    """LitGPT (all q heads, all k, all v) -> GPT-NeoX (per head: q, k, v)."""
    cols = shape[1] if len(shape) == 2 else 1
    out = []
    for h in range(n_head):
        for part in range(3):
            first = (part * n_head + h) * head_size
            out += data[first * cols:(first + head_size) * cols]
    return shape, out


def gpt2(w, cfg):
    hf = {"transformer.wte.weight": w["transformer.wte.weight"],
          "transformer.wpe.weight": w["transformer.wpe.weight"],
          "transformer.ln_f.weight": w["transformer.ln_f.weight"],
          "transformer.ln_f.bias": w["transformer.ln_f.bias"]}
    for l in range(int(cfg["n_layer"])):
        p, q = f"transformer.h.{l}.", f"transformer.h.{l}."
        for ours, theirs in [("norm_1", "ln_1"), ("norm_2", "ln_2")]:
            for kind in ("weight", "bias"):
                hf[f"{q}{theirs}.{kind}"] = w[f"{p}{ours}.{kind}"]
        for ours, theirs in [("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                             ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")]:
            hf[f"{q}{theirs}.weight"] = transpose(*w[f"{p}{ours}.weight"])
            hf[f"{q}{theirs}.bias"] = w[f"{p}{ours}.bias"]
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
              "vocab_size": int(cfg["padded_vocab_size"]), "n_positions": int(cfg["block_size"]),
              "n_ctx": int(cfg["block_size"]), "n_embd": int(cfg["n_embd"]),
              "n_layer": int(cfg["n_layer"]), "n_head": int(cfg["n_head"]), "n_inner": None,
              "activation_function": "gelu_new", "layer_norm_epsilon": float(cfg["norm_eps"]),
              "tie_word_embeddings": True, "torch_dtype": "float32"}
    if int(cfg["intermediate_size"]) != 4 * int(cfg["n_embd"]):
        config["n_inner"] = int(cfg["intermediate_size"])
    return hf, config


def pythia(w, cfg):
    nh, hs = int(cfg["n_head"]), int(cfg["head_size"])
    hf = {"gpt_neox.embed_in.weight": w["transformer.wte.weight"],
          "gpt_neox.final_layer_norm.weight": w["transformer.ln_f.weight"],
          "gpt_neox.final_layer_norm.bias": w["transformer.ln_f.bias"],
          "embed_out.weight": w["lm_head.weight"]}
    for l in range(int(cfg["n_layer"])):
        p, q = f"transformer.h.{l}.", f"gpt_neox.layers.{l}."
        for kind in ("weight", "bias"):
            hf[f"{q}input_layernorm.{kind}"] = w[f"{p}norm_1.{kind}"]
            hf[f"{q}post_attention_layernorm.{kind}"] = w[f"{p}norm_2.{kind}"]
            hf[f"{q}attention.query_key_value.{kind}"] = neox_qkv(*w[f"{p}attn.qkv.{kind}"], nh, hs)
            hf[f"{q}attention.dense.{kind}"] = w[f"{p}attn.proj.{kind}"]
            hf[f"{q}mlp.dense_h_to_4h.{kind}"] = w[f"{p}mlp.fc.{kind}"]
            hf[f"{q}mlp.dense_4h_to_h.{kind}"] = w[f"{p}mlp.proj.{kind}"]
    config = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
              "vocab_size": int(cfg["padded_vocab_size"]),
              "max_position_embeddings": int(cfg["block_size"]), "hidden_size": int(cfg["n_embd"]),
              "num_hidden_layers": int(cfg["n_layer"]), "num_attention_heads": nh,
              "intermediate_size": int(cfg["intermediate_size"]), "hidden_act": "gelu",
              "rotary_pct": float(cfg["rotary_percentage"]), "rotary_emb_base": float(cfg["rope_base"]),
              "layer_norm_eps": float(cfg["norm_eps"]), "use_parallel_residual": True,
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    return hf, config


def llama(w, cfg):
    nh, ng, hs = int(cfg["n_head"]), int(cfg["n_query_groups"]), int(cfg["head_size"])
    hf = {"model.embed_tokens.weight": w["transformer.wte.weight"],
          "model.norm.weight": w["transformer.ln_f.weight"],
          "lm_head.weight": w["lm_head.weight"]}
    for l in range(int(cfg["n_layer"])):
        p, q = f"transformer.h.{l}.", f"model.layers.{l}."
        hf[f"{q}input_layernorm.weight"] = w[f"{p}norm_1.weight"]
        hf[f"{q}post_attention_layernorm.weight"] = w[f"{p}norm_2.weight"]
        qkv = w[f"{p}attn.qkv.weight"]
        hf[f"{q}self_attn.q_proj.weight"] = rows_of(*qkv, 0, nh * hs)
        hf[f"{q}self_attn.k_proj.weight"] = rows_of(*qkv, nh * hs, ng * hs)
        hf[f"{q}self_attn.v_proj.weight"] = rows_of(*qkv, (nh + ng) * hs, ng * hs)
        hf[f"{q}self_attn.o_proj.weight"] = w[f"{p}attn.proj.weight"]
        hf[f"{q}mlp.gate_proj.weight"] = w[f"{p}mlp.fc_1.weight"]
        hf[f"{q}mlp.up_proj.weight"] = w[f"{p}mlp.fc_2.weight"]
        hf[f"{q}mlp.down_proj.weight"] = w[f"{p}mlp.proj.weight"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": int(cfg["padded_vocab_size"]),
              "max_position_embeddings": int(cfg["block_size"]), "hidden_size": int(cfg["n_embd"]),
              "intermediate_size": int(cfg["intermediate_size"]),
              "num_hidden_layers": int(cfg["n_layer"]), "num_attention_heads": nh,
              "num_key_value_heads": ng, "hidden_act": "silu", "rms_norm_eps": float(cfg["norm_eps"]),
              "rope_theta": float(cfg["rope_base"]), "rope_scaling": None,
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    return hf, config


def llama31(w, cfg, rope):
    hf, config = llama(w, cfg)
    config["head_dim"] = int(cfg["head_size"])
    config["rope_scaling"] = {"rope_type": "llama3", "factor": float(rope["factor"]),
                              "low_freq_factor": float(rope["low_freq_factor"]),
                              "high_freq_factor": float(rope["high_freq_factor"]),
                              "original_max_position_embeddings": int(rope["original_max_seq_len"])}
    return hf, config


def falcon(w, cfg):
    assert int(cfg["n_query_groups"]) == 1, "Falcon-7B's layout is multi-query"
    hf = {"transformer.word_embeddings.weight": w["transformer.wte.weight"],
          "transformer.ln_f.weight": w["transformer.ln_f.weight"],
          "transformer.ln_f.bias": w["transformer.ln_f.bias"],
          "lm_head.weight": w["lm_head.weight"]}
    for l in range(int(cfg["n_layer"])):
        p, q = f"transformer.h.{l}.", f"transformer.h.{l}."
        for kind in ("weight", "bias"):
            hf[f"{q}input_layernorm.{kind}"] = w[f"{p}norm_1.{kind}"]
        # q heads, then k, then v: the same rows as LitGPT's fused qkv
        hf[f"{q}self_attention.query_key_value.weight"] = w[f"{p}attn.qkv.weight"]
        hf[f"{q}self_attention.dense.weight"] = w[f"{p}attn.proj.weight"]
        hf[f"{q}mlp.dense_h_to_4h.weight"] = w[f"{p}mlp.fc.weight"]
        hf[f"{q}mlp.dense_4h_to_h.weight"] = w[f"{p}mlp.proj.weight"]
    config = {"architectures": ["FalconForCausalLM"], "model_type": "falcon",
              "vocab_size": int(cfg["padded_vocab_size"]), "hidden_size": int(cfg["n_embd"]),
              "num_hidden_layers": int(cfg["n_layer"]),
              "num_attention_heads": int(cfg["n_head"]), "multi_query": True,
              "new_decoder_architecture": False, "parallel_attn": True, "alibi": False,
              "bias": False, "layer_norm_epsilon": float(cfg["norm_eps"]),
              "max_position_embeddings": int(cfg["block_size"]),
              "rope_theta": float(cfg["rope_base"]), "tie_word_embeddings": False,
              "torch_dtype": "float32"}
    if int(cfg["intermediate_size"]) != 4 * int(cfg["n_embd"]):
        config["ffn_hidden_size"] = int(cfg["intermediate_size"])
    return hf, config


def read_rope_adjustments(path):
    """The indented lines under rope_adjustments: -> {key: text}."""
    rope, inside = {}, False
    for line in open(path):
        line = line.split("#")[0]
        if ":" not in line:
            continue
        key, value = (x.strip() for x in line.split(":", 1))
        if not line[0].isspace():
            inside = key == "rope_adjustments" and value == ""
        elif inside:
            rope[key] = value
    return rope


def write_safetensors(path, tensors):
    """tensors: {name: (shape, floats)} -> F32 safetensors, names sorted as the library does."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        shape, data = tensors[name]
        blob = struct.pack(f"<{len(data)}f", *data)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def write_dir(out, hf, config, shards):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    if shards == 1:
        write_safetensors(os.path.join(out, "model.safetensors"), hf)
        return
    names = sorted(hf)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: hf[n] for n in names[k::shards]}
        write_safetensors(os.path.join(out, file), part)
        weight_map.update({n: file for n in part})
    total = sum(4 * len(d) for _, d in hf.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")


def main():
    llama3 = lambda w, cfg: llama31(w, cfg, read_rope_adjustments(  # noqa: E731
        os.path.join(ROOT, "configs", "test-llama31.yaml")))
    for config_name, family, convert, shards in [("test-gpt2", "gpt2", gpt2, 1),
                                                 ("test-pythia", "pythia", pythia, 1),
                                                 ("test-llama", "llama", llama, 2),
                                                 ("test-falcon", "falcon", falcon, 1),
                                                 ("test-llama31", "llama31", llama3, 1)]:
        cfg = read_yaml(os.path.join(ROOT, "configs", config_name + ".yaml"))
        weights = read_reference(os.path.join(ROOT, "tests", "reference", config_name + ".bin"))
        hf, config = convert(weights, cfg)
        out = os.path.join(ROOT, "tests", "hf", family)
        write_dir(out, hf, config, shards)
        print(f"{out}: {len(hf)} tensors, {shards} file(s)")


if __name__ == "__main__":
    main()
