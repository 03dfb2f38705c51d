"""What Hugging Face transformers' causal LM of a config.json saves for
backward: the oracle of `trainmem estimate --model FILE`'s activation_bytes.

Builds the model transformers builds from the config (fp32 on CPU,
attn_implementation "sdpa", every dropout 0, model.train()), runs one
training forward with labels = input_ids under
torch.autograd.graph.saved_tensors_hooks and counts what autograd saves as
trainmem's SavedTensorMeter does: each storage once, parameters (and
buffers) excluded by storage. Prints one JSON document:

  {"transformers": VERSION, "torch": VERSION, "config": PATH, "batch": B,
   "seq_len": T, "num_params": P, "saved_bytes": S,
   "saved": [{"node": GRAD_FN, "shape": [...], "dtype": "float32",
              "bytes": STORAGE_BYTES, "new": true}, ...]}

where "saved" lists every tensor packed, in the order autograd packed them,
with the node that saved it (found by walking the graph from the loss), and
"new" is false for a storage counted already or a parameter's. Exits 77
(skipped) without transformers. No network: the config is a local file.

With --check, compares each CONFIG at BATCH x SEQ_LEN with
`trainmem estimate --model CONFIG --batch BATCH --seq-len SEQ_LEN --json`:
its num_params, activation_bytes and step_peak.activation_bytes must equal
transformers' parameters and saved bytes (the ctest
hf.saved_bytes_match_transformers).

With --precision bf16-autocast (after --check, or anywhere in the first
form) the forward runs under torch.autocast("cpu", torch.bfloat16) (with
fp16-autocast, torch.float16); with
--precision bf16 the model is cast to torch.bfloat16 first (as
from_pretrained(torch_dtype=torch.bfloat16)), with --precision fp16 to
torch.float16. The command is given the same
flag: its saved bytes come from the CPU kernels (and CPU autocast's casts)
run on meta.

With --lora RANK:ALPHA:TARGET,TARGET... the model is wrapped by peft's
get_peft_model(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=[...],
lora_dropout=0)) (peft PEFT_VERSION, pinned by scripts/bootstrap.sh), and the
command is given --lora-rank, --lora-alpha and --lora-targets: its
parameters, trainable parameters (those with requires_grad) and saved bytes
must equal peft's. Exits 77 (skipped) without peft.

usage: hf_saved_bytes.py CONFIG.json BATCH SEQ_LEN [--no-list] [--precision P] [--lora R:A:T,...]
       hf_saved_bytes.py --check TRAINMEM_CLI [--precision P] [--lora R:A:T,...] CONFIG.json:BATCH:SEQ_LEN...
"""
import contextlib
import json
import subprocess
import sys

try:
    import torch
    import transformers
except ImportError as e:  # optional check
    print(f"skipped: {e}")
    sys.exit(77)

CONFIGS = {
    "gpt2": "GPT2Config",
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}
DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout",
            "summary_first_dropout")


def hf_config(path):
    with open(path) as f:
        d = json.load(f)
    config = getattr(transformers, CONFIGS[d["model_type"]]).from_dict(d)
    for key in DROPOUTS:
        if hasattr(config, key):
            setattr(config, key, 0.0)
    config._attn_implementation = "sdpa"
    return config


def hf_model(path):
    model = transformers.AutoModelForCausalLM.from_config(hf_config(path), attn_implementation="sdpa")
    return model.float().train()


def num_params(model):
    return sum(p.numel() for p in model.parameters())  # a tied head once


def storage_key(t):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def saved_nodes(root, unpacked):
    """The index of each packed tensor -> the name of the graph node that
    saved it (reading a node's saved value unpacks it: `unpacked` records
    the index)."""
    names, seen, stack = {}, set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            del unpacked[:]
            try:
                getattr(node, attr)
            except Exception:  # noqa: BLE001 (a freed or odd saved value)
                continue
            for i in unpacked:
                names.setdefault(i, node.name())
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def autocast(precision):
    if precision in ("fp32", "bf16", "fp16"):
        return contextlib.nullcontext()
    if precision == "bf16-autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if precision == "fp16-autocast":
        return torch.autocast("cpu", dtype=torch.float16)
    raise SystemExit(f"unknown --precision {precision}")


