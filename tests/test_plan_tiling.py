"""engine_plan._first_overlap, the engine-shard plan's tiling check (no byte routed twice): a sort-and-sweep along one
dim that must find an overlapping pair exactly when the pairwise scan does."""

import random

from mcore2hf.layouts.pieces import Piece
from mcore2hf.plan.engine import _first_overlap, _meet


def _pairwise(ps):
    return next(((a, b) for i, a in enumerate(ps) for b in ps[i + 1:] if _meet(a, b)), None)


def test_first_overlap_equals_pairwise_scan_random_2d_progressions_steps_1_2_up_to_8_pieces():
    rng = random.Random(0)
    found = 0
    for _ in range(2000):
        ps = [Piece(0, 0, (rng.randrange(20), rng.randrange(20)), (rng.choice([1, 2]), rng.choice([1, 2])),
                    (rng.randrange(1, 6), rng.randrange(1, 6)), (1, 1), 0) for _ in range(rng.randrange(9))]
        got, want = _first_overlap(ps), _pairwise(ps)
        assert (got is None) == (want is None), ps
        if got is not None:
            assert _meet(*got)
            found += 1
    assert 200 < found < 1800  # both outcomes are exercised


def test_first_overlap_4000_row_pieces_of_4000x64_tile_then_one_duplicate():
    ps = [Piece(0, 0, (i, 0), (1, 1), (1, 64), (64, 1), 0) for i in range(4000)]
    assert _first_overlap(ps) is None  # pairwise: 8M comparisons (~40 s here), the sweep: 4000
    # interleaved halves (GatedInterleaved's step-2 rows) tile too; one row sent twice is found
    assert _first_overlap([Piece(0, 0, (0, 0), (2, 1), (50, 4), (4, 1), 0),
                           Piece(0, 1, (1, 0), (2, 1), (50, 4), (4, 1), 0)]) is None
    dup = Piece(0, 1, (1234, 0), (1, 1), (1, 64), (64, 1), 0)
    assert _first_overlap(ps + [dup]) == (ps[1234], dup)
