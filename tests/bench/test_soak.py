"""benchmarks/soak.py, shortened: the real app with 2 engine replicas under load while the chaos task
kills the router actor and then engine replicas. Nothing may fail, hang or leak."""
import pytest

from benchmarks import soak

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_short_chaos_soak_ends_every_request_and_leaks_nothing():
    [result] = soak.main(["--requests", "150", "--clients", "16", "--replicas", "2", "--kill-every-s", "30",
                          "--router-kill-at-s", "10", "--deadline-s", "120", "--runs", "chaos"])
    assert result.problems == []
    assert result.kills[0] == "router actor" and result.kills[1].startswith("engine replica")
    assert result.count("completed") + result.count("dropped") + result.count("gave_up") == 150
    assert result.count("completed") >= 100
