"""The package's layers (docs/architecture.md "The layers"): no import runs upward or in a
circle, the core imports no torch, and the top level holds only the commands.

One AST scan of every module under megatron_lbp/, module-level and function-level imports
alike: a function-level import that runs upward is still a dependency upward.
"""
import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_lbp"

# The layer order, lowest first: a module may import its own layer and those below. A module's
# layer is that of the longest prefix listed here; a module no prefix covers fails the test.
LAYERS = (
    # Pure Python: the presets, the hierarchy's math, the byte and memory model, the engine's
    # vocabulary (core/vocabulary.py), the patch registry's helper.
    ("core", ("megatron_lbp.core",)),
    # The ZeRO engine on torch.distributed, its process groups and its int8 kernels.
    ("engine", ("megatron_lbp.engine", "megatron_lbp.quant")),
    # megatron-core plugged in: the adapter, the training hooks, the runtime patches (the
    # test-only save stall among them), the entry's checks, the record a run writes for the study.
    ("integration", ("megatron_lbp.integration",)),
    # Real ranks and tiny models for the tests, the demo and the trace recorders.
    ("testing", ("megatron_lbp.testing",)),
    # The cost model and the trace reader and replay.
    ("projection", ("megatron_lbp.projection",)),
    # What a user runs around training on top of the projection: the plan and launch helpers,
    # the study, hf, the DeepSpeed baseline's runner.
    # gpucheck: the one-GPU check's parts (python -m megatron_lbp.gpu_check).
    ("tools", ("megatron_lbp.launch", "megatron_lbp.study", "megatron_lbp.hf",
               "megatron_lbp.deepspeed_baseline", "megatron_lbp.gpucheck")),
    ("demo", ("megatron_lbp.demo",)),
    # `python -m megatron_lbp.<command>` keeps working: each is a stub that runs its module.
    ("commands", ("megatron_lbp.plan", "megatron_lbp.pretrain_gpt", "megatron_lbp.capabilities",
                  "megatron_lbp.tokenizer_check", "megatron_lbp.preprocess_data",
                  "megatron_lbp.gpu_check")),
)

# Upward imports still allowed, each inside a function (checked), with why: none.
UPWARD: dict[tuple[str, str], str] = {}

# Import circles still allowed (every module of each, function-level imports included), with
# why; any other circle fails, and so does an entry no circle matches any more.
CIRCLES: dict[frozenset[str], str] = {}

# The package root runs first for every import (the Python 3.11 shims, the notice filter).
ROOT_IMPORTS = {"megatron_lbp.integration.compat"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> int | None:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def imports_of(module: str, path: Path, known: set[str]):
    """(imported module, line, at module level) for each megatron_lbp import in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))

    def resolve(name: str) -> str:
        while name not in known and "." in name:
            name = name.rpartition(".")[0]
        return name

    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for n in names:
            if n.split(".")[0] == "megatron_lbp":
                out.append((resolve(n), node.lineno, id(node) in top))
    return out


def test_every_module_has_a_layer():
    missing = [m for m in _modules() if m != "megatron_lbp" and layer_of(m) is None]
    assert not missing, f"modules no layer covers (add them to LAYERS): {missing}"


def test_no_import_runs_upward():
    modules = _modules()
    known = set(modules)
    bad, used = [], set()
    for module, path in modules.items():
        if module == "megatron_lbp":
            got = {m for m, _, _ in imports_of(module, path, known)}
            assert got <= ROOT_IMPORTS | {"megatron_lbp"}, f"the package root imports {got}"
            continue
        mine = layer_of(module)
        for target, line, at_top in imports_of(module, path, known):
            theirs = layer_of(target) if target != "megatron_lbp" else 0
            if theirs is None or mine is None or theirs <= mine:
                continue
            if (module, target) in UPWARD and not at_top:
                used.add((module, target))
                continue
            bad.append(f"{path.relative_to(REPO)}:{line} ({LAYERS[mine][0]}) imports {target} "
                       f"({LAYERS[theirs][0]})" + (" at module level" if at_top else ""))
    assert not bad, "imports that run upward:\n" + "\n".join(bad)
    assert used == set(UPWARD), f"UPWARD entries no module needs any more: {set(UPWARD) - used}"


def test_the_package_imports_no_benchmark_and_no_test():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] in ("benchmarks", "tests")]
    assert not bad, "\n".join(bad)


def test_the_top_level_holds_only_the_commands():
    commands = dict(LAYERS)["commands"]
    top = sorted(f"megatron_lbp.{p.stem}" for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert top == sorted(commands), f"top-level modules {top}, commands {sorted(commands)}"
    for name in commands:
        text = (PACKAGE / f"{name.split('.')[1]}.py").read_text()
        assert "runpy.run_module(" in text and len(text.splitlines()) < 15, (
            f"{name} should be a stub that runs its module, not code")


def test_the_core_imports_no_torch():
    core = sorted(m for m in _modules() if layer_of(m) == 0)
    assert "megatron_lbp.core.costs" in core and "megatron_lbp.core.vocabulary" in core, core
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {core!r}]; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, f"importing the core pulled in torch or numpy:\n{proc.stderr[-2000:]}"


def _circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.add(frozenset(component))
    return out


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: {t for t, _, _ in imports_of(m, p, known) if t in known and t not in (m, "megatron_lbp")}
            for m, p in modules.items()}


def test_no_import_circle():
    found = _circles(_import_graph())
    new = [sorted(c) for c in found - set(CIRCLES)]
    assert not new, "import circles:\n" + "\n".join(" <-> ".join(c) for c in new)
    gone = [sorted(c) for c in set(CIRCLES) - found]
    assert not gone, f"CIRCLES entries no circle matches any more: {gone}"


def test_the_circle_scan_finds_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == {frozenset("abc")}
    assert _circles({"a": {"b"}, "b": set()}) == set()


def test_the_scan_sees_an_upward_import(tmp_path):
    (tmp_path / "m.py").write_text("import os\n\ndef f():\n    from megatron_lbp.demo import cli\n")
    found = imports_of("megatron_lbp.core.m", tmp_path / "m.py", {"megatron_lbp.demo.cli"})
    assert found == [("megatron_lbp.demo.cli", 4, False)], found
    assert layer_of("megatron_lbp.demo.cli") > layer_of("megatron_lbp.core.m")
