"""The project's import structure, read from the code's own ``ast``.

* Data flows one way: ``aenv_api`` → ``aenv_vm`` → ``aenv_store``. The store
  imports neither the VM layer nor the API; the VM layer does not import the
  API; ``envd`` (the in-guest daemon) imports only the standard library.
* ``aenv_cli`` is the composition root: the only package that imports both the
  API and the fleet (the API does not import the fleet), and no package imports it.
* The fleet (``aenv_fleet``) does not import the node's API (``aenv_api``): what the
  two share is E2B's wire vocabulary (``aenv_wire``, which imports nothing of the
  project's and nothing but the standard library) and the HTTP plumbing both serve
  with (``aenv_http``, which of the project's imports only ``aenv_wire``).
* No import cycle anywhere among the project's modules, counting imports
  inside functions and under ``TYPE_CHECKING`` (a cycle hidden that way is
  still a cycle in the design).
* No module imports another module's private names (``from m import _x``), and
  no module reaches into a private attribute of an object another module owns
  (``obj._x`` with ``_x`` defined nowhere in the module itself), except the few
  places listed in ``PRIVATE_ALLOWED`` with the reason.
* Nothing outside ``aenv_vm/machine`` and ``aenv_vm/qemu`` starts a QEMU: no
  other module refers to ``QemuProcess.start`` or constructs a ``QemuProcess``
  (``qemu_starts``); every guest comes up through the one bring-up.
"""
from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("aenv_store", "aenv_vm", "aenv_wire", "aenv_http", "aenv_api", "aenv_fleet", "aenv_cli", "envd",
            "codeint", "aenv_dashboard")

# (module, private name) pairs where a module uses a private name of something it does
# not own, and why that is right there. All are third-party or standard-library names.
_AIOHTTP_HANDLER = ("JsonErrorHandler subclasses aiohttp's RequestHandler (pinned version) to answer "
                    "requests its HTTP parser refuses in E2B's JSON shape: aiohttp has no public hook")
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {
    ("aenv_http.runner", "_server"):
        "aiohttp's TCPSite has no public way to read the port it bound when asked for port 0",
    ("aenv_http.runner", "_ErrInfo"): _AIOHTTP_HANDLER,
    ("aenv_http.runner", "_messages"): _AIOHTTP_HANDLER,
    ("aenv_http.runner", "_current_request"): _AIOHTTP_HANDLER,
    ("aenv_http.runner", "_loop"): _AIOHTTP_HANDLER,
    ("aenv_http.runner", "_kwargs"): _AIOHTTP_HANDLER,
    ("aenv_store.p2p._iroh_fast", "_reserve"):
        "replaces the iroh bindings' byte-at-a-time copy into their own receive buffer (docs/remote.md)",
    ("codeint.ipython_startup", "_buffer"):
        "ipykernel 6.17's OutStream has no public size of what it buffers until its next flush; the "
        "startup flushes it at 1 MiB so no IOPub message is unbounded (docs/code-interpreter.md)",
    ("codeint.charts", "_suptitle"):
        "matplotlib 3.6 (Debian bookworm's, the guest's) has no Figure.get_suptitle (3.8 added it)",
    ("aenv_vm.confine.jail", "_exit"):
        "os._exit is the documented way out of a forked child that must not run the parent's clean-up",
}


def project_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


MODULES = project_modules()


def _is_package(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if _is_package(mod) else mod.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache
def imports_of(mod: str) -> list[tuple[str, int]]:
    """Every module ``mod`` imports (absolute names, project modules where they resolve
    to one, submodules for ``from pkg import sub``), with the line of the import."""
    tree = ast.parse(MODULES[mod].read_text(), str(MODULES[mod]))
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node)
            if target == "__future__":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub if sub in MODULES else target, node.lineno))
    return out


