"""A tensor record's lifecycle alone (lifecycle.py, records.py): every legal move lands
where the table says, every other move from every phase is refused and changes nothing,
each move is reported once, and a retired record's bytes go with its last pin only."""

from __future__ import annotations

import itertools

import pytest

from tierstack.services.tier_manager.lifecycle import LifecycleError, Phase, TensorRecord
from tierstack.services.tier_manager.records import Records

I, L, C, U, V, R = (Phase.IDLE, Phase.LOADING, Phase.CLAIMED, Phase.UPDATING, Phase.LEAVING,
                    Phase.RETIRED)

# move -> {phase it may come from: the phase it lands in}; pins: the pins it needs there.
MOVES = {
    "start_loading": ({I: L}, 1),
    "end_loading": ({L: I, R: R}, 1),
    "claim": ({I: C}, 1),
    "drop_claim": ({C: I, R: R}, 1),
    "start_update": ({C: U}, 1),
    "end_update": ({U: I, R: R}, 1),
    "start_leaving": ({I: V}, 0),
    "end_leaving": ({V: I, R: R}, 0),
    "retire": ({I: R, L: R, C: R, U: R, V: R}, 0),
    "pin": ({I: I, V: V}, 0),
    "unpin": ({p: p for p in Phase}, 1),
}
# Pin counts a move refuses even from a phase it comes from.
REFUSED_PINS = {"start_loading": [0], "claim": [0, 2], "start_leaving": [1, 3], "unpin": [0]}


def record(phase: Phase, pins: int, seen: list | None = None) -> TensorRecord:
    observer = (lambda r, old, new: seen.append((old, new))) if seen is not None else None
    return TensorRecord("job/t", "float32", (4,), 16, 7, phase=phase, pins=pins, observer=observer)


CASES = [(move, phase) for move, phase in itertools.product(MOVES, Phase)]


@pytest.mark.parametrize("move,phase", CASES, ids=[f"{m}-from-{p.value}" for m, p in CASES])
def test_every_move_from_every_phase(move, phase):
    table, pins = MOVES[move]
    seen: list = []
    r = record(phase, pins, seen)
    if phase in table:
        getattr(r, move)()
        assert r.phase is table[phase]
        assert r.pins == pins + {"pin": 1, "unpin": -1}.get(move, 0)
        assert seen == [(phase, table[phase])]  # reported once: the one place waiters hear of it
    else:
        with pytest.raises(LifecycleError, match=f"is {phase.value}"):
            getattr(r, move)()
        assert (r.phase, r.pins, seen) == (phase, pins, [])  # refused: nothing changed


@pytest.mark.parametrize("move,pins", [(m, n) for m, counts in REFUSED_PINS.items() for n in counts])
def test_moves_that_need_a_pin_count_refuse_any_other(move, pins):
    table, _ = MOVES[move]
    phase = next(iter(table))
    r = record(phase, pins)
    with pytest.raises(LifecycleError, match="pins"):
        getattr(r, move)()
    assert (r.phase, r.pins) == (phase, pins)


def test_a_whole_update_and_an_eviction_walk_the_table():
    r = record(I, 0)
    r.pin()
    r.claim()
    r.start_update()
    r.end_update()
    r.unpin()
    r.start_leaving()
    r.pin()  # a reader during the eviction: it keeps the CPU copy
    r.end_leaving()
    assert (r.phase, r.pins) == (I, 1)


def test_a_retired_record_is_freed_with_its_last_pin_and_never_before():
    freed = []
    records = Records(freed.append)
    old = records.new("job/t", "float32", (4,), 16, 1)
    records.swap(old)
    with records.lock:
        old.pin()
    records.swap(records.new("job/t", "float32", (4,), 16, 2))  # replaced while read
    assert old.phase is R and freed == []
    records.unpin(old)
    assert freed == [old]
    new = records.get("job/t")
    records.remove(new)  # deleted unpinned: freed at once
    assert freed == [old, new] and records.find("job/t") is None


def test_the_map_knows_which_records_are_passing_without_a_walk():
    records = Records(lambda r: None)
    r = records.new("job/t", "float32", (4,), 16, 1)
    records.swap(r)
    with records.lock:
        r.pin()
        r.claim()
        assert records.in_phase(C) == [r] and records.in_phase(U) == []
        r.start_update()
        assert records.in_phase(C) == [] and records.in_phase(U) == [r]
        r.end_update()
        assert records.in_phase(U) == []
