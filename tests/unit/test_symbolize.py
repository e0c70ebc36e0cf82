"""Unit tests of symbolize.py on real return addresses.

The fixtures (fixtures/sym_chain.c, sym_chain_cpp.cc) are built here -O2 -g without frame
pointers, print the return addresses backtrace() saw inside a known call chain and stay alive;
the test reads their /proc/PID/maps (modules) and asserts the exact function, file and line of
every frame (lines from the "@line NAME" marks of the sources), the inline frame, the offsets
(cross-checked with binutils' addr2line), separate debug files found by build-id and by
.gnu_debuglink, stripped binaries (ELF .dynsym names, or module+offset with the build-id), and
libc's frames named from Debian's libc6-dbg (installed when missing).
"""
import os
import shutil

import pytest

from memunreachable.stacks import symbolize as S
from memunreachable.stacks.symbolize import Frame, SymbolCache, format_frame, merge_python, symbolize
from sym_helpers import (addr2line, build_id_of, build_sym, ensure_libc_debug, libc_path,
                               lines_marked, run, source, SymProcess)

C_LINES = lines_marked("sym_chain.c")
CXX_LINES = lines_marked("sym_chain_cpp.cc")


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sym"))


@pytest.fixture(scope="module")
def c_exe(out_dir):
    return build_sym("sym_chain.c", out_dir)


def fresh_cache(**kw):
    kw.setdefault("disk_dir", None)
    return SymbolCache(**kw)


def native_frames_of(frames, exe):
    return [(f.function, f.file, f.line, f.inlined) for f in frames if f.module == exe]


def expected_c_chain():
    src = source("sym_chain.c")
    return [("leaf", src, C_LINES["leaf_bt"], False),
            ("helper", src, C_LINES["helper_leaf"], True),
            ("mid", src, C_LINES["mid_helper"], False),
            ("outer", src, C_LINES["outer_mid"], False),
            ("main", src, C_LINES["main_outer"], False)]


def test_fixture_is_built_without_frame_pointers(c_exe):
    # leaf must not set up rbp as a frame pointer: the stack is right only thanks to unwinding
    dis = run(["objdump", "-d", "--no-show-raw-insn", c_exe])
    body = dis.split("<leaf>:")[1].split("\n\n")[0]
    assert "push   %rbp" not in body and "mov    %rsp,%rbp" not in body


def test_c_chain_function_file_line_and_inline_frame(c_exe):
    with SymProcess(c_exe) as sp:
        frames = symbolize(sp.pcs, sp.modules(), cache=fresh_cache())
    got = native_frames_of(frames, c_exe)
    # _start (no DWARF line for it) follows main
    assert got[:5] == expected_c_chain()
    assert got[5][0] == "_start"
    # every frame of one pc carries that pc; helper is inlined at leaf's return address in mid
    assert frames[1].pc == frames[2].pc == sp.pcs[1]
    assert [f.pc for f in frames if not f.inlined] == sp.pcs
    bid = build_id_of(c_exe)
    assert {f.build_id for f in frames if f.module == c_exe} == {bid}


def test_c_chain_offsets_match_addr2line(c_exe):
    with SymProcess(c_exe) as sp:
        frames = symbolize(sp.pcs, sp.modules(), cache=fresh_cache())
    mine = [f for f in frames if f.module == c_exe and f.line]
    by_pc = {}
    for f in mine:
        by_pc.setdefault(f.offset, []).append((f.function, f.line))
    for offset, names in by_pc.items():
        assert addr2line(c_exe, offset) == names


def test_libc_frames_from_the_build_id_debug_file(c_exe):
    with SymProcess(c_exe) as sp:
        modules = sp.modules()
        libc = libc_path(modules)
        ensure_libc_debug(libc)
        cache = fresh_cache()
        frames = symbolize(sp.pcs, modules, cache=cache)
    in_libc = [f for f in frames if f.module == libc]
    assert in_libc, "backtrace() saw no libc frame below main"
    first = in_libc[0]
    assert first.function == "__libc_start_call_main"
    assert first.file.endswith("libc_start_call_main.h") and first.line > 0
    assert first.build_id == build_id_of(libc)
    # aliases of one function: the public name (not __libc_start_main_impl/_alias_2, nor the
    # symbol version suffix of the debug file's .symtab)
    assert in_libc[1].function == "__libc_start_main"
    # the debug file was found by build-id (libc itself is stripped: no DWARF)
    facts, opened = cache.facts([libc])
    assert not facts.has_dwarf
    assert cache.debug_file(facts, opened, libc)[1] == "build-id"


