"""Import hygiene: `core/` stays free of torch, and dabba's own modules import each other without
cycles. Both are read off the source (and a fresh interpreter), not off the test process, which
has long since imported torch through conftest."""
from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import dabba

PACKAGE_DIR = Path(dabba.__file__).resolve().parent
ROOT = PACKAGE_DIR.name  # "dabba"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}
CORE_MODULES = sorted(m for m in MODULES if m == f"{ROOT}.core" or m.startswith(f"{ROOT}.core."))


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_core_modules_do_not_import_torch():
    assert len(CORE_MODULES) >= 6, CORE_MODULES  # the package and its five modules at least
    code = ("import sys\n"
            f"for m in {CORE_MODULES!r}: __import__(m)\n"
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=PACKAGE_DIR.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"importing {CORE_MODULES} pulled in {result.stdout.strip()}"


def test_public_names_are_lazy_and_still_importable():
    code = ("import sys, dabba\n"
            "assert 'torch' not in sys.modules, 'import dabba pulled torch in'\n"
            "assert set(dabba.__all__) == {'LLM', 'SamplingParams', 'RequestOutputKind', 'RequestOutput',"
            " 'CompletionOutput', 'PoolingParams', 'PoolingRequestOutput', 'LoRARequest'}\n"
            "assert set(dabba.__all__) <= set(dir(dabba))\n"
            "from dabba import LLM, SamplingParams, RequestOutput, CompletionOutput\n"
            "assert LLM.__module__ == 'dabba.entrypoints.llm', LLM.__module__\n"
            "assert 'torch' in sys.modules\n"
            "try:\n"
            "    dabba.no_such_name\n"
            "except AttributeError:\n"
            "    pass\n"
            "else:\n"
            "    raise SystemExit('dabba.no_such_name did not raise AttributeError')\n"
            "print(dabba.__version__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=PACKAGE_DIR.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == dabba.__version__


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


class _ImportCollector(ast.NodeVisitor):
    """Every import statement that runs at some point: module level and inside functions and
    classes alike (a function-level import only postpones a cycle), but not under
    `if TYPE_CHECKING:`, which never runs."""

    def __init__(self, module: str):
        self.module = module
        self.imports: list[tuple[str, str | None, int]] = []  # (module, imported name or None, line)

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.imports.append((alias.name, None, node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            package = self.module if _is_package(self.module) else self.module.rpartition(".")[0]
            package_parts = package.split(".")
            package = ".".join(package_parts[:len(package_parts) - node.level + 1])
            base = f"{package}.{base}" if base else package
        for alias in node.names:
            self.imports.append((base, alias.name, node.lineno))


def _lazy_root_exports() -> dict[str, str]:
    """`from dabba import LLM` runs the root package's lazy `__getattr__`, which imports the module
    that defines the name; follow it there."""
    return {name: getattr(dabba, name).__module__ for name in dabba.__all__}


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported dabba module: line of the first such import}.

    `from a.b import c` imports the module `a.b.c` when there is one, else takes a name from `a.b`.
    Importing `a.b.c` also runs the `__init__` of `a.b` unless the importer lives inside `a.b`
    (then that package is already being imported), so the edge goes to those packages too.
    The root package's lazy `__getattr__` is not an edge out of the root; the names it serves are
    followed from each `from dabba import NAME` instead.
    """
    lazy = _lazy_root_exports()
    graph: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        collector = _ImportCollector(module)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        edges: dict[str, int] = {}
        for base, name, line in collector.imports:
            if name is not None and f"{base}.{name}" in MODULES:
                target = f"{base}.{name}"
            elif name is not None and base == ROOT and name in lazy:
                target = lazy[name]
            elif base in MODULES:
                target = base
            else:
                continue  # not one of ours (or a missing module, which importing would report)
            if target != module:
                edges.setdefault(target, line)
            for package in _ancestors(target):
                if package in MODULES and package not in _ancestors(module) and package != module:
                    edges.setdefault(package, line)
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each cyclic strongly connected component (Tarjan), as the shortest cycle through each of
    its members (BFS), each cycle once, starting at its smallest module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # the graph is small: plain recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles: set[tuple[str, ...]] = set()
    for component in components:
        members = set(component)
        if len(component) == 1 and component[0] not in graph.get(component[0], ()):
            continue
        for start in members:
            cycle = _shortest_cycle_through(start, graph, members)
            first = cycle.index(min(cycle))  # rotate, so each cycle is listed once
            cycles.add(tuple(cycle[first:] + cycle[:first]))
    return sorted(list(c) + [c[0]] for c in cycles)


def _shortest_cycle_through(start: str, graph: dict[str, dict[str, int]], members: set[str]) -> list[str]:
    """BFS from `start` inside its strongly connected component (so a cycle exists) back to it."""
    parent = {start: start}
    frontier = [start]
    while True:
        next_frontier = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1]
                if w in members and w not in parent:
                    parent[w] = v
                    next_frontier.append(w)
        frontier = next_frontier


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    return "\n    ".join(steps)


def test_find_cycles_finds_a_function_level_cycle():
    # The checker itself must be able to fail.
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"e": 5}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "e"]]
    # two cycles sharing a module (base -> rtn -> base, base -> gptq -> base): both are named
    graph = {"base": {"rtn": 1, "gptq": 2}, "rtn": {"base": 3}, "gptq": {"base": 4, "rtn": 5}}
    assert find_cycles(graph) == [["base", "gptq", "base"], ["base", "rtn", "base"]]
    assert find_cycles({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 2}}) == []


def test_import_graph_sees_function_level_and_from_imports():
    graph = import_graph()
    # `from dabba.ops import native` inside dabba.layers.* is the module dabba.ops.native, not the package
    assert any("dabba.ops.native" in edges for edges in graph.values())
    # the core package imports only within core plus config, sampling_params, pooling_params,
    # lora_request and errors
    for module in CORE_MODULES:
        assert set(graph[module]) <= set(CORE_MODULES) | {"dabba.config", "dabba.config_fields", "dabba.sampling_params",
                                                          "dabba.pooling_params", "dabba.lora_request",
                                                          "dabba.errors"}, graph[module]


def test_no_import_cycles_among_dabba_modules():
    graph = import_graph()
    cycles = find_cycles(graph)
    report = "\n".join(f"  {' -> '.join(c)}\n    {_describe(c, graph)}" for c in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) among dabba's modules:\n{report}"


# The ladder, bottom to top (../shared/design.md, docs/architecture.md): a module imports only
# modules of its own rung or of rungs below it. Each rung names modules and packages (a package
# takes its modules, unless a longer name places one elsewhere).
LADDER: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("dabba", "dabba.errors", "dabba.logger", "dabba.config", "dabba.config_fields", "dabba.router_config",
              "dabba.sampling_params",
              "dabba.pooling_params", "dabba.lora_request", "dabba.outputs",
              "dabba.structured_output", "dabba.structured_output.params")),  # plain data, no torch
    ("core", ("dabba.core",)),  # the scheduler's bookkeeping and the contracts with the worker
    ("arch", ("dabba.arch",)),  # a model's architecture, resolved
    ("multimodal", ("dabba.multimodal",)),  # images opened and preprocessed: pixels, no model
    ("ops", ("dabba.ops",)),  # native kernels' bindings, activations
    ("distributed", ("dabba.distributed",)),  # a rank's place and the collectives
    ("attention", ("dabba.attention",)),
    ("quantization", ("dabba.quantization",)),  # linear methods
    ("layers", ("dabba.layers",)),
    ("models", ("dabba.models",)),
    ("worker", ("dabba.worker",)),  # the model runner, sampler, speculative decoding's proposers
    ("executor", ("dabba.executor",)),  # where a step's ranks run
    ("grammars", ("dabba.structured_output.grammar", "dabba.structured_output.manager",  # the core's policies
                  "dabba.structured_output.compile_pool", "dabba.structured_output.compile_worker")),
    ("engine", ("dabba.engine",)),
    ("entrypoints", ("dabba.entrypoints",)),  # the server, the LLM class
    ("tools", ("dabba.tools",)),  # quantize, plan, eval, bench: above what they use
    # the command line dispatches servers and tools alike (its flags and its tools' commands beside it)
    ("cli", ("dabba.entrypoints.cli", "dabba.entrypoints.cli_args", "dabba.entrypoints.cli_tools")),
]


def rung_of(module: str, ladder: list[tuple[str, tuple[str, ...]]] = LADDER) -> int | None:
    """The rung of the longest name in the ladder that is the module or a package holding it
    (the root package only by its own name)."""
    best, best_len = None, -1
    for rung, (_, names) in enumerate(ladder):
        for name in names:
            holds = module == name or (name != ROOT and module.startswith(name + "."))
            if holds and len(name) > best_len:
                best, best_len = rung, len(name)
    return best


def arrows_up(graph: dict[str, dict[str, int]], ladder: list[tuple[str, tuple[str, ...]]] = LADDER) -> list[str]:
    """Every import that runs up the ladder, as 'importer (rung, line N) -> imported (rung)'."""
    found = []
    for module, edges in sorted(graph.items()):
        low = rung_of(module, ladder)
        for target, line in sorted(edges.items()):
            high = rung_of(target, ladder)
            if low is not None and high is not None and high > low:
                found.append(f"{module} ({ladder[low][0]}, line {line}) -> {target} ({ladder[high][0]})")
    return found


def test_the_ladder_check_can_fail():
    ladder = [("low", ("p.a",)), ("high", ("p.b",)), ("top", ("p.b.c",))]
    graph = {"p.a.x": {"p.b.y": 3}, "p.b.y": {"p.a.x": 1}, "p.b.c": {"p.b.y": 2}}
    assert rung_of("p.b.c", ladder) == 2 and rung_of("p.b.cc", ladder) == 1 and rung_of("q", ladder) is None
    assert arrows_up(graph, ladder) == ["p.a.x (low, line 3) -> p.b.y (high)"]


def test_every_module_has_a_rung_on_the_ladder():
    assert [m for m in MODULES if rung_of(m) is None] == []


def test_no_import_runs_up_the_ladder():
    up = arrows_up(import_graph())
    assert not up, f"{len(up)} import(s) run up the ladder:\n  " + "\n  ".join(up)


def test_the_server_reaches_the_engine_only_through_its_client_protocol():
    """The HTTP front end holds an EngineClient (engine/protocol.py) and its types, never an engine."""
    graph = import_graph()
    front = [m for m in MODULES if m.startswith((f"{ROOT}.entrypoints.openai", f"{ROOT}.entrypoints.web"))]
    assert len(front) >= 6, front
    reached = {(m, target) for m in front for target in graph[m]
               if target.startswith(f"{ROOT}.engine.") and target != f"{ROOT}.engine.protocol"}
    assert reached == set(), reached
