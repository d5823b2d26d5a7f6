"""Two "hosts" on one machine, for MPI across hosts: two network namespaces joined by a veth pair.

Each host is a network namespace with its own address (10.231.0.1 and 10.231.0.2 on the pair's
two ends) and, for every process started in it, its own hostname (a UTS namespace). MPICH's
launcher (hydra) starts the ranks of the other host as it would on a cluster, through "ssh": here
``HYDRA_LAUNCHER_EXEC`` names a small script that does ``ip netns exec`` instead. ``mpiexec``
itself runs on the first host, so the proxy on the second connects back to it over the veth
pair, and the ranks of different hosts talk over TCP while the ranks of one host share memory
(``environment``: UCX is held to TCP).

    with TwoHosts(rate="200mbit") as rig:          # the link slowed by a token bucket (tc tbf)
        hostfile = rig.hostfile(per_host=4)
        code, output = rig.run(["./run_mpi.sh", "--hostfile", hostfile, "-n", "8", "lessons/06_3d_parallel.py"],
                               timeout=120)

Needs root, ``ip`` and ``unshare`` (``tc`` for a rate). Every name carries this process's id, so
runs side by side do not meet; ``close`` (and leaving the ``with``) kills what is left in the
namespaces and deletes them, with the veth pair inside; a run killed before it could clean up is
cleaned by the next one (``remove_stale``). Nothing of the machine's own network is touched: the
veth pair is made inside the namespaces. The one file outside the run's temporary directory is
``/etc/netns/NAME/hosts``, the hosts file ``ip netns exec`` shows inside a namespace, so that each
host can resolve the other's name, as on a cluster.
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time

PREFIX = "minipar-h"  # namespaces and hostnames: minipar-h<pid>a, minipar-h<pid>b
SUBNET = "10.231.0"
NETNS_ETC = "/etc/netns"
LINK = "hostlink"  # each end's name in its own namespace: the same on both hosts, as eth0 on a cluster

# What hydra runs instead of ssh: `launcher [ssh options] HOST COMMAND...`. Like ssh, it joins the
# command's words and gives them to a shell, here in HOST's network namespace under HOST's name,
# and with a bare environment as a fresh login has: what the ranks need, hydra must carry.
LAUNCHER = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
case "$host" in
{cases}
  *) echo "two-hosts launcher: unknown host $host" >&2; exit 255 ;;
esac
exec env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin ip netns exec "$host" unshare --uts sh -c "hostname $host && exec $*"
"""


