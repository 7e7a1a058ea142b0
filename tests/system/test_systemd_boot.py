"""trnd@prefill + trnd@decode under a real systemd: the distribution's systemd booted as PID 1 of its own
pid/mount/uts/ipc/cgroup/net namespaces, on an overlay of / whose writes go to a tmpfs, with trnd
installed the way docs/DEPLOY.md says (its Install and Credentials blocks are run as written). Then what
an operator does: start (returns once both are READY), the official openai client through the decode
port, reload (a live field changes), stop (a running stream drains to completion), a bad config (exit 78,
one line at error priority, no restart), and `systemd-analyze security` on the loaded unit.

Nothing reaches the host: the booted systemd lacks CAP_SYS_MODULE/SYS_TIME/..., sees /proc/sys and /sys
read-only, has its own loopback-only network and a cgroup subtree of its own; killing its PID 1 ends
every process in it, and its files vanish with the tmpfs."""

from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.wheel import build_wheel

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "docs/DEPLOY.md"
SYSTEMD_BIN = Path("/lib/systemd/systemd")
DECODE_PORT, ROUTER_PORT = 8010, 8000  # configs/router.toml's layout: the router on 8000 before decode servers
SERVE_PORT = 8030  # trnd@serve: its API; its prefill child on the next two
EXPOSURE = 1.5  # `systemd-analyze security trnd@decode.service` today ("OK"); it must not get worse
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A process of the host environment that the install may need (a registry proxy, pip's own settings).
PASS_ENV = re.compile(r"PIP_.*|(?i:.*_proxy)|SSL_CERT_.*|REQUESTS_CA_BUNDLE", re.ASCII)

pytestmark = pytest.mark.slow

# PID 1 of the new namespaces until it execs systemd. $1: an empty host directory for the tmpfs, $2: this
# checkout (copied to /usr/src/trnd, the "source tree" DEPLOY.md installs from), $3: the wheel built from it
# (put in the tree's dist/, where DEPLOY.md's `pip wheel -w dist .` puts it).
BOOT = r"""
set -eu
T=$1 SRC=$2 WHEEL=$3
mount --make-rprivate /
mount -t tmpfs -o mode=0755,size=6g trnd-boot "$T"
mkdir "$T/upper" "$T/work" "$T/root"
mount -t overlay overlay -o "lowerdir=/,upperdir=$T/upper,workdir=$T/work" "$T/root"
R=$T/root
mount -t proc proc "$R/proc"
for p in sys sysrq-trigger irq bus fs; do  # as systemd-nspawn does: the kernel's knobs stay read-only
  if [ -e "$R/proc/$p" ]; then mount --bind "$R/proc/$p" "$R/proc/$p"; mount -o remount,bind,ro "$R/proc/$p"; fi
done
mount -t sysfs -o ro sysfs "$R/sys"
mount -t cgroup2 cgroup2 "$R/sys/fs/cgroup"  # this cgroup namespace's root: the subtree made for it
mount -t tmpfs -o mode=0755,nosuid tmpfs "$R/dev"
for d in null zero full random urandom tty; do : > "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
mkdir "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
ln -s /proc/self/fd "$R/dev/fd"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$R/dev/shm"
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$R/run"
mkdir -p "$R/usr/src/trnd"
tar -C "$SRC" --exclude=./.venv --exclude=./.git --exclude=./build --exclude='*.egg-info' -cf - . \
  | tar -C "$R/usr/src/trnd" -xf -
mkdir -p "$R/usr/src/trnd/dist"
cp "$WHEEL" "$R/usr/src/trnd/dist/"
echo trnd-ci > "$R/etc/hostname"
: > "$R/etc/machine-id"
cd "$R"
mkdir .oldroot
pivot_root . .oldroot
umount -l /.oldroot
rmdir /.oldroot
mount --make-rshared /  # systemd skips this in a container; LoadCredential= needs it
export container=trnd-ci
# No loading kernel modules, setting the clock, raw I/O, the kernel log or the LSMs: not from in there.
exec setpriv --bounding-set \
  -sys_module,-sys_time,-sys_rawio,-syslog,-wake_alarm,-block_suspend,-mac_admin,-mac_override,-audit_control \
  /lib/systemd/systemd --unit=basic.target
"""

# Runs on the host's filesystem (this venv has openai) inside the machine's network namespace.
CLIENT = r"""
import json, sys, time
import openai

key, port, action, arg = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)
model = c.models.list().data[0].id
if action == "complete":
    try:
        r = c.completions.create(model=model, prompt="hello there", max_tokens=4, n=arg, temperature=0)
        print(json.dumps({"status": 200, "choices": len(r.choices), "tokens": r.usage.completion_tokens,
                          "model": model, "text": r.choices[0].text}))
    except openai.APIStatusError as e:
        print(json.dumps({"status": e.status_code, "error": e.body}))
else:  # a stream of `arg` tokens; says "first" at the first chunk
    chunks, finish, usage, error = 0, None, None, None
    try:
        s = c.completions.create(model=model, prompt="tell me a story", max_tokens=arg, temperature=0, stream=True,
                                 stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for ch in s:
            if ch.choices:
                chunks += 1
                finish = ch.choices[0].finish_reason or finish
                if chunks == 1:
                    print("first", flush=True)
            if ch.usage:
                usage = ch.usage.completion_tokens
    except openai.APIError as e:
        error = str(e)
    print(json.dumps({"chunks": chunks, "finish": finish, "usage": usage, "error": error,
                      "t_done": time.monotonic()}))
"""


def _skip_unless_possible() -> None:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("booting systemd in namespaces needs root on Linux")
    for tool in ("unshare", "nsenter", "setpriv", "pivot_root"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (util-linux)")
    if not SYSTEMD_BIN.exists():
        pytest.skip("systemd is not installed (apt-get install systemd)")
    r = subprocess.run(["unshare", "--fork", "--pid", "--mount", "--uts", "--ipc", "--cgroup", "--net", "true"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"new namespaces are not allowed here: {r.stderr.strip()}")


def _cgroup2_dir() -> Path:
    """Our own cgroup in the cgroup2 hierarchy (systemd in the namespace gets a child of it)."""
    mnt = next((line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                if line.split(" - ")[1].split()[0] == "cgroup2"), None)
    if mnt is None:
        pytest.skip("no cgroup2 hierarchy is mounted")
    rel = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    return Path(mnt + rel.rstrip("/")) if rel != "/" else Path(mnt)


def _remove_cgroup(path: Path) -> None:
    deadline = time.monotonic() + 10
    while path.exists() and time.monotonic() < deadline:
        for d in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [path]:
            try:
                d.rmdir()
            except OSError:
                pass
        time.sleep(0.1)


def deploy_blocks(section: str) -> list[str]:
    """The ```sh blocks of one `## section` of docs/DEPLOY.md, as written."""
    text = DEPLOY.read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", body, re.S)


class Machine:
    """systemd as PID 1 of fresh namespaces; `sh` runs a script as root inside it."""

    def __init__(self, tmp: Path, wheel: Path):
        self.tmp = tmp
        parent = _cgroup2_dir()
        self.cgroup = parent / f"trnd-boot-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            self.cgroup.mkdir()
        except OSError as e:
            pytest.skip(f"cannot make a cgroup for the machine under {parent}: {e}")
        self.mnt = Path(tempfile.mkdtemp(prefix="trnd-boot-"))
        self.console = open(tmp / "console.log", "w+")
        self.pid1: int | None = None
        procs = str(self.cgroup / "cgroup.procs")

        def into_cgroup() -> None:  # in the child, before unshare: its namespace's cgroup root is this subtree
            with open(procs, "w") as f:
                f.write("0")
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with pytest

        self.proc = subprocess.Popen(
            ["unshare", "--fork", "--kill-child=SIGKILL", "--pid", "--mount", "--uts", "--ipc", "--cgroup", "--net",
             "sh", "-c", BOOT, "boot", str(self.mnt), str(ROOT), str(wheel)],
            preexec_fn=into_cgroup, stdin=subprocess.DEVNULL, stdout=self.console, stderr=subprocess.STDOUT,
            env={"PATH": PATH, "LANG": "C.UTF-8"})

    def boot(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.pid1 is None and time.monotonic() < deadline:
            self._fail_if_gone()
            self.pid1 = next((int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and
                              _ppid(p) == self.proc.pid), None)
            time.sleep(0.05)
        state = ""
        while time.monotonic() < deadline:
            self._fail_if_gone()
            if _comm(self.pid1) == "systemd":
                state = self.sh("systemctl is-system-running || true", check=False).stdout.strip()
                if state in ("running", "degraded"):
                    return
            time.sleep(0.2)
        raise AssertionError(f"systemd did not finish booting ({state!r}):\n{self.console_text()}")

    def _fail_if_gone(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the machine exited with {self.proc.returncode}:\n{self.console_text()}")

    def console_text(self) -> str:
        self.console.flush()
        return (self.tmp / "console.log").read_text()[-4000:]

    def _enter(self, net: bool = True) -> list[str]:
        ns = ["--mount", "--uts", "--ipc", "--pid", "--cgroup"] + (["--net"] if net else [])
        return ["nsenter", f"--target={self.pid1}", *ns, "--"]

    def sh(self, script: str, *, check: bool = True, timeout: float = 120, host_network: bool = False,
           env: dict | None = None) -> subprocess.CompletedProcess:
        """A root shell in the machine, with a clean environment. host_network: the host's network
        namespace (only for the install, which may need the package registry)."""
        environ = {"PATH": PATH, "LANG": "C.UTF-8", "HOME": "/root", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0",
                   **(env or {})}
        r = subprocess.run([*self._enter(net=not host_network), "sh", "-euc", script], input="", env=environ,
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"exit {r.returncode}: {script}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r

    def client(self, *args, port: int = DECODE_PORT, popen: bool = False):
        """The openai client (this checkout's venv) in the machine's network namespace: loopback only."""
        argv = ["nsenter", f"--target={self.pid1}", "--net", "--", sys.executable, "-c", CLIENT, self.api_key,
                str(port), *map(str, args)]
        if popen:
            return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=90)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        """Kill PID 1 (the kernel then kills everything in its pid namespace) and remove what is left."""
        try:
            if self.pid1 is not None:
                os.kill(self.pid1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)  # --kill-child: its child, PID 1, goes with it
        self.proc.wait(30)
        kill = self.cgroup / "cgroup.kill"
        if kill.exists():
            try:
                kill.write_text("1")
            except OSError:
                pass
        _remove_cgroup(self.cgroup)
        self.console.close()
        try:
            self.mnt.rmdir()  # only a mount point in the machine's namespace: empty here
        except OSError:
            pass


def _ppid(p: Path) -> int | None:
    try:
        return int(p.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def show(m: Machine, unit: str, *props: str) -> dict[str, str]:
    out = m.sh(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def install(m: Machine) -> None:
    """docs/DEPLOY.md's Install and Credentials blocks as written (the wheel, from the source tree's dist/),
    then a tiny model where DEPLOY.md says models go, and the configs edited to use it."""
    for block in deploy_blocks("Install"):
        script = "cd /usr/src/trnd\n" + block
        passed = {k: v for k, v in os.environ.items() if PASS_ENV.fullmatch(k)}
        m.sh(script, timeout=600, host_network=True, env=passed)
    for block in deploy_blocks("Credentials"):
        m.sh(block)
    m.api_key = m.sh("cat /etc/trnd/credentials/api_key").stdout.strip()
    m.sh("""
        trnd model init /var/lib/trnd/models/tiny --preset tiny
        chown -R trnd:trnd /var/lib/trnd/models/tiny
        for role in prefill decode; do
          sed -i -e 's|^# model = .*|model = "/var/lib/trnd/models/tiny"|' -e 's|^# api_key_file|api_key_file|' \
                 -e 's|^kv_memory_gb = .*|kv_memory_gb = 0.1|' /etc/trnd/$role.toml
          echo 'threads = 1' >> /etc/trnd/$role.toml
        done
        sed -i 's/^port = .*/port = %(decode)d/' /etc/trnd/decode.toml
        sed -i -e 's|^targets = .*|targets = ["127.0.0.1:%(decode)d"]|' -e 's|^# api_key_file|api_key_file|' \
               -e 's|^# model = .*|model = "/var/lib/trnd/models/tiny"|' -e 's/^port = .*/port = %(router)d/' \
               /etc/trnd/router.toml
        # The test hook (docs/DEPLOY.md): every decode step sleeps 50 ms, so a stream is still running at stop.
        mkdir -p /etc/systemd/system/trnd@decode.service.d
        printf '[Service]\\nEnvironment=TRND_DEBUG_STALL_S=0.05\\n' \\
          > /etc/systemd/system/trnd@decode.service.d/stall.conf
        systemctl daemon-reload
    """ % {"decode": DECODE_PORT, "router": ROUTER_PORT})


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    _skip_unless_possible()
    wheel = build_wheel(tmp_path_factory.mktemp("wheel"))  # what DEPLOY.md installs
    m = Machine(tmp_path_factory.mktemp("machine"), wheel)
    try:
        m.boot()
        install(m)
        yield m
    finally:
        m.close()


def journal(m: Machine, args: str) -> list[str]:
    return m.sh(f"journalctl --no-pager -o cat {args}").stdout.splitlines()


def test_start_returns_once_the_roles_are_ready_and_openai_gets_an_answer(machine):
    m = machine
    m.sh("systemctl enable trnd@prefill trnd@decode trnd@router trnd.target")
    m.sh("systemctl start trnd@prefill trnd@decode trnd@router", timeout=300)
    for role in ("prefill", "decode", "router"):  # start returned: READY=1 already came (Type=notify)
        s = show(m, f"trnd@{role}", "ActiveState", "SubState", "StatusText", "NRestarts")
        assert (s["ActiveState"], s["SubState"], s["NRestarts"]) == ("active", "running", "0"), s
        assert s["StatusText"].startswith(("ready", "routing")), s
    assert "handshaked" in "\n".join(journal(m, "-u trnd@decode"))
    r = m.client("complete", 1)
    assert r["status"] == 200 and r["model"] == "tiny" and r["tokens"] == 4 and r["text"], r
    via_router = m.client("complete", 1, port=ROUTER_PORT)
    assert via_router["status"] == 200 and via_router["text"] == r["text"], via_router  # temperature 0
    assert m.sh("systemctl is-enabled trnd@decode").stdout.strip() == "enabled"


def test_reload_applies_a_changed_live_field(machine):
    m = machine
    m.sh("systemctl start trnd@prefill trnd@decode", timeout=300)
    assert m.client("complete", 2)["status"] == 200
    pid = show(m, "trnd@decode", "MainPID")["MainPID"]
    m.sh("sed -i 's/^max_n = .*/max_n = 1/' /etc/trnd/decode.toml && systemctl reload trnd@decode")
    deadline = time.monotonic() + 20
    while (r := m.client("complete", 2))["status"] == 200 and time.monotonic() < deadline:
        time.sleep(0.2)  # the reload job ends when the signal is sent; the daemon applies it just after
    assert r["status"] == 400 and r["error"]["param"] == "n", r
    assert m.client("complete", 1)["status"] == 200
    s = show(m, "trnd@decode", "MainPID", "ActiveState", "StatusText")
    assert s["MainPID"] == pid and s["ActiveState"] == "active" and "reload failed" not in s["StatusText"], s


def test_stop_drains_a_running_stream_to_completion(machine):
    m = machine
    m.sh("systemctl start trnd@prefill trnd@decode", timeout=300)
    tokens = 60  # 60 steps of >= 50 ms (the stall drop-in): the stream outlives the start of the stop
    client = m.client("stream", tokens, popen=True)
    try:
        assert client.stdout.readline().strip() == "first", client.stderr.read()
        m.sh("systemctl stop trnd@decode", timeout=120)
        t_stopped = time.monotonic()
        out, err = client.communicate(timeout=60)
    finally:
        client.kill()
    r = json.loads(out.strip().splitlines()[-1])
    assert r["error"] is None and r["finish"] == "length" and r["usage"] == tokens, (r, err)
    assert r["t_done"] < t_stopped  # stop returned only after the stream had finished
    s = show(m, "trnd@decode", "ActiveState", "Result", "ExecMainStatus", "NRestarts")
    assert s == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0", "NRestarts": "0"}, s


def test_a_hung_role_is_killed_by_the_watchdog_and_restarted(machine):
    """A role that stops answering (kill -STOP: no thread of it runs, as in a hung step that holds the GIL)
    is killed by WatchdogSec and restarted by systemd; it serves the same greedy answer after, and the
    failure is in what DEPLOY.md tells an operator to read (journalctl -u trnd@decode -p warning)."""
    m = machine
    m.sh("""mkdir -p /etc/systemd/system/trnd@decode.service.d
            printf '[Service]\\nWatchdogSec=4s\\n' > /etc/systemd/system/trnd@decode.service.d/watchdog.conf
            systemctl daemon-reload""")
    try:
        m.sh("systemctl start trnd@prefill && systemctl restart trnd@decode", timeout=300)
        before = m.client("complete", 1)
        assert before["status"] == 200, before
        s = show(m, "trnd@decode", "MainPID", "NRestarts", "WatchdogUSec")
        assert s["WatchdogUSec"] == "4s", s
        warned = [ln for ln in journal(m, "-u trnd@decode -p warning") if "atchdog" in ln]
        m.sh(f"kill -STOP {s['MainPID']}")
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            now = show(m, "trnd@decode", "MainPID", "NRestarts", "ActiveState", "SubState")
            if now["NRestarts"] == str(int(s["NRestarts"]) + 1) and (now["ActiveState"], now["SubState"]) == (
                    "active", "running"):
                break  # Type=notify: active/running again means the new process sent READY=1
            time.sleep(0.5)
        assert now["MainPID"] != s["MainPID"] and now["ActiveState"] == "active", now
        assert now["NRestarts"] == str(int(s["NRestarts"]) + 1), now
        after = m.client("complete", 1)
        assert after["status"] == 200 and after["text"] == before["text"], (before, after)  # temperature 0
        lines = [ln for ln in journal(m, "-u trnd@decode -p warning") if "atchdog" in ln]
        assert len(lines) > len(warned), lines  # e.g. "Watchdog timeout (limit 4s)!", "Failed with result 'watchdog'"
    finally:
        m.sh("rm -f /etc/systemd/system/trnd@decode.service.d/watchdog.conf; systemctl daemon-reload")


def test_a_bad_config_exits_78_with_one_error_line_and_no_restart(machine):
    m = machine
    m.sh("systemctl stop trnd@decode; cp /etc/trnd/decode.toml /root/decode.toml; "
         "echo 'max_nn = 3' >> /etc/trnd/decode.toml")
    try:
        r = m.sh("systemctl start trnd@decode", check=False, timeout=120)
        assert r.returncode != 0, r.stdout + r.stderr
        s = show(m, "trnd@decode", "InvocationID", "ExecMainStatus", "Result", "RestartUSec")
        assert (s["ExecMainStatus"], s["Result"]) == ("78", "exit-code"), s
        time.sleep(_seconds(s["RestartUSec"]) + 2)  # a restart would have come by now
        after = show(m, "trnd@decode", "ActiveState", "NRestarts", "InvocationID")
        assert (after["ActiveState"], after["NRestarts"], after["InvocationID"]) == ("failed", "0", s["InvocationID"])
        this_run = f"_SYSTEMD_INVOCATION_ID={s['InvocationID']}"
        deadline = time.monotonic() + 10
        while not (lines := journal(m, f"{this_run} -p err")) and time.monotonic() < deadline:
            time.sleep(0.2)  # the journal may take a moment to have the stream's last line
        assert len(lines) == 1 and "max_nn" in lines[0], lines  # at error priority
        assert journal(m, this_run) == lines  # and the only thing the process wrote: no traceback
        assert lines[0] in journal(m, "-u trnd@decode -p warning")  # what DEPLOY.md tells an operator to run
    finally:
        m.sh("cp /root/decode.toml /etc/trnd/decode.toml; systemctl reset-failed trnd@decode || true")


def test_trnd_serve_supervisor_is_ready_once_its_children_are_and_stops_them(machine):
    """trnd@serve (the supervisor and its prefill + decode children): READY only once both children said
    so on its own notify socket, with the ports they were given; openai through its port; stop drains."""
    m = machine
    m.sh("""cat > /etc/trnd/serve.toml <<'EOF'
model = "/var/lib/trnd/models/tiny"
port = %(api)d
prefill_control_port = %(ctrl)d
prefill_admin_port = %(admin)d
kv_memory_gb = 0.1
threads = 1
EOF
systemctl start trnd@serve""" % {"api": SERVE_PORT, "ctrl": SERVE_PORT + 1, "admin": SERVE_PORT + 2}, timeout=300)
    try:
        s = show(m, "trnd@serve", "ActiveState", "SubState", "StatusText", "MainPID")
        assert (s["ActiveState"], s["SubState"]) == ("active", "running") and s["StatusText"].startswith("serving"), s
        r = m.client("complete", 1, port=SERVE_PORT)
        assert r["status"] == 200 and r["tokens"] == 4, r
        ready = [ln for ln in journal(m, "-u trnd@serve") if "deployment ready:" in ln]
        assert len(ready) == 1 and f"127.0.0.1:{SERVE_PORT + 1}" in ready[0] and f"127.0.0.1:{SERVE_PORT}" in ready[0]
        kids = m.sh(f"cat /proc/{s['MainPID']}/task/*/children").stdout.split()
        assert len(kids) == 2 and all(f"pid {k} " in ready[0] for k in kids), (kids, ready)
    finally:
        m.sh("systemctl stop trnd@serve", timeout=120)
    s = show(m, "trnd@serve", "ActiveState", "Result", "ExecMainStatus")
    assert s == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}, s


def test_security_exposure_of_the_loaded_unit_does_not_get_worse(machine):
    out = machine.sh("systemd-analyze security --no-pager trnd@decode.service").stdout
    found = re.search(r"Overall exposure level for trnd@decode\.service: (\d+(?:\.\d+)?) (\w+)", out)
    assert found, out
    assert float(found[1]) <= EXPOSURE, out


def _seconds(usec: str) -> float:
    """systemctl show's time spans: "5s", "100ms", "1min 30s"."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "min": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|min|h)", usec))
