"""A TCP relay between a store's clients and its server, for tests of broken connections (real sockets): it can
cut every live connection (:meth:`Relay.cut`: both ends see it) or make every live one drop what it carries, both
ways, without closing it (:meth:`Relay.black_hole`: a NAT or a firewall that forgot the flow; nobody hears a thing).
Connections made after either go through as before."""

from __future__ import annotations

import socket
import threading


class Relay:
    """Forwards TCP connections from its own port to ``target`` (an address with ``host`` and ``port``)."""

    def __init__(self, target) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flows: list[dict] = []  # {"dropped": bool, "sockets": (client, upstream)} per live connection
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection((self.target.host, self.target.port))
            except OSError:  # the server is gone: so is this connection
                client.close()
                continue
            flow = {"dropped": False, "sockets": (client, upstream)}
            with self.lock:
                self.flows.append(flow)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b, flow), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, flow: dict) -> None:
        try:
            while data := src.recv(65536):
                if not flow["dropped"]:
                    dst.sendall(data)
        except OSError:
            pass  # cut: the other direction's pipe sees it too
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def black_hole(self) -> None:
        with self.lock:
            for flow in self.flows:
                flow["dropped"] = True

    def cut(self) -> None:
        with self.lock:
            flows, self.flows = self.flows, []
        for flow in flows:
            for s in flow["sockets"]:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass  # already closed

    def close(self) -> None:
        self.listener.close()  # first: a client reconnecting as its connection is cut finds nobody
        self.cut()
