"""A throwaway PostgreSQL server for the tests: `initdb` + `pg_ctl` into a fresh temp dir, on a
free localhost port, trust authentication, fsync off. The binaries are found on PATH or under
/usr/lib/postgresql/<version>/bin (Debian's `postgresql` package puts them there, off PATH).
PostgreSQL refuses to run as root, so as root the server runs as the unprivileged user `nobody`
(the temp dir is handed to it). `find_binaries` says why there is no server; the fixture skips
with that reason, or fails where CKGEN_REQUIRE_POSTGRES=1 (CI installs the server)."""
from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

REQUIRE_ENV = "CKGEN_REQUIRE_POSTGRES"


def find_binaries() -> tuple[Path | None, str]:
    """(the folder holding initdb and pg_ctl, "") or (None, why not)."""
    on_path = shutil.which("initdb"), shutil.which("pg_ctl")
    if all(on_path):
        return Path(on_path[0]).resolve().parent, ""

    def version(d: str) -> tuple[int, ...]:
        return tuple(int(p) for p in Path(d).parent.name.split(".") if p.isdigit())

    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True):
        if os.access(f"{d}/initdb", os.X_OK) and os.access(f"{d}/pg_ctl", os.X_OK):
            return Path(d), ""
    return None, ("no PostgreSQL server binaries (initdb, pg_ctl) on PATH or in /usr/lib/postgresql/*/bin; "
                  "install the distribution's server (apt-get install postgresql)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running server; `url(db)` is a SQLAlchemy/optuna URL, `create_db()` a fresh database."""

    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.base = Path(tempfile.mkdtemp(prefix="ckgen-pg-"))
        self.data = self.base / "data"
        self.port = _free_port()
        self.as_user: dict = {}
        if os.geteuid() == 0:  # initdb and postgres refuse root: run them as nobody
            pw = pwd.getpwnam("nobody")
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
            self.as_user = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        env = {**os.environ, "LC_ALL": "C", "LANG": "C", "HOME": str(self.base)}
        self.env = env
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        opts = (f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.base / "server.log"), "-o", opts, "-w",
                  "-t", "60", "start")

    def _run(self, tool: str, *args: str) -> None:
        out = subprocess.run([str(self.bindir / tool), *args], capture_output=True, text=True, env=self.env,
                             cwd=self.base, timeout=120, **self.as_user)
        if out.returncode != 0:
            log = self.base / "server.log"
            extra = log.read_text()[-2000:] if log.is_file() else ""
            raise RuntimeError(f"{tool} failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-2000:]}{extra}")

    def url(self, db: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{db}"  # psycopg 3, whatever SQLAlchemy's default

    def create_db(self) -> str:
        """A new, empty database; its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.base, ignore_errors=True)
