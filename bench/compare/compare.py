"""trainmem beside PyTorch's Python tools, on the capstone, the demo's reference transformer (make compare).

1. Check: trainmem_compare --check writes the initial weights, the input and
   each variant's gradients; torch_side.py --check runs the same weights
   through PyTorch and reports its saved bytes and gradient differences.
   Bytes must agree exactly where both sides measure the same thing, and
   gradients within a tolerance (the two sides run Linear through different
   ATen paths, so they agree to rounding, not bit for bit).
2. Time (unless --check-only): ROUNDS rounds; each runs three processes in an
   order that alternates from round to round: the C++ side, the Python side,
   and the C++ side with the counting CPU allocator installed. Inside a
   process the variants are interleaved step by step. Ratios are taken within
   a round (same minute, same load) and summarised over rounds as
   min / median / max. A ratio inside one process (a variant against that
   process's plain step) is the median of step-by-step ratios, each step
   against the plain step run right beside it.

Exit status 1 when bytes disagree or gradients differ beyond the tolerance;
times never fail the run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SKIPPED = 77  # ctest's SKIP_RETURN_CODE
GRAD_RTOL = 1e-4  # max |diff| / max |value|, per variant

# (variant, what both sides measure): every row must agree to the byte.
BYTES_ROWS = [
    ("plain", "saved for backward, unique non-parameter storages"),
    ("full", "saved for backward (block inputs and the loss input)"),
    ("every_2", "saved for backward"),
    ("selective", "saved for backward + SAC cache, unique storages"),
    ("optimizer_in_backward", "saved for backward"),
    ("save_on_cpu", "unique non-parameter storages trainmem copies"),
]
# The Python variant each C++ variant is timed against.
TIME_PAIRS = [
    ("plain", "plain"), ("meter", "meter"), ("full", "full"), ("every_2", "every_2"),
    ("selective", "selective"), ("optimizer_in_backward", "optimizer_in_backward"),
    ("save_on_cpu", "save_on_cpu"), ("save_on_cpu_copies", None),
]


CHILD_ENV = dict(os.environ)


def run_json(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=CHILD_ENV)
    if p.returncode != 0:
        raise SystemExit(f"compare: {' '.join(cmd)} failed with status {p.returncode}:\n{p.stderr}")
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    if not lines:
        raise SystemExit(f"compare: {' '.join(cmd)} printed nothing on stdout:\n{p.stderr}")
    return json.loads(lines[-1])


def spread(xs):
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def commas(v):
    return f"{v:,}"


def check(cpp, python, dir_):
    c = run_json([cpp, "--check", dir_])
    p = run_json([python, os.path.join(HERE, "torch_side.py"), "--check", dir_])
    rows, ok = [], True
    for v, what in BYTES_ROWS:
        cb, pb = c["variants"][v]["saved_bytes"], p["variants"][v]["saved_bytes"]
        pe = p["variants"][v]
        rel = pe["max_abs_diff_vs_cpp"] / pe["max_abs_value"] if pe["max_abs_value"] else 0.0
        row = {"variant": v, "measures": what, "cpp_bytes": cb, "python_bytes": pb,
               "bytes_agree": cb == pb, "compares": pe["compares"],
               "max_abs_diff": pe["max_abs_diff_vs_cpp"], "max_abs_value": pe["max_abs_value"],
               "rel_diff": rel, "grads_agree": rel <= GRAD_RTOL}
        for k in ("hooks_saved_bytes", "sac_cache_bytes", "torch_device_copy_bytes",
                  "torch_device_copy_param_bytes", "torch_device_copy_repeat_bytes",
                  "num_packed", "max_abs_diff_vs_own_plain"):
            if k in pe:
                row["python_" + k] = pe[k]
        for k in ("num_packed", "num_storage_copies", "by_node"):
            if k in c["variants"][v]:
                row["cpp_" + k] = c["variants"][v][k]
        if v == "save_on_cpu":
            row["packs_agree"] = row["cpp_num_packed"] == row["python_num_packed"]
            ok = ok and row["packs_agree"]
        ok = ok and row["bytes_agree"] and row["grads_agree"]
        rows.append(row)
    env = {"cpp_num_threads": c["num_threads"], "python_num_threads": p["num_threads"],
           "cpp_torch": c["torch_version"], "python_torch": p["torch_version"]}
    return rows, env, ok


def medians(doc):
    return {v: statistics.median(d["ms"]) for v, d in doc["variants"].items()}


def paired(doc, variant, base="plain"):
    """Median over steps of variant / base, step i of one against step i of
    the other: they ran back to back, so a change of load hits both."""
    a, b = doc["variants"][variant]["ms"], doc["variants"][base]["ms"]
    return statistics.median(x / y for x, y in zip(a, b))


def time_rounds(cpp, python, dir_, rounds, steps, warmup, log):
    procs = {
        "cpp": [cpp, "--time", "--steps", str(steps), "--warmup", str(warmup)],
        "python": [python, os.path.join(HERE, "torch_side.py"), "--time", dir_,
                   "--steps", str(steps), "--warmup", str(warmup)],
        # The counting allocator installed: its plain step against the plain
        # step of the C++ process beside it is the allocator's cost; the
        # meter's step against its own plain step, the meter's with it.
        "cpp_allocator": [cpp, "--time", "--track-allocator", "--variants", "plain,meter",
                          "--steps", str(steps), "--warmup", str(warmup)],
    }
    order = ["cpp", "python", "cpp_allocator"]
    results = []
    for r in range(rounds):
        this = order if r % 2 == 0 else list(reversed(order))
        got = {}
        for name in this:
            t0 = time.monotonic()
            got[name] = run_json(procs[name])
            log(f"round {r + 1}/{rounds}: {name} done in {time.monotonic() - t0:.1f} s")
        results.append(got)
    return results


def summarise(raw):
    results = [{k: medians(d) for k, d in r.items()} for r in raw]
    table = []
    for cv, pv in TIME_PAIRS:
        ms_cpp = [r["cpp"][cv] for r in results]
        row = {"variant": cv, "cpp_ms": spread(ms_cpp),
               "cpp_vs_own_plain": spread([paired(r["cpp"], cv) for r in raw])}
        if pv is not None:
            row["python_variant"] = pv
            row["python_ms"] = spread([r["python"][pv] for r in results])
            row["python_vs_own_plain"] = spread([paired(r["python"], pv) for r in raw])
            row["cpp_over_python"] = spread([r["cpp"][cv] / r["python"][pv] for r in results])
        table.append(row)
    alloc = {
        "variant": "plain, counting CPU allocator",
        "cpp_ms": spread([r["cpp_allocator"]["plain"] for r in results]),
        "cpp_vs_own_plain": spread([r["cpp_allocator"]["plain"] / r["cpp"]["plain"] for r in results]),
    }
    alloc_meter = {
        "variant": "meter, counting CPU allocator (same process)",
        "cpp_ms": spread([r["cpp_allocator"]["meter"] for r in results]),
        "cpp_vs_own_plain": spread([paired(r["cpp_allocator"], "meter") for r in raw]),
    }
    return table + [alloc, alloc_meter], results


def scaling(cpp, rounds, steps, warmup, log):
    """The meter's cost against the plain step, by layers and by sequence length."""
    out = []
    configs = [(L, 64) for L in (1, 2, 6, 12, 24, 48)] + [(6, T) for T in (16, 32, 128, 256)]
    for L, T in configs:
        ratios, plain = [], []
        for _ in range(rounds):
            d = run_json([cpp, "--time", "--variants", "plain,meter", "--layers", str(L),
                          "--seq-len", str(T), "--steps", str(steps), "--warmup", str(warmup)])
            ratios.append(paired(d, "meter"))
            plain.append(medians(d)["plain"])
        log(f"scaling: L={L} T={T} meter/plain median {statistics.median(ratios):.3f}")
        out.append({"num_layers": L, "seq_len": T, "plain_ms": spread(plain),
                    "meter_vs_plain": spread(ratios)})
    return out


