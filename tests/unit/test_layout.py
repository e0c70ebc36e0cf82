"""Unit tests of glibc layout data, the file-image locators and allocator detection."""
import struct

import pytest

from memunreachable.sweep import detect
from memunreachable._types import Mapping
from memunreachable.heaps.glibc import layout as L
from memunreachable.heaps.glibc import locate


def test_first_chunk_of_heaps():
    # glibc-heap.md 8.2: h+0x8c0 (<=2.34), h+0x8d0 (>=2.35); later heaps at h+sizeof(heap_info)
    h = 0x7f0000000000
    assert L.HEAP_INFO_32.first_chunk(h, L.MALLOC_STATE_227, True) == h + 0x8c0
    assert L.HEAP_INFO_48.first_chunk(h, L.MALLOC_STATE_227, True) == h + 0x8d0
    assert L.HEAP_INFO_48.first_chunk(h, L.MALLOC_STATE_227, False) == h + 48
    assert L.MP_235.heap_info is L.HEAP_INFO_48 and L.MP_227.heap_info is L.HEAP_INFO_32


def test_bins_and_initial_top():
    a = 0x1000
    assert L.MALLOC_STATE_227.bin_chunk(a, 1) == a + 0x60 == L.MALLOC_STATE_227.initial_top(a)
    assert L.MALLOC_STATE_227.bin_chunk(a, 2) + 16 == a + 0x80      # bin 2's fd
    assert L.TCACHE_U16.bin_chunk_size(0) == 0x20 and L.TCACHE_U16.bin_chunk_size(63) == 0x410


def test_version_hint():
    assert L.find_version(b"xx GNU C Library (Debian GLIBC 2.36-9) release version 2.36.\n") == "2.36"
    assert L.find_version(b"nothing") is None
    # the first "release version 2." followed by digits counts; a number ends at a non-digit
    assert L.find_version(b"release version 2.x; release version 2.41") == "2.41"
    assert L.find_version(b"release version 2.") is None
    assert L.par_hint("2.36") is L.MP_235 and L.par_hint("2.31") is L.MP_227 and L.par_hint(None) is None


def arena_image(vaddr_a, relr=True):
    st = L.MALLOC_STATE_227
    data = bytearray(st.sizeof)
    struct.pack_into("<Q", data, st.attached_threads, 1)
    if relr:
        struct.pack_into("<Q", data, st.next, vaddr_a)
    return data


def mp_image(par):
    d = bytearray(par.sizeof)
    for off, val in ((par.trim_threshold, 0x20000), (par.top_pad, 0x20000), (par.mmap_threshold, 0x20000),
                     (par.arena_test, 8), (par.tcache_bins, 64), (par.tcache_max_bytes, 1032),
                     (par.tcache_count, 7)):
        struct.pack_into("<Q", d, off, val)
    struct.pack_into("<i", d, par.n_mmaps_max, 65536)
    return d


@pytest.mark.parametrize("par", [L.MP_235, L.MP_227])
@pytest.mark.parametrize("relr", [True, False])
def test_file_image_finds_main_arena_and_mp(par, relr):
    seg = 0x1d2000
    data = bytearray(0x4000)
    data[0x100:0x100 + 8] = struct.pack("<Q", 1)              # a lone 1: not an arena
    mp_off, ar_off = 0x800, 0x1000
    data[mp_off:mp_off + par.sizeof] = mp_image(par)
    data[ar_off:ar_off + L.MALLOC_STATE_227.sizeof] = arena_image(seg + ar_off, relr)
    relative = {} if relr else {seg + ar_off + L.MALLOC_STATE_227.next: seg + ar_off}
    img = locate._Image(bias=0x7f0000000000, rw=[(seg, bytes(data))], relative=relative, version=None)
    assert list(locate.iter_main_arena_images(img, L.MALLOC_STATE_227)) == [seg + ar_off]
    assert list(locate.iter_mp_images(img)) == [(seg + mp_off, par)]


def test_arena_image_with_stray_word_is_rejected():
    seg = 0x1000
    data = bytearray(arena_image(seg))
    struct.pack_into("<Q", data, 0x200, 5)
    img = locate._Image(0, [(seg, bytes(data))], {}, None)
    assert list(locate.iter_main_arena_images(img, L.MALLOC_STATE_227)) == []


def m(begin, path, perms="r--p", inode=1):
    return Mapping(begin, begin + 0x1000, perms, 0, "08:01", inode, path)


def test_detect_libc_and_foreign_allocators():
    maps = [m(0x400000, "/usr/bin/prog"), m(0x7f0000000000, "/usr/lib/x86_64-linux-gnu/libc.so.6"),
            m(0x7f0000100000, "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")]
    s = detect.scan_maps(maps)
    assert s.malloc_object == "/usr/lib/x86_64-linux-gnu/libc.so.6" and not s.static
    assert s.foreign == ["libjemalloc.so.2"]
    assert "libjemalloc.so.2" in detect.foreign_message(s) and "nothing was checked" in detect.foreign_message(s)
    assert [x.begin for x in s.object_mappings] == [0x7f0000000000]


