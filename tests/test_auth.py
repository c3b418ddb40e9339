"""Authentication of what a job deserializes: sealed values, the authenticated store (real TCPStore),
and object-collective payloads tampered with on the wire (real gloo rings). A forged payload's pickle
would create a marker file if it were ever unpickled: the marker never appears."""

import datetime
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import elastic_ring as er
from elastic_ring.backends import gloo
from elastic_ring.ring.store import StoreServer
from elastic_ring.collectives import objects as object_collectives
from elastic_ring.ring import runtime
from elastic_ring.core import auth
from elastic_ring.core.errors import AuthenticationError

SECRET = b"s" * 32


class Planted:
    """Unpickling this creates a marker file: proof that forged bytes were deserialized."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_seal_binds_domain_name_and_data():
    sealed = auth.seal(SECRET, "store", "job/k", b"value")
    assert auth.unseal(SECRET, "store", "job/k", sealed) == b"value"
    for secret, domain, name, data in [(b"t" * 32, "store", "job/k", sealed), (SECRET, "payload", "job/k", sealed),
                                       (SECRET, "store", "job/other", sealed), (SECRET, "store", "job/k", sealed[:-1]),
                                       (SECRET, "store", "job/k", b"plain bytes, no mac")]:
        with pytest.raises(AuthenticationError, match=r"failed authentication"):
            auth.unseal(secret, domain, name, data)
    text = auth.seal_json(SECRET, "q", {"a": 1})
    assert auth.unseal_json(SECRET, "q", text) == {"a": 1}
    with pytest.raises(AuthenticationError):
        auth.unseal_json(SECRET, "q", text.replace('"a":1', '"a":2'))


@pytest.mark.parametrize("secret", [None, b"short", "a string of 32 characters......."])
def test_secrets_are_checked(secret):
    with pytest.raises(ValueError, match="at least 16 bytes"):
        auth.check_secret(secret)


@pytest.fixture
def store_pair():
    server = StoreServer("127.0.0.1")
    rogue = dist.TCPStore("127.0.0.1", server.address.port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    genuine = auth.AuthenticatedStore(server.connect(5.0), SECRET, forged_grace_s=1.0)
    yield server, rogue, genuine
    server.close()


def test_store_server_listens_on_its_address_only(store_pair):
    server, _, _ = store_pair
    listening = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.split(":")[1], 16) == server.address.port:
                    listening.append(local.split(":")[0])
    assert listening == ["0100007F"], listening  # 127.0.0.1 only, not 0.0.0.0 or ::


def test_forged_store_value_is_refused_naming_the_key(store_pair, tmp_path):
    import pickle

    _, rogue, genuine = store_pair
    marker = tmp_path / "pwned"
    rogue.set("job/w/x/ring/1", pickle.dumps(Planted(str(marker))))
    started = time.monotonic()
    with pytest.raises(AuthenticationError, match=r"'job/w/x/ring/1' failed authentication"):
        genuine.get("job/w/x/ring/1")
    assert time.monotonic() - started < 3  # bounded: the grace for a genuine value, then a clear error
    assert not marker.exists()


def test_forged_value_is_ignored_when_the_genuine_one_still_arrives(store_pair):
    _, rogue, genuine = store_pair
    rogue.set("job/round3/gloo//0/1", b"garbage address")
    writer = auth.AuthenticatedStore(store_pair[0].connect(5.0), SECRET)
    threading.Timer(0.3, lambda: writer.set("job/round3/gloo//0/1", b"genuine address")).start()
    assert genuine.get("job/round3/gloo//0/1") == b"genuine address"
    assert genuine.forged_reads == 1


def test_a_ring_forms_over_forged_rendezvous_keys(ring):
    """A stranger who writes garbage under the next round's gloo keys before the ranks do cannot stop it
    forming (the genuine values overwrite the garbage), and cannot make it use his values."""
    rogue = dist.TCPStore("127.0.0.1", ring.address.port, is_master=False, wait_for_workers=False)
    round_id = ring.next_round() + 1
    for rank in range(2):
        for prefix in (gloo.EAGER_PREFIX, gloo.LAZY_PREFIX):  # a full mesh's keys and lazy pairs' keys
            rogue.set(f"elastic_ring/round{round_id}/{prefix}/0/{rank}", b"\x80\x04forged")
    ring._round = round_id - 1
    assert ring.run(_sum_of_ranks, world_size=2) == [1.0, 1.0]


def _sum_of_ranks():
    return er.allreduce(torch.tensor([float(er.rank())]), op=er.Sum).item()


def _tampered_broadcast(marker_path):
    if er.rank() == 0:  # this root seals with a secret that is not the job's: a stranger on the wire
        real = object_collectives.seal
        object_collectives.seal = lambda key, *a: real(b"x" * 32, *a)
        try:
            er.broadcast_object(Planted(marker_path))
        finally:
            object_collectives.seal = real
        return "sent"
    try:
        er.broadcast_object(None)
    except AuthenticationError as exc:
        return str(exc)
    return "accepted"


def test_tampered_broadcast_object_is_refused_on_the_receiver(ring, tmp_path):
    marker = tmp_path / "pwned"
    root, receiver = ring.run(_tampered_broadcast, str(marker), world_size=2)
    assert root == "sent"
    assert "broadcast_object" in receiver and "failed authentication" in receiver, receiver
    assert not marker.exists()


def _tampered_allgather(marker_path):
    if er.rank() == 1:
        real = object_collectives.seal
        object_collectives.seal = lambda key, *a: real(b"y" * 32, *a)
        try:
            return _gather(Planted(marker_path))
        finally:
            object_collectives.seal = real
    return _gather(er.rank())


def _gather(obj):
    try:
        return repr(er.allgather_object(obj))
    except AuthenticationError as exc:
        return str(exc)


def test_tampered_allgather_object_is_refused(ring, tmp_path):
    marker = tmp_path / "pwned"
    results = ring.run(_tampered_allgather, str(marker), world_size=3)
    assert results[1].startswith("[0, <"), results  # the sender keeps its own object
    assert all("allgather_object" in r and "from1" in r and "failed authentication" in r for r in results[::2]), results
    assert not marker.exists()


def _replayed_payload():
    """A genuine payload of one broadcast replayed into the next one is refused (names bind the sequence)."""
    comm = runtime.current()
    if er.rank() == 0:
        first = auth.seal(comm.auth_key, "payload", f"{comm.payload_name('broadcast_object')}/from0", b"x")
        real = object_collectives.seal
        object_collectives.seal = lambda *a: first
        try:
            er.broadcast_object("next")
        finally:
            object_collectives.seal = real
        return "sent"
    comm.payload_name("broadcast_object")
    try:
        return er.broadcast_object(None)
    except AuthenticationError:
        return "refused"


def test_replayed_payload_is_refused(ring):
    assert ring.run(_replayed_payload, world_size=2) == ["sent", "refused"]


def _tree_devices():
    tree = {"model": {"w": torch.arange(3.0)}, "opt": [{"step": torch.tensor(5.0)}, 7, "adam"],
            "rng": torch.ByteTensor([1, 2, 3])}
    got = er.broadcast_tree(tree if er.rank() == 0 else None)
    return (got["opt"][1:], got["model"]["w"].tolist(), got["rng"].tolist(), got["opt"][0]["step"].item(),
            [t.device.type for t in (got["model"]["w"], got["rng"])])


def test_broadcast_tree_is_authenticated_plain_and_keeps_cpu_leaves_on_cpu(ring):
    for result in ring.run(_tree_devices, world_size=3):
        assert result == ([7, "adam"], [0.0, 1.0, 2.0], [1, 2, 3], 5.0, ["cpu", "cpu"])


def test_init_requires_a_secret_beyond_one_rank():
    spec = er.RingSpec(round_id=1, rank=0, world_size=2, node_ids=("a", "b"), store=er.StoreAddress("127.0.0.1", 1))
    with pytest.raises(ValueError, match="RingSpec.auth_key is missing"):
        er.init(spec)
    assert os.environ.get("NEVER") is None
