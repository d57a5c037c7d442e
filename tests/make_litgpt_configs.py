"""Writes tests/litgpt/NAME.yaml: LitGPT's own model_config.yaml (what litgpt's save_config
writes: yaml.dump of the Config's fields) for the shipped configs LitGPT knows. The tests load
them with lg_config_load and compare with configs/NAME.yaml. Needs PyYAML and LitGPT's
litgpt/config.py (e.g. from a clone of Lightning-AI/litgpt):

    python3 tests/make_litgpt_configs.py /path/to/litgpt/litgpt/config.py
"""
import importlib.util
import sys
from dataclasses import asdict

import yaml

NAMES = ["pythia-14m", "pythia-70m", "pythia-160m", "tiny-llama-1.1b", "Llama-2-7b-hf",
         "Meta-Llama-3-8B", "Mistral-7B-v0.1", "Qwen2.5-0.5B", "SmolLM2-135M", "Llama-3.1-8B",
         "Llama-3.1-70B", "Llama-2-70b-hf"]

spec = importlib.util.spec_from_file_location("litgpt_config", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
for name in NAMES:
    with open(f"tests/litgpt/{name}.yaml", "w") as f:
        yaml.dump(asdict(module.Config.from_name(name)), f)
