#!/usr/bin/env python3
"""Every symbol of the public API is exported (TRAINMEM_API, trainmem/export.h).

The library is compiled with hidden visibility (CXX_VISIBILITY_PRESET hidden,
Note [Exported symbols] in include/trainmem/export.h): a declaration that the
library defines out of line and that lacks TRAINMEM_API links in a static
build and is an undefined reference to every user of a shared one. This check
reads the headers and fails on

  - a namespace-scope function declaration (no body) that is neither a
    template nor inline nor constexpr, and has no TRAINMEM_API;
  - an `extern` variable without TRAINMEM_API;
  - a `friend` function declared (not defined) in a class, without TRAINMEM_API;
  - a class or struct (not a template) without TRAINMEM_API that has a member
    function declared without a body (and not `= default` / `= delete`), a
    static member, a virtual function, or a base class (its vtable and
    typeinfo must be one across the library's boundary: dynamic_cast, catch).
    Nested classes are checked on their own (MSVC exports no nested class
    with its enclosing one).

It is a reader of declarations, not a C++ parser: it blanks comments, strings
and preprocessor lines, then follows braces, parentheses and semicolons.
Macro invocations in upper case (TORCH_ARG, TORCH_MODULE) are skipped: they
expand to inline code and templates.

    check_exports.py SOURCE_DIR            exit 0 when every declaration is exported
    check_exports.py SOURCE_DIR --fix      insert TRAINMEM_API where it is missing
"""
import re
import sys
from pathlib import Path

# Headers of src/ that tools/trainmem/app (trainmem_app, a separate static library
# that links trainmem, shared or not) uses across the library's boundary:
# their out-of-line declarations are exported too, though never installed.
INTERNAL = ["src/core/detail/checkpoint_state.h"]

MACRO = "TRAINMEM_API"
ACCESS = re.compile(r"^\s*(?:(?:public|private|protected)\s*:(?!:)\s*)+")
UPPER_MACRO = re.compile(r"^[A-Z][A-Z0-9_]*\s*\(")
OPERATOR = re.compile(r"\boperator\s*(?:\(\s*\)|\[\s*\]|[^\s(\w]+|\w[\w:<>\s*&]*?(?=\())")


def blank(text):
    """Comments, string and char literals and preprocessor lines as spaces (offsets kept)."""
    out = list(text)
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c == "#":
            j = i
            while j < n and text[j] != "\n":
                if text[j] == "\\" and j + 1 < n and text[j + 1] == "\n":
                    j += 2
                    continue
                j += 1
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
            continue
        if c == "\n":
            line_start = True
            i += 1
            continue
        if not c.isspace():
            line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                out[k] = " "
            i = j + 1
            continue
        i += 1
    return "".join(out)


def top_level_index(stmt, ch):
    """Index of `ch` outside (), [], {} and <> in stmt, or -1."""
    depth = 0
    for i, c in enumerate(stmt):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == ch and depth == 0:
            return i
    return -1


def is_function(stmt):
    s = OPERATOR.sub("operatorX", stmt)
    paren, eq = s.find("("), top_level_index(s, "=")
    return paren >= 0 and (eq < 0 or paren < eq)


def words(stmt):
    head = stmt.split("(", 1)[0]
    return set(re.findall(r"[A-Za-z_]\w*", head))


class Scope:
    def __init__(self, kind, head="", head_pos=0, name=""):
        self.kind = kind          # namespace, class, enum, block
        self.head = head
        self.head_pos = head_pos  # offset of the class-key in the file
        self.name = name
        self.reasons = []
        self.annotated = re.search(rf"\b{MACRO}\b", head) is not None
        self.template = head.lstrip().startswith("template")


