#!/usr/bin/env python3
"""One direction through the house: which layer may include which.

Every source file of the library (include/trainmem, src) belongs to one layer
in LAYERS below; a file includes its own layer and the layers beneath it,
never one above, and the siblings `audit` and `plan` never include each other.
The tools, examples, benchmarks and tests sit on top and see the public
headers only (never src/detail).

A file that is in no layer fails the check (new code is placed in a layer when
it is written), and so does an ALLOWED_BACK_ARROWS entry that no longer occurs
(the list only shrinks).

    check_layers.py SOURCE_DIR          exit 0 when the house is in order
"""
import re
import sys
from pathlib import Path

# Lowest first. A layer may include any layer with a smaller rank, except that
# layers of equal rank (siblings) may not include each other.
RANKS = {
    "detail": 0,  # src/detail: private helpers of no single layer
    "core": 1,    # hooks, meter, checkpoint, selective, offload, optimizer in
                  # backward, grad scaler, allocator, device, accountant, meta
    "audit": 2,   # audit, report data and writers, distributed
    "plan": 2,    # planner, CUDA prediction, CUDA allocator model, snapshots
    "models": 3,  # the reference transformer, GPT, config-file models
    "umbrella": 4,  # trainmem.h: every public header
    "app": 5,     # the command's own code (src/app, not installed): trainer,
                  # distributed trainer, the seed's variants
}

# Files by layer. Paths relative to the source directory; a directory entry
# (ending in /) takes every file under it that no longer entry names.
LAYERS = {
    "src/detail/": "detail",
    "src/detail/alloc_recorder.h": "core",
    # The checkpoint's RNG and autocast state (checkpoint.cpp defines it; the
    # command's trainers use it too, so it is exported: check_exports.py).
    "src/detail/checkpoint_state.h": "core",
    "src/detail/backward_on_meta.h": "detail", "src/detail/backward_on_meta.cpp": "detail",
    "src/detail/distributed_json.h": "audit",
    "src/detail/report_json.h": "audit",
    "include/trainmem/hooks.h": "core", "src/hooks.cpp": "core",
    "include/trainmem/meter.h": "core", "src/meter.cpp": "core",
    "include/trainmem/checkpoint.h": "core", "src/checkpoint.cpp": "core",
    "include/trainmem/selective.h": "core", "src/selective.cpp": "core",
    "include/trainmem/offload.h": "core", "src/offload.cpp": "core",
    "include/trainmem/optimizer_in_backward.h": "core", "src/optimizer_in_backward.cpp": "core",
    "include/trainmem/grad_scaler.h": "core", "src/grad_scaler.cpp": "core",
    "include/trainmem/allocator.h": "core", "src/allocator.cpp": "core",
    "include/trainmem/device.h": "core", "src/device.cpp": "core",
    "include/trainmem/format.h": "core", "src/format.cpp": "core",
    "include/trainmem/export.h": "core",  # TRAINMEM_API (Note [Exported symbols])
    "include/trainmem/accountant.h": "core", "src/accountant.cpp": "core",
    "include/trainmem/meta.h": "core", "src/meta.cpp": "core", "src/meta_rnn.cpp": "core",
    "src/detail/cpu_probe.h": "core",
    "src/detail/optimizer_state_walk.h": "core",
    "include/trainmem/timeline.h": "core", "src/timeline.cpp": "core",
    "include/trainmem/audit.h": "audit", "src/audit.cpp": "audit",
    "include/trainmem/report.h": "audit", "src/report.cpp": "audit",
    "src/html.cpp": "audit", "src/memory_viz.cpp": "audit",
    "include/trainmem/distributed.h": "audit", "src/distributed.cpp": "audit",
    "src/distributed_report.cpp": "audit",
    "include/trainmem/planner.h": "plan", "src/planner.cpp": "plan",
    "src/plan_meta_kernels.cpp": "plan", "src/predict.cpp": "plan", "src/op_cost.cpp": "plan",
    "src/region_profile.cpp": "plan", "src/plan_search.cpp": "plan",
    "src/detail/plan_internal.h": "plan",
    # The one meta allocator with its observers, and the step the predictions run.
    "src/detail/meta_allocator.h": "plan", "src/detail/meta_allocator.cpp": "plan",
    "src/detail/meta_step.h": "plan", "src/detail/meta_step.cpp": "plan",
    "include/trainmem/cuda_predict.h": "plan", "src/cuda_predict.cpp": "plan",
    "include/trainmem/cuda_allocator_model.h": "plan", "src/cuda_allocator_model.cpp": "plan",
    "include/trainmem/snapshot.h": "plan", "src/snapshot.cpp": "plan",
    "include/trainmem/block_checkpointing.h": "core", "src/block_checkpointing.cpp": "core",
    "include/trainmem/models/": "models",
    "src/transformer.cpp": "models", "src/transformer_plan.cpp": "models",
    "src/gpt.cpp": "models", "src/hf_model.cpp": "models", "src/cs336_lm.cpp": "models",
    # Forwarding headers of the models' old paths (kept for one release).
    "include/trainmem/transformer.h": "models",
    "include/trainmem/gpt.h": "models",
    "include/trainmem/hf_model.h": "models",
    "include/trainmem/trainmem.h": "umbrella",
    "src/app/": "app",
}

