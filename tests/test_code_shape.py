"""The shape of the code, checked on every run: lint clean (complexity included) and imports that run one
way, with no circle.

The layers, bottom to top (docs/design.md, "Layers"): plain option types and the default model's
maker; memory; attention and sampling; the model; LoRA adapters on it; the engine; the server and the
offline `LLM`; the programs and test support on top. A module may import its own layer and the layers
below it, never one above: so the device side never reaches back into the scheduler, nor the engine into
the server.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gapless"

LAYERS: list[set[str]] = [
    {"config", "cli", "env", "sampling_params", "tensors", "default_model", "pdl"},
    {"memory"},
    {"attention", "sampling"},
    {"model"},
    {"lora"},
    {"engine"},
    {"server", "llm"},
    {"chat", "__main__", "bench", "testing"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str:
    """The most specific module of ours that `import name` / `from name import ...` executes."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(path: Path, *, module_level_only: bool) -> set[str]:
    """The gapless modules `path` imports (a `from pkg import sub` of a submodule counts as `pkg.sub`).
    With `module_level_only`, imports inside functions and `if TYPE_CHECKING:` blocks are left out: those
    do not run when the module is imported, so they cannot close an import circle."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if module_level_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.split(".")[0] == "gapless")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] == "gapless":
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        found.add(sub if sub in MODULES else base)
            visit(child)

    visit(tree)
    return {_resolve(name) for name in found} - {_module_name(path)}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return RANK.get(parts[1]) if len(parts) > 1 else None  # the root package's lazy exports: exempt


def test_every_part_of_the_package_has_a_layer():
    tops = {m.split(".")[1] for m in MODULES if "." in m}
    assert tops <= set(RANK), f"place these in LAYERS: {sorted(tops - set(RANK))}"


def test_imports_run_one_way():
    upward = []
    for module, path in sorted(MODULES.items()):
        mine = _layer(module)
        if mine is None:
            continue
        for target in sorted(_imports(path, module_level_only=False)):
            theirs = _layer(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run back up the layers:\n" + "\n".join(upward)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def test_no_import_circle():
    graph = {m: _imports(p, module_level_only=True) for m, p in MODULES.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_circle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_lint_clean_with_complexity_limit():
    """ruff with the project's rules, McCabe complexity <= 15 among them (pyproject.toml)."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "gapless", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


MAX_LINES = 500
# Triton kernels stay whole: a kernel, its launcher and its tuning read best in one file
KERNEL_MODULES = {"gapless.attention.triton_kernels"}


def _too_long(modules: dict[str, Path]) -> list[str]:
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules.items() if m not in KERNEL_MODULES}
    return [f"{m}: {n} lines" for m, n in sorted(sizes.items()) if n > MAX_LINES]


def test_no_module_over_500_lines_except_kernels():
    assert not _too_long(MODULES), f"split these along a real seam (<= {MAX_LINES} lines):\n" + "\n".join(
        _too_long(MODULES)
    )


def test_the_length_check_finds_a_long_module(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    assert _too_long({"gapless.long": long}) == [f"gapless.long: {MAX_LINES + 1} lines"]
    assert _too_long({"gapless.attention.triton_kernels": long}) == []
