"""Unit tests of allocator detection on synthetic maps (no process needed)."""
from memunreachable.sweep import detect
from memunreachable._types import Mapping


def m(path, perms="r-xp", inode=7, offset=0):
    return Mapping(0x1000, 0x2000, perms, offset, "08:01", inode, path)


def test_glibc_found():
    scan = detect.scan_maps([m("/usr/bin/prog"), m("/usr/lib/x86_64-linux-gnu/libc.so.6")])
    assert scan.malloc_object == "/usr/lib/x86_64-linux-gnu/libc.so.6"
    assert not scan.static and scan.foreign == [] and not scan.musl


def test_named_allocators_are_foreign():
    maps = [m("/usr/bin/prog"), m("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
            m("/usr/lib/libtcmalloc_minimal.so.4"), m("/usr/lib/x86_64-linux-gnu/libc.so.6")]
    scan = detect.scan_maps(maps)
    assert scan.foreign == ["libjemalloc.so.2", "libtcmalloc_minimal.so.4"]
    msg = detect.foreign_message(scan)
    assert "libjemalloc.so.2" in msg and "nothing was checked" in msg


def test_musl_is_named():
    scan = detect.scan_maps([m("/usr/bin/prog"), m("/lib/ld-musl-x86_64.so.1")])
    assert scan.musl and scan.static
    assert "musl" in detect.not_glibc_message(scan, "no libc is mapped")


def test_interposer_found_in_dynsym(tmp_path):
    import subprocess
    src = tmp_path / "a.c"
    src.write_text("#include <stddef.h>\nvoid *malloc(size_t n){return 0;}\nvoid free(void*p){}\n")
    lib = tmp_path / "liba.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    plain = tmp_path / "libb.so"
    (tmp_path / "b.c").write_text("int f(void){return 1;}\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(plain), str(tmp_path / "b.c")], check=True)
    maps = [m(str(lib)), m(str(plain)), m("/usr/lib/x86_64-linux-gnu/libc.so.6")]
    scan = detect.scan_maps(maps)
    assert detect.malloc_interposers(maps, scan, None) == [str(lib)]


def test_a_repeated_scan_names_the_current_maps_objects():
    # scan_maps remembers its last answer per mapped paths: a repeat over new Mapping objects
    # (the next check's maps) gives those objects, and other paths are scanned anew
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    first = [m("/usr/bin/prog"), m(libc), m(libc + " (deleted)", perms="rw-p", offset=4096)]
    scan1 = detect.scan_maps(first)
    again = [Mapping(x.begin + 0x10000, x.end + 0x10000, x.perms, x.offset, x.dev, x.inode,
                     x.path) for x in first]
    scan2 = detect.scan_maps(again)
    assert scan2 == detect.AllocatorScan(libc, again[1:], False, [], False)
    assert scan1.object_mappings == first[1:]
    scan2.foreign.append("changed by a caller")        # never shared with the memo
    assert detect.scan_maps(again).foreign == []
    other = detect.scan_maps([m("/usr/bin/prog"), m("/usr/lib/libjemalloc.so.2")])
    assert other.static and other.malloc_object == "/usr/bin/prog"
    assert other.foreign == ["libjemalloc.so.2"]
    assert detect.scan_maps(again).malloc_object == libc


def test_another_allocator_s_hint(monkeypatch):
    env = {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2:/opt/other.so"}
    monkeypatch.setattr(detect.procfs, "read_environ_var", lambda pid, name: env.get(name))
    # preloaded (by path or basename): start without it
    assert detect.allocator_hint(["libjemalloc.so.2"], 42).startswith(
        "LD_PRELOAD loads libjemalloc.so.2: start the program without it")
    assert detect.allocator_hint(["/opt/other.so"], 42).startswith("LD_PRELOAD loads other.so:")
    # linked in (Redis's jemalloc), or no environment to read: a build with glibc's malloc
    env.clear()
    assert detect.allocator_hint(["libjemalloc.so.2"], 42) == (
        "only glibc's malloc heap can be checked: check a build of the program that allocates "
        "with glibc's malloc (Redis: make MALLOC=libc), or use the other allocator's own leak "
        "reports")
    assert detect.allocator_hint(["libjemalloc.so.2"], None) == detect.allocator_hint([], 42)


def test_an_unknown_glibc_release_s_hint():
    assert detect.glibc_range_hint((2, 44), 27, 43).startswith(
        "glibc 2.44 is newer than this memunreachable knows: a newer memunreachable")
    assert detect.glibc_range_hint((2, 26), 27, 43) == (
        "glibc releases before 2.27 (2018) are not supported")
