#!/usr/bin/env python3
"""include_floors.py — the include graph of src/ and include/ by folder, against
the floors of docs/DESIGN.md's layout: a folder includes only folders on its own
floor or below, and no two folders include each other, directly or around a loop.

    tools/include_floors.py            print the arrows between folders, every
                                       include that climbs a floor, the cycles
    tools/include_floors.py --check    the same; exit 1 on any climb or cycle
    tools/include_floors.py --root DIR another tree (a copy with src/ and include/)

Counts `#include "..."` lines (not system headers) in .cpp/.hpp/.cu/.cuh/.inc
files; an include of shardlm/... is of include/; src/main.cpp and src/no_cuda.cpp
stand on the top floor.
"""
import collections
import os
import re
import sys

FLOORS = {
    "include": 1, "base": 1,
    "config": 2, "model": 2, "data": 2, "cpu": 2, "cuda": 2,
    "comm": 3,
    "train": 4, "infer": 4, "checkpoint": 4, "broadcast": 4,
    "app": 5,
    "top": 6,
}


def folder_of(path):
    if path.startswith("include/"):
        return "include"
    parts = path.split("/")
    return "top" if len(parts) == 2 else parts[1]


def main():
    root_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    if "--root" in sys.argv:
        root_dir = sys.argv[sys.argv.index("--root") + 1]
    os.chdir(root_dir)
    arrows = collections.Counter()
    climbs = []
    unknown = set()
    for root in ("src", "include"):
        for d, _, names in os.walk(root):
            for name in sorted(names):
                if not re.search(r"\.(cpp|hpp|cu|cuh|inc)$", name):
                    continue
                path = os.path.join(d, name)
                src = folder_of(path)
                for line in open(path, errors="replace"):
                    m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                    if not m:
                        continue
                    inc = m.group(1)
                    dst = "include" if inc.startswith("shardlm/") else inc.split("/")[0] if "/" in inc else src
                    if dst == src:
                        continue
                    for f in (src, dst):
                        if f not in FLOORS:
                            unknown.add(f)
                    arrows[(src, dst)] += 1
                    if FLOORS.get(dst, 0) > FLOORS.get(src, 0):
                        climbs.append(f"{path} -> {inc}")
    graph = collections.defaultdict(set)
    for a, b in arrows:
        graph[a].add(b)

    def reaches(a, b):
        seen, todo = set(), [a]
        while todo:
            for c in graph[todo.pop()]:
                if c == b:
                    return True
                if c not in seen:
                    seen.add(c)
                    todo.append(c)
        return False

    cycles = sorted(f"{a} -> {b}" for a, b in arrows if reaches(b, a))
    for (a, b), n in sorted(arrows.items(), key=lambda e: (FLOORS.get(e[0][0], 0), e[0])):
        print(f"{a:>10} (floor {FLOORS.get(a, '?')}) -> {b:<10} (floor {FLOORS.get(b, '?')}) {n:4d} includes")
    print(f"includes that climb a floor: {len(climbs)}")
    for c in climbs:
        print("  " + c)
    print(f"arrows on a cycle between folders: {len(cycles)}")
    for c in cycles:
        print("  " + c)
    if unknown:
        print("folders with no floor in tools/include_floors.py: " + ", ".join(sorted(unknown)))
    if "--check" in sys.argv and (climbs or cycles or unknown):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
