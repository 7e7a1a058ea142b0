"""A real link to measure the handoff on: a network namespace joined to this one by a veth pair, shaped.

Prefill runs inside the namespace (`Link.wrap` prefixes `ip netns exec`), decode and the client in this
one: the two roles are in two network namespaces and every byte between them, control plane and NIXL
alike, crosses the veth. Both ends are shaped the same way:
- rate (and delay and loss) with netem where the kernel has it (sch_netem);
- else rate with tbf, loss with an nftables netdev rule (numgen random) on each end's egress, and no
  delay: some kernels (this project's VMs: no sch_netem, no modules to load) have neither netem nor a
  delay action. `Link.shaping` says which was set up, for the figures' legend.
The roles are told to move pages over TCP on the veth (UCX_TLS=tcp, FI_PROVIDER=tcp): on one host UCX
would otherwise pick shared memory and the bytes would never see the link.

Needs root, iproute2 (ip, tc) and, for loss without netem, nftables; `unavailable()` says what is
missing. The namespace, the veth pair and the rules are removed on exit, and a name left by a killed
run is removed before a new one is made.
"""

from __future__ import annotations

import os
import shutil
import subprocess

NS_PREFIX = "trnd-link"


def _run(*cmd: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    r = subprocess.run(full, capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(full)}: {(r.stderr or r.stdout).strip()}")
    return r


def unavailable() -> str | None:
    """Why a shaped link cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (apt-get install {pkg})"
    return None


def has_netem() -> bool:
    """Whether the kernel takes a netem qdisc (tried on a throwaway dummy device)."""
    dev = f"trndnetem{os.getpid() % 10000}"
    if _run("ip", "link", "add", dev, "type", "dummy", check=False).returncode:
        return False
    try:
        return _run("tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        _run("ip", "link", "del", dev, check=False)


class Link:
    """`with Link(rate="1gbit", delay_ms=0.2, loss_pct=0.0) as link:` -- link.ns_addr is the far end
    (bind prefill there), link.host_addr this end; link.wrap(cmd) runs cmd in the namespace."""

    def __init__(self, rate: str = "1gbit", delay_ms: float = 0.2, loss_pct: float = 0.0, index: int | None = None):
        self.rate, self.delay_ms, self.loss_pct = rate, delay_ms, loss_pct
        self.index = index if index is not None else os.getpid() % 200 + 20
        self.ns = f"{NS_PREFIX}{self.index}"
        self.host_if, self.ns_if = f"tlh{self.index}", f"tln{self.index}"
        # An address pair of our own inside this namespace pair only (never routed anywhere else).
        self.host_addr, self.ns_addr = f"10.213.{self.index}.1", f"10.213.{self.index}.2"
        self.shaping = ""

    def __enter__(self) -> "Link":
        why = unavailable()
        if why:
            raise RuntimeError(f"no shaped link here: {why}")
        self.close()  # a namespace of the same name a killed run left behind
        try:
            _run("ip", "netns", "add", self.ns)
            _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _run("ip", "link", "set", self.ns_if, "netns", self.ns)
            _run("ip", "addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
            _run("ip", "link", "set", self.host_if, "up")
            _run("ip", "addr", "add", f"{self.ns_addr}/30", "dev", self.ns_if, ns=self.ns)
            _run("ip", "link", "set", self.ns_if, "up", ns=self.ns)
            _run("ip", "link", "set", "lo", "up", ns=self.ns)
            self.shape(self.rate, self.delay_ms, self.loss_pct)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def shape(self, rate: str, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """(Re)shape both directions."""
        self.rate, self.delay_ms, self.loss_pct = rate, delay_ms, loss_pct
        netem = has_netem()
        for dev, ns in ((self.host_if, None), (self.ns_if, self.ns)):
            _run("tc", "qdisc", "del", "dev", dev, "root", check=False, ns=ns)
            if netem:
                args = ["rate", rate] + (["delay", f"{delay_ms}ms"] if delay_ms else []) + \
                       (["loss", f"{loss_pct}%"] if loss_pct else [])
                _run("tc", "qdisc", "add", "dev", dev, "root", "netem", *args, "limit", "100000", ns=ns)
            else:
                # burst: one 64 KiB GSO segment and some (tbf drops what exceeds it); 50 ms of queue
                _run("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                     "latency", "50ms", ns=ns)
        self._loss_rules(0.0 if netem else loss_pct)
        self.shaping = (f"netem rate {rate}" + (f" delay {delay_ms} ms" if delay_ms else "")
                        + (f" loss {loss_pct}%" if loss_pct else "")) if netem else (
            f"tbf rate {rate}" + (f", nftables loss {loss_pct}%" if loss_pct else "")
            + (", no delay (the kernel has no sch_netem)" if delay_ms else ""))

    def _loss_rules(self, loss_pct: float) -> None:
        for dev, ns in ((self.host_if, None), (self.ns_if, self.ns)):
            _run("nft", "delete", "table", "netdev", f"trndloss_{dev}", check=False, ns=ns)
        if not loss_pct:
            return
        if shutil.which("nft") is None:
            raise RuntimeError("a lossy link without netem needs nftables (apt-get install nftables)")
        per_million = max(1, round(loss_pct * 1e4))
        for dev, ns in ((self.host_if, None), (self.ns_if, self.ns)):
            rules = (f"table netdev trndloss_{dev} {{\n chain egress {{\n  type filter hook egress device \"{dev}\" "
                     f"priority 0;\n  numgen random mod 1000000 < {per_million} drop\n }}\n}}\n")
            _nft(rules, ns)

    def set_up(self, up: bool) -> None:
        """Cut (or restore) the link: the namespace's end goes down, both directions stop."""
        _run("ip", "link", "set", self.ns_if, "up" if up else "down", ns=self.ns)

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *cmd]

    def env(self, backend: str = "ucx") -> dict[str, str]:
        """What a role on either end needs so that its pages cross the veth over TCP."""
        return {"UCX_TLS": "tcp", "FI_PROVIDER": "tcp"} if backend == "ucx" else {"FI_PROVIDER": "tcp"}

    def close(self) -> None:
        if shutil.which("nft"):
            _run("nft", "delete", "table", "netdev", f"trndloss_{self.host_if}", check=False)
        _run("ip", "link", "del", self.host_if, check=False)  # removes the peer end too
        _run("ip", "netns", "del", self.ns, check=False)  # and the namespace's own rules


def _nft(rules: str, ns: str | None) -> None:
    full = (["ip", "netns", "exec", ns] if ns else []) + ["nft", "-f", "-"]
    r = subprocess.run(full, input=rules, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise RuntimeError(f"nft: {r.stderr.strip()}")
