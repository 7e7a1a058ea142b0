"""engine/corelock.py: the roles of one node take turns on its cores. Real processes hold the flock; what is
checked is the order of events and the bounded wait, never how long anything took."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from trnd.engine.corelock import CoreLock

HOLDER = textwrap.dedent("""
    import sys, time
    from trnd.engine.corelock import CoreLock
    lock = CoreLock(sys.argv[1])
    assert lock.acquire()
    with open(sys.argv[2], "a") as f:
        f.write("holder-in\\n")
    time.sleep(float(sys.argv[3]))
    with open(sys.argv[2], "a") as f:
        f.write("holder-out\\n")
    lock.release()
    time.sleep(60)  # stays alive: the lock must be free because it was released, not because it exited
""")


def start_holder(tmp_path, hold_s: float):
    path, log = str(tmp_path / "cores.lock"), tmp_path / "events"
    log.write_text("")
    p = subprocess.Popen([sys.executable, "-c", HOLDER, path, str(log), str(hold_s)])
    for _ in range(600):
        if "holder-in" in log.read_text():
            return p, path, log
        time.sleep(0.05)
    p.kill()
    raise AssertionError("the holder process never took the lock")


def test_a_second_role_waits_for_the_holder_to_let_go(tmp_path):
    p, path, log = start_holder(tmp_path, 1.0)
    try:
        lock = CoreLock(path, deadline_s=30)
        assert lock.acquire()
        with open(log, "a") as f:
            f.write("waiter-in\n")
        lock.release()
        assert log.read_text().split() == ["holder-in", "holder-out", "waiter-in"]
        assert lock.overruns == 0 and lock.waited_s > 0
        assert lock.acquire()  # uncontended now: taken again at once, and let go
        lock.release()
        lock.close()
    finally:
        p.kill()
        p.wait()


def test_a_stopped_holder_costs_at_most_the_deadline_and_a_dead_one_nothing(tmp_path):
    p, path, log = start_holder(tmp_path, 60)
    os.kill(p.pid, signal.SIGSTOP)  # a hung peer, holding the cores
    try:
        lock = CoreLock(path, deadline_s=0.3)
        with lock.held():  # computes anyway once the deadline passed
            pass
        assert lock.overruns == 1 and lock.give_ups == 1
        waited = lock.waited_s
        for _ in range(5):  # the turn it gave up on still holds the lock: no second wait (one missed turn)
            assert lock.acquire() is False
        assert lock.overruns == 6 and lock.give_ups == 1 and lock.waited_s == waited
        p.kill()  # the kernel drops a dead holder's flock
        p.wait()
        assert lock.acquire() is True
        lock.release()
        assert lock.acquire() is True  # and nothing was left half-held
        lock.release()
        lock.close()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_holder_that_lets_go_and_takes_it_again_is_waited_for_again(tmp_path):
    """Giving up on one turn is no licence for the next: a holder that released and took the lock again
    (a long pass, then another) is waited for as usual."""
    a, b = CoreLock(str(tmp_path / "l"), deadline_s=0.2), CoreLock(str(tmp_path / "l"), deadline_s=0.2)
    assert a.acquire()
    assert b.acquire() is False and b.give_ups == 1
    assert b.acquire() is False and b.give_ups == 1  # the same turn: not waited for
    a.release()
    assert a.acquire()  # a new turn
    assert b.acquire() is False and b.give_ups == 2  # waited the deadline again
    a.release()
    assert b.acquire() is True
    b.release()
    a.close()
    b.close()


def test_two_locks_in_one_process_exclude_each_other(tmp_path):
    """Each CoreLock opens its own file description, so two roles' locks in one process still exclude."""
    a, b = CoreLock(str(tmp_path / "l"), deadline_s=0.2), CoreLock(str(tmp_path / "l"), deadline_s=0.2)
    assert a.acquire()
    assert b.acquire() is False and b.overruns == 1
    a.release()
    assert b.acquire() is True
    b.release()
    a.close()
    b.close()


@pytest.mark.parametrize("share", [True, False])
def test_the_local_deployment_gives_its_roles_one_lock(tmp_path, share):
    from trnd.config import LocalConfig, load_config
    from trnd.roles.local import role_configs

    import tomllib

    def local(**kw) -> LocalConfig:
        return load_config(LocalConfig, None, {"model": "/nonexistent", "share_cores": share, **kw})

    children = role_configs(local(), "/nonexistent", tmp_path)
    locks = {c.name: tomllib.loads(open(c.config).read()).get("core_lock") for c in children}
    assert set(locks) == {"prefill0", "decode"}
    if share:
        assert locks["prefill0"] == locks["decode"] == str(tmp_path / "cores.lock")
    else:
        assert locks == {"prefill0": None, "decode": None}
    # an operator's own lock file (shared with other roles on the node) is the deployment's lock either way
    mine = str(tmp_path / "node.lock")
    children = role_configs(local(core_lock=mine), "/nonexistent", tmp_path)
    assert {tomllib.loads(open(c.config).read()).get("core_lock") for c in children} == {mine}


@pytest.mark.parametrize("share", [True, False])
def test_the_decode_role_prefills_short_prompts_itself_only_on_shared_cores(tmp_path, share):
    """local_prefill_tokens auto: Dynamo's 1000 where the roles take turns on one node's cores, 0 (every prompt
    to the prefill peer) where they do not; what the operator sets wins either way, and `trnd serve` passes it."""
    import tomllib

    from trnd.config import ConfigError, DecodeConfig, LocalConfig, load_config
    from trnd.roles.decode import LOCAL_PREFILL_SHARED_CORES, local_prefill_tokens
    from trnd.roles.local import role_configs

    def decode_cfg(**kw) -> DecodeConfig:
        local = load_config(LocalConfig, None, {"model": "/nonexistent", "share_cores": share, **kw})
        children = role_configs(local, "/nonexistent", tmp_path)
        dec = next(c for c in children if c.name == "decode")
        return load_config(DecodeConfig, dec.config, {})

    assert local_prefill_tokens(decode_cfg()) == (LOCAL_PREFILL_SHARED_CORES if share else 0)
    assert local_prefill_tokens(decode_cfg(local_prefill_tokens=0)) == 0
    assert local_prefill_tokens(decode_cfg(local_prefill_tokens=64)) == 64
    assert tomllib.loads(open(tmp_path / "prefill0.toml").read()).get("local_prefill_tokens") is None
    with pytest.raises(ConfigError, match="local_prefill_tokens"):
        load_config(DecodeConfig, None, {"local_prefill_tokens": -1})


def test_a_reloads_ready_keeps_the_ports_the_child_listens_on(tmp_path):
    """A child's READY=1 after RELOADING=1 names no ports (only its first does): the supervisor keeps the ports it
    heard, so a SIGHUP during or after start does not take the deployment down as 'not listening'."""
    from trnd.daemon import notify
    from trnd.roles.local import Child, heard

    c = Child("decode", "decode", tmp_path / "decode.toml", {"port": 8000})
    heard(c, {"READY": "1", notify.LISTEN: "127.0.0.1:8000"}, 1.0)
    assert c.ready and c.listening == ["127.0.0.1:8000"]
    heard(c, {"RELOADING": "1"}, 2.0)
    heard(c, {"READY": "1", "STATUS": "running"}, 3.0)
    assert c.ready and c.readies == 2
    fresh = Child("prefill0", "prefill", tmp_path / "prefill.toml", {"prefill_admin_port": 9000})
    heard(fresh, {"READY": "1"}, 1.0)  # a first READY=1 without its ports is still refused
    assert not fresh.ready
