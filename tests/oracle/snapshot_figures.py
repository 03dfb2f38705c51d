#!/usr/bin/env python3
"""Every recorded GPU snapshot in a folder, counted by Python and replayed by trainmem.

The independent count: Python's own pickle module reads each
torch.cuda.memory._dump_snapshot file (no trainmem code), and from each
device's trace and final segments computes what the recording says:

  - per device (each has its own allocator, trace and segments): events,
    segment_alloc/segment_map and segment_free/segment_unmap (cudaMalloc /
    cudaFree, an expandable segment's page maps and unmaps) calls;
  - reserved bytes when recording began (the final segments walked back
    through the segment events) and their peak over the trace;
  - the peak of live requested bytes (blocks live before recording: freed in
    the trace without an alloc there, or active at the end without one).

Then `trainmem snapshot FILE --json` must give the same recorded figures for
every device (its `devices` list) and replay each trace exactly:
replay.matches, the model's cudaMalloc count and peak reserved equal to the
recording's.

    snapshot_figures.py TRAINMEM DIR    exit 77 when DIR holds no snapshot
"""
import glob
import json
import os
import pickle
import subprocess
import sys


def devices(snap):
    """The devices a snapshot records: those with a trace entry or a segment."""
    found = {s.get("device", 0) for s in snap["segments"]}
    found |= {d for d, t in enumerate(snap.get("device_traces", [])) if t}
    return sorted(found) or [0]


def recorded(snap, device):
    """What device `device`'s trace and segments say, counted by Python."""
    traces = snap.get("device_traces", [])
    trace = traces[device] if device < len(traces) else []
    segments = [s for s in snap["segments"] if s.get("device", 0) == device]
    reserved = sum(s["total_size"] for s in segments)
    for e in trace:
        if e["action"] in ("segment_alloc", "segment_map"):
            reserved -= e["size"]
        elif e["action"] in ("segment_free", "segment_unmap"):
            reserved += e["size"]
    start_reserved = reserved
    live, before = set(), {}
    for e in trace:
        if e["action"] == "alloc":
            live.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] not in live:
            before[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            live.discard(e["addr"])
    for s in segments:
        at = s["address"]
        for b in s["blocks"]:
            b.setdefault("address", at)  # 2.0-era blocks carry no address: they tile the segment
            at = b["address"] + b["size"]
            if b["state"].startswith("active") and b["address"] not in live and b["address"] not in before:
                before[b["address"]] = b["requested_size"]
    requested = sum(before.values())
    peak_reserved, peak_requested = reserved, requested
    allocs = frees = 0
    for e in trace:
        a = e["action"]
        if a in ("segment_alloc", "segment_map"):
            reserved += e["size"]
            allocs += 1
        elif a in ("segment_free", "segment_unmap"):
            reserved -= e["size"]
            frees += 1
        elif a == "alloc":
            requested += e["size"]
        elif a == "free_completed":
            requested -= e["size"]
        peak_reserved = max(peak_reserved, reserved)
        peak_requested = max(peak_requested, requested)
    return {"num_events": len(trace), "preexisting_reserved_bytes": start_reserved,
            "peak_reserved_bytes": peak_reserved, "peak_requested_bytes": peak_requested,
            "num_segment_allocs": allocs, "num_segment_frees": frees}


def check(want, rep):
    """What differs between Python's count and one device's replay."""
    rec, model = rep["recorded"], rep["model"]
    problems = []
    if rep["num_events"] != want["num_events"]:
        problems.append(f"num_events {rep['num_events']} != {want['num_events']}")
    for k in ("peak_reserved_bytes", "peak_requested_bytes", "num_segment_allocs", "num_segment_frees"):
        if rec[k] != want[k]:
            problems.append(f"recorded {k} {rec[k]} != Python's {want[k]}")
    if not rep["matches"]:
        problems.append(f"replay diverges at event {rep['first_mismatch']}: {rep['mismatch']}")
    for k in ("peak_reserved_bytes", "num_segment_allocs", "num_segment_frees"):
        if model[k] != want[k]:
            problems.append(f"model {k} {model[k]} != recorded {want[k]}")
    return problems


def main():
    tm, folder = sys.argv[1], sys.argv[2]
    paths = sorted(glob.glob(os.path.join(folder, "**", "*.pickle"), recursive=True))
    if not paths:
        print(f"no snapshot under {folder}")
        return 77
    bad = 0
    for p in paths:
        with open(p, "rb") as f:
            snap = pickle.load(f)
        name = os.path.relpath(p, folder)
        out = subprocess.run([tm, "snapshot", p, "--json", "--alloc-conf", ""], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"FAIL {name}: trainmem snapshot exit {out.returncode}: {out.stderr.strip()}")
            bad += 1
            continue
        got = json.loads(out.stdout)
        by_device = {d["device"]: d["replay"] for d in got["devices"]}
        problems, said = [], []
        for dev in devices(snap):
            want = recorded(snap, dev)
            if dev not in by_device:
                problems.append(f"device {dev}: not in trainmem's devices")
                continue
            problems += [f"device {dev}: {x}" for x in check(want, by_device[dev])]
            said.append(f"device {dev}: {want['num_events']} events, {want['num_segment_allocs']} cudaMalloc, "
                        f"peak reserved {want['peak_reserved_bytes']:,} B, peak requested {want['peak_requested_bytes']:,} B")
        if problems:
            bad += 1
            print(f"FAIL {name}: " + "; ".join(problems))
        else:
            print(f"ok {name}: " + "; ".join(said))
    print(f"{len(paths)} snapshots, {len(paths) - bad} replayed exactly")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
