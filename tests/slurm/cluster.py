"""A real SLURM cluster on loopback for the test suite: munged, slurmctld and N slurmd on this machine.

Adapted from shared/reference/slurm/setup_local_slurm.sh (Debian bookworm, slurm-wlm 22.05, run as root), with
three differences that matter for a test harness:
- every daemon runs in the foreground (`-D`/`-F`) as our child, so we hold its exact PID and stop it by that
  PID (SIGTERM, then SIGKILL after a grace period) -- never by name;
- the config lives in a private directory passed as SLURM_CONF, so /etc/slurm is never touched;
- PIDs are also written to `<base>/pids`, so a session killed before its teardown ran has its leftovers
  stopped by the next one (only PIDs whose /proc/PID/comm still names the daemon).
`find_or_install()` installs the packages with apt-get when allowed (CI), the only system-wide change besides
munge's runtime dirs.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "munged"]
CTLD_PORT = 6817
SLURMD_PORT0 = 6830  # node i listens on SLURMD_PORT0 + i (several slurmd on one host need distinct ports)


class SlurmUnavailable(RuntimeError):
    """SLURM cannot run here (not root, packages missing and not installable): the tests skip with this."""


def find_or_install(*, install: bool) -> None:
    if os.geteuid() != 0:
        raise SlurmUnavailable("needs root (slurmd and munged run as root/munge on loopback)")
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if not missing:
        return
    if not install or shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"SLURM binaries missing ({', '.join(missing)}): "
                               f"apt-get install --no-install-recommends {' '.join(PACKAGES)}")
    # policy-rc.d keeps the packages' init scripts from starting daemons with a default config.
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise SlurmUnavailable(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
    finally:
        if made_policy:
            policy.unlink(missing_ok=True)


def _alive(pid: int, comm: str) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == comm
    except OSError:
        return False


def stop_pids(procs: list[tuple[int, str]], *, grace_s: float = 20.0) -> None:
    """SIGTERM each (pid, comm) still running as that comm, wait up to grace_s, then SIGKILL the rest."""
    live = [(p, c) for p, c in procs if _alive(p, c)]
    for pid, _ in live:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        for pid, _ in live:  # reap our own children so they do not linger as zombies
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        live = [(p, c) for p, c in live if _alive(p, c)]
        time.sleep(0.1)
    for pid, _ in live:
        os.kill(pid, signal.SIGKILL)


class LocalSlurm:
    """`with LocalSlurm(base, nodes=2) as cluster:` -> a running cluster; `cluster.env` for sbatch & co."""

    def __init__(self, base: Path, *, nodes: int = 2, cpus: int = 2) -> None:
        self.base, self.nodes, self.cpus = Path(base), nodes, cpus
        self.conf = self.base / "slurm.conf"
        self.node_names = [f"node{i + 1}" for i in range(nodes)]
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen] = []
        self._pid_dir = self.base / "pids"

    # -- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._stop_stale()
        for sub in ("state", "log", "pids"):
            shutil.rmtree(self.base / sub, ignore_errors=True)
            (self.base / sub).mkdir(parents=True)
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        for name in self.node_names:
            (self.base / "state" / f"spool.{name}").mkdir()
            self._spawn("slurmd", ["slurmd", "-D", "-N", name, "-f", str(self.conf)], tag=name)
        self._wait_idle(timeout_s=60)

    def stop(self) -> None:
        """Cancel jobs (their slurmstepd outlive slurmd otherwise), then stop every daemon we started, by PID."""
        if self._procs and any(p.poll() is None for p in self._procs):
            self.scontrol_quiet(["scancel", "--full", "--quiet", "-u", "root"])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self._busy():
                time.sleep(0.3)
        slurm = [(p.pid, _comm(p)) for p in self._procs if _comm(p) != "munged"]
        munge = [(p.pid, "munged") for p in self._procs if _comm(p) == "munged"]
        stop_pids(slurm)
        stop_pids(munge)
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        shutil.rmtree(self._pid_dir, ignore_errors=True)

    # -- helpers for tests -------------------------------------------------------------------------------
    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("timeout", 120)
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, **kw)

    def scontrol_quiet(self, cmd: list[str]) -> None:
        try:
            self.run(cmd, timeout=15)
        except subprocess.TimeoutExpired:
            pass

    def job_state(self, job_id: str) -> str:
        out = self.run(["scontrol", "show", "job", job_id]).stdout
        for tok in out.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return "UNKNOWN"

    def logs_tail(self, n: int = 30) -> str:
        parts = []
        for f in sorted((self.base / "log").glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-n:]
            parts.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # -- internals ---------------------------------------------------------------------------------------
    def _spawn(self, comm: str, cmd: list[str], *, tag: str = "", **kw) -> None:
        log = open(self.base / "log" / f"{comm}{'.' + tag if tag else ''}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, start_new_session=True, **kw)  # own session: Ctrl-C spares it
        log.close()
        proc.comm = comm  # type: ignore[attr-defined]
        self._procs.append(proc)
        (self._pid_dir / f"{comm}{'.' + tag if tag else ''}.pid").write_text(f"{proc.pid} {comm}\n")
        time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError(f"{comm} exited with {proc.returncode} at start:\n{self.logs_tail()}")

    def _stop_stale(self) -> None:
        if not self._pid_dir.is_dir():
            return
        stale = []
        for f in self._pid_dir.glob("*.pid"):
            pid, comm = f.read_text().split()
            stale.append((int(pid), comm))
        stop_pids([s for s in stale if s[1] != "munged"])
        stop_pids([s for s in stale if s[1] == "munged"])

    def _start_munge(self) -> None:
        if subprocess.run(["munge", "-n"], capture_output=True, stdin=subprocess.DEVNULL).returncode == 0:
            return  # a munged we did not start is already serving: use it, leave it alone
        key = Path("/etc/munge/munge.key")
        if not key.exists() or key.stat().st_size == 0:
            subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        for d, mode in (("/run/munge", 0o755), ("/var/log/munge", 0o700), ("/var/lib/munge", 0o711)):
            Path(d).mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
            Path(d).chmod(mode)
        self._spawn("munged", ["/usr/sbin/munged", "-F", "--force"], user="munge", group="munge")
        deadline = time.monotonic() + 10
        while subprocess.run(["munge", "-n"], capture_output=True, stdin=subprocess.DEVNULL).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not come up:\n{self.logs_tail()}")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        mem = _real_memory_mb() // self.nodes
        b = self.base
        lines = [
            "# written by tests/slurm/cluster.py",
            "ClusterName=shardtune-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={CTLD_PORT}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            "MpiDefault=none", "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "SchedulerType=sched/backfill", "SchedulerParameters=batch_sched_delay=0",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",  # CPUs= may exceed the real core count
            "ReturnToService=2",
            "MinJobAge=300",  # finished jobs stay visible to scontrol for 5 minutes
            "KillWait=10",  # SIGTERM -> SIGKILL grace for cancelled steps
            f"StateSaveLocation={b}/state",
            f"SlurmdSpoolDir={b}/state/spool.%n",
            f"SlurmctldPidFile={b}/state/slurmctld.pid",
            f"SlurmdPidFile={b}/state/slurmd.%n.pid",
            f"SlurmctldLogFile={b}/log/slurmctld.log",
            f"SlurmdLogFile={b}/log/slurmd.%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
        ]
        for i, name in enumerate(self.node_names):
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={SLURMD_PORT0 + i} "
                         f"CPUs={self.cpus} Sockets=1 CoresPerSocket={self.cpus} ThreadsPerCore=1 "
                         f"RealMemory={mem} State=UNKNOWN")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _wait_idle(self, *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{_comm(p)} exited with {p.returncode}:\n{self.logs_tail()}")
            try:
                out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10).stdout.split()
            except subprocess.TimeoutExpired:
                out = []
            if out[1::2].count("idle") == self.nodes:
                return
            time.sleep(0.3)
        raise RuntimeError(f"the cluster did not become idle in {timeout_s}s:\n{self.logs_tail()}")

    def _busy(self) -> bool:
        try:
            queue = self.run(["squeue", "-h", "-o", "%A"], timeout=10).stdout.strip()
            nodes = self.run(["sinfo", "-h", "-N", "-o", "%t"], timeout=10).stdout.split()
        except subprocess.TimeoutExpired:
            return True
        return bool(queue) or any(s.startswith("comp") for s in nodes)


def _comm(p: subprocess.Popen) -> str:
    return getattr(p, "comm", "")


def _real_memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 - 512
    return 1024
