#!/usr/bin/env python3
"""One direction through the house: which layer may include which.

The folders are the layers: every source file of the library belongs to the
layer of its folder (FOLDERS below: src/core, src/audit, src/plan, src/models,
src/detail for helpers of no single layer, tools/trainmem/app for the
command's own code), and a public header (include/trainmem/NAME.h) to the
layer whose folder holds src/LAYER/NAME.cpp. A file includes its own layer and
the layers beneath it, never one above, and the siblings `audit` and `plan`
never include each other. The tools, examples, benchmarks and tests sit on top
and see the public headers only (tests may look at src/).

A file that is in no layer fails the check (new code is placed in a layer's
folder when it is written), and so does an ALLOWED_BACK_ARROWS entry that no
longer occurs (the list only shrinks).

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
    "app": 5,     # the command's own code (tools/trainmem/app, not installed): trainer,
                  # distributed trainer, the capstone's variants
}

# Layers by folder: a file belongs to the layer of the longest prefix that
# names it. A public header (include/trainmem/NAME.h) belongs to the layer of
# the folder that holds its source (src/LAYER/NAME.cpp); PUBLIC_HEADERS names
# the few with no source of that name.
FOLDERS = {
    "src/detail/": "detail",
    "src/core/": "core",
    "src/audit/": "audit",
    "src/plan/": "plan",
    "src/models/": "models",
    "include/trainmem/models/": "models",
    "tools/trainmem/app/": "app",
}
PUBLIC_HEADERS = {
    "include/trainmem/export.h": "core",  # TRAINMEM_API (Note [Exported symbols])
    "include/trainmem/trainmem.h": "umbrella",
}

# Back-arrows allowed, (from file, included file): none since the models and
# the command's code left the planner's headers. Keep it empty; the
# check fails on an entry that no longer occurs.
ALLOWED_BACK_ARROWS = set()

# Above every layer: public headers only.
TOP = ("tools/", "examples/", "bench/", "tests/")

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]((?:trainmem|detail|core|audit|plan|models|app)/[A-Za-z0-9_./]+)[>"]', re.M)
SOURCES = (".h", ".hpp", ".cpp", ".cc")


def layer_of(rel, root):
    if rel in PUBLIC_HEADERS:
        return PUBLIC_HEADERS[rel]
    dirs = [d for d in FOLDERS if rel.startswith(d)]
    if dirs:
        return FOLDERS[max(dirs, key=len)]
    public = re.fullmatch(r"include/trainmem/([a-z_0-9]+)\.h", rel)
    if public:
        homes = [layer for folder, layer in FOLDERS.items() if folder.startswith("src/")
                 and (root / folder / f"{public.group(1)}.cpp").is_file()]
        return homes[0] if len(homes) == 1 else None
    return None


def resolve(name, root):
    if name == "trainmem/version.h":  # generated from cmake/version.h.in
        return None
    for base in ("include", "src", "tools/trainmem"):
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
        top = rel.startswith(TOP) and layer_of(rel, root) is None
        mine = None if top else layer_of(rel, root)
        if not top and mine is None:
            errors.append(f"{rel}: in no layer; put it in a layer's folder (FOLDERS in tests/layering/check_layers.py)")
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
                if target.startswith("src/") and not rel.startswith("tests/"):
                    errors.append(f"{rel}: includes {target}; tools, examples and benchmarks see public headers only")
                continue
            theirs = layer_of(target, root)
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
