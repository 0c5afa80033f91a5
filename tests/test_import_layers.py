"""Imports run one way: every module of moe_plugin/ imports only its own tier or lower ones, and no modules
import each other in a circle (README "Layout", docs/architecture.md section 6).

``TIERS`` below is the one table of the rule; README and docs/architecture.md cite it here. It lives in this
test rather than in the package because nothing at run time reads it: it is a rule about the source, and the
package would otherwise carry its own checker (which would then need a tier too).

The check reads the source with ``ast`` (nothing is imported): every ``import`` / ``from ... import`` anywhere
in a file, inside functions and ``if TYPE_CHECKING`` blocks too, since a lazy import is still a dependency.
Relative imports are resolved against the importing module's package; ``from pkg import name`` counts as an
import of ``pkg.name`` when that is a module, else of ``pkg``. The packages Python initialises on the way to a
module (``moe_plugin/__init__.py`` above all) are not counted: the root package sits in the top tier, and
every import would otherwise reach it.
"""

from __future__ import annotations

import pytest
import ast
import shutil
import textwrap
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

ROOT = Path(__file__).resolve().parents[1] / "moe_plugin"

# Lowest first: a module may import from its own tier and the tiers before it. Each entry names a top-level
# module or subpackage of moe_plugin ("__init__" is the package's own __init__.py).
TIERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("foundation", ("config", "fileio", "cli_errors", "output_paths", "limits", "compat")),
    ("ops", ("ops",)),
    ("layers", ("layers", "precision")),
    ("lora", ("lora", "lora_packed", "expert_adapters")),
    ("weights", ("weights",)),
    ("models", ("models",)),
    ("recipe", ("recipe",)),
    ("megatron", ("megatron",)),
    ("parallel", ("parallel",)),
    ("training", ("training",)),
    ("tools", ("plan", "export", "hf_trainer")),
    ("entry", ("train", "cli", "__init__")),
    # the test and benchmark harness: above everything, so no product module may import it
    ("testing", ("testing",)),
)
TIER_OF: Dict[str, int] = {part: i for i, (_, parts) in enumerate(TIERS) for part in parts}


class Import(NamedTuple):
    line: int
    target: str  # the moe_plugin module imported


class Module(NamedTuple):
    path: str  # as shown in messages: moe_plugin/...py
    imports: List[Import]


