"""The pure decisions of durable checkpoints, with tables: which locations, which names, what to prune."""

import pytest

from state import CheckpointConfig
from state.checkpoints.config import check_checkpoint_uri
from state.checkpoints.policy import Entry, by_age, next_sequence, parse_checkpoint_dir, plan_prune


@pytest.mark.parametrize("uri, normalized", [
    ("/data/ckpt", "/data/ckpt"), ("/data/ckpt/", "/data/ckpt"), ("file:///data/ckpt", "file:///data/ckpt"),
    ("s3://bucket/job", "s3://bucket/job"), ("s3://bucket", "s3://bucket"), ("gs://b/j/", "gs://b/j"),
    ("memory://job", "memory://job"), ("simplecache::s3://b/j", "simplecache::s3://b/j"),
])
def test_accepted_locations(uri, normalized):
    assert check_checkpoint_uri(uri) == normalized


@pytest.mark.parametrize("uri, message", [
    ("/", "filesystem root"), ("//", "filesystem root"), ("/./", "filesystem root"), ("file:///", "filesystem root"),
    ("ckpt", "relative path"), ("./ckpt", "relative path"), ("../x/ckpt", "relative path"), ("~/ckpt", "relative path"),
    ("file://ckpt", "relative path"), ("s3://", "names no bucket"), ("memory:///", "names no bucket"),
    ("", "absolute path or an fsspec URL"), (None, "absolute path or an fsspec URL"), (3, "absolute path"),
])
def test_refused_locations_say_why_and_what_to_do(uri, message):
    with pytest.raises(ValueError, match=message) as info:
        check_checkpoint_uri(uri, "checkpoint_uri")
    assert f"checkpoint_uri={uri!r}" in str(info.value)


@pytest.mark.parametrize("kwargs, field", [
    (dict(uri="relative/dir", every_s=1), "CheckpointConfig.uri='relative/dir' is a relative path"),
    (dict(uri="/", every_s=1), "filesystem root"),
    (dict(uri="/x", every_s=1, run_id=""), "run_id=''"),
    (dict(uri="/x", every_s=1, run_id="a/b"), "run_id='a/b'"),
    (dict(uri="/x", every_s=1, trusted="yes"), "trusted='yes'"),
    (dict(uri="/x", every_s=1, max_consecutive_failures=0), "max_consecutive_failures=0"),
    (dict(uri="/x", every_s=True), "every_s=True"),
    (dict(uri="/x", every_n_commits=True), "every_n_commits=True"),
    (dict(uri="/x", every_s=1, lease_generation=0), "lease_generation=0"),
    (dict(uri="/x", every_s=1, lease_generation=True), "lease_generation=True"),
    (dict(uri="/x", every_s=1, lease_generation="3"), "lease_generation='3'"),
])
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        CheckpointConfig(**kwargs)


def test_config_defaults():
    c = CheckpointConfig("/x/", every_n_commits=2)
    assert (c.uri, c.run_id, c.trusted, c.max_consecutive_failures, c.keep_last) == ("/x", None, False, 3, 3)


@pytest.mark.parametrize("name, seq", [
    ("ckpt-000000000007", 7), ("ckpt-000000000000", 0), ("old-ckpt-000000000005", None),
    ("ckpt-000000000005.bak", None), ("ckpt-5", None), ("ckpt-0000000000071", None), ("LEASE-000000000001.json", None),
])
def test_checkpoint_directory_names_are_anchored(name, seq):
    assert parse_checkpoint_dir(name) == seq


def E(seq, run="me", complete=True):
    return Entry(seq, run, complete)


@pytest.mark.parametrize("entries, newest, keep_last, lease_held, doomed", [
    # keep the newest keep_last complete ones of this run, the new one included
    ([E(1), E(2), E(3), E(4)], 4, 2, False, [1, 2]),
    ([E(1), E(2)], 2, 1, False, [1]),
    ([E(1)], 1, 1, False, []),
    # incomplete directories of this run below the new one are failed writes: removed
    ([E(1), E(2, complete=False), E(3)], 3, 5, False, [2]),
    # anything newer than the new checkpoint is another writer's, maybe in flight: never touched
    ([E(1), E(2), E(3, "other", False), E(4, "me", False)], 2, 1, False, [1]),
    # other runs' checkpoints: untouched without the lease ...
    ([E(1, "old"), E(2, "old"), E(3), E(4)], 4, 1, False, [3]),
    ([E(1, "old", False), E(2, None), E(3)], 3, 1, False, []),
    # ... and superseded by keep_last newer ones with it (their incomplete ones too)
    ([E(1, "old"), E(2, "old"), E(3, "old", False), E(4), E(5)], 5, 2, True, [1, 2, 3]),
    ([E(1, "old"), E(2, "old"), E(3)], 3, 2, True, [1]),
    ([E(1, None), E(2)], 2, 3, True, []),
])
def test_plan_prune(entries, newest, keep_last, lease_held, doomed):
    assert plan_prune(entries, newest, "me", keep_last, lease_held) == doomed


