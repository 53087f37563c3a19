"""The library apart from its applications: what imports what, and what its sources say."""

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = sorted((ROOT / "jax_flashoverlap").glob("*.py")) + sorted((ROOT / "models").glob("*.py"))


def _imported_modules(path: pathlib.Path) -> list[str]:
    """Every module (and name) ``path`` imports, relative ones without their dots."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names += [module] + [f"{module}.{alias.name}".lstrip(".") for alias in node.names]
    return names


def test_the_library_never_imports_the_applications():
    for path in LIBRARY:
        for name in _imported_modules(path):
            assert "cli" not in name.split("."), f"{path.relative_to(ROOT)} imports {name}"


def test_importing_the_library_loads_no_application(tmp_path):
    code = ("import sys, jax_flashoverlap, jax_flashoverlap.models; "
            "print(sorted(m for m in sys.modules if m.startswith('jax_flashoverlap.cli')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "[]\n"


def test_the_models_use_only_the_public_api():
    for path in sorted((ROOT / "models").glob("*.py")):
        for name in _imported_modules(path):
            if name.startswith("jax_flashoverlap"):
                assert not any(part.startswith("_") for part in name.split(".")), \
                    f"{path.relative_to(ROOT)} imports {name}"


def test_no_source_file_is_over_500_lines():
    """One concern per file: the library's modules, the models and the extension's sources."""
    sources = [*(ROOT / "jax_flashoverlap").rglob("*.py"), *(ROOT / "models").glob("*.py"),
               *(p for p in (ROOT / "ffi" / "src").rglob("*") if p.suffix in (".cu", ".cuh",
                                                                              ".h", ".cc"))]
    assert len(sources) > 40, len(sources)
    long = {str(p.relative_to(ROOT)): n for p in sources
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_the_extension_reads_no_environment_variable():
    """jax_flashoverlap/settings.py is the one parser: the C++ gets the values
    from it (push_settings, NVSHMEM's init), never from getenv."""
    sources = [p for p in (ROOT / "ffi" / "src").rglob("*") if p.suffix in (".cc", ".cu", ".h",
                                                                            ".cuh")]
    readers = [f"{p.relative_to(ROOT)}:{i}" for p in sources
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if "getenv(" in line]
    assert sources and not readers, readers


def test_the_package_touches_the_environment_only_through_settings():
    """settings.py holds every variable the package reads or writes (and why);
    only the launcher builds its children's environments itself."""
    allowed = {ROOT / "jax_flashoverlap" / "settings.py",
               ROOT / "jax_flashoverlap" / "cli" / "launch.py"}
    readers = [f"{p.relative_to(ROOT)}:{i}"
               for p in sorted((ROOT / "jax_flashoverlap").rglob("*.py")) if p not in allowed
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if "os.environ" in line or "getenv(" in line]
    assert not readers, readers


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in it (deferred
    and type-checking imports too), packages' __init__ left out."""
    files = {}
    for path in (ROOT / "jax_flashoverlap").rglob("*.py"):
        files[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    for path in (ROOT / "models").glob("*.py"):
        files["jax_flashoverlap.models." + path.stem] = path
    modules = {name for name in files if not name.endswith("__init__")}
    graph = {}
    for name in modules:
        package = name.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(files[name].read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1],
                                     *([base] if base else [])])
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def test_no_import_cycles():
    graph = _module_graph()
    assert len(graph) > 60, len(graph)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module):
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_source_comments_give_reasons_not_history():
    """No session numbers and no pointers into lab notes in the library, the
    models or the kernels: a choice made by measurement says what was
    measured, where it is made."""
    history = re.compile(r"[Ss]essions? \d+|measurements\.md|NOTES\.md|benchmarks/experiments")
    sources = [*(ROOT / "jax_flashoverlap").rglob("*.py"), *(ROOT / "models").glob("*.py"),
               *(p for p in (ROOT / "ffi" / "src").rglob("*") if p.is_file())]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sources
             for i, line in enumerate(p.read_text().splitlines(), 1) if history.search(line)]
    assert not found, "\n".join(found)
