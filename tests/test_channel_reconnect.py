"""A worker's sealed channel to the driver's store survives a broken connection (real sockets): the
connection runs through a TCP relay that the test cuts; the next sends and the next receive reconnect
through a fresh connection instead of failing (before, the heartbeat thread died and the driver later
killed a healthy worker as silent). What a lost push would have told the driver rides in every heartbeat."""

import pytest

import elastic_ring as er
from elastic_ring.ring.store import StoreServer
from elastic_ring.ring import store as ring_store
from elastic_ring.core.auth import new_secret
from ray_integration.wire.channel import Channel
from tests.relay import Relay


@pytest.fixture
def relay():
    server = StoreServer("127.0.0.1")
    r = Relay(server.address)
    yield server, r
    r.close()
    server.close()


def test_a_broken_connection_is_replaced_on_the_next_send_and_receive(relay):
    server, r = relay
    secret = new_secret()
    through = er.StoreAddress("127.0.0.1", r.port)

    def connect():
        return ring_store.connect(through, 5.0)

    worker = Channel(connect(), secret, "w1", connect=connect)
    driver = Channel(server.connect(5.0), secret, "driver")
    worker.send("q/driver", "hb", seq=1)
    assert driver.receive("q/driver", 5.0)["seq"] == 1
    r.cut()                                   # the worker's connection breaks
    # a push is fire-and-forget (no round trip that a stalled driver could block): the first one into the
    # broken connection may be lost; the next fails and is retried over a fresh connection
    worker.send("q/driver", "hb", seq=2)
    worker.send("q/driver", "hb", seq=3)
    got = [driver.receive("q/driver", 2.0) for _ in range(2)]
    assert [m["seq"] for m in got if m is not None][-1] == 3, got
    assert worker.reconnects >= 1
    r.cut()
    driver.send("q/w1", "pending", generation=1)
    assert worker.receive("q/w1", 5.0)["k"] == "pending"   # a blocking receive reconnects too


def test_without_a_way_to_reconnect_the_error_is_raised_naming_what_failed(relay):
    server, r = relay
    through = er.StoreAddress("127.0.0.1", r.port)
    worker = Channel(ring_store.connect(through, 5.0), new_secret(), "w1")
    r.cut()
    with pytest.raises((RuntimeError, OSError), match="sending hb to q/driver failed after 6 attempts"):
        for seq in range(1, 3):   # the first push may vanish into the broken connection; the next one fails
            worker.send("q/driver", "hb", seq=seq)
