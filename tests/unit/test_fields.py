"""Unit tests of _types.Fields / FrozenFields: the plain classes that replaced @dataclass in the
pipeline (issue 10, fast start) behave as the dataclasses did."""
import importlib
import inspect
import pickle

import pytest

from memunreachable._types import Fields, FrozenFields, Mapping, Range, ThreadState, record, set_fields

MODULES = ("sweep.classify", "sweep.detect", "collect.diagnose", "stacks.elf", "sweep.folding",
           "collect.freeze", "collect.leftovers", "collect.preflight", "collect.procfs",
           "collect.seccomp", "collect.snapshot", "stacks.suppressions", "sweep.sweeper",
           "stacks.symbolize", "stacks.tracking", "unreachable", "deferred", "sweep.retake",
           "sweep.steps", "heaps.glibc.freelists", "heaps.glibc.layout", "heaps.glibc.locate",
           "heaps.glibc.validate", "heaps.glibc.walker")


def _all_fields_classes():
    for name in MODULES:
        importlib.import_module(f"memunreachable.{name}")
    out, todo = [], [Fields]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if sub is not FrozenFields and sub.__module__.startswith("memunreachable."):
                out.append(sub)
    return sorted(out, key=lambda c: (c.__module__, c.__qualname__))


@pytest.mark.parametrize("cls", _all_fields_classes(),
                         ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_init_takes_the_fields_in_slots_order(cls):
    # set_fields and __reduce__ rely on it; a field missing from __init__ would stay unset
    params = list(inspect.signature(cls.__init__).parameters)[1:]
    assert params == list(cls._fields) == list(cls.__slots__)
    assert "__dict__" not in dir(cls)


def test_equality_repr_and_hash_like_a_dataclass():
    a = Mapping(0x1000, 0x2000, "rw-p", 0, "00:00", 0, "")
    b = Mapping(begin=0x1000, end=0x2000, perms="rw-p", offset=0, dev="00:00", inode=0, path="")
    assert a == b and a is not b and hash(a) == hash(b)
    assert a != a._replace(path="[heap]") and a._replace(path="[heap]").path == "[heap]"
    assert repr(a) == ("Mapping(begin=4096, end=8192, perms='rw-p', offset=0, dev='00:00', "
                       "inode=0, path='')")
    assert Range(1, 2) != (1, 2) and Range(1, 2) != ThreadState(1, 2)
    assert len({Range(1, 2), Range(1, 2), Range(2, 3)}) == 2


def test_frozen_fields_refuse_assignment_and_pickle_by_value():
    t = ThreadState(7, (1, 2, 3))
    with pytest.raises(AttributeError, match="cannot assign to field 'tid'"):
        t.tid = 8
    with pytest.raises(AttributeError, match="cannot delete field 'tid'"):
        del t.tid
    assert t.fpregs == b"" and t.stop_signal == 0
    assert pickle.loads(pickle.dumps(t)) == t


def test_mutable_fields_are_unhashable_and_get_fresh_defaults():
    from memunreachable.sweep.sweeper import SweepEntry, SweepResult
    r1, r2 = SweepResult(), SweepResult()
    r1.entries.append(SweepEntry(0x10, 32, 0, 0, b"x"))
    assert r2.entries == [] and r1 != r2
    with pytest.raises(TypeError, match="unhashable"):
        hash(r1)
    copy = pickle.loads(pickle.dumps(r1))
    assert copy == r1 and copy.entries[0].contents == b"x"


def test_range_orders_like_its_tuple():
    rs = [Range(5, 6), Range(1, 9), Range(1, 3)]
    assert sorted(rs) == [Range(1, 3), Range(1, 9), Range(5, 6)]
    assert Range(1, 3) < Range(1, 9) <= Range(1, 9) and Range(5, 6) > Range(1, 9) >= Range(1, 9)
    with pytest.raises(TypeError):
        Range(1, 2) < (1, 3)


def test_private_fields_are_left_out_of_the_repr():
    from memunreachable.collect.snapshot import Snapshot
    snap = Snapshot(pid=12, target_pid=11, mode="clone")
    assert repr(snap).startswith("Snapshot(pid=12, target_pid=11, mode='clone', reason=''")
    assert "_fz" not in repr(snap) and snap._created > 0


def test_a_subclass_adds_its_fields_after_its_bases():
    class Point(FrozenFields):
        __slots__ = ("x", "y")

        def __init__(self, x, y):
            set_fields(self, x, y)

    class Point3(Point):
        __slots__ = ("z",)

        def __init__(self, x, y, z=0):
            set_fields(self, x, y, z)

    class Loose(Point):         # no __slots__: a __dict__ for its own attributes
        def __init__(self, x, y, note):
            super().__init__(x, y)
            self.__dict__["note"] = note

    p = Point3(1, 2, 3)
    assert (p.x, p.y, p.z) == (1, 2, 3) and p._astuple() == (1, 2, 3)
    assert repr(p).endswith("Point3(x=1, y=2, z=3)") and p._replace(z=4).z == 4
    assert Point(5, 6) == Point(5, 6) and Point(5, 6) != p and p.__reduce__()[1] == (1, 2, 3)
    loose = Loose(1, 2, "n")
    assert loose._astuple() == (1, 2) and loose.note == "n"


@record
class Rec:
    a: int
    b: int = 2
    c: str = "x"

    @property
    def total(self) -> int:
        return self.a + self.b


def test_record_is_a_frozen_dataclass():
    r = Rec(1, c="y")
    assert (r.a, r.b, r.c, r.total) == (1, 2, "y", 3)
    assert r == Rec(a=1, b=2, c="y") and r != Rec(1, 3, "y") and hash(r) == hash(Rec(1, 2, "y"))
    assert repr(r) == "Rec(a=1, b=2, c='y')"
    assert pickle.loads(pickle.dumps(r)) == r
    assert list(inspect.signature(Rec.__init__).parameters) == ["self", "a", "b", "c"]
    with pytest.raises(AttributeError):
        r.a = 5
    for bad in (lambda: Rec(), lambda: Rec(1, 2, "z", 4), lambda: Rec(1, a=1), lambda: Rec(1, d=0)):
        with pytest.raises(TypeError):
            bad()