def test_cpp_names_demangled(out_dir):
    exe = build_sym("sym_chain_cpp.cc", out_dir)
    src = source("sym_chain_cpp.cc")
    with SymProcess(exe) as sp:
        frames = symbolize(sp.pcs, sp.modules(), cache=fresh_cache())
    assert native_frames_of(frames, exe)[:4] == [
        ("record", src, CXX_LINES["record_bt"], False),
        ("shapes::Store<int>::put(int const&)", src, CXX_LINES["put_record"], False),
        ("shapes::Circle::grow(double)", src, CXX_LINES["grow_put"], False),
        ("main", src, CXX_LINES["main_grow"], False)]


def _stripped_copy(exe, where, name):
    os.makedirs(where, exist_ok=True)
    out = os.path.join(where, name)
    shutil.copy(exe, out)
    return out


def test_separate_debug_file_by_build_id(c_exe, out_dir):
    root = os.path.join(out_dir, "debugroot")
    exe = _stripped_copy(c_exe, os.path.join(out_dir, "bid"), "chain")
    bid = build_id_of(exe)
    dbg = os.path.join(root, ".build-id", bid[:2], bid[2:] + ".debug")
    os.makedirs(os.path.dirname(dbg), exist_ok=True)
    run(["objcopy", "--only-keep-debug", exe, dbg])
    run(["strip", exe])
    assert "debug_info" not in run(["readelf", "-S", exe])
    with SymProcess(exe) as sp:
        with_dir = symbolize(sp.pcs, sp.modules(), cache=fresh_cache(debug_dirs=[root]))
        without = symbolize(sp.pcs, sp.modules(),
                            cache=fresh_cache(debug_dirs=[os.path.join(out_dir, "none")]))
    assert native_frames_of(with_dir, exe)[:5] == expected_c_chain()
    # without the debug directory: the stripped file names nothing in its own code
    assert [f.function for f in without if f.module == exe][:5] == [None] * 5


def test_separate_debug_file_by_debuglink(c_exe, out_dir):
    here = os.path.join(out_dir, "link")
    exe = _stripped_copy(c_exe, here, "chain")
    os.makedirs(os.path.join(here, ".debug"), exist_ok=True)
    dbg = os.path.join(here, ".debug", "chain.dbg")
    run(["objcopy", "--only-keep-debug", exe, dbg])
    run(["strip", exe])
    run(["objcopy", f"--add-gnu-debuglink={dbg}", exe])
    no_dirs = [os.path.join(out_dir, "none")]      # the build-id path cannot find it
    with SymProcess(exe) as sp:
        cache = fresh_cache(debug_dirs=no_dirs)
        frames = symbolize(sp.pcs, sp.modules(), cache=cache)
        facts, opened = cache.facts([exe])
        assert cache.debug_file(facts, opened, exe) == (dbg, "debuglink")
        # a file of that name whose CRC32 differs is not used
        with open(dbg, "ab") as f:
            f.write(b"\0")
        wrong = symbolize(sp.pcs, sp.modules(), cache=fresh_cache(debug_dirs=no_dirs))
    assert native_frames_of(frames, exe)[:5] == expected_c_chain()
    assert [f.function for f in wrong if f.module == exe][:5] == [None] * 5


def test_stripped_without_debug_info_is_module_offset_with_build_id(c_exe, out_dir):
    exe = _stripped_copy(c_exe, os.path.join(out_dir, "bare"), "chain")
    run(["strip", exe])
    syms = {l.split()[2]: int(l.split()[0], 16) for l in run(["nm", c_exe]).splitlines()
            if len(l.split()) == 3}
    with SymProcess(exe) as sp:
        frames = symbolize(sp.pcs, sp.modules(), cache=fresh_cache(debug_dirs=[]))
        leaf_ret = sp.pcs[0]
    first = frames[0]
    assert (first.function, first.file, first.line) == (None, None, None)
    assert first.module == exe and first.build_id == build_id_of(exe)
    # the offset is leaf's ELF address of the call (pc - 1): inside leaf, per the unstripped nm
    assert syms["leaf"] < first.offset < syms["leaf"] + 0x40
    assert addr2line(c_exe, first.offset)[0] == ("leaf", C_LINES["leaf_bt"])
    assert format_frame(0, first) == (f"#0 {leaf_ret:#x} ({exe}+{first.offset:#x}) "
                                      f"(BuildId: {first.build_id})")


def test_stripped_with_dynamic_symbols_gives_elf_names(out_dir):
    exe = build_sym("sym_chain.c", out_dir, extra=["-rdynamic"])
    run(["strip", exe])
    with SymProcess(exe) as sp:
        frames = symbolize(sp.pcs, sp.modules(), cache=fresh_cache(debug_dirs=[]))
    got = [(f.function, f.file, f.line) for f in frames if f.module == exe]
    # helper is inlined: .dynsym knows only the real functions, without files or lines
    assert got[:4] == [("leaf", None, None), ("mid", None, None), ("outer", None, None),
                       ("main", None, None)]


