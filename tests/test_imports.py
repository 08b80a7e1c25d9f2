"""The house (STYLE.md): the imports between the top-level modules, read from their source, go one way: no cycle,
no module imports one of a higher layer, and no program imports another program. Every import statement counts,
those inside functions and under `if __name__ == "__main__":` included."""

import ast
import os
import subprocess
import sys

import forkserver

from conftest import ROOT

MODULES = sorted(p.stem for p in ROOT.glob("*.py"))

# STYLE.md's layers: 1 model, 2 formats and I/O, 3 data, 4 pieces of the training loop, 5 programs
LAYERS = {"model": 1, "attention": 1, "model_config": 1, "anyres": 1, "lora": 1, "losses": 1,
          "chat": 2, "images": 2, "shards": 2, "weight_files": 2, "hf_config": 2, "hf_names": 2, "checkpoint": 2,
          "checkpoint_writer": 2, "model_files": 2, "parallel": 2, "storage": 2, "lease": 2, "progress": 2,
          "loader": 3, "mixture": 3, "pack": 3, "audit": 3, "sources": 3, "shapes": 3, "processor": 3, "video": 3,
          "config": 4, "evaluation": 4, "benchmarks": 4, "dpo": 4, "rl": 4, "objectives": 4, "memory": 4, "bench_data": 4,
          "train": 5, "convert": 5, "sample": 5, "bench": 5, "data": 5, "plot": 5, "score": 5}
PROGRAMS = 5


def import_edges():
    """{(importer, imported): first line} over the top-level modules, every import statement in the file counted."""
    edges = {}
    for name in MODULES:
        path = ROOT / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for imported in names:
                target = imported.split(".")[0]
                if target in MODULES and target != name:
                    edges.setdefault((name, target), f"{path.name}:{node.lineno}")
    return edges


def find_cycle(edges):
    """One import cycle as a list of modules (first == last), or None."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
    state, stack = {}, []

    def dfs(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_import_graph_has_no_cycle():
    edges = import_edges()
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} ({edges[a, b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_find_cycle_finds_the_cycle_that_was_there():
    """The detector on issue 21's seven-file circle (and a line off it), and on a graph without one."""
    circle = ["checkpoint", "convert", "processor", "data", "pack", "train", "checkpoint"]
    edges = dict.fromkeys(zip(circle, circle[1:]), "?") | {("sample", "data"): "?", ("data", "images"): "?"}
    assert set(find_cycle(edges)) == set(circle) and find_cycle(edges)[0] == find_cycle(edges)[-1]
    del edges["pack", "train"]
    assert find_cycle(edges) is None


def test_imports_go_down_the_layers():
    """No module imports one of a higher layer, and no program imports another program."""
    assert set(MODULES) == set(LAYERS), "give each top-level module a layer here (STYLE.md): " \
        f"{sorted(set(MODULES) ^ set(LAYERS))}"
    bad = {(a, b): line for (a, b), line in import_edges().items()
           if LAYERS[a] < LAYERS[b] or LAYERS[a] == LAYERS[b] == PROGRAMS}
    assert not bad, "imports up a layer or between programs: " + ", ".join(
        f"{a} (layer {LAYERS[a]}) imports {b} (layer {LAYERS[b]}) at {line}" for (a, b), line in sorted(bad.items()))


def test_no_module_only_passes_names_on():
    """Every name a module imports from another of ours is used there: a re-exported name hides where code lives."""
    passed_on = []
    for name in MODULES:
        tree = ast.parse((ROOT / f"{name}.py").read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in MODULES:
                passed_on += [f"{name}.{a.asname or a.name}" for a in node.names if (a.asname or a.name) not in used]
    assert not passed_on, f"imported but unused (a re-export): {passed_on}"


def test_data_py_is_still_the_command_line(tmp_path):
    """`python data.py pack|shapes|audit` as README documents it: the packing program."""
    r = forkserver.run([sys.executable, str(ROOT / "data.py"), "audit", str(tmp_path / "none"), "--tokenizer",
                        str(tmp_path / "none.model"), "--show", "0"], os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode != 0 and "Traceback" not in r.stderr and str(tmp_path / "none") in r.stdout + r.stderr, \
        r.stdout + r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "data.py"), "--help"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0 and "{pack,shapes,audit}" in r.stdout, r.stdout + r.stderr
