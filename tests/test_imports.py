"""The house (STYLE.md): the imports between the top-level modules, read from their source, go one way: no cycle,
and no module imports one of a higher layer. Every import statement counts, those inside functions included. The
block under `if __name__ == "__main__":` runs only when the file is the program, never when it is imported, so its
imports are the program's (node "data:__main__"): `python data.py audit` dispatches there to data_cli.py."""

import ast
import subprocess
import sys

from conftest import ROOT

MODULES = sorted(p.stem for p in ROOT.glob("*.py"))

# STYLE.md's layers. processor.py writes data.py's chat templates (and its image settings) as HF processor files,
# so it sits beside data.py rather than with the formats below it.
LAYERS = {"model": 1, "model_config": 1, "anyres": 1, "lora": 1,
          "images": 2, "shards": 2, "weight_files": 2, "hf_config": 2, "hf_names": 2, "checkpoint": 2, "parallel": 2,
          "chat": 3, "data": 3, "pack": 3, "shapes": 3, "processor": 3,
          "train": 4, "config": 4, "evaluation": 4, "dpo": 4, "rl": 4, "convert": 4, "sample": 4, "bench": 4, "data_cli": 4}
# imports up a layer still to be removed (the layer test fails while an entry is stale): none
PENDING = set()


def is_main_guard(node):
    t = node.test
    return isinstance(node, ast.If) and isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and \
        t.left.id == "__name__" and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in t.comparators)


def import_edges():
    """{(importer, imported): first line} over the top-level modules; importer is "name:__main__" for a main block."""
    edges = {}

    def visit(node, source, path):
        for child in ast.iter_child_nodes(node):
            here = f"{source}:__main__" if isinstance(child, ast.If) and is_main_guard(child) else source
            names = [a.name for a in child.names] if isinstance(child, ast.Import) else \
                [child.module] if isinstance(child, ast.ImportFrom) and child.module and not child.level else []
            for name in names:
                target = name.split(".")[0]
                if target in MODULES and target != source.split(":")[0]:
                    edges.setdefault((source, target), f"{path.name}:{child.lineno}")
            visit(child, here, path)

    for name in MODULES:
        path = ROOT / f"{name}.py"
        visit(ast.parse(path.read_text(), filename=str(path)), name, path)
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
    """No module imports one of a higher layer (programs may use each other, as bench.py runs train.py's step)."""
    assert set(MODULES) == set(LAYERS), "give each top-level module a layer here (STYLE.md): " \
        f"{sorted(set(MODULES) ^ set(LAYERS))}"
    edges = import_edges()
    layer = lambda node: 4 if node.endswith(":__main__") else LAYERS[node]  # noqa: E731  a main block is a program
    upward = {(a, b) for a, b in edges if layer(a) < layer(b)}
    assert upward == PENDING, "imports up a layer: " + ", ".join(
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)}) at {edges.get((a, b), 'nowhere now')}"
        for a, b in sorted(upward ^ PENDING))


def test_data_py_is_still_the_command_line(tmp_path):
    """`python data.py pack|shapes|audit` as README documents it: the command line moved to data_cli.py."""
    r = subprocess.run([sys.executable, str(ROOT / "data.py"), "audit", str(tmp_path / "none"), "--tokenizer",
                        str(tmp_path / "none.model"), "--show", "0"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and str(tmp_path / "none") in r.stdout + r.stderr, \
        r.stdout + r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "data.py"), "--help"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0 and "{pack,shapes,audit}" in r.stdout, r.stdout + r.stderr
