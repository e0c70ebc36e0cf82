"""Unit tests of demangle.py: C++ through __cxa_demangle, Rust legacy by rustc-demangle's
rules, Rust v0 through c++filt, GCC clone suffixes dropped."""
import shutil

import pytest

from memunreachable.stacks import demangle as S


@pytest.mark.parametrize("mangled, plain", [
    ("_ZN6shapes5StoreIiE3putERKi", "shapes::Store<int>::put(int const&)"),
    ("_ZN6shapes5StoreIiE3putERKi.isra.0", "shapes::Store<int>::put(int const&)"),
    ("_ZNKSt6vectorIiSaIiEE4sizeEv", "std::vector<int, std::allocator<int> >::size() const"),
    ("_Znwm", "operator new(unsigned long)"),
    ("_ZN1r5leafy17h38fae256fe66e4c4E", "r::leafy"),
    ("_ZN4core3ptr85drop_in_place$LT$std..rt..lang_start$LT$$LP$$RP$$GT$..$u7b$$u7b$closure"
     "$u7d$$u7d$$GT$17h0123456789abcdefE",
     "core::ptr::drop_in_place<std::rt::lang_start<()>::{{closure}}>"),
    ("_ZN3std2io5stdio6_print17h0123456789abcdefE.llvm.42", "std::io::stdio::_print"),
    ("msort_with_tmp.part.0", "msort_with_tmp"),
    ("main", "main"),
])
def test_demangle(mangled, plain):
    assert S.demangle(mangled) == plain


def test_demangle_rust_v0_through_cxxfilt():
    assert shutil.which("c++filt"), "binutils' c++filt is needed: apt-get install binutils"
    # the crate disambiguators c++filt prints (r[...]) are dropped, as the legacy hash is
    assert S.demangle("_RNvCs6GmmlP4bgsG_1r5leafy") == "r::leafy"
    assert S.demangle("_RNvCs3ZLWLHzac9D_8leaky_rs9make_leak") == "leaky_rs::make_leak"
    # a slice type's brackets stay (c++filt: <&[u8] as object[4f4cc23e276cbdd5]::read::...>)
    assert S.demangle("_RNvXNtNtCs6O6TnIPaRGP_6object4read8read_refRShNtB2_7ReadRef19read_"
                      "bytes_at_until") == \
        "<&[u8] as object::read::read_ref::ReadRef>::read_bytes_at_until"


def test_cxxfilt_is_one_process_for_many_names():
    import re
    assert shutil.which("c++filt"), "binutils' c++filt is needed: apt-get install binutils"
    f = S._CxxFilt()
    names = ["_RNvCs6GmmlP4bgsG_1r5leafy", "not_mangled", "_RNvCs3ZLWLHzac9D_8leaky_rs9make_leak"]
    got = f.demangle(names)
    assert sorted(got) == sorted([names[0], names[2]])     # unchanged names are left out
    assert re.fullmatch(r"r\[[0-9a-f]+\]::leafy", got[names[0]])
    assert re.fullmatch(r"leaky_rs\[[0-9a-f]+\]::make_leak", got[names[2]])
    pid = f.proc.pid
    assert f.demangle([names[2]]) == {names[2]: got[names[2]]}
    assert f.proc.pid == pid                    # the same process answered every name
    f.close()
    assert f.proc is None


def test_a_cxxfilt_that_does_not_answer_is_dropped(tmp_path, monkeypatch):
    """A c++filt that never answers: names stay as they are after TIMEOUT, it is killed and
    not asked again (no hang in symbolization)."""
    import os
    import time
    fake = tmp_path / "c++filt"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    f = S._CxxFilt()
    f.TIMEOUT = 0.3
    t0 = time.monotonic()
    assert f.demangle(["_RNvCs6GmmlP4bgsG_1r5leafy"]) == {}
    assert time.monotonic() - t0 < 5
    assert f.broken and f.proc is None
    assert f.demangle(["_RNvCs6GmmlP4bgsG_1r5leafy"]) == {}
