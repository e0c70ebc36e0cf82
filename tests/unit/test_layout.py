"""Unit tests of glibc layout data, the file-image locators and allocator detection."""
import struct

import pytest

from memunreachable import detect
from memunreachable._types import Mapping
from memunreachable.glibc import layout as L
from memunreachable.glibc import locate


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
