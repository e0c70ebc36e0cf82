"""CPython's memory map on current distributions' interpreters (issue 22): Debian trixie's
python3.13 (3.13.5) and sid's python3.13 (3.13.18), python3.14 (3.14.10) and python3.15
(3.15.2), each a non-PIE static executable started inside its root (tests/distros.py; a
missing root is built). From 3.13 on the layout comes from the runtime's own _Py_DebugOffsets
plus layout.SUPPLEMENTS; each test freezes a live target and checks what the walk read.
The leaks themselves: test_cpython_leaks.py (its interpreters() yields these specs too).
"""
import os
import subprocess
import textwrap

import pytest

import distros
from memunreachable.heaps.cpython import obmalloc
from memunreachable.heaps.cpython.walker import walk_cpython
from memunreachable.collect.freeze import frozen
from memunreachable.collect.memory import ProcessMemory

pytestmark = [pytest.mark.ptrace, pytest.mark.distro]

SPECS = distros.python_specs()

TARGET = textwrap.dedent(r'''
    import os, sys, threading
    keep = [b"k%06d" % i + b"x" * (i % 200) for i in range(1000)]
    ev = threading.Event()
    th = threading.Thread(target=ev.wait)
    th.start()
    f = 1.5 * len(keep); l = [1, len(keep)]; d = {len(keep): 1}
    msg = ("version %d %d %d\nnative %d %d\nids %d %d %d\nready\n" % (
        sys.version_info[:3] + (threading.get_native_id(), th.native_id, id(f), id(l), id(d))))
    del f, l, d                         # to their free lists (3.14+: chained through word 0)
    os.write(1, msg.encode())
    os.read(0, 1)
    ev.set()
''')


class Target:
    def __init__(self, spec, allocator):
        env = dict(os.environ)
        env.pop("PYTHONMALLOC", None)
        if allocator != "pymalloc":
            env["PYTHONMALLOC"] = allocator
        self.proc = subprocess.Popen(distros.python_argv(spec) + ["-c", TARGET],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     text=True)
        self.info = {}
        for line in self.proc.stdout:
            words = line.split()
            if words == ["ready"]:
                break
            self.info[words[0]] = [int(w) for w in words[1:]]
        else:
            raise AssertionError(f"{spec} target died")

    def close(self):
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stdin.close()


@pytest.fixture
def target():
    made = []

    def start(spec, allocator="pymalloc"):
        made.append(Target(spec, allocator))
        return made[-1]
    yield start
    for t in made:
        t.close()


@pytest.mark.parametrize("allocator", ["pymalloc", "malloc"])
@pytest.mark.parametrize("spec", SPECS)
def test_layout_from_debug_offsets_is_walked_and_fits(target, spec, allocator):
    t = target(spec, allocator)
    with frozen(t.proc.pid) as fz:
        with ProcessMemory(t.proc.pid) as mem:
            cm = walk_cpython(mem, fz.maps, fz.threads, t.proc.pid)
            scan = obmalloc.scan_pools(mem, fz.maps, cm.layout) if cm.usable else None
    assert cm.usable and cm.warnings == [], cm.warnings
    assert cm.version == tuple(t.info["version"][:2])
    lay = cm.layout
    assert lay.source == "_Py_DebugOffsets" and lay.gc is not None and lay.gc.generation0 is None
    # 3.13.5+ declare PyGC_Head 4-aligned: generations at 20 (3.13.0: 24)
    assert lay.gc.generations == {(3, 13): 20, (3, 14): 24, (3, 15): 8}[cm.version]
    assert cm.allocator == ("malloc" if allocator == "malloc" else "not set")
    (interp,) = cm.interpreters
    assert sorted(th.native_thread_id for th in interp.threads) == sorted(t.info["native"])
    assert len(cm.datastacks) == 2 and all(ds.live for ds in cm.datastacks)
    assert cm.stats["dead_blocks"] > 0           # free-listed float, tuple, list, dict ...
    if allocator == "malloc":
        assert cm.pymalloc.method == "none" and len(cm.blocks) == 0
        return
    assert cm.pymalloc.method == "arenas" and not cm.pymalloc.problems
    # the header heuristic agrees block for block with the arenas walk
    assert list(scan.blocks) == list(cm.blocks) and scan.problems == []
    # the freed float, tuple, list and dict are dead blocks, not allocations to scan
    f, lst, dct = t.info["ids"]
    assert {f, lst - 16, dct - 16} <= set(cm.dead_blocks)
