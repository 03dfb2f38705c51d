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

CATEGORIES = ["PARAMETER", "GRADIENT", "OPTIMIZER_STATE", "ACTIVATION", "TEMPORARY", "INPUT", "unknown", "before the audit"]


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


def check_snapshot(path):
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    actions = {e["action"] for e in trace}
    if not {"alloc", "free_requested", "free_completed"} <= actions:
        fail(f"{path}: actions {actions}")
    for seg in snap["segments"]:
        if sum(b["size"] for b in seg["blocks"]) != seg["total_size"]:
            fail(f"{path}: blocks do not tile segment {seg['address']}")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("SKIP: torch is not importable; memory_viz not checked")
        sys.exit(77)
    for cmd in ("stats", "trace"):
        r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", cmd, path],
                           capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"memory_viz {cmd}: {r.stderr[-2000:]}")
    r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace", path],
                       capture_output=True, text=True)
    if f"{len([e for e in trace if e['action'] == 'alloc'])}" not in r.stdout and "entries" not in r.stdout:
        fail("memory_viz trace printed no entries")


def main():
    report, page, trace, snapshot = sys.argv[1:5]
    check_report(report)
    check_html(page)
    check_trace(trace)
    check_snapshot(snapshot)
    print("outputs valid")


if __name__ == "__main__":
    main()
