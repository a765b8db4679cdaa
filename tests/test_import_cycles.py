"""No import circle in mtpkit: neither between modules (imports inside functions included, since a lazy import
that hides a circle is still one) nor between its folders (models -> checkpoint -> data/decode/train -> cli)."""

import ast
from pathlib import Path

import mtpkit

PACKAGE = Path(mtpkit.__file__).parent


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its file. `from P import x` names the submodule P.x
    when there is one, else P; a module's own parent packages are left out (importing a module runs them first)."""
    files = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + "."):
                    edges.add(t)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """mtpkit's folders (and top-level modules) -> those it imports."""
    def folder(m):
        return m.split(".")[1] if "." in m else m

    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(folder(a), set()).update(folder(b) for b in targets if folder(b) != folder(a))
    return out


def test_mtpkit_has_no_import_circle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 90 and sum(map(len, graph.values())) > 200  # the whole package was read
    assert cycles(graph) == []
    assert cycles(folder_graph(graph)) == []


def test_a_circle_hidden_in_a_function_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "a.py").write_text("from . import b\n\ndef f():\n    return b\n")
    (pkg / "sub" / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (pkg / "c.py").write_text("from .sub import a\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.a"}
    assert cycles(graph) == [["pkg.sub.a", "pkg.sub.b"]]
    (pkg / "sub" / "a.py").write_text("def f():\n    pass\n")
    (pkg / "sub" / "b.py").write_text("from ..c import a\n")  # modules b -> c -> a, but folders sub -> c -> sub
    assert cycles(import_graph(pkg)) == [] and cycles(folder_graph(import_graph(pkg))) == [["c", "sub"]]
