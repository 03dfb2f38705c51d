"""Counts each config's parameters with Hugging Face transformers (a model
built on the meta device, tied weights counted once) and compares them with
`trainmem estimate --model FILE --json`. Exits 77 (skipped) without
transformers; no network: the configs are local files.

usage: hf_params.py TRAINMEM_CLI CONFIG.json...
"""
import json
import subprocess
import sys

try:
    import torch
    import transformers
except ImportError as e:  # optional check
    print(f"skipped: {e}")
    sys.exit(77)


def hf_count(path):
    with open(path) as f:
        d = json.load(f)
    cls = getattr(transformers, {"gpt2": "GPT2Config", "llama": "LlamaConfig", "mistral": "MistralConfig",
                                 "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[d["model_type"]])
    config = cls.from_dict(d)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def main():
    cli, paths = sys.argv[1], sys.argv[2:]
    bad = 0
    for path in paths:
        out = subprocess.run([cli, "estimate", "--model", path, "--json", "--batch", "1", "--seq-len", "8"],
                             check=True, capture_output=True, text=True).stdout
        ours = json.loads(out)["num_params"]
        theirs = hf_count(path)
        print(f"{path}: trainmem {ours:,}, transformers {transformers.__version__} {theirs:,}")
        bad += ours != theirs
    if bad:
        sys.exit(1)
    print("parameter counts match transformers")


if __name__ == "__main__":
    main()