def part_of(module: str) -> str:
    """The TIERS key of a dotted module name: its top-level module or subpackage, "__init__" for the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def tier_name(i: int) -> str:
    return f"tier {i} ({TIERS[i][0]})"


def _module_names(root: Path) -> Dict[str, Path]:
    names = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        dotted = [root.name, *path.relative_to(root).with_suffix("").parts]
        if dotted[-1] == "__init__":
            dotted.pop()
        names[".".join(dotted)] = path
    return names


def _known(name: str, names) -> str:
    """The longest prefix of ``name`` that is a module of the package ("" if none)."""
    while name and name not in names:
        name = name.rpartition(".")[0]
    return name


def scan(root: Path = ROOT) -> Dict[str, Module]:
    """Every module of the package at ``root``, with the package modules it imports (line, module)."""
    names = _module_names(root)
    out = {}
    for module, path in names.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        imports = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                candidates = [[a.name] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # ``from pkg import name``: the module pkg.name if there is one, else pkg itself
                candidates = [[f"{source}.{a.name}", source] for a in node.names]
            else:
                continue
            for options in candidates:
                found = next((k for k in (_known(o, names) for o in options) if k), "")
                if found and found != module:
                    imports.append(Import(node.lineno, found))
        out[module] = Module(str(path.relative_to(root.parent)), sorted(set(imports)))
    return out


def untiered(graph: Dict[str, Module]) -> List[str]:
    return sorted(
        f"{m.path}: {part_of(name)!r} has no tier; add it to TIERS in tests/test_import_layers.py"
        for name, m in graph.items()
        if part_of(name) not in TIER_OF
    )


def upward_imports(graph: Dict[str, Module]) -> List[str]:
    """One "file:line imports module: tier a imports tier b" line per import of a higher tier."""
    found = []
    for name, m in graph.items():
        own = TIER_OF.get(part_of(name))
        for imp in m.imports:
            theirs = TIER_OF.get(part_of(imp.target))
            if own is not None and theirs is not None and theirs > own:
                found.append(
                    f"{m.path}:{imp.line} imports {imp.target}: {tier_name(own)} imports the higher "
                    f"{tier_name(theirs)}; move what it needs down to {TIERS[own][0]} or lower"
                )
    return sorted(found)


def import_cycles(graph: Dict[str, Module]) -> List[str]:
    """One line per circle of modules (a strongly connected component), each edge as file:line."""
    edges = {n: sorted({i.target for i in m.imports if i.target in graph}) for n, m in graph.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack = set()
    components = []
    for start in sorted(graph):  # Tarjan's algorithm, iteratively
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            for w in edges[v]:
                if w in on_stack:
                    low[v] = min(low[v], low[w])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    found = []
    for component in components:
        members = set(component)
        steps = [
            f"{graph[a].path}:{i.line} imports {i.target}"
            for a in component
            for i in graph[a].imports
            if i.target in members
        ]
        found.append(
            "import circle among "
            + ", ".join(component)
            + ": "
            + "; ".join(steps)
            + "; move the shared piece into a module that both import"
        )
    return sorted(found)


def test_every_module_has_a_tier():
    problems = untiered(scan())
    assert problems == [], "\n".join(problems)


def test_no_module_imports_a_higher_tier():
    problems = upward_imports(scan())
    assert problems == [], f"{len(problems)} upward imports:\n" + "\n".join(problems)


def test_no_import_circle():
    problems = import_cycles(scan())
    assert problems == [], f"{len(problems)} import circles:\n" + "\n".join(problems)


def test_the_scan_reads_the_package():
    graph = scan()
    assert len(graph) > 100 and "moe_plugin.training.loop" in graph
    # a relative import inside a function counts (export.merge reads weights.plan lazily)
    lazy = [i for i in graph["moe_plugin.export.merge"].imports if i.target == "moe_plugin.weights.plan"]
    assert lazy, graph["moe_plugin.export.merge"].imports


def _write(root: Path, files: Dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_planted_upward_import_fails_naming_the_file_line_and_tiers(tmp_path):
    """A copy of the real package with one lazy import of the trainer planted in a layer: the checker names it,
    beside whatever it finds in the real package."""
    copy = tmp_path / "moe_plugin"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "layers" / "moe.py"
    lines = target.read_text().splitlines()
    lines += ["", "", "def _planted():", "    from ..training import loop", "    return loop"]
    target.write_text("\n".join(lines) + "\n")
    planted = sorted(set(upward_imports(scan(copy))) - set(upward_imports(scan())))
    assert planted == [
        f"moe_plugin/layers/moe.py:{len(lines) - 1} imports moe_plugin.training.loop: tier 2 (layers) imports the "
        f"higher {tier_name(TIER_OF['training'])}; move what it needs down to layers or lower"
    ]


def test_synthetic_sources_resolve_relative_absolute_and_from_package_imports(tmp_path):
    _write(
        tmp_path,
        {
            "moe_plugin/__init__.py": "",
            "moe_plugin/config.py": "from .ops import kernels\n",
            "moe_plugin/ops/__init__.py": "",
            "moe_plugin/ops/kernels.py": "import moe_plugin.config\n",
            "moe_plugin/training/__init__.py": "",
            "moe_plugin/training/a.py": "from . import b\n",
            "moe_plugin/training/b.py": """\
            import os


            def f():
                from .a import thing
                from moe_plugin import cli
            """,
            "moe_plugin/cli.py": "",
            "moe_plugin/newpart.py": "",
        },
    )
    graph = scan(tmp_path / "moe_plugin")
    assert graph["moe_plugin.training.b"].imports == [Import(5, "moe_plugin.training.a"), Import(6, "moe_plugin.cli")]
    assert upward_imports(graph) == [
        "moe_plugin/config.py:1 imports moe_plugin.ops.kernels: tier 0 (foundation) imports the higher tier 1 "
        "(ops); move what it needs down to foundation or lower",
        f"moe_plugin/training/b.py:6 imports moe_plugin.cli: {tier_name(TIER_OF['training'])} imports the higher "
        f"{tier_name(TIER_OF['cli'])}; "
        "move what it needs down to training or lower",
    ]
    circles = import_cycles(graph)
    assert len(circles) == 2
    assert "moe_plugin/training/a.py:1 imports moe_plugin.training.b" in circles[1]
    assert "moe_plugin/training/b.py:5 imports moe_plugin.training.a" in circles[1]
    assert "moe_plugin.config, moe_plugin.ops.kernels" in circles[0]
    assert untiered(graph) == [
        "moe_plugin/newpart.py: 'newpart' has no tier; add it to TIERS in tests/test_import_layers.py"
    ]


# the single-device tiers: what the README promises they never reach
SINGLE_DEVICE = ("ops", "layers", "models")
DISTRIBUTED = ("torch.distributed", "deepspeed", "megatron")


def distributed_imports(root: Path = ROOT) -> List[str]:
    """``file:line imports X`` for every import of torch.distributed, DeepSpeed or megatron-core (lazy ones too)
    in the single-device packages."""
    out = []
    for module, path in sorted(_module_names(root).items()):
        if part_of(module) not in SINGLE_DEVICE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for name in names:
                if any(name == d or name.startswith(d + ".") for d in DISTRIBUTED):
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} imports {name}")
    return out


@pytest.mark.distributed
def test_single_device_code_never_imports_distributed_code(tmp_path):
    """ops/, layers/ and models/ import none of torch.distributed, DeepSpeed and megatron-core, and importing
    them (with the Auto classes registered) loads none of those; a planted lazy import is named."""
    import subprocess
    import sys

    assert distributed_imports() == []
    probe = (
        "import sys, moe_plugin.ops, moe_plugin.layers.decoder, moe_plugin.models, transformers; "
        "print([m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'megatron')])"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT.parent
    ).stdout.strip()
    assert loaded == "[]", loaded
    _write(
        tmp_path,
        {
            "moe_plugin/__init__.py": "",
            "moe_plugin/layers/__init__.py": "",
            "moe_plugin/layers/x.py": "def f():\n    import torch.distributed as dist\n",
        },
    )
    assert distributed_imports(tmp_path / "moe_plugin") == ["moe_plugin/layers/x.py:2 imports torch.distributed"]
