"""One job per run directory: rank 0 holds an exclusive lock on ``<run>/.lock`` for the life of
``train`` and ``resume``; ``prepare`` holds it while it writes the graphs.

The lock is ``flock(2)`` on that file, so the kernel releases it when the holder dies, however it
dies (on NFS, Linux emulates flock with the server's byte-range locks). The file names the holder
(host, pid, start time): a second job exits 2 naming it; a file left by a job that is gone (its
lock no longer held) is taken over with a warning. A clean end removes the file. ``export``,
``compare`` and ``doctor`` only read and take no lock.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import platform

from ..errors import UsageError

LOCK_FILE = ".lock"


class RunLock:
    def __init__(self, run_dir: str, log=print):
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.log = log
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise a UsageError naming the job that holds it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _describe(os.pread(fd, 4096, 0))
                os.close(fd)
                raise UsageError(f"{os.path.dirname(self.path)} is in use by another trainrun job ({holder}); "
                                 f"wait for it to end, or choose another run.output_dir") from None
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)    # locked a file its holder removed on release: lock the new one
        previous = os.pread(fd, 4096, 0)
        if previous.strip():
            self.log(f"warning: taking over the run directory's lock from a job that is gone "
                     f"({_describe(previous)})")
        me = json.dumps({"host": platform.node(), "pid": os.getpid(),
                         "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode() + b"\n", 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Remove the file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)        # while still holding it: no other job can be between
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def _describe(raw: bytes) -> str:
    try:
        h = json.loads(raw.decode())
        return f"host {h['host']}, pid {h['pid']}, started {h['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
