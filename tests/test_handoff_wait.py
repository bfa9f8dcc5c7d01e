"""``HandoffWait`` and ``HandoffPolicy`` (strata_jax/engine/handoff.py): when a decode replica
stops waiting for a prompt's pages, against a fake L3 and a fake clock."""

from __future__ import annotations

import math

import pytest

from strata_jax.engine.handoff import HandoffPolicy, HandoffWait


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _wait(landed: list[int], wanted: int = 10, deadline: float = 5.0, stall: float = 1.0) -> tuple[HandoffWait, _Clock]:
    clock = _Clock()
    return HandoffWait(lambda _start: landed[0], wanted, landed[0], deadline, stall, clock), clock


def test_complete_once_every_page_landed():
    landed = [0]
    wait, clock = _wait(landed)
    assert wait.poll() is None
    clock.now += 0.5
    landed[0] = 10
    result = wait.poll()
    assert result is not None and result.outcome == "complete" and not result.fell_back
    assert (result.wanted_pages, result.landed_pages, result.waited_s) == (10, 10, 0.5)
    landed[0] = 0  # the result stays what it was
    assert wait.poll() is result


def test_no_stall_before_the_first_page_only_the_deadline():
    landed = [0]
    wait, clock = _wait(landed, deadline=5.0, stall=1.0)
    for _ in range(4):  # 4 s of nothing: a long prefill writes its pages when it ends
        clock.now += 1.0
        assert wait.poll() is None
    clock.now += 1.0
    result = wait.poll()
    assert result is not None and result.outcome == "deadline" and result.fell_back
    assert result.landed_pages == 0 and result.waited_s == 5.0


def test_stalled_when_pages_stop_landing():
    landed = [0]
    wait, clock = _wait(landed, deadline=50.0, stall=1.0)
    landed[0] = 3
    assert wait.poll() is None
    clock.now += 0.9
    landed[0] = 4  # progress restarts the stall clock
    assert wait.poll() is None
    clock.now += 0.9
    assert wait.poll() is None
    clock.now += 0.2
    result = wait.poll()
    assert result is not None and result.outcome == "stalled" and result.landed_pages == 4


def test_pages_present_at_the_start_do_not_start_the_stall_clock():
    landed = [6]  # a shared document's pages, there before the wait: the new ones come when the prefill ends
    wait, clock = _wait(landed, deadline=5.0, stall=1.0)
    for _ in range(4):
        clock.now += 1.0
        assert wait.poll() is None
    landed[0] = 8
    assert wait.poll() is None
    clock.now += 0.5
    landed[0] = 10
    result = wait.poll()
    assert result is not None and result.outcome == "complete" and result.waited_s == 4.5


def test_a_count_that_goes_back_keeps_the_most_seen():
    landed = [0]
    wait, clock = _wait(landed)
    landed[0] = 6
    assert wait.poll() is None
    landed[0] = 2  # L3 evicted a page meanwhile: the engine's own probe will see it; the wait ends as stalled
    clock.now += 1.0
    result = wait.poll()
    assert result is not None and result.outcome == "stalled" and result.landed_pages == 6


def test_a_prompt_shorter_than_a_page_needs_no_wait():
    wait, _ = _wait([0], wanted=0)
    result = wait.poll()
    assert result is not None and result.outcome == "complete" and result.waited_s == 0.0


def test_policy_deadline_is_the_allowance_plus_a_multiple_of_the_predicted_prefill_capped():
    policy = HandoffPolicy(base_s=2.0, prefill_factor=3.0, max_wait_s=30.0)
    assert policy.deadline(1.5) == pytest.approx(2.0 + 4.5)
    assert policy.deadline(0.0) == 2.0
    assert policy.deadline(100.0) == 30.0
    assert policy.deadline(math.inf) == 30.0
    assert policy.deadline(math.nan) == 2.0  # no estimate: the allowance
    assert policy.deadline(-1.0) == 2.0


@pytest.mark.parametrize("field", ["base_s", "prefill_factor", "stall_s", "max_wait_s", "poll_s"])
@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_policy_refuses_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        HandoffPolicy(**{field: value})


def test_policy_refuses_a_zero_poll():
    with pytest.raises(ValueError, match="poll_s"):
        HandoffPolicy(poll_s=0.0)


def test_pages_all_there_at_the_start_end_the_wait_without_another_probe():
    calls = []

    def probe(start: int) -> int:
        calls.append(start)
        return 10

    wait = HandoffWait(probe, 10, 10, 5.0, 1.0, _Clock())
    result = wait.poll()
    assert result is not None and result.outcome == "complete" and result.landed_pages == 10
    assert calls == []  # the caller's first probe already counted them


def _peer_wait(deadline=5.0, max_wait=60.0, stall=1.0) -> tuple[HandoffWait, _Clock, list[int]]:
    clock, landed = _Clock(), [0]
    return HandoffWait(lambda _start: landed[0], 10, 0, deadline, stall, clock, max_wait_s=max_wait), clock, landed