def _project_target(name: str) -> str | None:
    """The project module an imported name lands in (longest prefix that is a module)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in MODULES:
            return cand
    return None


@functools.cache
def graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod in MODULES:
        for name, _line in imports_of(mod):
            target = _project_target(name)
            if target is not None and target != mod:
                g[mod].add(target)
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(g[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _cycle_path(g: dict[str, set[str]], comp: list[str]) -> str:
    """One concrete loop inside a strongly connected component, for the failure message."""
    members = set(comp)
    start = comp[0]
    path = [start]
    seen = {start}
    node = start
    while True:
        nxt = sorted(n for n in g[node] if n in members)
        step = next((n for n in nxt if n == start), None) or next((n for n in nxt if n not in seen), nxt[0])
        path.append(step)
        if step in seen:
            return " -> ".join(path[path.index(step):])
        seen.add(step)
        node = step


@pytest.mark.parametrize("layer,forbidden", [
    ("aenv_store", ("aenv_vm", "aenv_api", "aenv_fleet", "aenv_cli", "aenv_http")),
    ("aenv_vm", ("aenv_api", "aenv_fleet", "aenv_cli", "aenv_http")),
    ("aenv_api", ("aenv_fleet", "aenv_cli")),
    ("aenv_fleet", ("aenv_cli",)),
])
def test_layers_import_one_way(layer: str, forbidden: tuple[str, ...]) -> None:
    bad = list(dict.fromkeys(f"{mod}:{line} imports {name}" for mod in MODULES if mod.split(".")[0] == layer
                             for name, line in imports_of(mod) if name.split(".")[0] in forbidden))
    assert not bad, ("imports against the data flow (aenv_cli -> aenv_api, aenv_fleet -> aenv_vm -> "
                     "aenv_store):\n" + "\n".join(bad))


def test_only_tests_import_the_composition_root() -> None:
    """aenv_cli assembles nodes and gateways from every package: a package importing it
    would depend on all the others (tests and benchmarks may)."""
    bad = list(dict.fromkeys(f"{mod}:{line} imports {name}" for mod in MODULES if mod.split(".")[0] != "aenv_cli"
                             for name, line in imports_of(mod) if name.split(".")[0] == "aenv_cli"))
    assert not bad, "the composition root aenv_cli is imported by:\n" + "\n".join(bad)


def test_the_composition_root_is_where_api_and_fleet_meet() -> None:
    """aenv_cli imports both (it is where the node's API and its fleet agent are put
    together), so the rules above are about a real package, not an empty name."""
    targets = {name.split(".")[0] for mod in MODULES if mod.split(".")[0] == "aenv_cli" for name, _ in imports_of(mod)}
    assert {"aenv_api", "aenv_fleet", "aenv_vm", "aenv_store"} <= targets


def test_the_fleet_does_not_import_the_api() -> None:
    bad = [f"{mod}:{line} imports {name}" for mod in MODULES if mod.split(".")[0] == "aenv_fleet"
           for name, line in imports_of(mod) if name.split(".")[0] == "aenv_api"]
    assert not bad, ("aenv_fleet shares E2B's wire vocabulary with the node's API through aenv_wire and "
                     "aenv_http, never aenv_api's internals:\n" + "\n".join(bad))


def test_the_wire_package_imports_only_the_standard_library() -> None:
    stdlib = set(sys.stdlib_module_names)
    bad = [f"{mod}:{line} imports {name}" for mod in MODULES if mod.split(".")[0] == "aenv_wire"
           for name, line in imports_of(mod) if name.split(".")[0] not in stdlib | {"aenv_wire"}]
    assert not bad, "aenv_wire is sans-IO E2B vocabulary: the standard library and itself only:\n" + "\n".join(bad)


def test_the_http_plumbing_imports_only_the_wire_package_of_the_project() -> None:
    project = {m.split(".")[0] for m in MODULES}
    bad = [f"{mod}:{line} imports {name}" for mod in MODULES if mod.split(".")[0] == "aenv_http"
           for name, line in imports_of(mod) if name.split(".")[0] in project - {"aenv_http", "aenv_wire"}]
    assert not bad, "aenv_http imports of the project's only aenv_wire:\n" + "\n".join(bad)


def test_the_dashboard_imports_nothing_of_the_project() -> None:
    """The node's API and the fleet's gateway both serve the dashboard: it may import neither."""
    project = set(PACKAGES)
    bad = [f"{mod}:{line} imports {name}" for mod in MODULES if mod.split(".")[0] == "aenv_dashboard"
           for name, line in imports_of(mod) if name.split(".")[0] in project - {"aenv_dashboard"}]
    assert not bad, "aenv_dashboard serves static files and imports nothing of the project's:\n" + "\n".join(bad)


def test_envd_imports_only_the_standard_library() -> None:
    stdlib = set(sys.stdlib_module_names)
    bad = [f"{mod}:{line} imports {name}" for mod in MODULES if mod.split(".")[0] == "envd"
           for name, line in imports_of(mod) if name.split(".")[0] not in stdlib | {"envd"}]
    assert not bad, "envd runs in the guest on the guest's Python alone:\n" + "\n".join(bad)


# What the code interpreter may use besides the standard library: the guest's Debian
# Jupyter packages (pyzmq under jupyter_client; IPython, traitlets, matplotlib inside the kernel).
CODEINT_THIRD_PARTY = {"jupyter_client", "zmq", "IPython", "traitlets", "matplotlib"}


def test_codeint_imports_no_host_package() -> None:
    stdlib = set(sys.stdlib_module_names)
    bad = [f"{mod}:{line} imports {name}" for mod in MODULES if mod.split(".")[0] == "codeint"
           for name, line in imports_of(mod) if name.split(".")[0] not in stdlib | {"codeint"} | CODEINT_THIRD_PARTY]
    assert not bad, "codeint runs in the guest beside envd, on the guest's Python:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    g = graph()
    found = cycles(g)
    assert not found, "import cycles (counting function-level and TYPE_CHECKING imports):\n" + "\n".join(
        _cycle_path(g, c) for c in found)


def test_cycle_finder_finds_a_planted_cycle() -> None:
    """The checker itself: a graph with a loop is reported, one without is not."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]] and _cycle_path(g, ["a", "b", "c"]) == "a -> b -> c -> a"
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_private_imports_across_modules() -> None:
    bad = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and _resolve(mod, node) != "__future__"):
                continue
            source = _resolve(mod, node)
            for a in node.names:
                if not a.name.startswith("_") or a.name.startswith("__") or (mod, a.name) in PRIVATE_ALLOWED:
                    continue
                if f"{source}.{a.name}" in MODULES and mod.startswith(source + "."):
                    continue    # a package-private module, imported inside its own package
                bad.append(f"{mod}:{node.lineno} from {source} import {a.name}")
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def _private_names_defined(tree: ast.Module) -> set[str]:
    """Private attribute names a module defines itself (so objects of its own classes
    may use them across instances): methods and class attributes, ``self._x = ...``
    assignments and ``__slots__`` entries."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for tgt in targets:
                for t in ast.walk(tgt):
                    if isinstance(t, ast.Attribute):
                        out.add(t.attr)
                    elif isinstance(t, ast.Name):
                        out.add(t.id)
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets) and node.value is not None:
                out |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)
                        and isinstance(c.value, str)}
    return {n for n in out if n.startswith("_")}


def test_no_private_attribute_access_across_modules() -> None:
    bad = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text())
        own = _private_names_defined(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            if node.attr in own or (mod, node.attr) in PRIVATE_ALLOWED:
                continue     # a name of this module's own classes, or reviewed above
            bad.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "private attributes of objects other modules own:\n" + "\n".join(bad)


# Arrows that were cycles once and must not come back (issue 12): the store's facade
# and P2P know nothing of each other (assembly.py composes them), and a block image
# does not know its prefetcher (which attaches to it as an observer).
FORBIDDEN_ARROWS = [
    ("aenv_store.store", "aenv_store.p2p"),
    ("aenv_store.p2p", "aenv_store.store"),
    ("aenv_store.p2p", "aenv_store.assembly"),
    ("aenv_vm.blockimage.image", "aenv_vm.blockimage.prefetch"),
]


@pytest.mark.parametrize("source,target", FORBIDDEN_ARROWS)
def test_former_cycles_stay_cut(source: str, target: str) -> None:
    g = graph()
    bad = [(m, d) for m, deps in g.items() if m == source or m.startswith(source + ".")
           for d in deps if d == target or d.startswith(target + ".")]
    assert not bad, f"{source} must not import {target}: {bad}"
    assert "aenv_store.p2p.source" in g["aenv_store.assembly"]     # the assembly is where they meet


# Only these packages start a QEMU: aenv_vm/machine brings every guest up (and down), and
# aenv_vm/qemu is the process control beneath it (its accelerator probe boots a bare kernel).
QEMU_STARTERS = ("aenv_vm.machine", "aenv_vm.qemu")
QEMU_LAUNCHER = "aenv_vm.qemu.launcher"


def qemu_starts(mod: str) -> list[str]:
    """Where ``mod`` starts a QEMU: a reference to ``QemuProcess.start`` (called or handed
    on) or a call constructing a ``QemuProcess``, however the class or its module was
    imported (``from ...launcher import QemuProcess [as X]``, ``import ...launcher as L``)."""
    tree = ast.parse(MODULES[mod].read_text(), str(MODULES[mod]))
    classes: set[str] = set()       # names bound to QemuProcess in this module
    modules: set[str] = set()       # names bound to the launcher module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(mod, node)
            for a in node.names:
                if source == QEMU_LAUNCHER and a.name == "QemuProcess":
                    classes.add(a.asname or a.name)
                elif f"{source}.{a.name}" == QEMU_LAUNCHER:
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == QEMU_LAUNCHER and a.asname}

    def is_class(n: ast.expr) -> bool:
        return (isinstance(n, ast.Name) and n.id in classes) or (
            isinstance(n, ast.Attribute) and n.attr == "QemuProcess" and ast.unparse(n.value) in modules | {
                QEMU_LAUNCHER})
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "start" and is_class(node.value):
            out.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and is_class(node.func):
            out.append(f"{mod}:{node.lineno} {ast.unparse(node)[:80]}")
    return out


def test_only_the_machine_package_starts_qemu() -> None:
    bad = [where for mod in MODULES if not any(mod == p or mod.startswith(p + ".") for p in QEMU_STARTERS)
           for where in qemu_starts(mod)]
    assert not bad, ("a QEMU started outside aenv_vm/machine and aenv_vm/qemu (bring it up with "
                     "aenv_vm.machine.bringup: bring_up or start_standby):\n" + "\n".join(bad))
    # the checker sees the starts that are allowed
    assert any("QemuProcess.start" in w for w in qemu_starts("aenv_vm.machine.bringup"))
    assert any("QemuProcess.start" in w for w in qemu_starts("aenv_vm.qemu.accel"))
