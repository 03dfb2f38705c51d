"""The PyTorch (Python) half of the side-by-side comparison.

Runs the capstone (the demo's reference transformer) with the very weights and input that trainmem_compare
--check wrote (raw little-endian fp32 plus manifest.json), through PyTorch's
own tools:

  meter        a storage-deduplicating saved_tensors_hooks meter that excludes
               parameters by storage
  full         torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
  every_2      the same on blocks 0, 2, 4, ...
  selective    create_selective_checkpoint_contexts saving mm/addmm/bmm/baddbmm
  optimizer_in_backward
               register_post_accumulate_grad_hook, one AdamW per parameter
  save_on_cpu  torch.autograd.graph.save_on_cpu(pin_memory=False): on a CPU-only
               machine its pack is tensor.cpu(), which copies nothing

Two modes, one JSON document on stdout each:

  --check DIR  saved bytes per variant and the largest absolute difference of
               its gradients (parameters after the step, for the optimizer in
               backward) from the C++ side's.
  --time DIR   step times per variant, interleaved step by step.

Needs only torch (no numpy). Times are reported, never asserted.
"""

import argparse
import functools
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts  # noqa: E402

CHECK_VARIANTS = ["plain", "full", "every_2", "selective", "optimizer_in_backward", "save_on_cpu"]
TIME_VARIANTS = ["plain", "meter", "full", "every_2", "selective", "optimizer_in_backward", "save_on_cpu"]
SAVED_OPS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
             torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default]


