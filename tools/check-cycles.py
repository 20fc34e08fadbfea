#!/usr/bin/env python3
"""Fails when a workspace crate's top-level modules import each other in a cycle.

A module's dependencies are the top-level modules its non-test code names
through `crate::` paths (`crate::a::X`, `use crate::{a::X, b}`, `crate::c!`).
Code after `#[cfg(test)]` at the start of a line is test code and is skipped.
Crate-level cycles cannot build, so `cargo` itself rules those out; this
script prints the crate graph for reference and checks modules.

Usage: tools/check-cycles.py [crate_dir ...]   (default: every workspace member)
       tools/check-cycles.py --self-test          (checks that a cycle is caught)
"""

import json
import os
import re
import subprocess
import sys

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def strip_comments_and_strings(text):
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == '"' and not (i > 0 and text[i - 1] == "'"):
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif text.startswith("r#\"", i) or text.startswith('r"', i):
            hashes = 1 if text[i + 1] == "#" else 0
            end = '"' + "#" * hashes
            j = text.find(end, i + 2 + hashes)
            i = n if j < 0 else j + len(end)
            out.append('""')
        else:
            out.append(c)
            i += 1
    return "".join(out)


def non_test_code(text):
    text = strip_comments_and_strings(text)
    m = re.search(r"^\s*#\[cfg\(test\)\]", text, re.M)
    return text if m is None else text[: m.start()]


def brace_items(text, start):
    """Top-level comma-separated items of the `{...}` group opening at `start`."""
    depth, item, items = 0, [], []
    for i in range(start, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
            if depth == 1:
                continue
        elif c == "}":
            depth -= 1
            if depth == 0:
                items.append("".join(item))
                return items
        elif c == "," and depth == 1:
            items.append("".join(item))
            item = []
            continue
        item.append(c)
    return items


def referenced_modules(code):
    mods = set()
    for m in re.finditer(r"\bcrate\s*::\s*", code):
        rest = code[m.end():]
        if rest.startswith("{"):
            for item in brace_items(code, m.end()):
                first = IDENT.match(item.strip())
                if first:
                    mods.add(first.group(0))
        else:
            first = IDENT.match(rest)
            if first:
                mods.add(first.group(0))
    return mods


def crate_modules(src):
    """Top-level module name -> list of its files."""
    mods = {}
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if entry in ("lib.rs", "main.rs"):
            continue
        if entry.endswith(".rs"):
            mods.setdefault(entry[:-3], []).append(path)
        elif os.path.isdir(path) and entry != "bin":
            for root, _, files in os.walk(path):
                for f in files:
                    if f.endswith(".rs"):
                        mods.setdefault(entry, []).append(os.path.join(root, f))
    return mods


def cycles(graph):
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check_crate(crate_dir):
    src = os.path.join(crate_dir, "src")
    mods = crate_modules(src)
    graph = {}
    for name, files in mods.items():
        deps = set()
        for f in files:
            with open(f, encoding="utf-8") as fh:
                deps |= referenced_modules(non_test_code(fh.read()))
        graph[name] = {d for d in deps if d in mods and d != name}
    found = cycles(graph)
    for comp in found:
        edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
        print(f"{crate_dir}: module cycle among {', '.join(comp)}: " + "; ".join(edges))
    return not found


def workspace_members():
    meta = json.loads(
        subprocess.check_output(["cargo", "metadata", "--no-deps", "--format-version", "1"])
    )
    root = meta["workspace_root"]
    members = []
    for pkg in meta["packages"]:
        members.append(os.path.relpath(os.path.dirname(pkg["manifest_path"]), root))
    for pkg in meta["packages"]:
        deps = [d["name"] for d in pkg["dependencies"] if d["name"].startswith("kvshard") and d.get("kind") is None]
        print(f"crate {pkg['name']} -> {', '.join(sorted(deps)) or '(none)'}")
    return sorted(members)


def self_test():
    """A crate with a cycle through a grouped `use` must fail; without it, pass."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "src")
        os.makedirs(os.path.join(src, "c"))
        files = {
            "lib.rs": "mod a; mod b; mod c;",
            "a.rs": "use crate::{b::B, c};\npub struct A;",
            "b.rs": "// crate::a::A in a comment is no import\npub struct B;",
            "c/mod.rs": "pub fn f() -> crate::a::A { crate::a::A }",
        }
        for name, text in files.items():
            with open(os.path.join(src, name), "w") as fh:
                fh.write(text)
        assert not check_crate(d), "a -> c -> a not found"
        with open(os.path.join(src, "c/mod.rs"), "w") as fh:
            fh.write("#[cfg(test)]\nmod tests { use crate::a::A; }")
        assert check_crate(d), "test code or comments counted as imports"
    print("self-test passed")
    return 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    crates = sys.argv[1:] or workspace_members()
    ok = all([check_crate(c) for c in crates])
    print("no module cycles" if ok else "module cycles found")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