def parse_lora(spec):
    rank, alpha, targets = spec.split(":", 2)
    return int(rank), float(alpha), targets.split(",")


def with_lora(model, spec):
    try:
        import peft
    except ImportError as e:
        print(f"skipped: {e}")
        sys.exit(77)
    rank, alpha, targets = parse_lora(spec)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    return peft.get_peft_model(model, config), peft.__version__


def measure(path, batch, seq_len, precision="fp32", lora=None):
    torch.manual_seed(0)
    model = hf_model(path)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    elif precision == "fp16":
        model = model.to(torch.float16)
    peft_version = None
    if lora:
        model, peft_version = with_lora(model, lora)
    vocab = model.config.vocab_size
    excluded = {storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
    tokens = torch.tensor([[(7 * b + 3 * t + 1) % vocab for t in range(seq_len)] for b in range(batch)])
    packed = []  # (tensor, new)
    counted = set()

    def pack(t):
        key = storage_key(t)
        new = key not in excluded and key not in counted
        counted.add(key)
        packed.append((t, new))  # held: no address is reused meanwhile
        return len(packed) - 1

    unpacked = []

    def unpack(i):
        unpacked.append(i)
        return packed[i][0]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), autocast(precision):
        loss = model(input_ids=tokens, labels=tokens).loss
    names = saved_nodes(loss.grad_fn, unpacked)
    saved = [{"node": names.get(i, "?"), "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
              "bytes": t.untyped_storage().nbytes(), "new": new} for i, (t, new) in enumerate(packed)]
    loss.backward()  # the graph is whole: every saved tensor was usable
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "config": path,
        "architecture": type(model).__name__,
        "batch": batch,
        "seq_len": seq_len,
        "precision": precision,
        "lora": lora,
        "peft": peft_version,
        "num_params": num_params(model),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "saved_bytes": sum(s["bytes"] for s in saved if s["new"]),
        "saved": saved,
    }


def check(cli, cases, precision, lora):
    bad = 0
    for case in cases:
        path, batch, seq_len = case.rsplit(":", 2)
        command = [cli, "estimate", "--model", path, "--json", "--batch", batch, "--seq-len", seq_len,
                   "--precision", precision]
        if lora:
            rank, alpha, targets = parse_lora(lora)
            command += ["--lora-rank", str(rank), "--lora-alpha", str(alpha), "--lora-targets", ",".join(targets)]
        ours = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        theirs = measure(path, int(batch), int(seq_len), precision, lora)
        got = (ours["num_params"], ours["trainable_params"], ours["activation_bytes"],
               ours["step_peak"]["activation_bytes"])
        want = (theirs["num_params"], theirs["trainable_params"], theirs["saved_bytes"], theirs["saved_bytes"])
        ok = got == want
        bad += not ok
        under = f"transformers {theirs['transformers']} {theirs['architecture']}" + (
            f" with peft {theirs['peft']} LoRA {lora}" if lora else "")
        print(f"{path} batch {batch} x {seq_len}, {precision}: parameters trainmem {got[0]:,} ({got[1]:,} trainable), "
              f"{under} {want[0]:,} ({want[1]:,}); saved bytes trainmem {got[2]:,} (step peak's {got[3]:,}), "
              f"theirs {want[2]:,}{'' if ok else '  MISMATCH'}")
    if bad:
        sys.exit(1)
    print("saved bytes match transformers")


def main():
    argv = sys.argv[1:]
    precision = "fp32"
    if "--precision" in argv:
        i = argv.index("--precision")
        precision = argv[i + 1]
        del argv[i:i + 2]
    lora = None
    if "--lora" in argv:
        i = argv.index("--lora")
        lora = argv[i + 1]
        del argv[i:i + 2]
    if len(argv) > 1 and argv[0] == "--check":
        check(argv[1], argv[2:], precision, lora)
        return
    args = [a for a in argv if not a.startswith("--")]
    if len(args) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    result = measure(args[0], int(args[1]), int(args[2]), precision, lora)
    if "--no-list" in sys.argv:
        del result["saved"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
