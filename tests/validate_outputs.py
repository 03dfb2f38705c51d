"""Checks the files `trainmem audit --html --trace --snapshot --json` wrote.

Usage: validate_outputs.py REPORT.json PAGE.html TRACE.json SNAPSHOT.pickle
Exit 0 when all hold, 1 with a message when one does not, 77 (skip) when
torch is not importable (the memory_viz checks need it).
"""
import html.parser
import json
import pickle
import subprocess
import sys

CATEGORIES = ["PARAMETER", "BUFFER", "GRADIENT", "OPTIMIZER_STATE", "ACTIVATION", "TEMPORARY", "INPUT", "COMMUNICATION", "unknown",
              "before the audit"]


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def check_report(path):
    with open(path) as f:
        d = json.load(f)
    if d.get("schema") != "trainmem/1":
        fail(f"{path}: schema is {d.get('schema')!r}")
    for key in ("num_params", "static_bytes", "saved_activation_bytes", "peak_bytes"):
        if not isinstance(d[key], int) or d[key] <= 0:
            fail(f"{path}: {key} = {d[key]!r} is not a positive integer")
    if d["static_bytes"] != sum(b["bytes"] for b in d["buckets"]):
        fail(f"{path}: static_bytes is not the sum of the buckets")
    phases = [p["phase"] for p in d["phases"] if p["step"] == 0]
    if phases != ["forward", "backward", "optimizer step"]:
        fail(f"{path}: step 0 phases are {phases}")
    series = d["series"]
    n = len(series["time_ns"])
    if n < 2 or any(len(series["bytes"][c]) != n for c in CATEGORIES):
        fail(f"{path}: series lengths differ")
    top = max(sum(series["bytes"][c][i] for c in CATEGORIES) for i in range(n))
    if top != d["peak_bytes"]:
        fail(f"{path}: the series' highest point {top} != peak_bytes {d['peak_bytes']}")
    return d


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.csp, self.refs = [], None, []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = dict(attrs)
        if tag == "meta" and a.get("http-equiv") == "Content-Security-Policy":
            self.csp = a.get("content")
        for name in ("src", "href", "xlink:href", "action", "data"):
            if name in a:
                self.refs.append((tag, name, a[name]))


def check_html(path):
    text = open(path, encoding="utf-8").read()
    p = Page()
    p.feed(text)
    if p.csp != "default-src 'none'; style-src 'unsafe-inline'; img-src data:":
        fail(f"{path}: Content-Security-Policy is {p.csp!r}")
    if p.refs:
        fail(f"{path}: references outside the page: {p.refs}")
    for bad in ("<script", "http://", "https://", "url(", "@import"):
        if bad in text:
            fail(f"{path}: contains {bad!r}")
    for tag in ("svg", "polygon", "table", "title"):
        if tag not in p.tags:
            fail(f"{path}: no <{tag}>")
    for c in ("PARAMETER", "ACTIVATION", "GRADIENT"):
        if c not in text:
            fail(f"{path}: category {c} not shown")


def check_trace(path):
    with open(path) as f:
        d = json.load(f)
    ev = d["traceEvents"]
    counters = [e for e in ev if e["ph"] == "C"]
    slices = [e for e in ev if e["ph"] == "X"]
    if not counters or not slices:
        fail(f"{path}: {len(counters)} counter events, {len(slices)} slices")
    for e in counters:
        if sorted(e["args"]) != sorted(CATEGORIES) or not all(isinstance(v, int) for v in e["args"].values()):
            fail(f"{path}: counter args {e['args']}")
        if not isinstance(e["ts"], (int, float)):
            fail(f"{path}: ts {e['ts']!r}")
    names = {e["cat"] for e in slices}
    if names != {"forward", "backward", "optimizer step"}:
        fail(f"{path}: phase slices {names}")


def replay_segments(snap, trace):
    """What memory_viz's "Allocator State History" does: start from the final
    segments and undo the trace backwards. Every block must lie in a segment
    the trace allocated (segment_alloc) or that existed at the end."""
    segs = {}
    for seg in snap["segments"]:
        live = {b["address"]: b["size"] for b in seg["blocks"] if b["state"] == "active_allocated"}
        segs[seg["address"]] = {"size": seg["total_size"], "live": live}

    def segment_of(addr):
        for saddr, seg in segs.items():
            if saddr <= addr < saddr + max(seg["size"], 1):
                return seg
        fail(f"snapshot: block {addr:#x} lies in no segment (the viewer's Allocator State History breaks)")

    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        a, addr = e["action"], e["addr"]
        if a == "segment_free":
            if addr in segs:
                fail(f"snapshot entry {i}: segment_free of {addr:#x}, which is still a segment later")
            segs[addr] = {"size": e["size"], "live": {}}
        elif a == "free_completed":
            seg = segment_of(addr)
            if addr in seg["live"]:
                fail(f"snapshot entry {i}: free of {addr:#x}, which is live again before anything allocates it")
            seg["live"][addr] = e["size"]
        elif a == "alloc":
            seg = segment_of(addr)
            if seg["live"].pop(addr, None) != e["size"]:
                fail(f"snapshot entry {i}: alloc of {addr:#x} ({e['size']} B) is not the block live after it")
        elif a == "segment_alloc":
            seg = segs.pop(addr, None)
            if seg is None or seg["live"]:
                fail(f"snapshot entry {i}: segment_alloc of {addr:#x} with no segment or live blocks after it")


def check_snapshot(path):
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    actions = {e["action"] for e in trace}
    want = {"segment_alloc", "alloc", "free_requested", "free_completed", "segment_free"}
    if not want <= actions:
        fail(f"{path}: actions {actions}, expected {want}")
    for seg in snap["segments"]:
        if sum(b["size"] for b in seg["blocks"]) != seg["total_size"]:
            fail(f"{path}: blocks do not tile segment {seg['address']}")
    cats = {c.lower() for c in CATEGORIES}
    for e in trace:
        if e.get("category") not in cats:
            fail(f"{path}: entry {e['action']} at {e['addr']:#x} has category {e.get('category')!r}")
    replay_segments(snap, trace)
    try:
        import torch  # noqa: F401
        from torch.cuda import _memory_viz as mv
    except ImportError:
        print("SKIP: torch is not importable; memory_viz not checked")
        sys.exit(77)
    for cmd in ("stats", "trace"):
        r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", cmd, path],
                           capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"memory_viz {cmd}: {r.stderr[-2000:]}")
    # PyTorch's own reading of the trace: every entry, each alloc inside a
    # segment it saw allocated (not "MEM[...]", memory from nowhere).
    out = mv.trace(snap)
    if f"{len(trace)} entries" not in out:
        fail(f"memory_viz trace did not read {len(trace)} entries: {out[:200]!r}")
    num_segment_allocs = sum(1 for e in trace if e["action"] == "segment_alloc")
    if out.count("cudaMalloc(") != num_segment_allocs:
        fail(f"memory_viz trace shows {out.count('cudaMalloc(')} segment allocations, not {num_segment_allocs}")
    if " = MEM[" in out:
        fail("memory_viz trace has allocations outside any segment")
    mv.segsum(snap)
    for html in (mv.trace_plot(snap), mv.segment_plot(snap)):
        if "snapshot.pickle" not in html:
            fail("memory_viz could not embed the snapshot")


def main():
    report, page, trace, snapshot = sys.argv[1:5]
    check_report(report)
    check_html(page)
    check_trace(trace)
    check_snapshot(snapshot)
    print("outputs valid")


if __name__ == "__main__":
    main()