def check_file(path, rel):
    text = path.read_text()
    clean = blank(text)
    errors, fixes = [], []  # fixes: (offset, inserted text)
    stack = []
    stmt_start = 0
    paren = 0
    counted = {"functions": 0, "classes": 0}

    def line_of(pos):
        return text.count("\n", 0, pos) + 1

    def stmt_at(end):
        raw = clean[stmt_start:end]
        m = ACCESS.match(raw)
        off = stmt_start + (m.end() if m else 0)
        lead = len(clean[off:end]) - len(clean[off:end].lstrip())
        return off + lead, clean[off + lead:end].strip()

    def all_namespaces():
        return all(s.kind == "namespace" for s in stack)

    def in_class():
        return bool(stack) and stack[-1].kind == "class" and all(s.kind in ("namespace", "class") for s in stack)

    def needs_api(pos, stmt, what):
        counted["functions"] += 1
        if re.search(rf"\b{MACRO}\b", stmt):
            return
        errors.append(f"{rel}:{line_of(pos)}: {what} without {MACRO}: {' '.join(stmt.split())[:100]}")
        # Where the macro goes: after [[attributes]] and extern/friend.
        m = re.match(r"(?:\[\[[^\]]*\]\]\s*)*(?:(?:extern|friend)\s+)?", stmt)
        fixes.append((pos + m.end(), MACRO + " "))

    def on_statement(end):
        pos, stmt = stmt_at(end)
        if not stmt or stmt.startswith(("template", "using", "typedef", "static_assert", "namespace")):
            return
        if UPPER_MACRO.match(stmt):
            return
        w = words(stmt)
        if all_namespaces():
            if {"class", "struct", "union", "enum"} & w and not is_function(stmt):
                return  # a forward declaration
            if "extern" in w and not is_function(stmt):
                needs_api(pos, stmt, "extern variable")
            elif is_function(stmt) and not ({"inline", "constexpr", "consteval"} & w):
                needs_api(pos, stmt, "function")
        elif in_class():
            cls = stack[-1]
            if "friend" in w:
                if is_function(stmt) and not ({"inline", "constexpr"} & w):
                    needs_api(pos, stmt, "friend function")
                return
            if "virtual" in w:
                cls.reasons.append("virtual")
            if "static" in w and not ({"constexpr", "inline"} & w):
                cls.reasons.append(f"static member (line {line_of(pos)})")
            elif is_function(stmt) and not ({"inline", "constexpr"} & w) \
                    and not re.search(r"=\s*(default|delete)\s*$", stmt):
                cls.reasons.append(f"out-of-line member (line {line_of(pos)})")

    i, n = 0, len(clean)
    while i < n:
        c = clean[i]
        if c == "(":
            paren += 1
        elif c == ")":
            paren -= 1
        elif paren > 0:
            pass
        elif c == "{":
            pos, stmt = stmt_at(i)
            w = set(re.findall(r"[A-Za-z_]\w*", stmt))
            if re.match(r"(inline\s+)?namespace\b", stmt) or (not stack or all_namespaces()) and stmt.startswith("extern"):
                stack.append(Scope("namespace"))
            elif "enum" in w:
                stack.append(Scope("enum"))
            elif not is_function(stmt) and re.search(r"\b(class|struct|union)\b", stmt) and "=" not in stmt \
                    and (all_namespaces() or in_class()):
                m = re.search(r"\b(class|struct|union)\b\s*((?:\w+\s+)*?)(\w+)?\s*(final\b)?\s*(:(?!:)[^{]*)?$", stmt)
                key_end = pos + m.end(1) if m else pos
                name = (m.group(3) or "") if m else ""
                scope = Scope("class", stmt, key_end, name)
                if m and m.group(5):
                    scope.reasons.append("base class")
                stack.append(scope)
            else:
                stack.append(Scope("block"))
            stmt_start = i + 1
        elif c == "}":
            scope = stack.pop() if stack else None
            if scope and scope.kind == "class" and not scope.template:
                counted["classes"] += 1
                if scope.reasons and not scope.annotated:
                    errors.append(f"{rel}:{line_of(scope.head_pos)}: class {scope.name} without {MACRO} "
                                  f"has {', '.join(dict.fromkeys(scope.reasons))}")
                    fixes.append((scope.head_pos, " " + MACRO))
            stmt_start = i + 1
        elif c == ";":
            if stack and stack[-1].kind in ("block", "enum"):
                pass
            else:
                on_statement(i)
            stmt_start = i + 1
        elif c == ":" and stack and stack[-1].kind == "class":
            # `public:` ends nothing, but keeps the label out of the next statement.
            pass
        i += 1
    return errors, fixes, counted