def test_detect_static_and_musl():
    s = detect.scan_maps([m(0x400000, "/opt/static-prog"), m(0x7ff000000000, "[stack]", "rw-p", 0)])
    assert s.static and s.malloc_object == "/opt/static-prog"
    s = detect.scan_maps([m(0x400000, "/bin/prog"), m(0x7f0000000000, "/lib/ld-musl-x86_64.so.1")])
    assert s.musl
    assert "musl" in detect.not_glibc_message(s, "no glibc main_arena was found")
    s = detect.scan_maps([m(0x400000, "/usr/lib/libc-2.31.so")])
    assert not s.static and s.malloc_object == "/usr/lib/libc-2.31.so"


def test_dynamic_musl_is_named_not_static():
    # Debian's musl: /lib/ld-musl-x86_64.so.1 is a symlink, maps show the resolved libc.so
    for path in ("/usr/lib/x86_64-linux-musl/libc.so", "/lib/ld-musl-x86_64.so.1",
                 "/usr/lib/libc.musl-x86_64.so.1"):
        s = detect.scan_maps([m(0x400000, "/bin/prog"), m(0x7f0000000000, path)])
        msg = detect.not_glibc_message(s, "no glibc main_arena was found")
        assert s.musl, path
        assert msg == ("unsupported allocator: looks like musl libc (dynamically linked); "
                       "no glibc main_arena was found; nothing was checked")
    s = detect.scan_maps([m(0x400000, "/opt/static-prog")])
    assert not s.musl and "a static executable" in detect.not_glibc_message(s, "x")


# ---- glibc 2.42 / 2.43 (issue 22) ---------------------------------------------------------
def test_243_layout_families():
    # Debian 2.43-7's DWARF: malloc_state without fastbins, mp_ with thp_mode, tcache of 76 bins
    st, par = L.MALLOC_STATE_243, L.MP_243
    a, h = 0x7f0000000030, 0x7f0000000000
    assert (st.sizeof, st.top, st.bins, st.next, st.attached_threads, st.system_mem) == (
        2112, 8, 24, 2072, 2088, 2096)
    assert st.initial_top(a) == a + st.top and st.nfastbins == 0 and st.fastbins is None
    assert par.heap_info.first_chunk(h, st, True) == h + 0x870
    assert (par.sizeof, par.thp_mode, par.hp_pagesize, par.n_mmaps, par.mmapped_mem, par.sbrk_base,
            par.tcache_bins, par.tcache_max_bytes, par.tcache_count) == (
        144, 40, 56, 68, 88, 104, 112, 120, 128)
    assert par.state is st and L.MP_242.state is L.MALLOC_STATE_227 is L.MP_235.state
    assert not par.heap_max_from_hp and L.MP_242.heap_max_from_hp
    tc = L.TCACHE_76
    assert (tc.entries, tc.nbins, tc.chunk_size - 8) == (152, 76, 760)
    assert [tc.bin_size_range(i) for i in (0, 63, 64, 65, 75)] == [
        (0x20, 0x20), (0x410, 0x410), (0x420, 0x7f0), (0x800, 0xff0), (0x200000, 0x3ffff0)]
    assert par.tcaches == L.MP_242.tcaches == (tc,) and L.MP_235.tcaches == (L.TCACHE_U16,)
    assert L.MMAP_CHUNK_243.tail == 16 and L.MP_242.mmap_chunk is L.MMAP_CHUNK_227
    assert L.par_hint("2.43") is par and L.par_hint("2.42") is L.MP_242 and L.MAX_MINOR >= 43


def test_tcache_max_bytes_tells_the_families_apart():
    # <= 2.41: a usable size (1032); 2.42: the largest chunk + 0 (0x410), 2.43: + 1 (0x411)
    for par, value in ((L.MP_235, 1032), (L.MP_242, 0x410), (L.MP_243, 0x411)):
        assert [p.tcache_max_plausible(64, value) for p in (L.MP_235, L.MP_242, L.MP_243)] == [
            p is par for p in (L.MP_235, L.MP_242, L.MP_243)], par.name
    # the tcache_max tunable: a smaller small-bin count, or large bins (2.42+ only)
    assert L.MP_243.tcache_max_plausible(10, 0x20 + 16 * 9 + 1)
    assert L.MP_243.tcache_max_plausible(64, 0x3d0911) and L.MP_242.tcache_max_plausible(64, 0x3d0910)
    assert not L.MP_243.tcache_max_plausible(10, 0x3d0911)      # large bins need all 64 small
    assert not L.MP_243.tcache_max_plausible(64, 0x400001)      # beyond the last large bin


