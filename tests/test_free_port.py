"""free_port never hands out one port twice in a process: the local deployment (roles/local.py) and the
tests take several ports before the children that bind them start, and the kernel does offer a port it
has just given again."""

import socket

from trnd import procs


class Replaying(socket.socket):
    """A socket whose bind to port 0 lands on the next port of a script (what the kernel may do)."""

    script: list[int] = []

    def bind(self, addr):
        super().bind((addr[0], self.script.pop(0)))


def test_a_port_the_kernel_offers_again_is_not_handed_out_again(monkeypatch):
    with socket.socket() as a, socket.socket() as b:  # two ports free now, then released
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        p, q = a.getsockname()[1], b.getsockname()[1]
    Replaying.script = [p, p, q]
    monkeypatch.setattr(procs.socket, "socket", Replaying)
    monkeypatch.setattr(procs, "_handed_out", set())
    assert (procs.free_port(), procs.free_port()) == (p, q)
    assert not Replaying.script


def test_many_picks_are_distinct():
    ports = [procs.free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