def fmt_spread(s, f="{:.2f}"):
    return f"{f.format(s['median'])} [{f.format(s['min'])}, {f.format(s['max'])}]"


def print_report(doc):
    print("saved bytes and gradients, trainmem (C++) vs PyTorch (Python), capstone")
    print(f"  {'variant':<22} {'C++ bytes':>12} {'Python bytes':>13} {'agree':>5}  "
          f"{'compares':<26} {'max |diff|':>10} {'rel':>9}")
    for r in doc["check"]:
        print(f"  {r['variant']:<22} {commas(r['cpp_bytes']):>12} {commas(r['python_bytes']):>13} "
              f"{'yes' if r['bytes_agree'] else 'NO':>5}  {r['compares']:<26} "
              f"{r['max_abs_diff']:>10.2e} {r['rel_diff']:>9.2e}")
    for r in doc["check"]:
        if r["variant"] == "selective":
            print(f"  selective, Python: {commas(r['python_hooks_saved_bytes'])} B seen by "
                  f"saved_tensors_hooks + {commas(r['python_sac_cache_bytes'])} B in the SAC cache")
        if r["variant"] == "save_on_cpu":
            print(f"  save_on_cpu: {r['cpp_num_packed']} packs in C++, {r['python_num_packed']} in "
                  f"Python; from a GPU torch would copy {commas(r['python_torch_device_copy_bytes'])} B "
                  f"({commas(r['python_torch_device_copy_param_bytes'])} B of it parameters, "
                  f"{commas(r['python_torch_device_copy_repeat_bytes'])} B storages packed again), "
                  f"trainmem {commas(r['cpp_bytes'])} B")
    e = doc["environment"]
    print(f"  threads: C++ {e['cpp_num_threads']}, Python {e['python_num_threads']}; "
          f"torch {e['cpp_torch']} / {e['python_torch']}")
    if "time" in doc:
        t = doc["time"]
        print(f"\nstep times, median [min, max] over {t['rounds']} interleaved rounds of "
              f"{t['steps']} steps (per-round medians), {t['threads'] or 'default'} thread(s)")
        if t["rounds"] * t["steps"] < 5:
            print("  (quick mode: too few steps for these times to mean anything)")
        print(f"  {'variant':<46} {'C++ ms':>20} {'x C++ plain':>20} {'Python ms':>20} "
              f"{'x Py plain':>20} {'C++ / Python':>20}")
        for r in t["table"]:
            py = (fmt_spread(r["python_ms"], "{:.1f}"), fmt_spread(r["python_vs_own_plain"]),
                  fmt_spread(r["cpp_over_python"])) if "python_ms" in r else ("", "", "")
            print(f"  {r['variant']:<46} {fmt_spread(r['cpp_ms'], '{:.1f}'):>20} "
                  f"{fmt_spread(r['cpp_vs_own_plain']):>20} {py[0]:>20} {py[1]:>20} {py[2]:>20}")
    if "planner" in doc:
        m = doc["planner"]["meta_70b"]
        print(f"\n70 B meta build (LLaMA-2-70B's width and depth in these blocks): "
              f"{m['build_ms']:.0f} ms, {commas(m['num_params'])} parameters "
              f"({commas(m['param_bytes'])} B planned), {commas(m['cpu_allocated_bytes_while_building'])} B "
              f"allocated on the CPU while building")
        print("planner (plan_checkpointing) by depth and sequence length")
        for r in doc["planner"]["planner"]:
            print(f"  L={r['num_layers']:<3} T={r['seq_len']:<4} unconstrained {r['unconstrained_ms']:8.1f} ms"
                  f"   budget 60 %: {r['budget_ms']:8.1f} ms ({r['budget_plan']}, "
                  f"{'fits' if r['budget_feasible'] else 'does not fit'}, {r['num_candidates']} candidates)")
    if "scaling" in doc:
        print("\nmeter cost by depth and sequence length (C++, meter step / plain step)")
        for s in doc["scaling"]:
            print(f"  L={s['num_layers']:<3} T={s['seq_len']:<4} plain {fmt_spread(s['plain_ms'], '{:.1f}'):>22} ms"
                  f"   meter/plain {fmt_spread(s['meter_vs_plain'], '{:.3f}')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build", help="CMake build directory (default: build)")
    ap.add_argument("--cpp", help="the trainmem_compare program (default: BUILD/bench/compare/...)")
    ap.add_argument("--python", default=sys.executable, help="Python with torch for the PyTorch side")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant per process")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads on both sides (OMP_NUM_THREADS; default 1: on a "
                         "shared machine OpenMP's spinning barriers make 2-thread timings erratic; "
                         "0 leaves LibTorch's default)")
    ap.add_argument("--quick", action="store_true", help="1 round of 1 step (for the ctest)")
    ap.add_argument("--check-only", action="store_true", help="bytes and gradients, no times")
    ap.add_argument("--scaling", action="store_true", help="also the meter's cost by depth and length")
    ap.add_argument("--planner", action="store_true",
                    help="also a 70 B meta build and the planner's cost by depth and length")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.steps, a.warmup = 1, 1, 0
    for name in ("rounds", "steps"):
        if getattr(a, name) < 1:
            ap.error(f"expected --{name} >= 1, but got {getattr(a, name)}")
    if a.threads < 0:
        ap.error(f"expected --threads >= 0, but got {a.threads}")
    if a.threads > 0:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            CHILD_ENV[k] = str(a.threads)
    cpp = a.cpp or os.path.join(a.build, "bench", "compare", "trainmem_compare")
    if not os.access(cpp, os.X_OK):
        raise SystemExit(f"compare: {cpp} not found; build it with cmake --build {a.build} "
                         f"--target trainmem_compare")
    probe = subprocess.run([a.python, "-c", "import torch.utils.checkpoint"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=CHILD_ENV)
    if probe.returncode != 0:
        print(f"compare: skipped: {a.python} cannot import torch", file=sys.stderr)
        return SKIPPED
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    doc = {"schema": "trainmem-compare/1", "grad_rtol": GRAD_RTOL}
    with tempfile.TemporaryDirectory(prefix="trainmem-compare-") as dir_:
        rows, env, ok = check(cpp, a.python, dir_)
        doc["check"], doc["environment"], doc["agree"] = rows, env, ok
        log(f"check: bytes and gradients {'agree' if ok else 'DISAGREE'}")
        if not a.check_only:
            raw = time_rounds(cpp, a.python, dir_, a.rounds, a.steps, a.warmup, log)
            table, results = summarise(raw)
            doc["time"] = {"rounds": a.rounds, "threads": a.threads, "steps": a.steps, "warmup": a.warmup,
                           "table": table, "per_round_medians_ms": results}
        if a.scaling:
            doc["scaling"] = scaling(cpp, max(1, min(a.rounds, 3)), min(a.steps, 8),
                                     min(a.warmup, 1), log)
    if a.planner:
        tool = os.path.join(os.path.dirname(cpp), "trainmem_plan_scaling")
        if not os.access(tool, os.X_OK):
            raise SystemExit(f"compare: {tool} not found; build it with --target trainmem_plan_scaling")
        doc["planner"] = run_json([tool])
        log("planner: done")
    try:
        doc["loadavg_at_end"] = list(os.getloadavg())
    except OSError:
        pass
    if a.json:
        json.dump(doc, sys.stdout)
        print()
    else:
        print_report(doc)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
