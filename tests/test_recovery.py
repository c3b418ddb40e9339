"""Who gives a re-formed ring its state, and from which point (state.recovery), as a table."""

import pytest

from state.recovery import CONSISTENT, DIRTY, WHOLE, Mode, RankStatus, decide_sync, failure_trust


def S(holds=True, trust=CONSISTENT, version=10, commit=8):
    return RankStatus(holds, trust, version, commit)


@pytest.mark.parametrize("ranks, root, mode", [
    # a fresh job (or every rank a joiner): rank 0, which resumes from a checkpoint if there is one
    ([S(holds=False), S(holds=False)], 0, Mode.FRESH),
    # a join or a drain: every holder is consistent and equal; the joiner receives
    ([S(), S(), S(holds=False)], 0, Mode.LIVE),
    ([S(holds=False), S(), S()], 1, Mode.LIVE),
    # a failure in the gradient reduction: nobody applied it; live state, no rollback
    ([S(trust=WHOLE), S(trust=WHOLE)], 0, Mode.LIVE),
    # the ring broke after rank 1 applied step 11 while rank 0 did not: rank 1's newer live state wins
    ([S(trust=WHOLE, version=10), S(trust=WHOLE, version=11)], 1, Mode.LIVE),
    # rank 0 applied the step but failed in a user collective before its bookkeeping (dirty);
    # rank 1 is whole but one step behind: the whole one wins, rank 0's half-done step is discarded
    ([S(trust=DIRTY, version=11), S(trust=WHOLE, version=10)], 1, Mode.LIVE),
    # every holder dirty: roll back to the newest commit
    ([S(trust=DIRTY, version=11, commit=8), S(trust=DIRTY, version=11, commit=9)], 1, Mode.ROLLBACK),
    ([S(trust=DIRTY, commit=9), S(trust=DIRTY, commit=9), S(holds=False)], 0, Mode.ROLLBACK),
    # a joiner never roots, even with a large version
    ([S(holds=False, version=99), S(trust=WHOLE, version=10)], 1, Mode.LIVE),
])
def test_decide_sync(ranks, root, mode):
    decision = decide_sync(ranks)
    assert (decision.root, decision.mode) == (root, mode)


def test_rows_round_trip_and_bad_codes():
    s = S(trust=DIRTY, version=12, commit=3)
    assert RankStatus.from_row(s.as_row()) == s
    with pytest.raises(ValueError, match="trust code"):
        RankStatus.from_row([1, 7, 0, 0])


@pytest.mark.parametrize(
    "linked, surfaced_whole, inside_apply, expected",
    [
        (True, True, False, WHOLE),     # linked: a gradient bucket, the step's check, a commit, a sync
        (True, False, False, WHOLE),    # linked: the loop's own collective (a loss log, a "have a batch" flag)
        (False, True, False, WHOLE),    # unlinked: where the state is whole whatever the loop
        (False, False, False, DIRTY),   # unlinked: the loop's own collective may sit inside its bookkeeping
        (True, False, True, DIRTY),     # inside the wrapped optimizer's own step(): half applied
        (False, True, True, DIRTY),
    ],
)
def test_failure_trust(linked, surfaced_whole, inside_apply, expected):
    assert failure_trust(linked, surfaced_whole, inside_apply) == expected
