"""Unit tests of demangle.py: C++ through __cxa_demangle, Rust legacy by rustc-demangle's
rules, Rust v0 through c++filt, GCC clone suffixes dropped."""
import shutil

import pytest

from memunreachable import demangle as S


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
