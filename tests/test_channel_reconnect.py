"""A worker's sealed channel to the driver's store survives a broken connection (real sockets): the
connection runs through a TCP relay that the test cuts; the next sends and the next receive reconnect
through a fresh connection instead of failing (before, the heartbeat thread died and the driver later
killed a healthy worker as silent). What a lost push would have told the driver rides in every heartbeat."""

import socket
import threading

import pytest

import elastic_ring as er
from elastic_ring.ring.store import StoreServer
from elastic_ring.ring import store as ring_store
from elastic_ring.core.auth import new_secret
from ray_integration.wire.channel import Channel


class Relay:
    """Forwards TCP connections from its own port to ``target``; :meth:`cut` closes every live one."""

    def __init__(self, target: er.StoreAddress) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.live: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection((self.target.host, self.target.port))
            with self.lock:
                self.live += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass  # cut: the other direction's pipe sees it too
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def cut(self) -> None:
        with self.lock:
            for s in self.live:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass  # already closed
            self.live.clear()

    def close(self) -> None:
        self.cut()
        self.listener.close()


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