class Block(nn.Module):
    """One pre-LN block, as trainmem::TransformerBlockImpl::forward."""

    def __init__(self, d, h):
        super().__init__()
        self.d, self.h = d, h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, _ = x.shape
        hd = self.d // self.h
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.h, hd)  # (B, T, 3, H, hd)
        q, k, v = (qkv.select(2, i).transpose(1, 2) for i in range(3))  # (B, H, T, hd)
        attn = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        h = x + self.proj(attn.transpose(1, 2).reshape(B, T, self.d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class Transformer(nn.Module):
    def __init__(self, num_layers, d, h):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(num_layers))

    def forward(self, x, checkpointed=(), context_fn=None):
        for i, b in enumerate(self.blocks):
            if i in checkpointed:
                kw = {} if context_fn is None else {"context_fn": context_fn}
                x = checkpoint(b, x, use_reentrant=False, **kw)
            else:
                x = b(x)
        return x


def read_floats(path):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if sys.byteorder != "little":
        raise RuntimeError(f"expected a little-endian machine, but this one is {sys.byteorder}")
    return torch.frombuffer(data, dtype=torch.float32)


def load(dir_):
    with open(os.path.join(dir_, "manifest.json")) as f:
        manifest = json.load(f)
    if manifest.get("dtype") != "float32" or manifest.get("byte_order") != "little":
        raise RuntimeError(f"expected float32 little-endian files, but the manifest says "
                           f"{manifest.get('dtype')} {manifest.get('byte_order')}")
    o = manifest["options"]
    model = Transformer(o["num_layers"], o["d_model"], o["num_heads"])
    flat = read_floats(os.path.join(dir_, "params.bin"))
    state = {}
    for e in manifest["params"]:
        state[e["name"]] = flat[e["offset"]:e["offset"] + e["numel"]].view(e["shape"]).clone()
    model.load_state_dict(state, strict=True)
    x = read_floats(os.path.join(dir_, manifest["input"]["file"])).view(manifest["input"]["shape"]).clone()
    return manifest, model, x


def split_like(flat, manifest):
    return [flat[e["offset"]:e["offset"] + e["numel"]].view(e["shape"]) for e in manifest["params"]]


class Meter:
    """Bytes of unique non-parameter storages saved for backward."""

    def __init__(self, model):
        self.excluded = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen = {}

    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.excluded:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def add(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.excluded:
            self.seen[s.data_ptr()] = s.nbytes()

    @property
    def saved_bytes(self):
        return sum(self.seen.values())


class SacContexts:
    """context_fn for checkpoint that remembers each region's SAC storage, so
    the cache (which saved-tensor hooks never see) can be counted too."""

    def __init__(self):
        self.storages = []

    def __call__(self):
        caching, cached = create_selective_checkpoint_contexts(SAVED_OPS)
        self.storages.append(caching.storage)
        return caching, cached

    def cached_tensors(self):
        for storage in self.storages:
            for per_idx in storage.values():
                for entry in per_idx.values():
                    for leaf in torch.utils._pytree.tree_leaves(entry):
                        val = getattr(leaf, "val", None)
                        if isinstance(val, torch.Tensor):
                            yield val


def plan_of(variant, num_layers):
    if variant in ("full", "selective"):
        return tuple(range(num_layers))
    if variant == "every_2":
        return tuple(range(0, num_layers, 2))
    return ()


def per_param_adamw(model):
    opts = {p: torch.optim.AdamW([p], lr=1e-3, foreach=False) for p in model.parameters()}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]
    return opts, handles


def max_abs_diff(a, b):
    if len(a) != len(b):
        raise RuntimeError(f"expected {len(b)} tensors, but got {len(a)}")
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def run_check(dir_):
    manifest, base, x = load(dir_)
    L = manifest["options"]["num_layers"]
    out = {"side": "python", "torch_version": torch.__version__,
           "num_threads": torch.get_num_threads(), "variants": {}}
    own_plain = None
    for v in CHECK_VARIANTS:
        model = Transformer(L, manifest["options"]["d_model"], manifest["options"]["num_heads"])
        model.load_state_dict(base.state_dict())
        meter = Meter(model)
        entry = {}
        if v == "optimizer_in_backward":
            _, handles = per_param_adamw(model)
            with meter.hooks():
                loss = model(x).pow(2).mean()
            loss.backward()
            result = [p.detach().clone() for p in model.parameters()]
            for h in handles:
                h.remove()
            entry["saved_bytes"] = meter.saved_bytes
        elif v == "save_on_cpu":
            # torch's save_on_cpu packs with tensor.cpu(), a no-op for CPU
            # tensors; from a GPU it copies every saved tensor by its own size,
            # parameters included. Count that, and (deduplicated by storage,
            # parameters excluded) what trainmem's guard copies.
            ctx = torch.autograd.graph.save_on_cpu(pin_memory=False)
            inner = ctx.pack_hook
            copied = {"bytes": 0, "param_bytes": 0, "repeat_bytes": 0, "num": 0}

            def pack(t, inner=inner):
                nbytes = t.numel() * t.element_size()
                copied["bytes"] += nbytes
                copied["num"] += 1
                ptr = t.untyped_storage().data_ptr()
                if ptr in meter.excluded:
                    copied["param_bytes"] += nbytes
                else:
                    if ptr in meter.seen:
                        copied["repeat_bytes"] += nbytes
                    meter.add(t)
                return inner(t)

            ctx.pack_hook = pack
            with ctx:
                loss = model(x).pow(2).mean()
            loss.backward()
            result = [p.grad.clone() for p in model.parameters()]
            entry["saved_bytes"] = meter.saved_bytes
            entry["torch_device_copy_bytes"] = copied["bytes"]
            entry["torch_device_copy_param_bytes"] = copied["param_bytes"]
            entry["torch_device_copy_repeat_bytes"] = copied["repeat_bytes"]
            entry["num_packed"] = copied["num"]
        else:
            sac = SacContexts() if v == "selective" else None
            with meter.hooks():
                loss = model(x, plan_of(v, L), sac).pow(2).mean()
            entry["hooks_saved_bytes"] = meter.saved_bytes
            if sac is not None:
                for t in sac.cached_tensors():
                    meter.add(t)
                entry["sac_cache_bytes"] = meter.saved_bytes - entry["hooks_saved_bytes"]
            entry["saved_bytes"] = meter.saved_bytes
            loss.backward()
            result = [p.grad.clone() for p in model.parameters()]
            if v == "plain":
                own_plain = result
        ref = split_like(read_floats(os.path.join(dir_, manifest["variants"][v]["file"])), manifest)
        entry["max_abs_diff_vs_cpp"] = max_abs_diff(result, ref)
        entry["max_abs_value"] = max(float(t.abs().max()) for t in ref)
        if own_plain is not None and v not in ("plain", "optimizer_in_backward"):
            entry["max_abs_diff_vs_own_plain"] = max_abs_diff(result, own_plain)
        entry["compares"] = manifest["variants"][v]["compares"]
        out["variants"][v] = entry
    return out


class Runner:
    def __init__(self, variant, base, manifest):
        o = manifest["options"]
        self.name = variant
        self.model = Transformer(o["num_layers"], o["d_model"], o["num_heads"])
        self.model.load_state_dict(base.state_dict())
        self.plan = plan_of(variant, o["num_layers"])
        self.sac = functools.partial(create_selective_checkpoint_contexts, SAVED_OPS) \
            if variant == "selective" else None
        self.opt = None
        self.meter = Meter(self.model) if variant == "meter" else None
        if variant == "optimizer_in_backward":
            self.oib = per_param_adamw(self.model)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.ms = []

    def step(self, x):
        if self.opt is not None:
            self.opt.zero_grad()
        if self.meter is not None:
            self.meter.seen.clear()  # like SavedTensorMeter::reset(): keeps the exclusions
            with self.meter.hooks():
                loss = self.model(x).pow(2).mean()
        elif self.name == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=False):
                loss = self.model(x).pow(2).mean()
        else:
            loss = self.model(x, self.plan, self.sac).pow(2).mean()
        loss.backward()
        if self.opt is not None:
            self.opt.step()


def run_time(dir_, steps, warmup, variants):
    manifest, base, x = load(dir_)
    runners = [Runner(v, base, manifest) for v in variants]
    n = len(runners)
    for i in range(warmup + steps):
        for j in range(n):
            r = runners[(i + j) % n]
            t0 = time.perf_counter()
            r.step(x)
            t1 = time.perf_counter()
            if i >= warmup:
                r.ms.append((t1 - t0) * 1e3)
    return {"side": "python", "num_threads": torch.get_num_threads(),
            "variants": {r.name: {"ms": r.ms} for r in runners}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", metavar="DIR")
    mode.add_argument("--time", metavar="DIR")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default=",".join(TIME_VARIANTS))
    a = ap.parse_args()
    if a.check:
        doc = run_check(a.check)
    else:
        variants = [v for v in a.variants.split(",") if v]
        for v in variants:
            if v not in TIME_VARIANTS:
                ap.error(f"unknown variant '{v}' (expected one of {', '.join(TIME_VARIANTS)})")
        doc = run_time(a.time, a.steps, a.warmup, variants)
    json.dump(doc, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
