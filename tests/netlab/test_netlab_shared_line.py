"""``SharedLine`` in memory: flows sharing one direction's rate and queue, driven by a fake clock."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from netlab.shared_line import SharedLine
from pddlink.errors import InvalidInput

RATE = 1_000_000.0  # bytes/s: an 8 Mbit/s line
QUEUE = 300_000
QUANTUM = 16_384


def drive(
    line: SharedLine, offers: dict[int, float], until_s: float, stalled_after: dict[int, int] | None = None
) -> tuple[dict[int, int], list[int]]:
    """Run the line to ``until_s`` with each flow offering as much as it may (``offers[flow]``: the
    bytes it has in all, inf: a sender that never runs out; ``stalled_after``: a flow whose pump
    stops once it has offered that many, as when its receiver stops reading). Bytes that left the
    line per flow, and the queue's size after every step."""
    left = dict(offers)
    stop = stalled_after or {}
    offered: dict[int, int] = defaultdict(int)
    sent: dict[int, int] = defaultdict(int)
    queued: list[int] = []
    now = 0.0
    while now <= until_s:
        for flow in left:
            cap = min(left[flow], stop.get(flow, float("inf")) - offered[flow])
            if cap <= 0:
                continue
            room = line.room(flow)
            if room:
                n = int(min(room, cap))
                line.offer(flow, n, now)
                left[flow] -= n
                offered[flow] += n
            else:
                line.want(flow)
        for s in line.advance(now):
            assert s.leave_s >= now
            if s.leave_s <= until_s:
                sent[s.flow] += s.nbytes
        queued.append(line.queued_bytes)
        nxt = line.next_s()
        now = nxt if nxt is not None and nxt > now else now + 0.001
    return sent, queued


def test_one_flow_alone_gets_the_full_rate() -> None:
    line = SharedLine(RATE, QUEUE, QUANTUM)
    a = line.open()
    sent, _ = drive(line, {a: float("inf")}, 5.0)
    assert abs(sent[a] - 5 * RATE) <= QUANTUM


def test_two_flows_each_get_half() -> None:
    line = SharedLine(RATE, QUEUE, QUANTUM)
    a, b = line.open(), line.open()
    sent, _ = drive(line, {a: float("inf"), b: float("inf")}, 5.0)
    assert abs(sent[a] - 2.5 * RATE) <= 2 * QUANTUM
    assert abs(sent[b] - 2.5 * RATE) <= 2 * QUANTUM
    assert sent[a] + sent[b] <= 5 * RATE + QUANTUM  # together, never more than the line


def test_a_late_flow_gets_its_share_of_a_full_queue() -> None:
    """A flow that arrives while another holds the whole queue still gets half the line soon."""
    line = SharedLine(RATE, QUEUE, QUANTUM)
    a = line.open()
    drive(line, {a: float("inf")}, 2.0)
    if line.room(a):
        line.offer(a, line.room(a), 2.0)
    assert line.queued_bytes == QUEUE
    b = line.open()
    assert line.room(b) == 0  # the queue is full: b waits, and counts as contending
    line.want(b)
    assert line.room(a) == 0  # a is over its share now
    start = line.next_s()
    assert start is not None
    line.advance(start)
    assert line.room(b) > 0


def test_a_stalled_reader_does_not_block_the_other_flow() -> None:
    line = SharedLine(RATE, QUEUE, QUANTUM)
    a, b = line.open(), line.open()
    sent, _ = drive(line, {a: float("inf"), b: float("inf")}, 5.0, stalled_after={a: 100_000})
    assert sent[a] == 100_000  # what it offered left, then nothing
    assert sent[b] >= 5 * RATE - 100_000 - QUANTUM


def test_a_finite_flow_ends_and_the_other_takes_the_line() -> None:
    line = SharedLine(RATE, QUEUE, QUANTUM)
    a, b = line.open(), line.open()
    sent, _ = drive(line, {a: 1_000_000, b: float("inf")}, 4.0)
    assert sent[a] == 1_000_000
    assert abs(sent[a] + sent[b] - 4 * RATE) <= 2 * QUANTUM


@pytest.mark.parametrize("flows", [1, 2, 5, 40])
def test_the_queue_bound_holds(flows: int) -> None:
    line = SharedLine(RATE, QUEUE, QUANTUM)
    ids = [line.open() for _ in range(flows)]
    _, queued = drive(line, dict.fromkeys(ids, float("inf")), 3.0)
    assert max(queued) <= max(QUEUE, flows * QUANTUM)
    assert max(queued) >= min(QUEUE, flows * QUANTUM) - QUANTUM  # and the queue does fill


def test_the_bound_holds_under_random_offers_and_closes() -> None:
    rng = random.Random(7)
    line = SharedLine(RATE, QUEUE, QUANTUM)
    open_flows = [line.open() for _ in range(3)]
    now = 0.0
    for _ in range(5000):
        if rng.random() < 0.02:
            open_flows.append(line.open())
        if len(open_flows) > 1 and rng.random() < 0.015:
            line.close(open_flows.pop(rng.randrange(len(open_flows))))
        flow = rng.choice(open_flows)
        room = line.room(flow)
        if room:
            line.offer(flow, rng.randint(1, room), now)
        else:
            line.want(flow)
        line.advance(now)
        assert line.queued_bytes <= max(QUEUE, len(open_flows) * QUANTUM)
        assert line.queued_bytes == sum(line.pending(f) for f in open_flows)
        now += rng.expovariate(200.0)


def test_an_outage_sends_nothing_and_earns_no_credit() -> None:
    line = SharedLine(RATE, QUEUE, QUANTUM)
    a = line.open()
    line.offer(a, QUEUE, 0.0)
    first = line.advance(0.0)
    assert [s.nbytes for s in first] == [QUANTUM]
    assert line.advance(1.0, cut=True) == []
    after = line.advance(1.0)
    assert sum(s.nbytes for s in after) == QUANTUM  # one piece at the end of the cut, not a second's worth
    assert after[0].leave_s == pytest.approx(1.0 + QUANTUM / RATE)


def test_headers_are_charged_on_the_wire() -> None:
    line = SharedLine(RATE, QUEUE, 14_480, segment_bytes=1448, header_bytes=52)
    a = line.open()
    line.offer(a, 14_480, 0.0)
    (s,) = line.advance(0.0)
    assert s.leave_s == pytest.approx(15_000 / RATE)


def test_an_unlimited_line_sends_everything_at_once() -> None:
    line = SharedLine(0.0, QUEUE, QUANTUM)
    a, b = line.open(), line.open()
    line.offer(a, 50_000, 3.0)
    line.offer(b, 70_000, 3.0)
    sent = sorted((s.flow, s.nbytes, s.leave_s) for s in line.advance(3.0))
    assert sent == [(a, 50_000, 3.0), (b, 70_000, 3.0)]
    assert line.next_s() is None


def test_offers_past_the_room_and_bad_settings_are_refused() -> None:
    line = SharedLine(RATE, QUEUE, QUANTUM)
    a = line.open()
    with pytest.raises(InvalidInput):
        line.offer(a, QUEUE + 1, 0.0)
    with pytest.raises(InvalidInput):
        line.offer(a, 0, 0.0)
    with pytest.raises(InvalidInput):
        SharedLine(-1.0, QUEUE, QUANTUM)
    with pytest.raises(InvalidInput):
        SharedLine(RATE, 0, QUANTUM)
