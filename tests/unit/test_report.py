"""Unit tests of report.py's grouping by allocation stack and of how the reporters show groups,
backtraces, missing stacks and suppressions (issue 9)."""
import io
import json

from memunreachable.reporters.report import Leak, UnreachableMemoryInfo, group_leaks, members, stack_key
from memunreachable.reporters import format_text, load_json, render_json, write_json
from memunreachable.stacks.symbolize import Frame

S1 = [0x401234, 0x401300]
S2 = [0x401999]
PY = [("work", "/app/w.py", 12)]


def leak(addr, size, stack=None, status="recorded", ref=(0, 0), py=()):
    return Leak(addr, size, ref[0], ref[1], b"", stack=list(stack or []),
                python_stack=list(py), stack_status=status if stack or py else status)


def sample():
    return [leak(0x3000, 100, S1, ref=(1, 16)),
            leak(0x1000, 100, S1),
            leak(0x2000, 100, S1, ref=(2, 32)),
            leak(0x4000, 500, S2),
            leak(0x5000, 40, None, status="untracked"),
            leak(0x6000, 40, None, status="untracked"),
            leak(0x7000, 8, S1, py=PY),                 # same pcs, other Python frames
            leak(0x8000, 1000, S1, status="table_full")]  # a stack that is not "recorded"


def test_stack_key():
    assert stack_key(leak(1, 1, S1)) == (tuple(S1), ())
    assert stack_key(leak(1, 1, S1, py=PY)) == (tuple(S1), (PY[0],))
    assert stack_key(leak(1, 1, None, status="untracked")) is None
    assert stack_key(leak(1, 1, S1, status="table_full")) is None


def test_group_leaks_like_libmemunreachable():
    groups, left = group_leaks(sample())
    assert left == 0
    assert [[l.address for l in g.leaks] for g in groups] == [
        [0x8000], [0x4000], [0x1000, 0x2000, 0x3000], [0x5000], [0x6000], [0x7000]]
    g = groups[2]
    # representative = lowest address; similar = the others, with what they reference
    assert g.representative.address == 0x1000
    assert (g.num_entries, g.num_allocations, g.total_size) == (3, 6, 348)
    assert (g.similar_count, g.similar_size) == (2, 200)
    assert (g.similar_referenced_count, g.similar_referenced_size) == (3, 48)
    assert [g.total_size for g in groups] == [1000, 500, 348, 40, 40, 8]


def listing(addr, size, stack, ref, indirect):
    """A leak entry that reaches ref=(count, bytes) and lists the (address, size) blocks of
    indirect (the blocks no entry before it reaches)."""
    l = leak(addr, size, stack, ref=ref)
    l.indirect = [leak(a, s, S2) for a, s in indirect]
    l.num_indirect, l.indirect_size = len(indirect), sum(s for _, s in indirect)
    return l


def test_group_totals_equal_leak_totals_when_heads_share_children():
    # issue 23 item 5: A and B (same stack) both reach C; C is listed by A alone, so the group
    # counts 3 blocks and 264 bytes, as num_leaks and leak_bytes do (it was 4 and 328)
    a = listing(0x1000, 100, S1, (1, 64), [(0x3000, 64)])
    b = listing(0x2000, 100, S1, (1, 64), [])
    (g,), _ = group_leaks([a, b])
    assert (g.num_allocations, g.total_size) == (3, 264)
    assert (g.similar_referenced_count, g.similar_referenced_size) == (0, 0)
    assert [l.total_size for l in (a, b)] == [164, 164]     # what each reaches, upstream's
    # groups sort by what their members reach, as single entries do: B (200 bytes reaching
    # C) before A, though C is listed under A
    a = listing(0x1000, 100, S1, (1, 64), [(0x3000, 64)])
    b = listing(0x2000, 200, S2, (1, 64), [])
    groups, _ = group_leaks([a, b])
    assert [(g.representative.address, g.num_allocations, g.total_size) for g in groups] == [
        (0x2000, 1, 200), (0x1000, 2, 164)]


