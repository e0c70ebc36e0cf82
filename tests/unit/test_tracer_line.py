"""_tracer's "go" line: the DEAD ranges word, on in-memory text."""
from memunreachable._tracer import format_ranges, parse_ranges
from memunreachable.sweep.mark import DeadWords, with_dead_ranges


def test_dead_ranges_round_trip_aligned_inwards():
    assert format_ranges([]) == "-" and parse_ranges("-") == []
    text = format_ranges([(0x1000, 0x5000), (0x7003, 0x700f)])
    assert text == "1000-5000,7003-700f"
    # 0x7003-0x700f holds no whole aligned word: dropped
    assert parse_ranges(text) == [(0x1000, 0x5000)]
    assert parse_ranges("1001-2007") == [(0x1008, 0x2000)]


def test_with_dead_ranges_merges_into_the_mask():
    dead = with_dead_ranges(DeadWords(ranges=[(0x1000, 0x1010)]), [(0x1008, 0x1100), (0x3000, 0x3008)])
    assert list(dead.ranges) == [(0x1000, 0x1100), (0x3000, 0x3008)]
    assert with_dead_ranges(None, []) is None


def test_helper_env_caches_bytecode_in_our_own_directory_when_writing_is_off(tmp_path):
    from memunreachable.noleaks import helper_env
    env = {"PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(tmp_path), "PATH": "/bin"}
    out = helper_env(env)
    prefix = tmp_path / "memunreachable" / "pycache"
    assert out == {"XDG_CACHE_HOME": str(tmp_path), "PATH": "/bin",
                   "PYTHONPYCACHEPREFIX": str(prefix)}
    assert prefix.is_dir()
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"        # the caller's environment is unchanged
    # bytecode is written anyway, the user chose a prefix, or disk caches are off: ours
    assert helper_env({"XDG_CACHE_HOME": str(tmp_path)}) is None
    assert helper_env(dict(env, PYTHONPYCACHEPREFIX="/elsewhere")) is None
    assert helper_env(dict(env, MEMUNREACHABLE_SYMCACHE_DIR="")) is None
    # a cache directory that cannot be made: ours
    (tmp_path / "file").write_text("")
    assert helper_env(dict(env, XDG_CACHE_HOME=str(tmp_path / "file"))) is None
