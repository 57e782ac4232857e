"""The layout's rules, read from the source: who may import (or spawn) whom, and no import cycles
between modules or between the parts of a package.

Reads every ``import`` statement of the runtime packages, at module top and
inside functions (lazy imports count), and every string that names one of our
modules (``python -m ...`` command lines count), so a boundary cannot be
crossed by importing late or by spawning a process.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDECAR = REPO / "sidecar" / "kv_offload_sidecar"
ENGINE = SIDECAR / "engine"
OURS = ("kv_offload_sidecar", "kv_offload_operator", "kv_offload_tools", "kv_offload_testing")
# Runtime files are kept small enough to read in one sitting.
MAX_RUNTIME_LINES = 520


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)[1:]  # drop sidecar/ or operator/
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    top, *rest = dotted.split(".")
    base = REPO / ("operator" if top == "kv_offload_operator" else "sidecar") / top
    path = base.joinpath(*rest)
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module top) for every import in ``path``; TYPE_CHECKING blocks skipped.

    Relative imports count as the absolute names they resolve to (``from ..webhook import x``
    in ``kv_offload_operator.pools.a`` imports ``kv_offload_operator.webhook``)."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[str, bool]] = []
    package = module_name(path).split(".")[:None if path.name == "__init__.py" else -1]  # for relative imports

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package[:len(package) - child.level + 1] if child.level else []
                module = ".".join([*base, *([child.module] if child.module else [])])
                # "from pkg import mod" imports pkg.mod; "from mod import name" imports mod.
                for a in child.names:
                    sub = f"{module}.{a.name}"
                    out.append((sub if is_module(sub) else module, top))
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, True)
    return out


def module_strings(path: Path) -> list[str]:
    """String constants naming one of our modules (e.g. a ``-m kv_offload_...`` argument)."""
    tree = ast.parse(path.read_text(), str(path))
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and any(p + "." in n.value or n.value == p for p in OURS)]


def runtime_files() -> list[Path]:
    return sorted([*SIDECAR.rglob("*.py"), *(REPO / "operator").rglob("*.py")])


def test_the_sidecar_never_imports_or_spawns_the_operator_or_the_tools():
    bad = []
    for path in SIDECAR.rglob("*.py"):
        for name, _ in imports(path):
            if name.split(".")[0] in ("kv_offload_operator", "kv_offload_tools", "kv_offload_testing", "kopf"):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
        for text in module_strings(path):
            if any(p in text for p in ("kv_offload_operator", "kv_offload_tools", "kv_offload_testing")):
                bad.append(f"{path.relative_to(REPO)} names {text!r}")
    assert bad == []


def test_the_operator_never_imports_the_tools():
    bad = [f"{p.relative_to(REPO)} imports {name}" for p in (REPO / "operator").rglob("*.py")
           for name, _ in imports(p) if name.startswith(("kv_offload_tools", "kv_offload_testing"))]
    assert bad == []


def test_the_test_harness_never_imports_the_tools():
    # kv_offload_testing (local pools, sidecar processes, simulated engines) is what the tests,
    # the demo and the benches share: it sits under the tools, never on them.
    bad = [f"{p.relative_to(REPO)} imports {name}" for p in (REPO / "sidecar" / "kv_offload_testing").rglob("*.py")
           for name, _ in imports(p) if name.startswith(("kv_offload_tools", "kv_offload_operator"))]
    assert bad == []


def test_what_runs_inside_vllm_imports_only_the_standard_library_numpy_and_itself():
    allowed = set(sys.stdlib_module_names) | {"numpy", "kv_offload_sidecar"}
    bad = []
    for path in ENGINE.rglob("*.py"):
        for name, _ in imports(path):
            root = name.split(".")[0]
            if root == "vllm" and path.name == "vllm_contract.py":
                continue  # vLLM's own classes, inside vLLM
            inside = name == "kv_offload_sidecar" or name.startswith("kv_offload_sidecar.engine")
            if root not in allowed or (root == "kv_offload_sidecar" and not inside):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert bad == []


def test_the_operator_imports_of_the_engine_only_its_contract():
    # engine/ runs inside vLLM; what the operator writes and the tier reads (config structs,
    # model identity, ports) is engine/contract/, so a change to the tier never reaches the operator.
    bad = [f"{p.relative_to(REPO)} imports {name}" for p in (REPO / "operator").rglob("*.py")
           for name, _ in imports(p) if name.startswith("kv_offload_sidecar.engine")
           and not name.startswith("kv_offload_sidecar.engine.contract")]
    assert bad == []


def test_the_contract_imports_only_the_standard_library_and_itself():
    bad = [f"{p.relative_to(REPO)} imports {name}" for p in (ENGINE / "contract").rglob("*.py")
           for name, _ in imports(p) if name.split(".")[0] not in sys.stdlib_module_names
           and not name.startswith("kv_offload_sidecar.engine.contract")]
    assert bad == []


def cycles_in(graph: dict[str, set[str]]) -> list[str]:
    """Each cycle of ``graph`` (module -> modules it needs) found by a depth-first walk."""
    cycles = []
    state: dict[str, int] = {}

    def walk(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]) if n in stack else n)
            elif n not in state:
                walk(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
    return cycles


def module_graph() -> dict[str, set[str]]:
    """Each runtime module -> the runtime modules it imports, lazily or not."""
    files = {module_name(p): p for p in runtime_files()}
    return {m: {n for n, _ in imports(p)} & files.keys() - {m} for m, p in files.items()}


def test_no_import_cycles_between_modules_even_through_lazy_imports():
    assert cycles_in(module_graph()) == []


def test_no_import_cycles_between_the_parts_of_a_package():
    # A package's parts (its modules and subpackages, each taken with all it holds) are
    # layered: the webhook builds on the pools, never the pools on the webhook, even where
    # no two modules would form a cycle (pools.a -> webhook.b -> pools.c); so too peers on
    # data and settings, control on peers.
    graph = module_graph()
    cycles = []
    for package in sorted(m for m in graph if m.split(".")[0] in ("kv_offload_operator", "kv_offload_sidecar")
                          and any(n.startswith(m + ".") for n in graph)):
        def part(m: str, prefix: str = package + ".") -> str | None:
            return m[len(prefix):].split(".")[0] if m.startswith(prefix) else None

        parts: dict[str, set[str]] = {}
        for m, needs in graph.items():
            if (a := part(m)) is not None:
                parts.setdefault(a, set()).update(b for n in needs if (b := part(n)) not in (None, a))
        cycles += [f"{package}: {c}" for c in cycles_in(parts)]
    assert cycles == []


def test_no_module_runs_while_a_package_it_imports_is_half_loaded():
    # Importing a.b.c runs a/__init__ and a/b/__init__ first, so a module needs every package
    # on the path of what it imports. A package whose __init__ imports, at its top, a module
    # that imports the package back runs that module while the package is half loaded (as
    # data -> data.base -> data would). Lazy imports run once loading is over: only top ones count.
    files = {module_name(p): p for p in runtime_files()}

    def loaded(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & files.keys()

    graph = {m: set().union(*(loaded(n) for n, top in imports(p) if top)) - {m}
             for m, p in files.items()}
    assert cycles_in(graph) == []


def test_runtime_modules_stay_small():
    big = [f"{p.relative_to(REPO)}: {n} lines" for p in runtime_files()
           if (n := len(p.read_text().splitlines())) > MAX_RUNTIME_LINES]
    assert big == []


# The tree named after what it holds: each folder's modules and subpackages, exactly, so a
# module is placed on purpose (the operator by job: command line, pool reconcile, webhook
# and certificates, translation; the sidecar's chunk directory in its own folder).
FOLDERS = {
    "operator/kv_offload_operator": {
        "cli", "pools", "webhook", "translation", "handlers", "startup", "options", "leadership",
        "operator_metrics", "kube_api", "rbac", "quantity"},
    # ``__main__``: ``python -m kv_offload_operator.cli`` where no ``kv-offload`` script is installed.
    "operator/kv_offload_operator/cli": {"operator", "translate", "fingerprint", "diff", "webhook_cert", "__main__"},
    "operator/kv_offload_operator/pools": {
        "reconcile", "pool_spec", "pool_source", "kv_transfer", "pool_objects", "pool_key",
        "key_rotation", "model_config", "model_config_follower", "ready_peers", "pool_pod", "pool_api",
        "translation_change", "drift", "sidecar_image"},
    "operator/kv_offload_operator/webhook": {"admission", "pod_patch", "pod_host", "pod_defaults", "tls_server",
                                             "certificate"},
    "operator/kv_offload_operator/translation": {"vllm_args", "kv_cache_geometry", "translate",
                                                 "vllm_releases", "declared_identity"},
    # The chunk directory: owners, the holder's and the owner's sides, its messages (its
    # endpoints are the control port's, control/location_routes.py, like the handshake's).
    "sidecar/kv_offload_sidecar/peers/directory": {
        "location", "ownership", "publisher", "holders", "location_wire"},
    # What the operator shares with the tier inside vLLM: the config file's structs, the
    # model identity, the ports (the operator imports nothing else of engine/).
    "sidecar/kv_offload_sidecar/engine/contract": {"offloading_config", "model_identity", "ports"},
    # The sidecar package's subcommands, named after them.
    "sidecar/kv_offload_sidecar/commands": {"sidecar", "install_tier", "ucx_info", "admin_token"},
}


def test_each_folder_holds_what_it_is_named_for():
    def held(folder: Path) -> set[str]:
        return {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | {
            p.name for p in folder.iterdir() if (p / "__init__.py").exists()}

    assert {f: held(REPO / f) for f in FOLDERS} == FOLDERS


def test_nothing_in_the_sidecar_or_the_tier_waits_with_select_select():
    # select.select raises ValueError for a descriptor of 1,024 or more (issue 48): a sidecar
    # of a large pool and vLLM's process (the tier runs inside it) get there. poll(2) it is.
    pattern = re.compile(r"\bselect\.select\(|from select import[^\n]*\bselect\b")
    bad = [f"{p.relative_to(REPO)}:{n}" for p in (REPO / "sidecar" / "kv_offload_sidecar").rglob("*.py")
           for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert bad == []