def add_include(text):
    """The include of export.h, first among trainmem's own includes (after the
    standard and LibTorch ones when there are none)."""
    line = '#include "trainmem/export.h"'
    if line in text:
        return text
    lines = text.split("\n")
    own = [i for i, l in enumerate(lines) if l.startswith('#include "')]
    if own:
        lines.insert(own[0], line)
        return "\n".join(lines)
    incs = [i for i, l in enumerate(lines) if l.startswith("#include")]
    at = incs[-1] + 1 if incs else next(i for i, l in enumerate(lines) if l.startswith("#pragma once")) + 1
    lines[at:at] = ["", line]
    return "\n".join(lines)


# The check checked: declarations it must flag (by line) and must not. Run
# first, each time (a reader that flags nothing passes everything).
SELF_TEST = """\
namespace trainmem {
int missing(int x);                                 // 2: function
TRAINMEM_API int exported(int x);
inline int defined_inline(int x) { return x; }
template <typename T> T templated(T x);
constexpr int folded(int x) { return x; }
extern int counter;                                 // 7: extern variable
using Fn = int (*)(int);
struct Plain { int a = 0; std::string b = f("x;"); int sum() const { return a; } };
struct Options { TORCH_ARG(int64_t, size) = 0; Options(int s = {}) : size_(s) {} };
class Guard {                                       // 11: out-of-line members
 public:
  Guard();
  ~Guard();
  Guard(const Guard&) = delete;
  class Inner {                                     // 16: nested, static member
    static int count;
  };
  friend bool operator==(const Guard&, const Guard&);  // 19: friend function
};
struct Hooks { virtual ~Hooks() = default; };       // 21: vtable
struct Impl : public Base<Impl> { int x = 0; };     // 22: base class
class TRAINMEM_API Done { void f(); struct TRAINMEM_API In { void g(); }; };
template <typename T> class Holder { void f(); };
enum class Kind { kA, kB };
}  // namespace trainmem
"""
SELF_TEST_EXPECTED = [2, 7, 11, 16, 19, 21, 22]


def self_test(tmp):
    path = tmp / "self_test.h"
    path.write_text(SELF_TEST)
    errors, _, _ = check_file(path, "self_test.h")
    got = sorted(int(e.split(":")[1]) for e in errors)
    if got != SELF_TEST_EXPECTED:
        for e in errors:
            print("exports: self-test:", e)
        print(f"exports: self-test flagged lines {got}, expected {SELF_TEST_EXPECTED}")
        return False
    return True


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    fix = "--fix" in sys.argv
    root = Path(args[0] if args else ".").resolve()
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        if not self_test(Path(tmp)):
            return 1
    files = [p for p in sorted((root / "include" / "trainmem").rglob("*.h")) + [root / p for p in INTERNAL]
             if p.name != "export.h"]
    all_errors, totals = [], {"functions": 0, "classes": 0}
    for path in files:
        rel = path.relative_to(root).as_posix()
        errors, fixes, counted = check_file(path, rel)
        for k in totals:
            totals[k] += counted[k]
        text = path.read_text()
        if (fixes or re.search(rf"\b{MACRO}\b", blank(text))) and '#include "trainmem/export.h"' not in text:
            all_errors.append(f"{rel}: uses {MACRO} without including trainmem/export.h")
            if fix and not fixes:
                path.write_text(add_include(text))
        all_errors += errors
        if fix and fixes:
            for off, ins in sorted(fixes, reverse=True):
                text = text[:off] + ins + text[off:]
            path.write_text(add_include(text))
    for e in all_errors:
        print("exports:", e)
    print(f"exports: {len(files)} headers, {totals['functions']} exported declarations, "
          f"{totals['classes']} classes, {len(all_errors)} errors")
    return 1 if all_errors else 0


if __name__ == "__main__":
    sys.exit(main())
