"""The port plumbing of trnd/procs.py. free_port never hands out one port twice in a process: the local
deployment (roles/local.py) and the tests take several ports before the children that bind them start,
and the kernel does offer a port it has just given again. dial refuses a connection that reached itself."""

import asyncio
import socket

import pytest
import uvloop

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


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_a_dial_that_reaches_itself_is_refused_and_frees_the_port(run):
    """A local port nobody listens on, dialed from that same port, connects to itself (TCP simultaneous
    open). dial refuses it and resets the socket, so the peer that starts there next can bind (under
    asyncio's loop and uvloop, which the roles run on)."""
    port = procs.free_port()

    async def go():
        with pytest.raises(ConnectionRefusedError, match="connected to itself"):
            await procs.dial("127.0.0.1", port, 5, local_addr=("127.0.0.1", port))
        await asyncio.sleep(0)  # the transport's close runs on the next turn of the loop

    run(go())
    with procs.bind_port("127.0.0.1", port, "control_port") as s:  # the peer's listener can take the port now
        s.listen()
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