def test_deleted_binary_is_read_through_map_files(c_exe, out_dir):
    exe = _stripped_copy(c_exe, os.path.join(out_dir, "gone"), "chain")
    with SymProcess(exe) as sp:
        modules = sp.modules()
        os.unlink(exe)
        modules = [(b, e, o, p) for b, e, o, p in sp.modules()]
        assert any(p == exe + " (deleted)" for _, _, _, p in modules)
        frames = symbolize(sp.pcs, modules, cache=fresh_cache(), pid=sp.pid)
    assert native_frames_of(frames, exe)[:5] == expected_c_chain()


def test_no_symbolize_keeps_module_offset_build_id(c_exe):
    with SymProcess(c_exe) as sp:
        cache = fresh_cache()
        frames = symbolize(sp.pcs, sp.modules(), cache=cache, resolve=False)
    assert len(frames) == len(sp.pcs)
    assert all(f.function is None and f.module for f in frames)
    assert cache.stats["symcaches_built"] == 0 and cache.stats["lookups"] == 0
    assert frames[0].build_id == build_id_of(c_exe)


def test_pc_outside_every_module():
    frames = symbolize([0x1000], [(0x400000, 0x401000, 0, "/bin/x")], cache=fresh_cache())
    assert frames == [Frame(pc=0x1000, module=None, offset=0xfff)]
    assert format_frame(3, frames[0]) == "#3 0x1000 (<unknown module>)"


def test_disk_cache_is_reused_by_a_new_process_cache(c_exe, tmp_path):
    with SymProcess(c_exe) as sp:
        first = SymbolCache(disk_dir=str(tmp_path))
        a = symbolize(sp.pcs, sp.modules(), cache=first)
        second = SymbolCache(disk_dir=str(tmp_path))
        b = symbolize(sp.pcs, sp.modules(), cache=second)
    assert a == b
    assert first.stats["symcaches_built"] >= 1
    assert second.stats["symcaches_built"] == 0
    assert second.stats["disk_hits"] == first.stats["symcaches_built"]
    assert os.listdir(tmp_path) and all(n.endswith(".symcache") for n in os.listdir(tmp_path))


def _native(fn, pc):
    return Frame(pc=pc, module="/usr/lib/libpython3.11.so", offset=pc, function=fn)


PY = [("inner", "/app/b.py", 7), ("outer", "/app/a.py", 3)]


def test_python_frames_replace_the_single_eval_frame():
    native = [_native("PyList_New", 1), _native("_PyEval_EvalFrameDefault", 2),
              _native("PyEval_EvalCode", 3)]
    got = merge_python(native, PY)
    assert [(f.function, f.python) for f in got] == [
        ("PyList_New", False), ("inner", True), ("outer", True), ("PyEval_EvalCode", False)]
    assert got[1] == Frame(pc=0, module="", function="inner", file="/app/b.py", line=7,
                           python=True)


def test_python_frames_one_per_eval_frame():
    native = [_native("malloc_caller", 1), _native("_PyEval_EvalFrameDefault", 2),
              _native("_PyFunction_Vectorcall", 3), _native("_PyEval_EvalFrameDefault", 4)]
    got = merge_python(native, PY)
    assert [f.function for f in got] == ["malloc_caller", "inner", "_PyFunction_Vectorcall",
                                         "outer"]


def test_python_frames_at_the_first_eval_frame_when_the_counts_differ():
    # 3.11+ runs several Python calls per eval frame, and the native stack is cut at its
    # depth: the Python frames go where the first eval frame is; below it, only frames outside
    # the interpreter's module stay (an embedding program's)
    main = Frame(pc=9, module="/usr/bin/app", offset=9, function="main")
    native = [_native("f", 1), _native("_PyEval_EvalFrameDefault", 2),
              _native("_PyObject_Call", 3), _native("_PyEval_EvalFrameDefault", 4),
              _native("_PyEval_EvalFrameDefault", 5), main]
    got = merge_python(native, PY)
    assert [f.function for f in got] == ["f", "inner", "outer", "main"]


def test_python_frames_above_native_without_an_eval_frame():
    native = [_native("f", 1), _native("PyObject_Malloc", 2)]
    got = merge_python(native, PY)
    assert [f.function for f in got] == ["inner", "outer", "f", "PyObject_Malloc"]
    assert merge_python([], PY)[0].python and merge_python(native, []) == native
    assert format_frame(0, got[0]) == "#0 inner /app/b.py:7 (Python)"


def test_frame_dict_round_trip():
    f = Frame(pc=0x10, module="/x", build_id="ab", offset=0xf, function="g", file="g.c",
              line=3, inlined=True)
    d = f.to_dict()
    assert d == {"pc": 0x10, "module": "/x", "build_id": "ab", "offset": 0xf, "function": "g",
                 "file": "g.c", "line": 3, "inlined": True}
    assert Frame.from_dict(d) == f
    p = S.python_frames([("h", "h.py", 1)])[0]
    assert p.to_dict()["python"] is True and Frame.from_dict(p.to_dict()) == p


