"""The package reads like the pipeline (issue 27): stage folders below, faces on top.

Every import of the package's modules counts, those inside functions too (a lazy import
that dodges a circle is still a circle). The graph is read from the source with ast.
"""
import ast
import graphlib
import pathlib
import subprocess
import sys

import memunreachable

PACKAGE = pathlib.Path(memunreachable.__file__).parent
STAGES = ("collect", "heaps", "sweep", "stacks", "reporters")
# the faces and orchestrators: they import the stages, never the other way round
FACES = ("cli", "noleaks", "_tracer", "pytest_plugin", "pytest_tracked", "signal_dump",
         "track_here", "track_pid", "unreachable", "deferred")


def _modules() -> dict:
    """{dotted name: path} of every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(sources: dict) -> dict:
    """{module: set of package modules it imports}, from {module: source text}."""
    edges = {}
    for name, text in sources.items():
        out = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    out.add(full if full in sources else node.module)
            elif isinstance(node, ast.Import):
                out.update(alias.name for alias in node.names)
        edges[name] = {m for m in out if m in sources and m != name}
    return edges


def cycle(edges: dict) -> list:
    """One import circle, as the modules on it (the first again at the end); [] when none."""
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as exc:
        return exc.args[1]
    return []


def test_cycle_finds_a_circle_through_a_lazy_import():
    sources = {"p.a": "from p import b\n", "p.b": "def f():\n    from p.a import x\n",
               "p.c": "import p.a\n"}
    found = cycle(import_graph(sources))
    assert sorted(set(found)) == ["p.a", "p.b"] and found[0] == found[-1]
    assert cycle(import_graph({"p.a": "import p.b\n", "p.b": ""})) == []


def test_no_import_circle():
    sources = {name: path.read_text() for name, path in _modules().items()}
    assert cycle(import_graph(sources)) == []


def test_stages_never_import_the_faces():
    sources = {name: path.read_text() for name, path in _modules().items()}
    faces = tuple(f"memunreachable.{f}" for f in FACES)
    upward = {name: sorted(t for t in targets if t.startswith(faces))
              for name, targets in import_graph(sources).items()
              if name.split(".")[1:2] and name.split(".")[1] in STAGES}
    assert {name: t for name, t in upward.items() if t} == {}


def test_stage_folders_hold_the_pipeline():
    names = set(_modules())
    for stage, members in {"collect": ("preflight", "diagnose", "procfs", "freeze", "seccomp",
                                       "snapshot", "leftovers", "memory", "inject"),
                           "heaps": ("glibc", "cpython", "libstate"),
                           "sweep": ("sweeper", "classify", "mark", "folding", "detect",
                                     "written", "explain"),
                           "stacks": ("tracking", "symbolize", "demangle", "suppressions", "elf"),
                           "reporters": ("report", "text", "json")}.items():
        for m in members:
            assert f"memunreachable.{stage}.{m}" in names
            assert f"memunreachable.{m}" not in names       # no copy left at the old path


def test_a_python_without_cffi_is_told_so():
    # the C core is built, the interpreter cannot import cffi's backend (a Debian root whose
    # python3-cffi-backend serves other versions): the error names cffi, not a rebuild
    out = subprocess.run([sys.executable, "-c", "import sys; sys.modules['_cffi_backend'] = None\n"
                          "import memunreachable._ffi"], capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.rstrip().splitlines()[-1] == (
        f"ImportError: memunreachable's C core needs cffi, which {sys.executable} cannot import "
        "(pip install cffi)")