def missing():
    """Why this machine cannot build the rig, or None where it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    return None


def _sh(*args, check=True):
    return subprocess.run(args, capture_output=True, text=True, timeout=30, check=check)


def namespaces():
    listing = _sh("ip", "netns", "list", check=False).stdout.split()
    return [word for word in listing if word.startswith(PREFIX)]


def remove_stale():
    """Delete the namespaces (and their /etc/netns files) of earlier runs whose process is gone."""
    for name in namespaces():
        pid = name[len(PREFIX):-1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _delete(name)


def _kill_in(name):
    """Kill every process in the network namespace ``name``."""
    for pid in _sh("ip", "netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _delete(name):
    _kill_in(name)  # a namespace with processes in it would outlive `ip netns del`
    _sh("ip", "netns", "del", name, check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)


class TwoHosts:
    def __init__(self, rate=None):
        """``rate``: tc's rate ("200mbit") for both directions of the link; None: full speed."""
        why = missing() or (rate and shutil.which("tc") is None and "no `tc` on PATH to slow the link")
        if why:
            raise RuntimeError(f"two-hosts rig: {why}")
        remove_stale()
        tag = f"{PREFIX}{os.getpid()}"
        self.hosts = (tag + "a", tag + "b")
        self.addresses = (f"{SUBNET}.1", f"{SUBNET}.2")
        self.dir = tempfile.mkdtemp(prefix="two_hosts_")
        self.launcher = os.path.join(self.dir, "launcher.sh")
        try:
            self._build(rate)
        except BaseException:
            self.close()
            raise

    def _build(self, rate):
        a, b = self.hosts
        for host in self.hosts:
            _delete(host)  # a leftover of this very pid (a reused process id)
            _sh("ip", "netns", "add", host)
        _sh("ip", "link", "add", LINK, "netns", a, "type", "veth", "peer", "name", LINK, "netns", b)
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{ip} {h}\n" for ip, h in zip(self.addresses, self.hosts))
        for host, address in zip(self.hosts, self.addresses):
            _sh("ip", "-n", host, "addr", "add", f"{address}/24", "dev", LINK)
            _sh("ip", "-n", host, "link", "set", LINK, "up")
            _sh("ip", "-n", host, "link", "set", "lo", "up")
            os.makedirs(os.path.join(NETNS_ETC, host), exist_ok=True)
            with open(os.path.join(NETNS_ETC, host, "hosts"), "w") as f:
                f.write(hosts_file)
            if rate:
                # A token bucket: `rate` on average, bursts of 64 KiB, packets wait at most 50 ms.
                _sh("ip", "netns", "exec", host, "tc", "qdisc", "add", "dev", LINK, "root", "tbf",
                    "rate", rate, "burst", "64kb", "latency", "50ms")
        self._wait_for_carrier()
        with open(self.launcher, "w") as f:
            f.write(LAUNCHER.format(cases="\n".join(f"  {h}) ;;" for h in self.hosts)))
        os.chmod(self.launcher, 0o755)

    def _wait_for_carrier(self, seconds=10):
        """A veth pair's ends come up a moment after they are set up; UCX, looking for its
        interfaces before that, would find none but the loopback."""
        deadline = time.monotonic() + seconds
        while True:
            states = [_sh("ip", "netns", "exec", h, "cat", f"/sys/class/net/{LINK}/operstate").stdout.strip()
                      for h in self.hosts]
            if states == ["up", "up"]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"two-hosts rig: the link is not up after {seconds} s ({states})")
            time.sleep(0.05)

    def hostfile(self, per_host=4, name="hostfile"):
        """MPICH's hostfile, ``host:slots`` per line: ranks fill the first host's slots, then the next's."""
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write("".join(f"{h}:{per_host}\n" for h in self.hosts))
        return path

    def environment(self, env=None):
        """``env`` (default: this process's) with hydra told to start remote ranks through the
        launcher, and UCX (the MPICH wheel's network layer) told to use TCP: it sees that the two
        hosts share one kernel and would otherwise pass their messages through shared memory, at
        GB/s, past the link (measured: 3.8 GB/s instead of the link's 200 Mbit/s). Between the ranks
        of one host MPICH's own shared memory is used either way."""
        env = dict(env if env is not None else os.environ, HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=self.launcher)
        env.setdefault("UCX_TLS", "tcp")
        env.setdefault("UCX_NET_DEVICES", LINK)  # not the loopback, which UCX's TCP would also try
        return env

    def link_bytes(self):
        """Bytes both ends of the link have sent so far (TCP's headers included)."""
        total = 0
        for host in self.hosts:
            total += int(_sh("ip", "netns", "exec", host, "cat", f"/sys/class/net/{LINK}/statistics/tx_bytes").stdout)
        return total

    def command(self, argv):
        """``argv`` as started on the first host (its namespace and hostname)."""
        return ["ip", "netns", "exec", self.hosts[0], "unshare", "--uts", "sh", "-c",
                f'hostname {self.hosts[0]} && exec "$@"', "sh", *argv]

    def run(self, argv, timeout, env=None, cwd=None):
        """Run ``argv`` on the first host in a session of its own; on timeout kill the session.
        Returns (exit code, stdout and stderr together)."""
        proc = subprocess.Popen(self.command(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=self.environment(env), cwd=cwd, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            self.kill_all()
            out, _ = proc.communicate()
            return None, out
        return proc.returncode, out

    def kill_all(self):
        """Kill every process in the two namespaces (the remote proxy is not in the launcher's session)."""
        for host in self.hosts:
            _kill_in(host)

    def close(self):
        for host in self.hosts:
            _delete(host)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
