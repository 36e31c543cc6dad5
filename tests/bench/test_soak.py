"""benchmarks/soak.py: its chaos schedule; and the soak shortened, the real app with 2 engine replicas under load
while the chaos task kills the router actor and then engine replicas. Nothing may fail, hang or leak."""
import pytest

from benchmarks import soak


def due_kills(chaos: soak.Chaos) -> list[str]:
    kills = []
    while (kill := chaos.due_kill()) is not None:
        kills.append(getattr(kill, "func", kill).__name__)
    return kills


def test_chaos_kills_at_a_count_of_ended_requests_or_in_time_whichever_comes_first():
    args = soak.parse_args(["--kill-every-s", "60", "--kill-every-requests", "3", "--router-kill-at-requests", "2"])
    num_ended = 0
    chaos = soak.Chaos(args, lambda: num_ended)
    schedule = []
    for num_ended in range(1, 8):
        schedule.append(due_kills(chaos))
    assert schedule == [[], ["kill_router"], ["kill_engine_replica"], [], [], ["kill_engine_replica"], []]
    chaos.started -= 180  # the third kill's time comes before its count (9)
    assert due_kills(chaos) == ["kill_engine_replica"]
    num_ended = 11
    assert due_kills(chaos) == []
    num_ended = 12
    assert due_kills(chaos) == ["kill_engine_replica"]


def test_by_default_chaos_kills_by_time_only():
    num_ended = 10 ** 6
    chaos = soak.Chaos(soak.parse_args(["--kill-every-s", "60"]), lambda: num_ended)
    assert due_kills(chaos) == []
    chaos.started -= 60
    assert due_kills(chaos) == ["kill_engine_replica"]
    chaos.started -= 30  # the router at 1.5 x 60 s
    assert due_kills(chaos) == ["kill_router"]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_short_chaos_soak_ends_every_request_and_leaks_nothing():
    # by progress, not time, so that every kill happens however fast the machine serves the 150 requests
    [result] = soak.main(["--requests", "150", "--clients", "16", "--replicas", "2", "--kill-every-s", "inf",
                          "--kill-every-requests", "60", "--router-kill-at-requests", "20", "--deadline-s", "120",
                          "--runs", "chaos"])
    assert result.problems == []
    router_kill, *engine_kills = result.kills
    assert router_kill == "router actor"
    assert len(engine_kills) == 2 and all(kill.startswith("engine replica ") for kill in engine_kills)
    assert result.count("completed") + result.count("dropped") + result.count("gave_up") == 150
    assert result.count("completed") >= 100
