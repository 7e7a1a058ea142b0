"""The port plumbing of trnd/procs.py. free_port never hands out one port twice in a process: the local
deployment (roles/local.py) and the tests take several ports before the children that bind them start,
and the kernel does offer a port it has just given again. It draws them below the kernel's ephemeral range,
where no port the kernel hands out can take one before its child binds it. dial refuses a connection that
reached itself."""

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
    monkeypatch.setattr(procs, "_ephemeral_start", lambda: 1024)  # no room below it: the kernel's pick
    assert (procs.free_port(), procs.free_port()) == (p, q)
    assert not Replaying.script


class Scripted:
    def __init__(self, ports):
        self.ports = ports

    def randrange(self, lo, hi):
        port = self.ports.pop(0)
        assert lo <= port < hi
        return port


def test_ports_are_drawn_below_the_ephemeral_range_and_a_taken_one_is_skipped(monkeypatch):
    top = procs._ephemeral_start()
    if top <= 12000:
        pytest.skip(f"the ephemeral range starts at {top}: no room below it, ports come from the kernel")
    ports = [procs.free_port() for _ in range(50)]
    assert all(10000 <= p < top for p in ports), ports
    taken, free = [p for p in range(10000, top) if p not in ports and _free(p)][:2]
    with socket.socket() as held:  # a port another process listens on is never handed out
        held.bind(("127.0.0.1", taken))
        held.listen()
        monkeypatch.setattr(procs, "_rng", Scripted([taken, free]))
        assert procs.free_port() == free


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


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
