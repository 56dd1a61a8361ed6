"""The compensate package's import structure: every name has one import path (the module that defines it),
and no module of the package imports, directly or through others, one that imports it back."""

import ast
from pathlib import Path

import spear

ROOT = Path(spear.__file__).resolve().parents[1]
PACKAGE = "spear.compensate"


def _files():
    for folder in ("spear", "tests", "benchmarks"):
        yield from (ROOT / folder).rglob("*.py")


def _module_file(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def _defined(module: str) -> set[str]:
    """Names a module defines itself (functions, classes, assignments), not those it imports."""
    tree = ast.parse(_module_file(module).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _imports_from(path: Path):
    """``(module, names)`` of every ``from spear.compensate.X import ...`` in a file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE + "."):
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE + "."):
                    yield a.name, []


def test_every_imported_name_comes_from_the_module_that_defines_it():
    """Catches: a re-export shim (``calibrate.py`` handing out ``CalibrationConfig`` from calib_config or
    ``TopKTeacher`` from teacher), which gives one name two import paths."""
    wrong = []
    for path in _files():
        for module, names in _imports_from(path):
            if not _module_file(module).is_file():
                continue
            missing = [n for n in names if n not in _defined(module)]
            if missing:
                wrong.append(f"{path.relative_to(ROOT)}: {module} does not define {missing}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_inside_the_package():
    """Catches: ``ec.py`` importing ``registry.py`` (to register itself) while ``registry.py`` imports ``ec.py``
    (to build it), at the top or inside a function."""
    graph = {}
    for path in (ROOT / "spear" / "compensate").glob("*.py"):
        module = f"{PACKAGE}.{path.stem}"
        graph[module] = {m for m, _ in _imports_from(path) if m != module}

    def reaches(start, goal, seen):
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and (seen.add(nxt) or reaches(nxt, goal, seen))):
                return True
        return False

    cycles = sorted(m for m in graph if reaches(m, m, set()))
    assert not cycles, cycles
