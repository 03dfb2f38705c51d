"""Independent check of trainmem's models (hf_model.h) against Hugging Face
transformers' (GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM; dropout 0): both fill every parameter
with the same deterministic values (by its transformers name), take the
same tokens, and must give the same causal-LM loss. Runs the C++ side as
`trainmem_tests --gtest_filter=HfModelTest.LlamaLossEqualsTransformers` with
the config in TRAINMEM_HF_CONFIG and the expected loss in TRAINMEM_HF_LLAMA_LOSS. Exits 77 (skipped) without
transformers; no network: the config is a local file.

usage: hf_llama_loss.py TRAINMEM_TESTS CONFIG.json...
"""
import os
import subprocess
import sys

try:
    import torch
    import transformers
except ImportError as e:  # optional check
    print(f"skipped: {e}")
    sys.exit(77)

from hf_saved_bytes import hf_config  # the same config as the saved-bytes oracle: sdpa, dropout 0


def fill(name_index, numel):
    # Must match tests/hf_model_test.cpp's deterministic_fill().
    k = torch.arange(numel, dtype=torch.float64)
    return (0.25 * torch.sin(0.7 * k + name_index)).to(torch.float32)


def is_norm_weight(name):
    # Must match tests/hf_model_test.cpp's is_norm_weight().
    return name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight"))


def check(tests, path):
    model = transformers.AutoModelForCausalLM.from_config(hf_config(path), attn_implementation="sdpa").float()
    config = model.config
    params = dict(model.named_parameters())  # a tied head once, as its embedding
    with torch.no_grad():
        for i, n in enumerate(sorted(params)):
            p = params[n]
            norm = is_norm_weight(n)
            p.copy_((1.0 if norm else 0.0) + fill(i, p.numel()).view_as(p))
    B, T = 2, 16
    tokens = torch.tensor([[(7 * b + 3 * t) % config.vocab_size for t in range(T)] for b in range(B)])
    loss = model(input_ids=tokens, labels=tokens).loss.item()
    print(f"{path}: transformers {transformers.__version__} {type(model).__name__} loss {loss:.9f}")
    env = dict(os.environ, TRAINMEM_HF_LLAMA_LOSS=repr(loss), TRAINMEM_HF_CONFIG=path)
    r = subprocess.run([tests, "--gtest_filter=HfModelTest.LlamaLossEqualsTransformers"], env=env,
                       capture_output=True, text=True)
    print(r.stdout[-2000:])
    return r.returncode == 0 and "[  PASSED  ] 1 test" in r.stdout and "SKIPPED" not in r.stdout


def main():
    tests, paths = sys.argv[1], sys.argv[2:]
    if not all([check(tests, p) for p in paths]):
        sys.exit(1)
    print("loss matches transformers")


if __name__ == "__main__":
    main()
