"""MD's reservation ids: fresh per grant, Release names the right request, stale ids release nothing."""

from __future__ import annotations

from pddlink.drc.reservations import ReservationIds


def test_each_grant_gets_its_own_id_and_release_names_its_request() -> None:
    book = ReservationIds()
    a, b = book.grant("r1"), book.grant("r2")
    assert a != b and a > 0 and b > 0
    assert book.release(b) == "r2" and book.release(a) == "r1"
    assert book.release(a) is None  # twice: nothing left


def test_a_superseded_id_releases_nothing() -> None:
    book = ReservationIds()
    old = book.grant("r1")
    new = book.grant("r1")  # the same request reserved again (a retry)
    assert book.release(old) is None
    assert book.release(new) == "r1"


def test_the_book_is_bounded_oldest_forgotten_first() -> None:
    book = ReservationIds(max_ids=2)
    first = book.grant("a")
    book.grant("b")
    third = book.grant("c")
    assert book.release(first) is None and book.release(third) == "c"
