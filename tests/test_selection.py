"""How tox's runs pick and place the tests (tests/conftest.py): the bench modules said to
time nothing exist, and the last run's lanes keep chromium's tests together, one at a
time, and each other file's tests on one worker."""

from __future__ import annotations

from tests.conftest import TESTS, UNTIMED_BENCH, _Lanes


def test_every_module_named_untimed_exists() -> None:
    missing = sorted(s for s in UNTIMED_BENCH if not (TESTS / "bench" / f"{s}.py").is_file())
    assert missing == []


def test_chromium_tests_share_one_lane_and_every_other_file_has_its_own() -> None:
    lanes = _Lanes.__new__(_Lanes)  # the scope of a test is read from its id alone
    scope = lanes._split_scope
    player = scope("tests/player/test_player.py::test_plays_live")
    assert player == scope("tests/player/test_player_keys.py::test_keys[d]")
    assert player == scope("tests/security/test_security_headers.py::test_csp")
    assert player == scope("tests/bench/test_bench_glass.py::test_the_page_measures")
    bench = scope("tests/bench/test_bench.py::test_report")
    assert bench == scope("tests/bench/test_bench.py::test_figures[x]")
    assert bench != scope("tests/bench/test_soak.py::test_short_soak")
    assert player not in {bench, scope("tests/security/test_limits.py::test_a")}
