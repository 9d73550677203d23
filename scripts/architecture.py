"""The import graph of the project, built from the source with ``ast``, and the rules it must keep.

``python scripts/architecture.py`` prints every violation (exit 1 if any, 0 if none):

- **circles**: a cycle between modules, or between packages (``trainer`` <-> ``eval``), counting imports made inside
  functions too (an import inside a function still ties the two modules together);
- **upward imports**: an import from a lower layer to a higher one (:data:`LAYERS`, top to bottom); packages of
  one layer may import each other as long as that makes no circle;
- **Megatron or vLLM in algorithms/**: the DynaMO maths stays plain torch/numpy;
- **the converter's narrow base** (:data:`ONLY_IMPORTS`): ``checkpoints_convert`` is an entry point, but shares the
  model code with the trainer through ``models/`` and never imports the trainer (or anything but ``models``,
  ``parallel``, ``data`` and the base);
- **private names across modules**: ``from m import _x``, or ``m._x`` on an imported module or an imported name
  (``StepRunner._update``), where ``m`` is another module of the project;
- **modules over 400 lines** (``MAX_LINES``), benchmarks included;
- **product functions over 60 lines** (``MAX_FUNCTION_LINES``; megatron_dynamo and checkpoints_convert, nested
  functions and methods each on their own, counted from ``def`` to the last line): only those of
  :data:`LONG_FUNCTIONS`, each no longer than it is listed. The list may only shrink: an entry whose function is
  gone or within the budget is a problem too (remove it).
- **imports of the project's own modules inside functions** (product only): they hide a module's dependencies, so
  each stays only for a measured reason (the start-up of a command, an optional heavy library), with a comment
  saying which. A module may hold only as many as :data:`FUNCTION_IMPORTS` lists for it, and the whole product no
  more than ``MAX_FUNCTION_IMPORTS``. The list may only shrink: an entry above the module's count is a problem too
  (lower or remove it).

``python scripts/architecture.py --write-docs`` rewrites the generated part of ``docs/architecture.md`` (the layer
table and the drawing of the arrows between packages); ``--check-docs`` exits 1 when that part is stale. The test
(``tests/test_architecture.py``) runs :func:`analyse` on the tree, and on planted trees to show that it fails.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("megatron_dynamo", "checkpoints_convert", "benchmarks")
MAX_LINES = 400
MAX_FUNCTION_LINES = 60
PRODUCT = ("megatron_dynamo", "checkpoints_convert")
# Product functions allowed over MAX_FUNCTION_LINES: "path:Qualified.name" -> lines. Empty since issue 34 split the
# last ones; an entry may not grow, and one no longer needed is itself reported.
LONG_FUNCTIONS: dict[str, int] = {}
# The product's imports of its own modules inside functions (module docstring), by file: "path" -> how many, each
# with a comment at the import saying why it stays. Issue 34's target is MAX_FUNCTION_IMPORTS <= 25; the entries
# beyond that are the ones not yet moved to their module's top.
MAX_FUNCTION_IMPORTS = 8
FUNCTION_IMPORTS: dict[str, int] = {
    "checkpoints_convert/cli.py": 1,
    "megatron_dynamo/commands/ablate.py": 1,
    "megatron_dynamo/commands/compare.py": 1,
    "megatron_dynamo/commands/confirm.py": 1,
    "megatron_dynamo/data/__init__.py": 1,
    "megatron_dynamo/trainer/preflight.py": 1,
    "megatron_dynamo/trainer/rollout_setup.py": 1,
}
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- BEGIN GENERATED: scripts/architecture.py --write-docs -->", "<!-- END GENERATED -->"

# Top to bottom. A package is a sub-package of megatron_dynamo (or one of its top-level modules), or one of the
# other source roots. An arrow may point down, or sideways inside a layer; never up.
LAYERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("tools", ("benchmarks",), "measurement scripts; nothing imports them"),
    ("entry points", ("cli", "commands", "checkpoints_convert"),
     "the `dynamo` subcommands and the `python -m checkpoints_convert` converter: parse, validate, call down"),
    ("experiments", ("experiments",),
     "ablate / compare / confirm: one variant registry, Plan -> Executor (process pool, resume, signals) -> "
     "Collector -> Analysis, the paper's numbers as data"),
    ("launch", ("launch",), "recipes and the NeMo-Run / Slurm / torchrun launch of the entry points"),
    ("trainer", ("trainer",), "the DynaMO training loop on Megatron-Core: actor, step, checkpoints, metrics"),
    ("stages", ("rollout", "eval", "reward", "report"),
     "what the trainer and the commands use: vLLM rollouts, benchmark evaluation, math rewards, run reports"),
    ("foundations", ("algorithms", "parallel", "models", "data"),
     "DynaMO maths, process groups, Qwen models and checkpoint formats, datasets and tokenizers"),
    ("base", ("__init__", "config", "cpus", "heap", "library_logs"),
     "standard-library helpers every layer may use: YAML config plumbing, CPU counts, the collector at start-up, "
     "library log routing"),
)
NO_IMPORTS = {"algorithms": ("megatron", "vllm")}
# A package here may import only these packages of the project (its own modules aside).
ONLY_IMPORTS = {"checkpoints_convert": ("models", "parallel", "data") + LAYERS[-1][1]}


def layer_of(package: str) -> int:
    for index, (_, packages, _) in enumerate(LAYERS):
        if package in packages:
            return index
    raise KeyError(f"package {package!r} is in no layer of scripts/architecture.py LAYERS")


def package_of(module: str) -> str:
    """``megatron_dynamo.trainer.step`` -> ``trainer``; ``megatron_dynamo.config`` -> ``config``;
    ``megatron_dynamo`` -> ``__init__``; ``checkpoints_convert.cli`` -> ``checkpoints_convert``."""
    parts = module.split(".")
    if parts[0] == "megatron_dynamo":
        return parts[1] if len(parts) > 1 else "__init__"
    return parts[0]


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    lines: int
    rel: str  # the path from the tree's root
    tree: ast.Module


@dataclass
class Import:
    source: str
    target: str  # a module of the project
    line: int
    names: tuple[str, ...] = ()


@dataclass
class Report:
    modules: dict[str, Module]
    imports: list[Import]
    module_cycles: list[list[str]] = field(default_factory=list)
    package_cycles: list[list[str]] = field(default_factory=list)
    upward: list[str] = field(default_factory=list)
    forbidden: list[str] = field(default_factory=list)
    private: list[str] = field(default_factory=list)
    too_long: list[str] = field(default_factory=list)
    long_functions: list[str] = field(default_factory=list)
    function_imports: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        return ([f"circle between modules: {' -> '.join(c + c[:1])}" for c in self.module_cycles]
                + [f"circle between packages: {' -> '.join(c + c[:1])}" for c in self.package_cycles]
                + self.upward + self.forbidden + self.private + self.too_long + self.long_functions
                + self.function_imports)

    def package_edges(self) -> set[tuple[str, str]]:
        edges = set()
        for imp in self.imports:
            a, b = package_of(imp.source), package_of(imp.target)
            if a != b:
                edges.add((a, b))
        return edges


def load_modules(root: Path, sources: tuple[str, ...] = SOURCES) -> dict[str, Module]:
    modules = {}
    for source in sources:
        for path in sorted((root / source).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            text = path.read_text(encoding="utf-8")
            modules[".".join(parts)] = Module(".".join(parts), path, is_package, len(text.splitlines()),
                                              str(path.relative_to(root)), ast.parse(text, filename=str(path)))
    return modules


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str, modules: dict[str, Module]) -> str | None:
    """The longest prefix of a dotted name that is a module of the project."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def collect_imports(modules: dict[str, Module]) -> tuple[list[Import], list[str], list[str]]:
    """Every import of a project module by another one, wherever it stands (functions included); also the
    forbidden third-party imports and the private names taken from other modules."""
    imports: list[Import] = []
    forbidden: list[str] = []
    private: list[str] = []
    private_defs = {name: {node.name for node in ast.walk(m.tree)
                           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                           and node.name.startswith("_") and not node.name.startswith("__")}
                    for name, m in modules.items()}
    defined_in: dict[str, set[str]] = {}
    for name, defs in private_defs.items():
        for d in defs:
            defined_in.setdefault(d, set()).add(name)
    for module in modules.values():
        def where(node: ast.AST, rel: str = module.rel) -> str:
            return f"{rel}:{node.lineno}"

        banned = NO_IMPORTS.get(package_of(module.name), ())
        bound: dict[str, str] = {}  # local name -> the project module (or name in it) it stands for
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in banned:
                        forbidden.append(f"{where(node)}: {module.name} imports {alias.name} "
                                         f"({package_of(module.name)}/ imports no {', '.join(banned)})")
                    target = _owner(alias.name, modules)
                    if target and target != module.name:
                        imports.append(Import(module.name, target, node.lineno))
                        bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                            alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, node)
                if base.split(".")[0] in banned:
                    forbidden.append(f"{where(node)}: {module.name} imports {base} "
                                     f"({package_of(module.name)}/ imports no {', '.join(banned)})")
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    target = full if full in modules else _owner(base, modules)
                    if not target or target == module.name:
                        continue
                    imports.append(Import(module.name, target, node.lineno, (alias.name,)))
                    bound[alias.asname or alias.name] = full
                    if alias.name.startswith("_") and not alias.name.startswith("__") and full not in modules:
                        private.append(f"{where(node)}: {module.name} imports the private name "
                                       f"{alias.name} from {target}")
        own = private_defs.get(module.name, set())
        for node in ast.walk(module.tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in bound:
                private.append(f"{where(node)}: {module.name} uses the private name "
                               f"{bound[node.value.id]}.{node.attr}")
            elif node.attr not in own and node.attr in defined_in and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                # obj._method() of a class defined in another module of the project (runner._update)
                private.append(f"{where(node)}: {module.name} uses the private name {node.attr} of "
                               f"{', '.join(sorted(defined_in[node.attr]))}")
    return imports, forbidden, private


def cycle_path(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One real circle inside a strongly connected component: the shortest path of imports from its smallest name
    back to it (breadth first), so that ``a -> b -> c -> a`` names imports that exist."""
    start, members = min(component), set(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1]
                if nxt in members and nxt not in parent:
                    parent[nxt] = node
                    following.append(nxt)
        frontier = following
    raise ValueError(f"no circle through {start}")  # cannot happen in a strongly connected component


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each as one circle of imports through its
    smallest name (:func:`cycle_path`; the other members of a larger component are reached by other circles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(cycle_path(component, edges))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def function_lengths(modules: dict[str, Module], sources: tuple[str, ...] = PRODUCT) -> dict[str, int]:
    """Lines of every function of the modules under ``sources`` (``def`` to its last line, decorators aside), by
    ``path:Qualified.name``; methods as ``Class.method``, nested functions as ``outer.inner``."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, rel: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{rel}:{prefix}{child.name}"] = child.end_lineno - child.lineno + 1
                visit(child, rel, f"{prefix}{child.name}.")
            else:
                visit(child, rel, f"{prefix}{child.name}." if isinstance(child, ast.ClassDef) else prefix)

    for module in modules.values():
        if module.rel.split("/")[0] in sources:
            visit(module.tree, module.rel, "")
    return lengths


def function_budget(lengths: dict[str, int], max_lines: int, allowed: dict[str, int]) -> list[str]:
    """The breaches of the function budget (module docstring): over ``max_lines`` and not ``allowed``, longer than
    ``allowed`` lists, or listed in ``allowed`` without need."""
    problems = []
    for name, lines in sorted(lengths.items()):
        if lines > allowed.get(name, max_lines):
            limit = f"listed at {allowed[name]}" if name in allowed else f"over {max_lines}"
            problems.append(f"{name}: function of {lines} lines ({limit})")
    for name, listed in sorted(allowed.items()):
        if lengths.get(name, 0) <= max_lines:
            now = f"{lengths[name]} lines now" if name in lengths else "gone"
            problems.append(f"{name}: in LONG_FUNCTIONS ({listed}) but {now}: remove the entry")
    return problems


def function_imports(modules: dict[str, Module], sources: tuple[str, ...] = PRODUCT) -> dict[str, list[int]]:
    """The lines of the imports of project modules that stand inside a function (at any depth), by path."""
    found: dict[str, list[int]] = {}

    def visit(node: ast.AST, module: Module, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.ImportFrom):
                base = _absolute(module, child)
                project = any(f"{base}.{alias.name}" in modules for alias in child.names) or _owner(base, modules)
            elif in_function and isinstance(child, ast.Import):
                project = any(_owner(alias.name, modules) for alias in child.names)
            else:
                project = False
            if project:
                found.setdefault(module.rel, []).append(child.lineno)
            visit(child, module, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    for module in modules.values():
        if module.rel.split("/")[0] in sources:
            visit(module.tree, module, False)
    return found


def import_budget(found: dict[str, list[int]], max_total: int, allowed: dict[str, int]) -> list[str]:
    """The breaches of the in-function import budget (module docstring): a module with more than ``allowed`` lists
    for it (none if unlisted), an entry above its module's count, and a total over ``max_total``."""
    problems = []
    for rel, lines in sorted(found.items()):
        if len(lines) > allowed.get(rel, 0):
            limit = f"listed at {allowed[rel]}" if rel in allowed else "not listed"
            problems.append(f"{rel}: {len(lines)} imports of project modules inside functions ({limit}), at lines "
                            f"{', '.join(map(str, lines))}: import at the top, or list it with its reason")
    for rel, listed in sorted(allowed.items()):
        if len(found.get(rel, ())) < listed:
            problems.append(f"{rel}: in FUNCTION_IMPORTS ({listed}) but {len(found.get(rel, ()))} now: lower the entry")
    total = sum(map(len, found.values()))
    if total > max_total:
        problems.append(f"{total} imports of project modules inside functions, over MAX_FUNCTION_IMPORTS ({max_total})")
    return problems


def analyse(root: Path = ROOT, sources: tuple[str, ...] = SOURCES, max_lines: int = MAX_LINES,
            max_function_lines: int = MAX_FUNCTION_LINES, long_functions: dict[str, int] | None = None,
            max_function_imports: int | None = None, allowed_function_imports: dict[str, int] | None = None) -> Report:
    modules = load_modules(root, sources)
    imports, forbidden, private = collect_imports(modules)
    report = Report(modules, imports, forbidden=forbidden, private=private)
    module_edges: dict[str, set[str]] = {}
    package_edges: dict[str, set[str]] = {}
    for imp in imports:
        # A package's __init__ importing its own modules is how packages re-export; it is no circle.
        if not (modules[imp.source].is_package and imp.target.startswith(imp.source + ".")):
            module_edges.setdefault(imp.source, set()).add(imp.target)
        a, b = package_of(imp.source), package_of(imp.target)
        if a != b:
            package_edges.setdefault(a, set()).add(b)
            if a in ONLY_IMPORTS and b not in ONLY_IMPORTS[a]:
                report.forbidden.append(f"{modules[imp.source].rel}:{imp.line}: {imp.source} imports {imp.target} "
                                        f"({a}/ imports only {', '.join(ONLY_IMPORTS[a])})")
            try:
                up = layer_of(b) < layer_of(a)
            except KeyError as err:
                report.upward.append(f"{modules[imp.source].rel}:{imp.line}: {err.args[0]}")
                continue
            if up:
                report.upward.append(
                    f"{modules[imp.source].rel}:{imp.line}: {imp.source} ({LAYERS[layer_of(a)][0]}) "
                    f"imports {imp.target} ({LAYERS[layer_of(b)][0]}): up the layers")
    report.module_cycles = cycles(module_edges)
    report.package_cycles = cycles(package_edges)
    report.too_long = [f"{m.rel}: {m.lines} lines (over {max_lines})"
                       for m in modules.values() if m.lines > max_lines]
    report.long_functions = function_budget(function_lengths(modules), max_function_lines,
                                            LONG_FUNCTIONS if long_functions is None else long_functions)
    report.function_imports = import_budget(
        function_imports(modules), MAX_FUNCTION_IMPORTS if max_function_imports is None else max_function_imports,
        FUNCTION_IMPORTS if allowed_function_imports is None else allowed_function_imports)
    return report


def mermaid(report: Report) -> str:
    """The arrows between packages, one subgraph a layer, top to bottom."""
    lines = ["```mermaid", "flowchart TD"]
    present = {package_of(m) for m in report.modules}
    for index, (name, packages, _) in enumerate(LAYERS):
        shown = [p for p in packages if p in present]
        if shown:
            lines.append(f'    subgraph L{index}["{name}"]')
            lines += [f'        {p.strip("_") or p}["{p}"]' for p in shown]
            lines.append("    end")
    for a, b in sorted(report.package_edges()):
        lines.append(f"    {a.strip('_')} --> {b.strip('_')}")
    lines.append("```")
    return "\n".join(lines)


def generated(report: Report) -> str:
    present = {package_of(m) for m in report.modules}
    rows = ["| layer (top to bottom) | packages | what it owns |", "| --- | --- | --- |"]
    for name, packages, owns in LAYERS:
        rows.append(f"| {name} | {', '.join(f'`{p}`' for p in packages if p in present)} | {owns} |")
    edges = sorted(report.package_edges())
    arrows = ["| package | imports |", "| --- | --- |"]
    for a in sorted({a for a, _ in edges}, key=lambda p: (layer_of(p), p)):
        arrows.append(f"| `{a}` | {', '.join(f'`{b}`' for x, b in edges if x == a)} |")
    return "\n".join([BEGIN, "", *rows, "", mermaid(report), "", *arrows, "", END])


def doc_with(text: str, report: Report) -> str:
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + generated(report) + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-docs", action="store_true",
                        help=f"rewrite the generated part of {DOC.relative_to(ROOT)} (between its markers)")
    parser.add_argument("--check-docs", action="store_true",
                        help=f"exit 1 when the generated part of {DOC.relative_to(ROOT)} is not current")
    args = parser.parse_args(argv)
    report = analyse()
    if args.write_docs or args.check_docs:
        text = DOC.read_text(encoding="utf-8")
        if BEGIN not in text or END not in text:
            print(f"{DOC.relative_to(ROOT)} has no generated markers ({BEGIN} ... {END})", file=sys.stderr)
            return 2
        new = doc_with(text, report)
        if args.check_docs:
            if new != text:
                print(f"{DOC.relative_to(ROOT)} is stale: run python scripts/architecture.py --write-docs")
                return 1
            return 0
        DOC.write_text(new, encoding="utf-8")
        print(f"wrote {DOC.relative_to(ROOT)}")
        return 0
    problems = report.problems()
    for line in problems:
        print(line)
    print(f"{len(report.modules)} modules, {len(report.imports)} imports: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
