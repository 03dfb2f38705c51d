#!/usr/bin/env python3
"""Every Note the code cites is written out in docs/design.md.

A comment that says `Note [Some name]` sends its reader to the design notes:
docs/design.md holds one `## Note [Some name]` section per cross-cutting
decision, saying what the problem is and what trainmem does about it. This
check lists every Note cited under src, include, tools, tests, bench and
examples (any file: sources, headers, CMake lists, scripts) and every
`## Note [...]` heading of docs/design.md, and fails on a cited Note that has
no heading, naming one file that cites it. A Note written out only in a
comment still needs its section: write it there (a few lines, ending with
"In the code: path/to/file.cpp.").

    check_notes.py SOURCE_DIR           exit 0 when every cited Note has a section
"""
import re
import sys
from pathlib import Path

# Where Notes are cited: the library, its headers, the command, tests,
# benchmarks and examples.
CITED_IN = ("src", "include", "tools", "tests", "bench", "examples")
DESIGN = "docs/design.md"

NOTE = re.compile(r"Note \[([^\]]+)\]")
HEADING = re.compile(r"^## Note \[([^\]]+)\]", re.M)
# A citation may wrap across comment lines ("Note [One meta\n// allocator]"):
# the line break, the next line's comment marker and the spaces are one space.
WRAP = re.compile(r"\s*\n\s*(?:/{2,3}!?|#+|\*)?\s*")


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    design = root / DESIGN
    if not design.is_file():
        print(f"notes: {DESIGN} not found under {root}")
        return 1
    written = set(HEADING.findall(design.read_text(errors="replace")))
    cited = {}  # name -> the first file (in sorted order) that cites it
    me = Path(__file__).resolve()  # this file's examples are not citations
    files = sorted(p for d in CITED_IN for p in (root / d).rglob("*") if p.is_file() and p.resolve() != me)
    for path in files:
        try:
            text = path.read_text(errors="strict")
        except (UnicodeDecodeError, OSError):
            continue  # binary files cite nothing
        for name in NOTE.findall(text):
            cited.setdefault(WRAP.sub(" ", name).strip(), path.relative_to(root).as_posix())
    missing = sorted(set(cited) - written)
    for name in missing:
        print(f"notes: Note [{name}] (cited in {cited[name]}) has no '## Note [{name}]' section in {DESIGN}")
    if missing:
        print(f"notes: {len(missing)} of {len(cited)} cited Notes are not in {DESIGN}")
        return 1
    print(f"notes: {len(cited)} cited Notes, {len(written)} sections: every cited Note is in {DESIGN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