def test_a_prefill_replica_that_holds_the_request_is_waited_for_up_to_max_wait():
    wait, clock, landed = _peer_wait(deadline=5.0, max_wait=60.0)
    wait.note_peer("in_flight")  # queued behind other prompts there: its own deadline would recompute it
    for _ in range(50):
        clock.now += 1.0
        assert wait.poll() is None
    landed[0] = 10
    result = wait.poll()
    assert result is not None and result.outcome == "complete" and result.waited_s == 50.0
    wait, clock, _ = _peer_wait(deadline=5.0, max_wait=60.0)
    wait.note_peer("in_flight")
    clock.now += 60.0
    result = wait.poll()
    assert result is not None and result.outcome == "deadline"  # never past max_wait_s


def test_a_prefill_replica_that_never_got_the_request_leaves_the_deadline_as_it_was():
    wait, clock, _ = _peer_wait(deadline=5.0, max_wait=60.0)
    wait.note_peer("unknown")
    clock.now += 4.9
    assert wait.poll() is None
    clock.now += 0.1
    result = wait.poll()
    assert result is not None and result.outcome == "deadline" and result.waited_s == pytest.approx(5.0)


@pytest.mark.parametrize("said", [["failed"], ["in_flight", "unreachable", "unreachable"], ["unreachable"] * 2])
def test_a_failed_or_dead_prefill_replica_ends_the_wait_at_once(said):
    wait, clock, landed = _peer_wait(deadline=30.0, max_wait=60.0)
    landed[0] = 2
    assert wait.poll() is None
    clock.now += 0.3
    for state in said:
        wait.note_peer(state)
    result = wait.poll()
    assert result is not None and result.outcome == "prefill_lost" and result.fell_back
    assert (result.landed_pages, result.waited_s) == (2, pytest.approx(0.3))


def test_one_unanswered_question_is_not_a_dead_replica():
    wait, clock, _ = _peer_wait(deadline=5.0, max_wait=60.0)
    wait.note_peer("in_flight")
    wait.note_peer("unreachable")  # a busy replica may miss one answer: what it said before holds
    clock.now += 10.0
    assert wait.poll() is None and wait.peer == "in_flight"
    wait.note_peer("in_flight")
    wait.note_peer("unreachable")  # not two in a row
    assert wait.poll() is None


def test_pages_that_do_not_follow_a_finished_prefill_stall_a_deadline_after_it():
    wait, clock, landed = _peer_wait(deadline=5.0, max_wait=60.0, stall=1.0)
    wait.note_peer("in_flight")
    clock.now += 3.0
    wait.note_peer("done")
    clock.now += 4.9  # past its own deadline from the start: the pages get the deadline again from "done"
    assert wait.poll() is None
    wait.note_peer("done")  # said again: the clock runs from the first time
    clock.now += 0.1
    result = wait.poll()
    assert result is not None and result.outcome == "stalled" and result.landed_pages == 0
    assert result.waited_s == pytest.approx(8.0)
    wait, clock, landed = _peer_wait(deadline=5.0, max_wait=60.0, stall=1.0)
    wait.note_peer("done")
    clock.now += 4.0
    landed[0] = 10  # they followed
    result = wait.poll()
    assert result is not None and result.outcome == "complete"
    wait, clock, landed = _peer_wait(deadline=5.0, max_wait=6.0, stall=1.0)
    clock.now += 4.0
    wait.note_peer("done")
    clock.now += 2.0
    result = wait.poll()
    assert result is not None and result.outcome == "stalled" and result.waited_s == 6.0  # max_wait_s caps it


def test_an_unknown_peer_state_is_refused():
    wait, _, _ = _peer_wait()
    with pytest.raises(ValueError, match="unknown prefill replica state"):
        wait.note_peer("busy")


def test_no_stall_while_the_prefill_replica_holds_the_room():
    wait, clock, landed = _peer_wait(deadline=5.0, max_wait=60.0, stall=1.0)
    wait.note_peer("in_flight")
    landed[0] = 3
    assert wait.poll() is None
    clock.now += 10.0  # its next chunk waits behind other prompts' chunks there
    assert wait.poll() is None
    wait.note_peer("done")
    clock.now += 4.9  # its last pages are being written: the deadline again from "done"
    assert wait.poll() is None
    clock.now += 0.1
    result = wait.poll()
    assert result is not None and result.outcome == "stalled" and result.landed_pages == 3


def test_each_probe_asks_from_the_pages_already_seen():
    starts, landed = [], [0]

    def probe(start: int) -> int:
        starts.append(start)
        return max(start, landed[0])

    clock = _Clock()
    wait = HandoffWait(probe, 10, 0, 5.0, 1.0, clock)
    assert wait.poll() is None
    landed[0] = 4
    assert wait.poll() is None
    landed[0] = 10
    result = wait.poll()
    assert result is not None and result.outcome == "complete"
    assert starts == [0, 0, 4]


def test_a_short_prompt_is_computed_here_without_a_probe():
    probes = []
    wait = HandoffWait(lambda start: probes.append(start) or 0, 3, 1, 5.0, 1.0, _Clock(), compute_here=True)
    result = wait.poll()
    assert result is not None and result.outcome == "local"
    assert (result.wanted_pages, result.landed_pages, result.waited_s) == (3, 1, 0.0)
    assert result.fell_back and not result.gave_up  # computed here, by design: not a wait that failed
    assert probes == []


@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_policy_refuses_a_bad_local_tokens(value):
    with pytest.raises(ValueError, match="local_tokens"):
        HandoffPolicy(local_tokens=value)
