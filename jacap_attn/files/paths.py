"""The file system side of saved caches: the output path checked before any work, the atomic write,
the header read through one open file, and the one message for a cache file that is not there
(docs/cache.md#atomic-write)."""

from __future__ import annotations

import errno
import json
import os
import secrets
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


def check_input_file(path) -> None:
    """Raise, before any read, ``IsADirectoryError`` naming ``path`` for a folder (the operating system's
    own error for a folder opened as a file is "No such device" or "Is a directory", depending on the
    reader). A missing file is the readers' ``FileNotFoundError`` (:func:`missing_file`)."""
    if os.path.isdir(path):
        error = IsADirectoryError(f"{os.fspath(path)!r} is a folder, not a cache file (give the .safetensors "
                                  "file that jacap compress, Document.save or save_cache wrote)")
        error.errno = errno.EISDIR
        raise error


def check_output_path(path) -> str:
    """Check, before any work, that a cache file can be written at ``path`` (a file name, in an
    existing, writable folder; an existing file there would be replaced). Returns ``path`` as a
    string. Raises ``ValueError`` naming ``path``: an empty path, a directory (or a path ending in a separator), a
    missing folder, a folder where no
    file can be created (probed with a temporary file, removed at once). A symbolic link is checked, as
    :func:`write_atomically` writes, at the file it names."""
    path = os.fspath(path)
    if not path:
        raise ValueError("cannot write the cache file '': give a file name such as 'doc.safetensors'")
    if os.path.isdir(path) or path.endswith(("/", os.sep)):  # 'out/' names a folder, existing or not
        what = "is a directory" if os.path.isdir(path) else "ends in a separator: it names a directory"
        raise ValueError(f"cannot write the cache file {path!r}: it {what}; give a file name "
                         f"such as {os.path.join(path, 'doc.safetensors')!r}")
    folder = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(folder):
        what = "is a file, not a folder" if os.path.exists(folder) else "does not exist"
        raise ValueError(f"cannot write the cache file {path!r}: folder {folder!r} {what}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".jacap-", suffix=".tmp", dir=folder)
    except OSError as err:
        raise ValueError(f"cannot write the cache file {path!r}: folder {folder!r} is not writable "
                         f"({err.strerror or err})") from None
    os.close(fd)
    os.unlink(probe)
    return path


def write_atomically(path, data: bytes) -> None:
    """Write ``data`` to a temporary file in ``path``'s folder, flush, fsync, rename it over ``path``,
    fsync the folder; on any error the temporary file is removed and a previous ``path`` is intact.
    The file's permission bits are those of the file it replaces, else what ``open(path, "w")`` gives
    (``0o666`` less the umask, which the kernel applies; ``tempfile.mkstemp`` would give 0600). A symbolic
    link stays a link: the file it names is the one replaced."""
    path = os.path.realpath(path)
    folder = os.path.dirname(path)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    tmp = os.path.join(folder, f".jacap-{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        if mode is not None:
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


def header_length(data: bytes) -> int:
    """The JSON header's length in bytes, from the first 8 bytes of a safetensors file (little-endian);
    -1 when ``data`` is shorter than 8 bytes."""
    return int.from_bytes(data[:8], "little") if len(data) >= 8 else -1


def parse_header(data: bytes) -> dict:
    """The JSON header (a dict) of safetensors bytes ``data``: an 8-byte length, then that many bytes of
    JSON (the tensor data may follow). ``ValueError`` when ``data`` is shorter or the header is not a JSON object."""
    length = header_length(data)
    if length < 2 or len(data) < 8 + length:
        raise ValueError(f"header of {length} bytes in {len(data)} bytes")
    header = json.loads(data[8:8 + length])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header


def read_header(path) -> tuple[dict, frozenset]:
    """``(metadata, tensor names)`` of a safetensors file's header (metadata ``{}`` without), read through one
    open file: a file replaced meanwhile (:func:`write_atomically`'s rename) is read whole as one version, never as
    the size of one and the header of another. ``ValueError`` for a header that does not parse or tensors
    that end past the file (truncated); ``OSError`` as ``open`` raises it."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(8)
        length = header_length(head)
        if length < 2 or 8 + length > size:
            raise ValueError(f"header of {length} bytes in a file of {size}")
        header = parse_header(head + handle.read(length))
    names = frozenset(name for name in header if name != "__metadata__")
    ends = [header[name]["data_offsets"][1] for name in names]
    if 8 + length + max(ends, default=0) > size:
        raise ValueError(f"tensors end at byte {8 + length + max(ends)}, past the file's {size}")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ is not a map of strings")
    return metadata, names


def canonical_header(data: bytes) -> bytes:
    """A safetensors file's bytes with its ``__metadata__`` entries in sorted key order (safetensors
    writes them in hash-map order, which differs from call to call), so that one cache saved twice
    gives the same bytes. Only the header's JSON is rewritten, to the same length; a header that would
    not re-serialize to that length is left as it is."""
    text = data[8:8 + header_length(data)].rstrip(b" ")
    header = json.loads(text)
    if isinstance(header.get("__metadata__"), dict):
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    rewritten = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(rewritten) != len(text):
        return data
    return data[:8] + rewritten + data[8 + len(text):]