# Back-arrows allowed, (from file, included file): none since the models and
# the command's code left the planner's headers (issue 23). Keep it empty; the
# check fails on an entry that no longer occurs.
ALLOWED_BACK_ARROWS = set()

# Above every layer: public headers only.
TOP = ("tools/", "examples/", "bench/", "tests/")

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]((?:trainmem|detail|app)/[A-Za-z0-9_./]+)[>"]', re.M)
SOURCES = (".h", ".hpp", ".cpp", ".cc")


def layer_of(rel):
    if rel in LAYERS:
        return LAYERS[rel]
    dirs = [d for d in LAYERS if d.endswith("/") and rel.startswith(d)]
    return LAYERS[max(dirs, key=len)] if dirs else None


def resolve(name, root):
    if name == "trainmem/version.h":  # generated from cmake/version.h.in
        return None
    for base in ("include", "src"):
        if (root / base / name).is_file():
            return f"{base}/{name}"
    return f"<missing>/{name}"


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    errors, seen_back_arrows, num_edges = [], set(), 0
    files = sorted(p for d in ("include", "src", *TOP) for p in (root / d).rglob("*")
                   if p.suffix in SOURCES and p.is_file() and "/install/fake_torch" not in str(p))
    for path in files:
        rel = path.relative_to(root).as_posix()
        top = rel.startswith(TOP)
        mine = None if top else layer_of(rel)
        if not top and mine is None:
            errors.append(f"{rel}: in no layer; add it to LAYERS in tests/layering/check_layers.py")
            continue
        for name in INCLUDE.findall(path.read_text(errors="replace")):
            target = resolve(name, root)
            if target is None:
                continue
            num_edges += 1
            if target.startswith("<missing>"):
                errors.append(f"{rel}: includes {name}, which is in neither include/ nor src/")
                continue
            if top:
                if target.startswith("src/detail/") and not rel.startswith("tests/"):
                    errors.append(f"{rel}: includes {target}; tools, examples and benchmarks see public headers only")
                continue
            theirs = layer_of(target)
            if theirs is None:
                continue  # reported once, as its own file
            upward = RANKS[theirs] > RANKS[mine] or (RANKS[theirs] == RANKS[mine] and theirs != mine)
            if not upward:
                continue
            if (rel, target) in ALLOWED_BACK_ARROWS:
                seen_back_arrows.add((rel, target))
                continue
            errors.append(f"{rel} ({mine}) includes {target} ({theirs}): "
                          f"{'a sibling' if RANKS[theirs] == RANKS[mine] else 'a layer above'}")
    for paid in sorted(ALLOWED_BACK_ARROWS - seen_back_arrows):
        errors.append(f"allowed back-arrow {paid[0]} -> {paid[1]} no longer occurs: remove it from ALLOWED_BACK_ARROWS")
    for e in errors:
        print("layering:", e)
    print(f"layering: {len(files)} files, {num_edges} includes of trainmem's own headers, "
          f"{len(seen_back_arrows)} allowed back-arrows, {len(errors)} errors")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
