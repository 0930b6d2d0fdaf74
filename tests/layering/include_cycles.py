#!/usr/bin/env python3
"""The include graph of dp/engines and tools/ has no cycle (no file includes one that includes it
back, directly or not), and the engine interface (engine.h, engine.cpp) includes none of the engines.
Quoted includes are resolved against the including file's folder and the layers' include folders."""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1]).resolve()
include_dirs = [p for p in root.glob("*/include")] + [p for p in root.glob("dp/*/include")]
include = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def resolve(src, name):
    for base in [src.parent] + include_dirs:
        candidate = base / name
        if candidate.is_file():
            return candidate.resolve()
    return None


def edges(files):
    graph = {}
    for f in files:
        graph[f] = [r for r in (resolve(f, n) for n in include.findall(f.read_text())) if r]
    return graph


failures = []
for folder in ["dp/engines", "tools"]:
    files = [p.resolve() for p in (root / folder).rglob("*") if p.suffix in (".h", ".cpp", ".cu")]
    graph = edges(files)
    # Also follow headers outside the folder, so an indirect way back is seen.
    todo = [t for ts in graph.values() for t in ts if t not in graph]
    while todo:
        f = todo.pop()
        if f in graph:
            continue
        graph[f] = [r for r in (resolve(f, n) for n in include.findall(f.read_text())) if r]
        todo += [t for t in graph[f] if t not in graph]
    state = {}

    def visit(f, path):
        state[f] = "open"
        for t in graph.get(f, []):
            if state.get(t) == "open":
                cycle = path[path.index(t):] + [t]
                failures.append("include cycle: " + " -> ".join(str(p.relative_to(root)) for p in cycle))
            elif t not in state:
                visit(t, path + [t])
        state[f] = "done"

    for f in files:
        if f not in state:
            visit(f, [f])

engines = {"trainer.h", "data_parallel.h", "ddp.h", "replica_engine.h", "fixed_shards.h"}
for name in ["dp/engines/include/dp/engines/engine.h", "dp/engines/src/engine.cpp"]:
    f = (root / name).resolve()
    for n in include.findall(f.read_text()):
        if pathlib.Path(n).name in engines:
            failures.append(f"{name} includes an engine: {n}")

for failure in failures:
    print(failure)
sys.exit(1 if failures else 0)
