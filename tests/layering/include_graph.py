#!/usr/bin/env python3
"""The include graph between pskv's folders, checked: no cycle, no relative path climbing out
of a folder, and the Python binding on the public API alone. The build enforces each layer's
allowed includes (src/CMakeLists.txt, pskv_layer); this is the picture of the result, printed
for docs/ARCHITECTURE.md, and a second lock on the same door.

    tests/layering/include_graph.py [ROOT]          # prints the graph; exit 1 on a violation
"""
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
LIBRARY_FOLDERS = ("src", "transport", "include")


def folder_of_file(path):
    """The folder a source file belongs to: src/<x>, transport, transport/<x>, include/pskv."""
    parts = os.path.relpath(path, ROOT).split(os.sep)
    if parts[0] == "include":
        return "include/pskv"
    if parts[0] == "transport":
        return "transport" if len(parts) == 2 else "transport/" + parts[1]
    return "src/" + parts[1]


def folder_of_include(text):
    parts = text.split("/")
    if parts[0] == "pskv":
        return "include/pskv"
    if parts[0] == "transport":
        return "transport" if len(parts) == 2 else "transport/" + parts[1]
    if len(parts) > 1 and os.path.isdir(os.path.join(ROOT, "src", parts[0])):
        return "src/" + parts[0]
    return None  # a file of the same folder, named bare


def sources(top):
    for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
        for f in files:
            if f.endswith((".h", ".cc")):
                yield os.path.join(dirpath, f)


def main():
    edges, problems = {}, []
    for top in LIBRARY_FOLDERS:
        for path in sources(top):
            here = folder_of_file(path)
            for line in open(path, encoding="utf-8"):
                m = INCLUDE.match(line)
                if not m:
                    continue
                if ".." in m.group(1).split("/"):
                    problems.append(f"{os.path.relpath(path, ROOT)}: includes {m.group(1)} (climbs out of its folder)")
                there = folder_of_include(m.group(1))
                if there and there != here:
                    edges.setdefault(here, set()).add(there)
    for path in sources("python"):
        for line in open(path, encoding="utf-8"):
            m = INCLUDE.match(line)
            if m and "/" in m.group(1) and not m.group(1).startswith("pskv/"):
                problems.append(f"{os.path.relpath(path, ROOT)}: includes {m.group(1)}; the binding uses include/pskv only")

    # Cycles, by depth-first search over the folder graph.
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                problems.append("cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)

    for node in sorted(edges):
        print(f"{node} -> {', '.join(sorted(edges[node]))}")
    for p in problems:
        print("VIOLATION " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
