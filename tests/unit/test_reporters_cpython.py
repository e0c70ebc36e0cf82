"""The CPython additions to the reports: a leak's Python object (type, refcount, repr) and the
cyclic garbage list, in the text and JSON reporters (additive fields), and through the
sweeper's pipe."""
import json

from memunreachable.reporters.report import Leak, UnreachableMemoryInfo
from memunreachable.reporters import format_text, load_json, render_json
from memunreachable.sweep.sweeper import SweepEntry, SweepResult, decode, encode_result


def info():
    lst = Leak(0x7F00_0000_1000, 64, 1001, 40008, b"\x01" * 8, python_type="list", refcount=1)
    s = Leak(0x7F00_0000_2000, 64, 0, 0, b"", python_type="str", refcount=2, repr="'leaked'")
    native = Leak(0x5555_0000_0000, 4008, 0, 0, b"")
    garbage = Leak(0x7F00_0000_3000, 48, 1, 48, b"", python_type="Node", refcount=1)
    return UnreachableMemoryInfo(pid=42, num_allocations=10, allocation_bytes=99999,
                                 num_leaks=1004, leak_bytes=44144, leaks=[native, lst, s],
                                 cyclic_garbage=[garbage], num_cyclic_garbage=2,
                                 cyclic_garbage_bytes=96)


def test_text_names_python_objects_and_lists_garbage_apart():
    lines = format_text(info()).splitlines()
    i = lines.index("  64 bytes unreachable at 7f0000001000")
    assert lines[i + 1] == "   Python object: list, refcount 1"
    assert lines[i + 2] == "   referencing 40008 unreachable bytes in 1001 allocations"
    j = lines.index("  64 bytes unreachable at 7f0000002000")
    assert lines[j + 1] == "   Python object: str, refcount 2, value 'leaked'"
    k = lines.index("  4008 bytes unreachable at 555500000000")
    assert not lines[k + 1].startswith("   Python object")
    g = lines.index("  96 bytes in 2 allocations of cyclic garbage awaiting collection "
                    "(not counted as leaks)")
    assert lines[g + 1] == "   48 bytes at 7f0000003000 (Node, refcount 1), referencing 1 allocation"
    assert lines[-1] == ("SUMMARY: memunreachable: 44144 bytes leaked in 1004 allocations, "
                         "3 report entries")


def test_json_additive_fields_round_trip():
    obj = json.loads(json.dumps(render_json(info())))
    by_addr = {e["address"]: e for e in obj["leaks"]}
    assert (by_addr[0x7F00_0000_2000]["python_type"], by_addr[0x7F00_0000_2000]["refcount"],
            by_addr[0x7F00_0000_2000]["repr"]) == ("str", 2, "'leaked'")
    assert "python_type" not in by_addr[0x5555_0000_0000]
    assert obj["num_cyclic_garbage"] == 2 and obj["cyclic_garbage_bytes"] == 96
    assert obj["cyclic_garbage"][0]["python_type"] == "Node"
    back = load_json(obj)
    assert back.leaks == info().leaks and back.cyclic_garbage == info().cyclic_garbage
    assert back.num_cyclic_garbage == 2
    # no CPython: no new keys at all
    plain = render_json(UnreachableMemoryInfo(pid=1))
    assert "cyclic_garbage" not in plain


def test_sweeper_pipe_carries_annotations_and_garbage():
    res = SweepResult(num_leaks=3, entries=[SweepEntry(1, 16, 0, 0, b"a", "list", 1, None),
                                            SweepEntry(2, 16, 0, 0, b"b")],
                      cyclic_garbage=[SweepEntry(3, 48, 1, 48, b"\x00c", "Node", 1, None)],
                      meta={"warnings": ["w"]})
    back = decode(encode_result(res))
    assert back.entries == res.entries and back.cyclic_garbage == res.cyclic_garbage
    assert back.meta == {"warnings": ["w"]}
