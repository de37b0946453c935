"""The file system side of saved caches: the output path checked before any work, the atomic write,
and the one message for a cache file that is not there (docs/cache.md#atomic-write)."""

from __future__ import annotations

import errno
import os
import stat
import tempfile


def missing_file(path) -> FileNotFoundError:
    """The ``FileNotFoundError`` for a cache file that does not exist, one message wherever it is read
    (``load_cache``, ``Document.load``, ``jacap inspect`` / ``ask`` / ``run --cache``), with ``errno``
    ``ENOENT`` as the operating system's (its text is the message alone, no ``[Errno 2]``)."""
    error = FileNotFoundError(f"no cache file at {os.fspath(path)!r} (check the path; jacap compress, "
                              "Document.save or save_cache write one)")
    error.errno = errno.ENOENT
    return error


def check_output_path(path) -> str:
    """Check, before any work, that a cache file can be written at ``path`` (a file name, in an
    existing, writable folder; an existing file there would be replaced). Returns ``path`` as a
    string. Raises ``ValueError`` naming ``path``: a directory, a missing folder, a folder where no
    file can be created (probed with a temporary file, removed at once)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"cannot write the cache file {path!r}: it is a directory; give a file name "
                         f"such as {os.path.join(path, 'doc.safetensors')!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write the cache file {path!r}: folder {folder!r} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".jacap-", suffix=".tmp", dir=folder)
    except OSError as err:
        raise ValueError(f"cannot write the cache file {path!r}: folder {folder!r} is not writable "
                         f"({err.strerror or err})") from None
    os.close(fd)
    os.unlink(probe)
    return path


def _umask() -> int:
    """The process's file mode creation mask (Linux's ``/proc/self/status``, else set and put back)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _file_mode(path) -> int:
    """The permission bits a file written at ``path`` gets: those of the file it replaces, else what
    ``open(path, "w")`` would give (``0o666`` less the umask); ``tempfile.mkstemp`` alone gives 0600."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _write_atomically(path, data: bytes) -> None:
    """Write ``data`` to a temporary file in ``path``'s folder, flush, fsync, rename it over ``path``,
    fsync the folder; on any error the temporary file is removed and a previous ``path`` is intact.
    The file's permission bits are the replaced file's, else the umask's (:func:`_file_mode`)."""
    folder = os.path.dirname(os.path.abspath(path))
    mode = _file_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=".jacap-", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
