#!/usr/bin/env python3
"""Golden outputs: a command's output pinned, byte for byte, but for timings.

    golden.py --source DIR --golden FILE [--json] -- PROGRAM ARGS...

Runs PROGRAM ARGS in DIR (so paths in the output are the relative ones given),
normalizes what changes from run to run (wall-clock times, warning locations),
and compares with FILE: the first lines of FILE name the command and its exit
status, the rest is its standard output, then its standard error after a
`--- stderr` line when there is any. On a difference it prints a unified diff
and exits 1. With TRAINMEM_UPDATE_GOLDENS=1 it writes FILE instead (review the
diff with git before committing: a golden that moves is a figure that moved).

--json: standard output is one JSON document; values of keys that hold times
(`time_ms`, `*_ns`, `*_us`, `*_ms`, `*_seconds`, `wall_s`) become "<time>", and
the document is written back sorted and indented, one value a line, so a diff
names the field that moved.
"""
import argparse
import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

TIME_KEY = re.compile(r"(^time$|^time_|_time$|_ns$|_us$|_ms$|_seconds$|^wall_s$|^elapsed)")
TEXT_RULES = [
    # "791.5 ms", "0.3 s" as a duration, "(mean of two)" stays
    (re.compile(r"\b\d[\d,]*\.\d+ ms\b"), "<t> ms"),
    (re.compile(r"\b\d+(?:\.\d+)? s\b(?= \(| wall| CPU|$)", re.M), "<t> s"),
    # the time column of the steps table: "  0             905.1           58,170,888"
    # (right-aligned: the spaces before it change with its width)
    (re.compile(r"(?m)^(\s+\d+)\s+\d+\.\d+(?=\s{2,}[\d,]+)"), r"\g<1>  <t>"),
    # TORCH_WARN prefixes name a source line: "[W1202 07:31:11.123 file.cpp:123] "
    (re.compile(r"\[W\d{4} [\d:.]+ [^\]]*\] "), "[W] "),
]


def normalize_json(value):
    if isinstance(value, dict):
        return {k: ("<time>" if TIME_KEY.search(k) else normalize_json(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize_json(v) for v in value]
    return value


def normalize_text(text):
    for pattern, repl in TEXT_RULES:
        text = pattern.sub(repl, text)
    return text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--golden", required=True)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command after --")
    run = subprocess.run(cmd, cwd=a.source, capture_output=True, text=True, timeout=600)
    out = run.stdout
    if a.json:
        try:
            out = json.dumps(normalize_json(json.loads(out)), indent=1, sort_keys=True) + "\n"
        except json.JSONDecodeError as e:
            print(f"golden: standard output is not one JSON document ({e}):\n{out[:2000]}")
            return 1
    else:
        out = normalize_text(out)
    shown = " ".join([Path(cmd[0]).name] + cmd[1:])
    actual = f"# command: {shown}\n# exit: {run.returncode}\n{out}"
    if run.stderr:
        actual += "--- stderr\n" + normalize_text(run.stderr)
    golden = Path(a.golden)
    if os.environ.get("TRAINMEM_UPDATE_GOLDENS") == "1":
        golden.write_text(actual)
        print(f"golden: wrote {golden}")
        return 0
    if not golden.is_file():
        print(f"golden: {golden} does not exist; run with TRAINMEM_UPDATE_GOLDENS=1 to write it")
        print(actual)
        return 1
    expected = golden.read_text()
    if expected == actual:
        print(f"golden: {golden.name} unchanged ({len(actual.splitlines())} lines)")
        return 0
    sys.stdout.writelines(difflib.unified_diff(
        expected.splitlines(True), actual.splitlines(True), str(golden), "this run"))
    print(f"\ngolden: {golden.name} differs; if the change is intended, rerun with "
          "TRAINMEM_UPDATE_GOLDENS=1 and commit the new golden with the change that moved it")
    return 1


if __name__ == "__main__":
    sys.exit(main())
