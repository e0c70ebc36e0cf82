"""CPython memory map on real interpreters: pyenv 3.8-3.13 (shared libpython) and Debian's
/usr/bin/python3 (3.11, libpython linked into a non-PIE executable).

Each target script allocates known objects, prints their id() and sys.getsizeof(), frees
others, prints sys._debugmallocstats() to a file, says `ready` and blocks on stdin. The test
freezes it and reads the map through /proc/PID/mem. Offsets of objects in their blocks:
cpython-memory.md section 3 (bytes: block start; tuple: block + 16, its GC head).
"""
import os
import re
import subprocess
import textwrap

import pytest

import interpreters

from memunreachable._types import merge_ranges
from memunreachable.heaps.cpython import layout as L
from memunreachable.heaps.cpython import obmalloc
from memunreachable.heaps.cpython.walker import walk_cpython
from memunreachable.collect.freeze import frozen
from memunreachable.collect.memory import ProcessMemory

pytestmark = pytest.mark.ptrace

PYTHONS = [(v, interpreters.pyenv_pythons().get(v, f"pyenv's CPython {v} (pyenv install {v})"))
           for v in ("3.8", "3.9", "3.10", "3.11", "3.12", "3.13")] + [
    ("debian-3.11", "/usr/bin/python3")]
IDS = [label for label, _ in PYTHONS]
COUNT_SLACK = 8      # blocks allocated after the stats print (os.read's buffer, ...)

TARGET = textwrap.dedent(r'''
    import os, sys, threading
    keep = [b"k%06d" % i + b"x" * (i % 200) for i in range(1000)]   # 1000 distinct sizes/objects
    tuples = [(i, str(i)) for i in range(100)]                        # GC-tracked
    doomed = [b"d%06d" % i + b"y" * 450 for i in range(50)]          # 496-byte class, then freed
    f = float(len(keep)) * 1.5                                          # then free-listed (3.10+)
    lst = [len(keep), len(tuples), 3]
    ev = threading.Event()
    th = threading.Thread(target=ev.wait)
    th.start()
    lines = [
        "version %d %d" % sys.version_info[:2],
        "keep " + " ".join("%d:%d" % (id(x), sys.getsizeof(x)) for x in keep),
        "tuples " + " ".join("%d:%d" % (id(x), sys.getsizeof(x)) for x in tuples),
        "freed " + " ".join(str(id(x)) for x in doomed),
        "float %d" % id(f),
        "list %d" % id(lst),
        "idents %d %d" % (threading.get_ident(), th.ident),
        "native %d %d" % (threading.get_native_id(), th.native_id),
    ]
    msg = ("\n".join(lines) + "\n").encode()
    del doomed, f, lst
    os.write(1, msg)
    sys._debugmallocstats()
    os.write(1, b"ready\n")
    os.read(0, 1)
    ev.set()
''')