def image_243(seg, ar_off, mp_off, state, par, values):
    data = bytearray(0x4000)
    data[ar_off:ar_off + state.sizeof] = bytes(state.sizeof)
    struct.pack_into("<Q", data, ar_off + state.attached_threads, 1)
    struct.pack_into("<Q", data, ar_off + state.next, seg + ar_off)
    for off, val in values:
        struct.pack_into("<Q", data, mp_off + off, val)
    struct.pack_into("<i", data, mp_off + par.n_mmaps_max, 65536)
    if par.thp_mode is not None:
        struct.pack_into("<i", data, mp_off + par.thp_mode, 3)
    return bytes(data)


def mp_values(par, max_bytes, count):
    return ((par.trim_threshold, 0x20000), (par.top_pad, 0x20000), (par.mmap_threshold, 0x20000),
            (par.arena_test, 8), (par.tcache_bins, 64), (par.tcache_max_bytes, max_bytes),
            (par.tcache_count, count))


@pytest.mark.parametrize("state, par, max_bytes, count", [
    (L.MALLOC_STATE_243, L.MP_243, 0x411, 16), (L.MALLOC_STATE_227, L.MP_242, 0x410, 7),
    (L.MALLOC_STATE_227, L.MP_235, 1032, 7)])
def test_file_image_locator_picks_the_families(monkeypatch, state, par, max_bytes, count):
    # sid's libc.so.6 (2.43): mp_ 0x1e7180, main_arena 0x1e7ac0 in the RW PT_LOAD at 0x1e3b98
    seg, bias = 0x1e3b98, 0x7f0000000000
    ar_off, mp_off = 0x1e7ac0 - seg, 0x1e7180 - seg
    data = image_243(seg, ar_off, mp_off, state, par, mp_values(par, max_bytes, count))
    img = locate._Image(bias=bias, rw=[(seg, data)], relative={}, version=None)
    monkeypatch.setattr(locate, "read_image", lambda mappings, pid: img)
    loc = locate._locate_in_file([], None, "/usr/lib/x86_64-linux-gnu/libc.so.6")
    assert (loc.main_arena, loc.mp) == (bias + 0x1e7ac0, bias + 0x1e7180)
    assert loc.layout == L.Layout(state, par) and loc.method == "file"


def test_file_image_of_243_is_no_older_family():
    seg = 0x1e3b98
    st, par = L.MALLOC_STATE_243, L.MP_243
    data = image_243(seg, 0x3000, 0x1000, st, par, mp_values(par, 0x411, 16))
    img = locate._Image(bias=0, rw=[(seg, data)], relative={}, version=None)
    assert list(locate.iter_main_arena_images(img, L.MALLOC_STATE_227)) == []
    assert list(locate.iter_main_arena_images(img, st)) == [seg + 0x3000]
    assert list(locate.iter_mp_images(img)) == [(seg + 0x1000, par)]
    # without thp_mode's initial value (3) it is no 2.43 mp_
    bad = bytearray(data)
    struct.pack_into("<i", bad, 0x1000 + par.thp_mode, 0)
    assert list(locate.iter_mp_images(locate._Image(0, [(seg, bytes(bad))], {}, None))) == []


@pytest.mark.parametrize("state, par, max_bytes, count", [
    (L.MALLOC_STATE_243, L.MP_243, 0x411, 16), (L.MALLOC_STATE_227, L.MP_235, 1032, 7)])
def test_memory_locator_picks_the_families(state, par, max_bytes, count):
    # method B: a run of empty bins, a ring that closes, mp_ after malloc's initialisation
    from memunreachable._types import BufferMemory
    base, heap = 0x7f0000200000, 0x5555555000
    data = bytearray(0x4000)
    a, mp = base + 0x2000, base + 0x800
    for i in range(1, state.nbins):
        slot = state.bin_chunk(a, i)
        struct.pack_into("<QQ", data, slot + 16 - base, slot, slot)
    struct.pack_into("<Q", data, a + state.next - base, a)
    struct.pack_into("<Q", data, a + state.attached_threads - base, 1)
    for off, val in mp_values(par, max_bytes, count) + ((par.sbrk_base, heap),):
        struct.pack_into("<Q", data, mp - base + off, val)
    struct.pack_into("<i", data, mp - base + par.n_mmaps_max, 65536)
    struct.pack_into("<i", data, mp - base + par.max_n_mmaps, 1)
    maps = [Mapping(heap, heap + 0x21000, "rw-p", 0, "00:00", 0, "[heap]"),
            Mapping(base, base + 0x4000, "rw-p", 0x1e0000, "08:01", 7, "/lib/libc.so.6")]
    mem = BufferMemory({base: bytes(data)})
    loc = locate.locate_in_memory(mem, maps, maps[1:], "/lib/libc.so.6", None)
    assert (loc.main_arena, loc.mp, loc.layout) == (a, mp, L.Layout(state, par))