def test_leading_operator_new_frames_are_dropped():
    new = Frame(pc=1, module="/usr/lib/libstdc++.so.6", offset=0, function="operator new(unsigned long)")
    arr = Frame(pc=2, module="/usr/lib/libstdc++.so.6", offset=1,
                function="operator new[](unsigned long)")
    user = Frame(pc=3, module="/bin/app", offset=2, function="make")
    assert S.drop_allocator_frames([new, arr, user, new]) == [user, new]
    assert S.drop_allocator_frames([new]) == [new]         # nothing else: keep what there is
    assert S.drop_allocator_frames([]) == []


PY_SCRIPT = '''\
import ctypes, sys, traceback
libc = ctypes.CDLL(None)
buf = (ctypes.c_void_p * 64)()

def leaky():
    n = libc.backtrace(buf, 64)                      # @line py_bt
    return n, traceback.extract_stack()

def outer():
    return leaky()                                   # @line py_outer

n, st = outer()                                      # @line py_module
for i in range(n):
    print("pc", i, hex(buf[i]))
print("ready", flush=True)
sys.stdin.readline()
print("bye")
'''


def test_cpython_python_frames_in_place_of_the_eval_frame(tmp_path):
    """A real interpreter's native stack (ctypes -> libc backtrace() from Python code): the
    eval loop frame is found by name and replaced by the Python frames that ran in it."""
    import subprocess
    import sys
    from memunreachable.collect import procfs
    script = tmp_path / "leaky_app.py"
    script.write_text(PY_SCRIPT)
    marks = {m: n for n, text in enumerate(PY_SCRIPT.split("\n"), 1)
             for m in ("py_bt", "py_outer", "py_module") if f"@line {m}" in text}
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        pcs = []
        for line in proc.stdout:
            if line.startswith("pc "):
                pcs.append(int(line.split()[2], 16))
            elif line.startswith("ready"):
                break
        native = symbolize(pcs, S.modules_from_maps(procfs.read_maps(proc.pid)),
                           cache=fresh_cache())
    finally:
        proc.communicate("quit\n", timeout=30)
    # what the tracker records: (function, file, line), innermost first
    python_stack = [("leaky", str(script), marks["py_bt"]),
                    ("outer", str(script), marks["py_outer"]),
                    ("<module>", str(script), marks["py_module"])]
    evals = [i for i, f in enumerate(native) if f.function == "_PyEval_EvalFrameDefault"]
    assert len(evals) == 1, [f.function for f in native]
    merged = merge_python(native, python_stack)
    i = evals[0]
    assert [(f.function, f.file, f.line, f.python) for f in merged[i:i + 3]] == \
        [(fn, fl, ln, True) for fn, fl, ln in python_stack]
    assert merged[:i] == native[:i] and merged[i + 3:] == native[i + 1:]
    # the ctypes call into libc is below (inner to) the Python line that made it
    assert any(f.function == "PyCFuncPtr_call" for f in merged[:i])


def test_allocation_stacks_malloc_calloc_strdup(out_dir):
    """Stacks shaped as the tracking table records them (the allocator's own frame removed):
    the caller's file:line of each malloc/calloc call, and for strdup libc's strdup (from its
    debug file) then the caller's line."""
    exe = build_sym("sym_alloc.c", out_dir, extra=["-fno-builtin-malloc", "-fno-builtin-calloc"])
    src, marks = source("sym_alloc.c"), lines_marked("sym_alloc.c")
    with SymProcess(exe) as sp:
        modules = sp.modules()
        libc = libc_path(modules)
        debug = ensure_libc_debug(libc)
        cache = fresh_cache()
        got = {kind: symbolize(stack, modules, cache=cache) for kind, stack in sp.stacks.items()}
    assert set(got) == {"malloc", "calloc", "strdup"}
    names = {k: [(f.function, f.file, f.line) for f in v] for k, v in got.items()}
    assert names["malloc"][:2] == [("make_block", src, marks["alloc_malloc"]),
                                   ("main", src, marks["main_malloc"])]
    assert names["calloc"][:2] == [("make_zeroed", src, marks["alloc_calloc"]),
                                   ("main", src, marks["main_calloc"])]
    top = got["strdup"][0]
    assert (top.module, top.function) == (libc, "strdup")
    assert top.file.endswith("strdup.c") and top.line == addr2line(debug, top.offset)[-1][1]
    assert names["strdup"][1:3] == [("make_name", src, marks["alloc_strdup"]),
                                    ("main", src, marks["main_strdup"])]
