"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd in the foreground, as
root, with a configuration of their own (``SLURM_CONF``) in a private directory, on free
loopback ports, with a private munge socket; nothing of the machine's own Slurm or munge is
used or changed.

The node has one GPU GRES backed by a fake character device (``mknod ... c 195 0``: Slurm needs
a ``File=`` for a GPU and never opens it) and ``shard`` GRES on it, so that two jobs asking
``--gres=shard:1`` hold the same GPU at once. Prolog, epilog and TaskProlog are the given
scripts, run through small wrappers that set their environment (their defaults live under
/etc and /run).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from timeslice_tools.dev._procs import free_ports

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel")
NODE = "tsnode"
SHARDS = 4


def missing_binaries() -> list[str]:
    """The Slurm and munge programs this machine lacks (Debian: slurm-wlm, munge)."""
    return [name for name in DAEMONS if shutil.which(name) is None]


class SlurmError(RuntimeError):
    """A daemon did not start, or a job did not finish; the message carries the logs."""


class SlurmNode:
    """munged + slurmctld + slurmd for one node ``tsnode`` with ``gpu:1,shard:4``.

    ``scripts`` maps ``Prolog``, ``Epilog`` and ``TaskProlog`` to script paths; ``script_env``
    is set for each of them (by a wrapper that execs the script).
    """

    def __init__(self, scripts: Mapping[str, Path], script_env: Mapping[str, str]) -> None:
        # munged insists that every directory above its socket is searchable by all (pytest's
        # tmp_path is 0700), so the whole tree lives in a 0755 directory of its own.
        self.dir = Path(tempfile.mkdtemp(prefix="timeslice-slurm-", dir="/tmp"))
        self.dir.chmod(0o755)
        self.conf = self.dir / "etc" / "slurm.conf"
        self.log_dir = self.dir / "log"
        self._scripts = dict(scripts)
        self._script_env = dict(script_env)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- commands ------------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm's commands (sbatch, squeue...): our configuration."""
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_CONF": str(self.conf)}

    def command(self, *argv: str, env: Mapping[str, str] | None = None, timeout: float = 20) -> str:
        result = subprocess.run(
            argv,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise SlurmError(f"{shlex.join(argv)}: {result.stderr.strip()}\n{self.logs()}")
        return result.stdout

    def sbatch(self, script: Path, *options: str, env: Mapping[str, str]) -> int:
        """Submit ``script``; ``env`` is the submitter's whole environment (what --export=ALL
        passes on). Returns the job id."""
        out = self.command("sbatch", "--parsable", *options, str(script), env=env)
        return int(out.strip().split(";")[0])

    def jobs(self) -> dict[int, str]:
        """Job id -> state (PENDING, RUNNING, COMPLETING...) of the jobs Slurm still lists."""
        out = self.command("squeue", "--noheader", "--format=%i %T")
        return {int(i): state for i, state in (line.split() for line in out.splitlines())}

    def job_field(self, job: int, field: str) -> str:
        """One ``Field=value`` of ``scontrol show job`` (while Slurm remembers the job)."""
        for word in self.command("scontrol", "show", "job", str(job)).split():
            if word.startswith(f"{field}="):
                return word.partition("=")[2]
        raise SlurmError(f"job {job} has no {field}")

    def logs(self, lines: int = 30) -> str:
        parts = []
        for path in sorted(self.log_dir.glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    # -- life ----------------------------------------------------------------------------------

    def start(self, timeout: float = 30) -> SlurmNode:
        try:
            self._configure()
            self._start_munge()
            self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
            self._spawn("slurmd", ["slurmd", "-D", "-N", NODE])
            deadline = time.monotonic() + timeout
            while True:
                state = self._node_state()
                if state.startswith("IDLE") and "DRAIN" not in state:
                    return self
                for name, proc in self._procs.items():
                    if proc.poll() is not None:
                        raise SlurmError(f"{name} exited ({proc.returncode})\n{self.logs()}")
                if time.monotonic() > deadline:
                    raise SlurmError(f"node {NODE} is {state!r} after {timeout}s\n{self.logs()}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel what runs, stop the daemons (SIGTERM, then SIGKILL), remove the directory."""
        if self._procs.get("slurmctld") is not None and self._procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--user=root"], env=self.env, timeout=20, check=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    if not self.jobs():
                        break
                except (SlurmError, subprocess.TimeoutExpired):
                    break
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SlurmNode:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- inside --------------------------------------------------------------------------------

    def _node_state(self) -> str:
        try:
            out = self.command("sinfo", "--noheader", "--Node", "--format=%T", timeout=5)
        except (SlurmError, subprocess.TimeoutExpired):
            return "unreachable"
        return out.strip().upper() or "unknown"

    def _configure(self) -> None:
        for sub in ("etc", "log", "state", "spool", "munge", "msock", "dev", "bin"):
            (self.dir / sub).mkdir(mode=0o755)
        (self.dir / "munge").chmod(0o700)
        gpu = self.dir / "dev" / "fake-nvidia0"
        # A GPU GRES needs a device file; Slurm only records it (a job's cgroup would allow it).
        os.mknod(gpu, 0o600 | 0o020000, os.makedev(195, 0))
        hooks = {}
        for name, script in self._scripts.items():
            wrapper = self.dir / "bin" / name.lower()
            exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self._script_env.items())
            wrapper.write_text(f"#!/bin/bash\n{exports}exec {shlex.quote(str(script))}\n")
            wrapper.chmod(0o755)
            hooks[name] = wrapper
        ctld_port, slurmd_port = free_ports(2)
        host = socket.gethostname().split(".")[0]
        d = self.dir
        lines = [
            "ClusterName=timeslice-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={d}/msock/munge.sock",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd.log",
            # No cgroups in a container: plain process tracking, no task binding.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            # What deploy/slurm/slurm.conf.example asks for:
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu,shard",
            f"Prolog={hooks['Prolog']}",
            f"Epilog={hooks['Epilog']}",
            "PrologFlags=Alloc",
            f"TaskProlog={hooks['TaskProlog']}",
            f"NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 CPUs=4 RealMemory=1000 "
            f"Gres=gpu:1,shard:{SHARDS} State=UNKNOWN",
            f"PartitionName=gpu Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        (self.dir / "etc" / "gres.conf").write_text(
            f"NodeName={NODE} Name=gpu File={gpu}\nNodeName={NODE} Name=shard Count={SHARDS}\n"
        )

    def _start_munge(self) -> None:
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = self.dir / "msock" / "munge.sock"
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={self.dir / 'munge' / 'munged.pid'}",
                f"--seed-file={self.dir / 'munge' / 'munged.seed'}",
                f"--log-file={self.log_dir / 'munged.log'}",
            ],
        )
        deadline = time.monotonic() + 10
        while not sock.exists():
            if self._procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise SlurmError(f"munged did not start\n{self.logs()}")
            time.sleep(0.05)

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = (self.log_dir / f"{name}.out").open("wb")
        try:
            self._procs[name] = subprocess.Popen(
                argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            out.close()