def test_group_totals_of_many_heads_sharing_a_few_blocks():
    # 100 entries of one stack; 5 shared blocks each reached by several heads: the group
    # holds exactly the 105 unreachable blocks (the report said 105 for 100 + 14 referenced)
    shared = [(0x9000 + 0x100 * k, 32) for k in range(5)]
    leaks = [listing(0x10000 + 0x100 * i, 48, S1, (3, 96),
                     shared[i // 20:i // 20 + 1] if i % 20 == 0 else [])
             for i in range(100)]
    (g,), _ = group_leaks(leaks)
    assert g.num_allocations == 105 == 100 + len(shared)
    assert g.total_size == 100 * 48 + 5 * 32
    assert g.similar_referenced_count == 4


def test_group_limit_counts_groups_and_caps_members():
    groups, left = group_leaks(sample(), limit=3)
    assert left == 3
    assert [g.total_size for g in groups] == [1000, 500, 348]
    assert [len(g.leaks) for g in groups] == [1, 1, 3]
    groups, left = group_leaks(sample(), limit=2)
    assert left == 4
    groups, _ = group_leaks([leak(a, 8, S1) for a in range(0x100, 0x600, 0x100)], limit=2)
    assert [l.address for l in groups[0].leaks] == [0x100, 0x200]
    assert groups[0].num_entries == 5 and groups[0].similar_count == 4
    assert members(groups) == groups[0].leaks


def frames_s1():
    return [Frame(pc=0x401234, module="/usr/bin/app", build_id="ab12", offset=0x1233,
                  function="make_node", file="/src/list.c", line=42),
            Frame(pc=0x401300, module="/usr/bin/app", build_id="ab12", offset=0x12ff,
                  function="main", file="/src/main.c", line=7)]


def info_for(leaks, **kw):
    groups, truncated = group_leaks(leaks, kw.pop("limit", None))
    fields = dict(pid=7, threads=1, num_allocations=20, allocation_bytes=4096,
                  num_leaks=sum(1 + l.referenced_count for l in leaks),
                  leak_bytes=sum(l.total_size for l in leaks), groups=groups,
                  leaks=members(groups), truncated=truncated)
    fields.update(kw)
    return UnreachableMemoryInfo(**fields)


def body(text):
    lines = text.split("\n")
    start = lines.index("  ABI: 'x86_64'") + 2
    return lines[start:]


def test_text_group_shows_similar_and_the_stack_once():
    leaks = [leak(0x3000, 100, S1, ref=(1, 16)), leak(0x1000, 100, S1),
             leak(0x2000, 100, S1, ref=(2, 32))]
    for l in leaks:
        l.backtrace = frames_s1()
    out = format_text(info_for(leaks))
    assert body(out)[:7] == [
        "  100 bytes unreachable at 1000",
        "   and 200 similar unreachable bytes in 2 allocations",
        "   referencing 48 unreachable bytes in 3 allocations",
        "   #0 0x401234 in make_node /src/list.c:42 (/usr/bin/app+0x1233)",
        "   #1 0x401300 in main /src/main.c:7 (/usr/bin/app+0x12ff)",
        "",
        "SUMMARY: memunreachable: 348 bytes leaked in 6 allocations, 1 report entry",
    ]
    assert out.count("make_node") == 1


def test_text_missing_stacks_on_a_tracked_target():
    leaks = [leak(0x1000, 64, None, status="untracked"), leak(0x2000, 32, None, status="table_full")]
    tracked = info_for(leaks, tracking={"version": 1, "live_blocks": 10, "stacks": 3,
                                        "table_full_blocks": 1, "budget_bytes": 1 << 26})
    assert body(format_text(tracked))[:6] == [
        "  64 bytes unreachable at 1000",
        "   no stack recorded (allocated before tracking / not tracked)",
        "",
        "  32 bytes unreachable at 2000",
        "   no stack recorded: the tracking table was full ([stack table full]; raise "
        "MEMUNREACHABLE_TRACK_BUDGET)",
        "",
    ]
    # an untracked target (no table at all) keeps the plain report
    assert "no stack recorded (" not in format_text(info_for(leaks[:1]))
    # a table that says when recording began (track PID, the plugin): the time, local
    import time
    began = time.mktime((2026, 11, 27, 15, 30, 1, 0, 0, -1))
    since = info_for(leaks[:1], tracking={"version": 3, "started": began})
    assert body(format_text(since))[1] == ("   no stack recorded (allocated before tracking "
                                           "began, 15:30:01, or not tracked)")


def test_text_python_and_unresolved_frames():
    l = leak(0x1000, 24, S2, py=PY)
    l.backtrace = [Frame(pc=0x401999, module="/usr/lib/libx.so", build_id="cafe", offset=0x998),
                   Frame(pc=0, module="", function="work", file="/app/w.py", line=12,
                         python=True)]
    assert body(format_text(info_for([l])))[:4] == [
        "  24 bytes unreachable at 1000",
        "   #0 0x401999 (/usr/lib/libx.so+0x998) (BuildId: cafe)",
        "   #1 work /app/w.py:12 (Python)",
        "",
    ]


def test_text_suppressions_block_before_summary():
    info = info_for([leak(0x1000, 8, None, status="untracked")], num_suppressed=3,
                    suppressed_bytes=700, suppressions_used=[("*LSanTestLeakingFunc*", 3, 700)])
    lines = format_text(info).split("\n")
    i = lines.index("Suppressions used:")
    assert lines[i - 1:i + 6] == [
        "-----------------------------------------------------",
        "Suppressions used:",
        "  count      bytes template",
        "      3        700 *LSanTestLeakingFunc*",
        "-----------------------------------------------------",
        "",
        "SUMMARY: memunreachable: 8 bytes leaked in 1 allocation, 1 report entry",
    ]


def test_json_backtrace_groups_and_round_trip():
    leaks = [leak(0x2000, 100, S1), leak(0x1000, 100, S1), leak(0x9000, 5, None, "untracked")]
    for l in leaks[:2]:
        l.backtrace = frames_s1()
    info = info_for(leaks, suppressions_used=[("x", 1, 2)], num_suppressed=1,
                    suppressed_bytes=2)
    obj = render_json(info)
    assert [l["address"] for l in obj["leaks"]] == [0x1000, 0x2000, 0x9000]
    assert obj["leaks"][0]["backtrace"] == [
        {"pc": 0x401234, "module": "/usr/bin/app", "build_id": "ab12", "offset": 0x1233,
         "function": "make_node", "file": "/src/list.c", "line": 42, "inlined": False},
        {"pc": 0x401300, "module": "/usr/bin/app", "build_id": "ab12", "offset": 0x12ff,
         "function": "main", "file": "/src/main.c", "line": 7, "inlined": False}]
    assert obj["leaks"][0]["stack_status"] == "recorded"
    assert obj["leaks"][2]["backtrace"] == [] and obj["leaks"][2]["stack_status"] == "untracked"
    assert obj["groups"] == [
        {"leaks": [0, 1], "num_entries": 2, "num_allocations": 2, "total_size": 200,
         "similar_count": 1, "similar_size": 100, "similar_referenced_count": 0,
         "similar_referenced_size": 0},
        {"leaks": [2], "num_entries": 1, "num_allocations": 1, "total_size": 5,
         "similar_count": 0, "similar_size": 0, "similar_referenced_count": 0,
         "similar_referenced_size": 0}]
    assert obj["suppressions_used"] == [{"template": "x", "count": 1, "bytes": 2}]
    assert (obj["num_suppressed"], obj["suppressed_bytes"], obj["tracking"]) == (1, 2, None)
    buf = io.StringIO()
    write_json(info, buf)
    back = load_json(json.loads(buf.getvalue()))
    assert back.leaks[0].backtrace == frames_s1()
    assert [[l.address for l in g.leaks] for g in back.groups] == [[0x1000, 0x2000], [0x9000]]
    assert format_text(back) == format_text(info)
    assert render_json(back) == obj


def indirect_sample():
    """A vector (24 bytes) listing its element buffer and 3 string bodies (issue 23), with
    the sizes the program asked for; one more block untracked."""
    head = listing(0x1000, 24, S1, (5, 352), [])
    s2 = [Frame(pc=0x401999, module="/usr/bin/app", build_id="ab12", offset=0x998,
                function="make_name", file="/src/names.cc", line=9)]
    blocks = [(0x1100, 136, 128, S1), (0x1200, 56, 41, S2), (0x1300, 56, 41, S2),
              (0x1400, 56, 41, S2), (0x1500, 48, None, None)]
    head.indirect = []
    for addr, size, requested, stack in blocks:
        b = leak(addr, size, stack, status="recorded" if stack else "untracked")
        b.requested_size = requested
        b.backtrace = frames_s1() if stack is S1 else s2 if stack else []
        head.indirect.append(b)
    head.num_indirect, head.indirect_size = 6, 136 + 3 * 56 + 48 + 64     # one more unlisted
    head.requested_size, head.backtrace = 24, frames_s1()
    buf = leak(0x2000, 88, S2)
    buf.requested_size, buf.backtrace = 79, s2
    return [head, buf]


def test_text_requested_sizes_and_indirect_leaks_by_stack():
    info = info_for(indirect_sample(), tracking={"version": 2})
    assert body(format_text(info))[:16] == [
        "  24 bytes unreachable at 1000",
        "   referencing 352 unreachable bytes in 5 allocations",
        "   #0 0x401234 in make_node /src/list.c:42 (/usr/bin/app+0x1233)",
        "   #1 0x401300 in main /src/main.c:7 (/usr/bin/app+0x12ff)",
        "   indirect: 128 bytes (136 usable) in 1 allocation at 1100",
        "   #0 0x401234 in make_node /src/list.c:42 (/usr/bin/app+0x1233)",
        "   #1 0x401300 in main /src/main.c:7 (/usr/bin/app+0x12ff)",
        "   indirect: 123 bytes (168 usable) in 3 allocations at 1200, 1300, 1400",
        "   #0 0x401999 in make_name /src/names.cc:9 (/usr/bin/app+0x998)",
        "   indirect: 48 bytes in 1 allocation at 1500",
        "   no stack recorded (allocated before tracking / not tracked)",
        "   indirect: 1 more allocation not listed",
        "",
        "  79 bytes (88 usable) unreachable at 2000",
        "   #0 0x401999 in make_name /src/names.cc:9 (/usr/bin/app+0x998)",
        "",
    ]


def test_json_requested_sizes_and_indirect_leaks_round_trip():
    info = info_for(indirect_sample())
    obj = render_json(info)
    head = obj["leaks"][0]
    assert (head["requested_size"], head["num_indirect"], head["indirect_size"]) == (24, 6, 416)
    assert [(b["address"], b["size"], b["requested_size"], b["stack_status"])
            for b in head["indirect"]] == [
        (0x1100, 136, 128, "recorded"), (0x1200, 56, 41, "recorded"),
        (0x1300, 56, 41, "recorded"), (0x1400, 56, 41, "recorded"),
        (0x1500, 48, None, "untracked")]
    assert head["indirect"][1]["backtrace"][0]["function"] == "make_name"
    assert obj["leaks"][1]["requested_size"] == 79
    assert obj["groups"][0]["num_allocations"] + obj["groups"][1]["num_allocations"] == 8
    back = load_json(json.loads(json.dumps(obj)))
    assert back.leaks[0].indirect[0].backtrace == frames_s1()
    assert render_json(back) == obj and format_text(back) == format_text(info)


def test_a_leaks_address_is_an_int_that_holds_nothing():
    # an exact int holding a native block's address is its handle (mu_types.h MU_TYPE_INT):
    # a report kept through the next in-process check must not keep its leaks reachable
    import pickle
    from memunreachable.reporters.report import Address
    leak = Leak(0x7F00_0000_1000, 64)
    assert type(leak.address) is Address and leak.address == 0x7F00_0000_1000
    assert type(pickle.loads(pickle.dumps(leak)).address) is Address
    assert (repr(leak.address), json.dumps(leak.address), f"{leak.address:#x}") == \
        (repr(0x7F00_0000_1000), "139637976731648", "0x7f0000001000")