def test_plan_prune_never_deletes_the_new_checkpoint_nor_newer_ones():
    import itertools

    for n, keep_last, lease in itertools.product(range(1, 7), range(1, 4), (False, True)):
        for mask in range(2 ** n):
            entries = [E(s + 1, "me" if mask >> s & 1 else "old", complete=bool(s % 2)) for s in range(n)]
            newest = max(1, n // 2)
            entries = [e if e.seq != newest else E(newest) for e in entries]
            doomed = plan_prune(entries, newest, "me", keep_last, lease)
            assert all(s < newest for s in doomed)
            kept_complete = [e.seq for e in entries if e.complete and e.seq <= newest and e.seq not in doomed
                             and (lease or e.run_id == "me")]
            assert newest in kept_complete and len(kept_complete) <= keep_last


@pytest.mark.parametrize("entries, oldest_first", [
    ([], []),
    ([Entry(3), Entry(1), Entry(2)], [1, 2, 3]),
    ([Entry(1), Entry(2, complete=False), Entry(4)], [1, 4]),  # incomplete: never the newest, never kept
])
def test_by_age_is_the_one_order_of_checkpoints(entries, oldest_first):
    assert [e.seq for e in by_age(entries)] == oldest_first


@pytest.mark.parametrize("existing, seq", [([], 1), ([1, 2, 3], 4), ([7], 8), ([2, 9, 4], 10)])
def test_next_sequence(existing, seq):
    assert next_sequence(existing) == seq


def O(seq, lineage, round_id, version, run="me", complete=True):
    from state.checkpoints.policy import StateOrder

    return Entry(seq, run, complete, StateOrder(lineage, round_id, version))


@pytest.mark.parametrize("entries, oldest_first", [
    # the state's order decides, not the number: a late write of round 5 (number 2) is older than round 6's
    ([O(1, 0, 6, 120), O(2, 0, 5, 100)], [2, 1]),
    # a later run (it resumed: lineage + 1) is newer though its rounds start again
    ([O(1, 0, 40, 900), O(2, 1, 1, 3)], [1, 2]),
    # within a round, the version; the same state written twice: by number
    ([O(3, 0, 2, 9), O(1, 0, 2, 11), O(2, 0, 2, 9)], [2, 3, 1]),
    # checkpoints without an order (older writers) sort below every ordered one, by number among themselves
    ([Entry(5), O(1, 0, 1, 1), Entry(2)], [2, 5, 1]),
    ([O(1, 0, 1, 1, complete=False), Entry(2)], [2]),
])
def test_by_age_orders_by_the_state(entries, oldest_first):
    assert [e.seq for e in by_age(entries)] == oldest_first


@pytest.mark.parametrize("entries, newest, keep_last, doomed", [
    # a late write of an older state (2) never prunes the newer one (1); it is kept itself, for now
    ([O(1, 0, 6, 120), O(2, 0, 5, 100)], 2, 1, []),
    # the next write of the newest state removes both
    ([O(1, 0, 6, 120), O(2, 0, 5, 100), O(3, 0, 6, 130)], 3, 1, [1, 2]),
    ([O(1, 0, 6, 120), O(2, 0, 5, 100), O(3, 0, 6, 130)], 3, 2, [2]),
])
def test_plan_prune_keeps_the_newest_states(entries, newest, keep_last, doomed):
    assert plan_prune(entries, newest, "me", keep_last, lease_held=True) == doomed


@pytest.mark.parametrize("value, parsed", [
    ([0, 3, 9], (0, 3, 9)), ((1, 1, 0), (1, 1, 0)), (None, None), ([0, 3], None), ([0, -1, 2], None),
    ([0, True, 2], None), ("0,3,9", None), ([0, 3.0, 9], None),
])
def test_state_order_parse(value, parsed):
    from state.checkpoints.policy import StateOrder

    got = StateOrder.parse(value)
    assert (None if got is None else (got.lineage, got.round_id, got.version)) == parsed
