"""7-8B models fine-tuned on one H100, side by side: trainmem's prediction
beside the "will it fit" estimators people use. Writes docs/llm_comparison.md.

For LLaMA-2-7B, Mistral-7B-v0.1 and Qwen3-8B (tests/data/*.json), batch 1 and
4 at 2,048 and 4,096 tokens, bf16 autocast with AdamW, with and without full
checkpointing and with and without LoRA (r 16 on q, k, v and o projections):

- trainmem: `trainmem estimate --model ... --precision bf16-autocast --gpu
  h100` (the H100's attention backend and 32 MiB cuBLAS workspace, cuBLASLt
  sharing it, as the installed LibTorch runs there): predicted
  max_memory_allocated and max_memory_reserved of the second step.
- accelerate: `accelerate estimate-memory`'s "Training using Adam" for
  bfloat16, from its Python API on the local config (calculate_maximum_sizes on
  the model built empty by transformers; no hub access): weights only.
- DeepSpeed: estimate_zero2_model_states_mem_needs and
  estimate_zero3_model_states_mem_needs on one GPU without offload (model
  states only; they take every parameter, LoRA or not).
- Korthikanti et al. (2022): activations per layer s b h (34 + 5 a s / h)
  bytes without recompute, 2 s b h with full recompute, over L layers, plus
  16 bytes per trained parameter (fp32 weights, gradients and Adam's two
  moments; with LoRA 4 bytes per frozen parameter).

usage: python bench/compare/llm_table.py TRAINMEM [--out docs/llm_comparison.md] [--quick]
DeepSpeed is imported from DEEPSPEED_PATH (a directory on sys.path) when
set; without it the DeepSpeed columns are left empty.
"""
import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = [("LLaMA-2-7B", "llama2_7b.json"), ("Mistral-7B-v0.1", "mistral_7b_v0.1.json"), ("Qwen3-8B", "qwen3_8b.json")]
LORA = ["--lora-rank", "16", "--lora-alpha", "32", "--lora-targets", "q_proj,k_proj,v_proj,o_proj"]
GB = 1e9


def trainmem(cli, config, batch, seq, checkpoint, lora):
    cmd = [cli, "estimate", "--model", config, "--batch", str(batch), "--seq-len", str(seq), "--precision",
           "bf16-autocast", "--gpu", "h100", "--checkpoint",
           checkpoint, "--json"] + (LORA if lora else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def accelerate_estimate(config_path):
    """accelerate estimate-memory's bfloat16 "Training using Adam", on the local config."""
    import transformers
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    with open(config_path) as f:
        d = json.load(f)
    config = transformers.AutoConfig.for_model(**d)
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    total_size, _ = calculate_maximum_sizes(model)
    usage = estimate_training_usage(total_size, "bfloat16")
    return max(usage.values()), total_size


def deepspeed_estimates(num_params, largest_layer):
    path = os.environ.get("DEEPSPEED_PATH")
    if not path:
        return None, None
    sys.path.insert(0, path)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        z2 = estimate_zero2_model_states_mem_needs(num_params, 1, 1, cpu_offload=False)[1]
        z3 = estimate_zero3_model_states_mem_needs(num_params, largest_layer, 1, 1, cpu_offload=False,
                                                   cpu_offload_params=False)[1]
    return z2, z3


def korthikanti(model, batch, seq, checkpoint, num_params, trainable):
    h, a, L = model["hidden_size"], model["num_heads"], model["num_layers"]
    s, b = seq, batch
    per_layer = 2 * s * b * h if checkpoint == "full" else s * b * h * (34 + 5 * a * s / h)
    static = 16 * trainable + 4 * (num_params - trainable)
    return int(per_layer * L), int(static)


def gb(x):
    return "" if x is None else f"{x / GB:.1f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cli")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "llm_comparison.md"))
    ap.add_argument("--quick", action="store_true", help="batch 1 at 2,048 tokens only")
    args = ap.parse_args()
    rows = []
    started = time.time()
    for name, file in MODELS:
        config = os.path.join(ROOT, "tests", "data", file)
        acc, acc_size = accelerate_estimate(config)
        for batch in (1,) if args.quick else (1, 4):
            for seq in (2048,) if args.quick else (2048, 4096):
                for checkpoint in ("none", "full"):
                    for lora in (False, True):
                        t0 = time.time()
                        e = trainmem(args.cli, config, batch, seq, checkpoint, lora)
                        secs = time.time() - t0
                        n, trainable = e["num_params"], e["trainable_params"]
                        z2, z3 = deepspeed_estimates(n, e["sharding"]["largest_layer_params"])
                        act, static = korthikanti(e["model"], batch, seq, checkpoint, n, trainable)
                        rows.append({
                            "model": name, "batch": batch, "seq": seq, "checkpoint": checkpoint, "lora": lora,
                            "allocated": e["cuda"]["max_memory_allocated_bytes"],
                            "reserved": e["cuda"]["max_memory_reserved_bytes"],
                            "saved": e["activation_bytes"], "num_params": n, "trainable": trainable,
                            "accelerate": acc, "accelerate_weights": acc_size, "ds_zero2": z2, "ds_zero3": z3,
                            "korthikanti_act": act, "korthikanti_total": act + static, "seconds": secs,
                        })
                        print(f"{name} b{batch} s{seq} ckpt {checkpoint} lora {lora}: allocated "
                              f"{gb(rows[-1]['allocated'])} GB, reserved {gb(rows[-1]['reserved'])} GB "
                              f"({secs:.1f} s)", flush=True)
    lines = [
        "| model | batch x tokens | checkpointing | LoRA | trainmem max allocated (GB) | trainmem max reserved (GB) "
        "| trainmem saved for backward (GB) | accelerate, Adam bf16 (GB) | DeepSpeed ZeRO-2 states (GB) "
        "| DeepSpeed ZeRO-3 states (GB) | Korthikanti activations (GB) | 16 P + Korthikanti (GB) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} x {r['seq']} | {r['checkpoint']} | {'r 16' if r['lora'] else 'no'} "
                     f"| {gb(r['allocated'])} | {gb(r['reserved'])} | {gb(r['saved'])} | {gb(r['accelerate'])} "
                     f"| {gb(r['ds_zero2'])} | {gb(r['ds_zero3'])} | {gb(r['korthikanti_act'])} "
                     f"| {gb(r['korthikanti_total'])} |")
    table = "\n".join(lines)
    print(table)
    print(f"{len(rows)} predictions in {time.time() - started:.0f} s")
    marker = "<!-- table -->"
    if os.path.exists(args.out):
        with open(args.out) as f:
            doc = f.read()
        if doc.count(marker) == 2:
            head, _, tail = doc.split(marker)
            with open(args.out, "w") as f:
                f.write(head + marker + "\n" + table + "\n" + marker + tail)
            return
    with open(args.out, "w") as f:
        f.write(marker + "\n" + table + "\n" + marker + "\n")


if __name__ == "__main__":
    main()
