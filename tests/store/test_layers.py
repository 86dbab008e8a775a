"""The store's layering, read from the code's own ast (imports inside functions and
under TYPE_CHECKING count): no import cycle inside aenv_store, nothing in it
imports aenv_vm or aenv_api, Store.open's module does not know P2P and P2P does
not know the Store, and a block image does not know its prefetcher."""
from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Modules (of ``known``, or outside packages) that ``path`` imports anywhere."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
    return out


def graph(package: str) -> dict[str, set[str]]:
    files = sorted((REPO_ROOT / package).rglob("*.py"))
    known = {module_name(f) for f in files}
    return {module_name(f): {m for m in imports_of(f, known) if m in known or not m.startswith(package)}
            for f in files}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if n not in g:
                continue
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle_inside_aenv_store() -> None:
    g = graph("aenv_store")
    # a package's __init__ is imported on the way to any of its modules: only
    # the modules' own arrows count
    assert find_cycle({m: {n for n in deps if n in g} for m, deps in g.items()}) is None
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # the check itself works


def test_aenv_store_imports_neither_vm_nor_api() -> None:
    for module, deps in graph("aenv_store").items():
        assert not {d for d in deps if d.split(".")[0] in ("aenv_vm", "aenv_api")}, module


def test_store_and_p2p_do_not_know_each_other() -> None:
    g = graph("aenv_store")
    assert not {d for d in g["aenv_store.store"] if d.startswith("aenv_store.p2p")}
    for module, deps in g.items():
        if module.startswith("aenv_store.p2p"):
            assert "aenv_store.store" not in deps and "aenv_store.assembly" not in deps, module
    assert "aenv_store.p2p.source" in g["aenv_store.assembly"]


def test_block_image_does_not_import_its_prefetcher() -> None:
    g = graph("aenv_vm")
    assert "aenv_vm.blockimage.prefetch" not in g["aenv_vm.blockimage.image"]
    assert find_cycle({m: {n for n in deps if n in g and n.startswith("aenv_vm.blockimage")}
                       for m, deps in g.items() if m.startswith("aenv_vm.blockimage")}) is None