class Target:
    def __init__(self, python, tmp_path, env_extra=None, source=None):
        script = tmp_path / "target.py"
        script.write_text(source or TARGET)
        self.stderr_path = tmp_path / "stderr.txt"
        env = dict(os.environ)
        env.pop("PYTHONMALLOC", None)
        env.update(env_extra or {})
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([python, str(script)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env)
        self.info = {}
        for raw in self.proc.stdout:
            words = raw.decode().split()
            if words == ["ready"]:
                break
            self.info[words[0]] = words[1:]
        else:
            raise AssertionError(f"target died: {self.stderr_path.read_text()}")

    def pairs(self, key):
        return [tuple(int(v) for v in w.split(":")) for w in self.info[key]]

    def ints(self, key):
        return [int(w) for w in self.info[key]]

    def stats_used_blocks(self):
        """Sum of 'blocks in use' over the size classes of sys._debugmallocstats()."""
        rows = re.findall(r"^\s+\d+\s+\d+\s+\d+\s+(\d+)\s+\d+\s*$", self.stderr_path.read_text(), re.M)
        return sum(int(r) for r in rows)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def target(tmp_path):
    made = []

    def start(python, source=None, **env):
        t = Target(python, tmp_path, env, source)
        made.append(t)
        return t
    yield start
    for t in made:
        t.close()


def walk(t, **kw):
    with frozen(t.proc.pid) as fz:
        with ProcessMemory(t.proc.pid) as mem:
            return walk_cpython(mem, fz.maps, fz.threads, t.proc.pid, **kw), fz.threads


def class_size(request):
    return (request + 15) // 16 * 16


@pytest.mark.parametrize("label,python", PYTHONS, ids=IDS)
def test_map_of_a_live_interpreter(target, label, python):
    t = target(python)
    cm, threads = walk(t)
    version = tuple(t.ints("version"))
    assert cm.found and cm.usable, cm.warnings
    assert cm.warnings == []
    assert cm.version == version
    if label.startswith("debian"):
        assert cm.runtime.object_path.startswith("/usr/bin/python3") and not cm.runtime.shared
    else:
        assert os.path.basename(cm.runtime.object_path).startswith("libpython%d.%d" % version)
        assert cm.runtime.shared
    # interpreters and thread states: the two threads the target printed
    assert len(cm.interpreters) == 1
    tstates = cm.interpreters[0].threads
    assert sorted(ts.thread_id for ts in tstates) == sorted(t.ints("idents"))
    if version >= (3, 11):
        assert sorted(ts.native_thread_id for ts in tstates) == sorted(t.ints("native"))
        assert {ts.native_thread_id for ts in tstates} <= {th.tid for th in threads}
    # pymalloc: live objects are used blocks of their size class
    used = dict(zip(cm.blocks, cm.sizes))
    assert list(cm.blocks) == sorted(set(cm.blocks))
    for obj, size in t.pairs("keep"):                   # bytes: not GC, object = block
        assert used.get(obj) == class_size(size), hex(obj)
    for obj, size in t.pairs("tuples"):                 # tuple: GC head first
        assert used.get(obj - L.GC_HEAD_SIZE) == class_size(size), hex(obj)
    # freed objects: inside pymalloc's memory, but not used blocks
    for obj in t.ints("freed"):
        assert obj not in used
        assert any(r.contains(obj) for r in cm.heap_ranges), hex(obj)
    # what the pipeline cuts from the roots covers pymalloc and the dead ranges
    cuts = cm.root_cuts
    for r in cm.heap_ranges + cm.dead_ranges:
        assert any(c.begin <= r.begin and r.end <= c.end for c in cuts)
    # the count agrees with the interpreter's own statistics
    assert 0 <= len(cm.blocks) - t.stats_used_blocks() <= COUNT_SLACK
    assert cm.stats["used_blocks"] == len(cm.blocks)
    # every used block lies in a copied region
    regions = sorted((b, b + len(buf)) for b, buf in cm.regions)
    k = 0
    for a, s in zip(cm.blocks, cm.sizes):
        while regions[k][1] <= a:
            k += 1
        assert regions[k][0] <= a and a + s <= regions[k][1]
    # free lists (3.10+): the freed float and list are dead blocks, still pymalloc-used
    (fobj,), (lobj,) = t.ints("float"), t.ints("list")
    if version >= (3, 10):
        assert fobj in cm.dead_blocks and fobj in used
        assert lobj - L.GC_HEAD_SIZE in cm.dead_blocks and lobj - L.GC_HEAD_SIZE in used
    else:
        assert len(cm.dead_blocks) == 0
    # data stacks (3.11+): each thread's dead part is a dead range, the live part is not
    if version >= (3, 11):
        assert len(cm.datastacks) == 2
        for ds in cm.datastacks:
            for r in ds.dead:
                assert any(d.begin <= r.begin and r.end <= d.end for d in cm.dead_ranges)
            for r in ds.live:
                assert not any(d.overlaps(r) for d in cm.dead_ranges)
        main = next(ds for ds in cm.datastacks if ds.live and ds.live[0].size > 0)
        assert main.live[0].begin % 8 == 0
    else:
        assert cm.datastacks == []


@pytest.mark.parametrize("label,python", PYTHONS, ids=IDS)
def test_pythonmalloc_malloc_means_no_pymalloc(target, label, python):
    t = target(python, PYTHONMALLOC="malloc")
    cm, _ = walk(t)
    assert cm.usable and cm.warnings == []
    assert cm.allocator == "malloc"
    assert cm.pymalloc.in_use is False
    assert len(cm.blocks) == 0 and cm.heap_ranges == []
    assert t.stats_used_blocks() == 0


@pytest.mark.parametrize("label,python", [p for p in PYTHONS if p[0] in ("3.12", "3.13")],
                         ids=["3.12", "3.13"])
def test_pool_scan_finds_what_the_arenas_array_says(target, label, python):
    """The header heuristic used for 3.8-3.11 agrees block for block with the arenas walk."""
    t = target(python)
    with frozen(t.proc.pid) as fz:
        with ProcessMemory(t.proc.pid) as mem:
            cm = walk_cpython(mem, fz.maps, fz.threads, t.proc.pid)
            scan = obmalloc.scan_pools(mem, fz.maps, cm.layout)
    assert cm.pymalloc.method == "arenas" and scan.method == "pool scan"
    assert scan.warnings == [] and scan.problems == []
    assert list(scan.blocks) == list(cm.blocks)
    assert list(scan.sizes) == list(cm.sizes)


@pytest.mark.parametrize("label,python", [PYTHONS[0], PYTHONS[4], PYTHONS[6]],
                         ids=["3.8", "3.12", "debian-3.11"])
def test_unknown_version_falls_back_with_a_warning(target, label, python):
    t = target(python)
    cm, _ = walk(t, layouts={})
    assert cm.found and not cm.usable
    assert cm.version == tuple(t.ints("version"))
    assert len(cm.warnings) == 1 and "no known memory layout" in cm.warnings[0]
    assert "cannot be checked (its memory is scanned whole as roots)" in cm.warnings[0]
    assert len(cm.blocks) == 0 and cm.heap_ranges == [] and cm.dead_ranges == []
    assert cm.root_cuts == []


# a target read with another version's table: validation must refuse it
WRONG = [("3.10", PYTHONS[2][1], (3, 12)), ("3.11", PYTHONS[3][1], (3, 12)),
         ("3.12", PYTHONS[4][1], (3, 11)), ("3.13", PYTHONS[5][1], (3, 12)),
         ("debian-3.11", PYTHONS[6][1], (3, 10))]


@pytest.mark.parametrize("label,python,other", WRONG, ids=[w[0] for w in WRONG])
def test_wrong_layout_is_refused_not_trusted(target, label, python, other):
    t = target(python)
    version = tuple(t.ints("version"))
    cm, _ = walk(t, layouts={version: L.LAYOUTS[other]})
    assert cm.found and not cm.usable
    assert len(cm.blocks) == 0 and cm.dead_ranges == []
    assert any("does not fit" in w or "does not add up" in w for w in cm.warnings), cm.warnings


def test_not_a_python_process():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        with frozen(proc.pid) as fz:
            with ProcessMemory(proc.pid) as mem:
                cm = walk_cpython(mem, fz.maps, fz.threads, proc.pid)
        assert not cm.found and not cm.usable and cm.warnings == []
    finally:
        proc.kill()
        proc.wait()


SUBINTERP_TARGET = textwrap.dedent(r'''
    import os, sys
    try:
        import _xxsubinterpreters as si          # 3.12
    except ImportError:
        import _interpreters as si               # 3.13
    run = getattr(si, "run_string", None) or si.exec
    iid = si.create()                            # isolated: its own obmalloc state
    run(iid, "import os\nkeep = [b'sub%d' % i for i in range(5000)]\n"
             "os.write(1, ('sub ' + ' '.join(str(id(x)) for x in keep[:200]) + '\\n').encode())\n")
    keep = [b"main%d" % i for i in range(3000)]
    os.write(1, ("main " + " ".join(str(id(x)) for x in keep[:200]) + "\n").encode())
    sys._debugmallocstats()
    run(iid, "import sys\nsys._debugmallocstats()\n")
    os.write(1, b"ready\n")
    os.read(0, 1)
''')


@pytest.mark.parametrize("label,python", [PYTHONS[4], PYTHONS[5]], ids=["3.12", "3.13"])
def test_sub_interpreter_with_its_own_allocator(target, label, python):
    t = target(python, SUBINTERP_TARGET)
    cm, _ = walk(t)
    assert cm.usable and cm.warnings == []
    assert len(cm.interpreters) == 2
    used = set(cm.blocks)
    assert all(obj in used for obj in t.ints("main"))
    assert all(obj in used for obj in t.ints("sub"))      # blocks of the second obmalloc state
    # both interpreters' statistics (main's, then the sub-interpreter's) account for the blocks
    assert abs(len(cm.blocks) - t.stats_used_blocks()) <= 64


@pytest.mark.parametrize("label,python", [PYTHONS[0], PYTHONS[3], PYTHONS[5]],
                         ids=["3.8", "3.11", "3.13"])
def test_pymalloc_with_debug_hooks(target, label, python):
    """PYTHONMALLOC=pymalloc_debug: blocks carry a 16-byte prefix (size, API id) before the
    object, so each object sits 16 bytes into its block."""
    t = target(python, PYTHONMALLOC="pymalloc_debug")
    cm, _ = walk(t)
    assert cm.usable and cm.warnings == [] and cm.allocator == "pymalloc_debug"
    used = set(cm.blocks)
    pre = L.DEBUG_HOOK_PREFIX
    assert all(obj - pre in used for obj, _ in t.pairs("keep"))
    assert all(obj - pre - L.GC_HEAD_SIZE in used for obj, _ in t.pairs("tuples"))
    assert not any(obj - pre in used for obj in t.ints("freed"))
    assert 0 <= len(cm.blocks) - t.stats_used_blocks() <= COUNT_SLACK
    if tuple(t.ints("version")) >= (3, 10):
        assert t.ints("float")[0] - pre in cm.dead_blocks


def symtab_arena_array(path, maps):
    """The 3.8-3.11 statics `arenas`, `maxarenas`, `narenas_currently_allocated` of
    Objects/obmalloc.c, from an unstripped libpython's .symtab (pyenv builds keep it)."""
    from elftools.elf.elffile import ELFFile
    from memunreachable.heaps.cpython import locate
    with open(path, "rb") as f:
        elf = ELFFile(f)
        symtab = elf.get_section_by_name(".symtab")
        addr = {n: symtab.get_symbol_by_name(n)[0]["st_value"]
                for n in ("arenas", "maxarenas", "narenas_currently_allocated")}
        bias = locate._load_bias(elf, [m for m in maps if m.path == path])
    return obmalloc.ArenaArray(bias + addr["arenas"], bias + addr["maxarenas"],
                               bias + addr["narenas_currently_allocated"])


@pytest.mark.parametrize("label,python", PYTHONS[:4], ids=IDS[:4])
def test_pool_scan_finds_what_the_static_arenas_array_says(target, label, python):
    """3.8-3.11 find pools by their headers; the arenas array (a static, reachable here only
    through the pyenv build's symbol table) must list exactly the same used blocks."""
    t = target(python)
    with frozen(t.proc.pid) as fz:
        with ProcessMemory(t.proc.pid) as mem:
            cm = walk_cpython(mem, fz.maps, fz.threads, t.proc.pid)
            arr = symtab_arena_array(cm.runtime.object_path, fz.maps)
            exact = obmalloc.walk_arena_arrays(mem, cm.layout, [arr])
    assert cm.usable and cm.pymalloc.method == "pool scan"
    assert exact.problems == [] and exact.stats["arenas"] > 0
    assert list(cm.blocks) == list(exact.blocks)
    assert list(cm.sizes) == list(exact.sizes)
    arenas = merge_ranges(exact.heap_ranges)  # adjacent arenas merge, like adjacent pools
    for r in cm.heap_ranges:                  # every pool found lies in an arena
        assert any(a.begin <= r.begin and r.end <= a.end for a in arenas)
