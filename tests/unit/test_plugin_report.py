"""The pytest plugin's failure text: a headline per test, no lines about the batch's check."""
from memunreachable.pytest_report import headline, leak_text
from memunreachable.reporters.report import Leak, UnreachableMemoryInfo


def _info(leaks, **kw):
    return UnreachableMemoryInfo(pid=7, threads=3, pause_ms=4.5, duration_ms=80.0,
                                 num_allocations=1000, allocation_bytes=1 << 20,
                                 num_leaks=sum(1 + l.referenced_count for l in leaks),
                                 leak_bytes=sum(l.total_size for l in leaks), leaks=leaks, **kw)


def test_headline_names_objects_native_blocks_and_what_they_hold():
    tup = Leak(0x1000, 64, referenced_count=4, referenced_size=432, python_type="tuple")
    lst = Leak(0x2000, 56, python_type="list")
    raw = Leak(0x3000, 104)
    assert headline(_info([raw])) == \
        "1 block leaked during this test (104 bytes): 1 native heap block"
    assert headline(_info([tup, lst, raw, Leak(0x4000, 24)])) == \
        ("8 blocks leaked during this test (680 bytes): 2 Python objects (list, tuple) and "
         "2 native heap blocks, holding 4 more blocks")


def test_failure_text_has_the_leaks_and_caveats_not_the_batch_s_timing():
    info = _info([Leak(0x3000, 104, contents=b"A" * 32)],
                 warnings=["libfoo.so: its .bss could not be read"])
    text = leak_text(info, info.leaks)
    lines = text.splitlines()
    assert lines[0] == "1 block leaked during this test (104 bytes): 1 native heap block"
    assert lines[1] == "warning: libfoo.so: its .bss could not be read"
    assert "  104 bytes unreachable at 3000" in lines
    assert lines[-1] == "SUMMARY: memunreachable: 104 bytes leaked in 1 allocation, 1 report entry"
    assert not [l for l in lines if "paused" in l or "ABI" in l or "pid 7" in l]
