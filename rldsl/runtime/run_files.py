"""Checked writes into a run directory.

A run directory can fill up (ENOSPC), run out of quota (EDQUOT) or turn
read-only (EROFS) under a running job. The run's appends (the journal,
metrics.jsonl) and its small JSON records (summary.json, a checkpoint's
progress.json) go through here, so that such an error

- leaves whole lines only: a failed append is cut back to where it began,
  so the next append (after space is freed) starts on a fresh line;
- reaches the user as one ``RunDirectoryError`` that names the directory,
  the file and the cause, and says how to go on; no traceback.

``repair_torn_tail`` mends a file that a process killed mid-write left
with a partial last line, before anything is appended to it again.
Standard library only: every layer may use it.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from rldsl.runtime.atomic import write_json_atomically

# The errors that mean "the directory cannot take more", as opposed to a bug.
_CAUSES = {errno.ENOSPC: "is full", errno.EDQUOT: "is over its disk quota", errno.EROFS: "is read-only"}
_TAIL_BLOCK = 1 << 16


class RunDirectoryError(RuntimeError):
    """A write into the run directory failed; the run stops here, resumable."""

    def __init__(self, path: str | Path, error_number: int | None, reason: str) -> None:
        self.path, self.errno, self.reason = str(path), error_number, reason
        directory = os.path.dirname(self.path)
        self.directory = directory
        what = _CAUSES.get(error_number, "cannot be written")
        code = errno.errorcode.get(error_number, "") if error_number else ""
        super().__init__(f"the run directory {directory} {what}: writing {os.path.basename(self.path)} failed "
                         f"({code + ': ' if code else ''}{reason})")

    def __reduce__(self):  # crosses process boundaries (Ray) whole
        return type(self), (self.path, self.errno, self.reason)

    @property
    def help(self) -> str:
        fix = {errno.EROFS: "make it writable"}.get(self.errno, "free space")
        return (f"{fix}, then continue the run with `rldsl run --resume {self.directory}` (repeat --steps and "
                "--address if you gave them); what was written ends on whole lines")


def checked(path: Path, error: OSError) -> RunDirectoryError:
    return RunDirectoryError(path, error.errno, error.strerror or str(error))


def append_text(path: Path, text: str, sync: bool = True) -> None:
    """Append ``text`` (whole lines) in one write; on failure the file is cut
    back to its size before, and ``RunDirectoryError`` is raised."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab", buffering=0) as file:  # unbuffered: nothing left to land after a cut-back
            start = file.seek(0, os.SEEK_END)
            try:
                _write_all(file, text.encode())
                if sync:
                    os.fsync(file.fileno())
            except OSError:
                _cut_back(file, start)
                raise
    except OSError as error:
        raise checked(path, error) from None


def _write_all(file, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[file.write(view):]


def _cut_back(file, size: int) -> None:
    """Undo a partial append; on a read-only file system this fails too, and
    the reader's torn-line repair mends it later."""
    try:
        file.truncate(size)
    except OSError:
        pass


def write_json_checked(path: Path, payload: dict, indent: int | None = None) -> None:
    """``write_json_atomically`` (whole or not at all), its failure a
    ``RunDirectoryError``; a temporary file it could not finish is removed."""
    path = Path(path)
    try:
        write_json_atomically(path, payload, indent=indent)
    except OSError as error:
        try:
            path.with_suffix(".tmp").unlink(missing_ok=True)
        except OSError:
            pass
        raise checked(path, error) from None


def repair_torn_tail(path: Path) -> str | None:
    """Make ``path`` end on a whole line before it is appended to. A last
    line without its newline is either a complete JSON record (the process
    died just before the newline: it is kept, the newline added) or a
    fragment (it is cut off). Returns what was done, None when nothing was."""
    path = Path(path)
    try:
        with open(path, "rb+") as file:
            size = file.seek(0, os.SEEK_END)
            if size == 0 or _last_byte(file, size) == b"\n":
                return None
            start = _last_line_start(file, size)
            file.seek(start)
            tail = file.read(size - start)
            if _is_json_record(tail):
                file.write(b"\n")
                return f"{path}: its last line had no newline (the writer was cut off); the newline was added"
            file.truncate(start)
            file.flush()
            os.fsync(file.fileno())
    except FileNotFoundError:
        return None
    except OSError as error:
        raise checked(path, error) from None
    return (f"{path}: its last line was cut off mid-write ({size - start} bytes, by a process that died or a full "
            "disk) and was removed before appending")


def _last_byte(file, size: int) -> bytes:
    file.seek(size - 1)
    return file.read(1)


def _last_line_start(file, size: int) -> int:
    """The offset just after the last newline (0 when there is none)."""
    end = size
    while end > 0:
        begin = max(0, end - _TAIL_BLOCK)
        file.seek(begin)
        found = file.read(end - begin).rfind(b"\n")
        if found >= 0:
            return begin + found + 1
        end = begin
    return 0


def _is_json_record(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False
