"""Files autopar writes and the cache folder it reads from: one atomic write, one privacy check.

`atomic_write_text` writes a file so that a reader, or a crash, never sees half of it: a temporary file
in the same folder (`tempfile.mkstemp`), written, flushed and fsynced, then `os.replace`d over the target,
and the folder fsynced (POSIX). `cache_dir()` is the root of autopar's caches (the plan cache, the
calibration cache). A cache file is data autopar acts on, so it is read only when nobody else could have
changed it: `check_private` refuses a symlink, something of another user, or (on POSIX) a mode that the
group or others can write; `cache_subdir` and `read_private_bytes` apply it to a cache's folder and files.
Every refusal is a `CacheError` that names the path and says what to do. Where the default cache folder (under
$XDG_CACHE_HOME or the home folder) cannot be made, a read finds nothing cached and says so once a process (a
`CacheWarning`): autopar plans without its caches. An AUTOPAR_CACHE_DIR that names a file is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import warnings
from pathlib import Path

from ..errors import CacheError, StorageError

#: POSIX permission bits are checked; Windows reports no meaningful group/other bits.
_CHECK_MODES = os.name != "nt"


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------
def atomic_write_text(path: str | os.PathLike[str], text: str, *, mode: int | None = None,
                      durable: bool = True) -> None:
    """Write `text` (UTF-8) to `path` atomically. `mode`: the file's permission bits (default: what a
    plain `open` would give, 0o666 less the umask). `durable=False` skips the fsyncs: still atomic for a
    reader, but a power loss may lose it (for files rewritten often that only signal progress)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # created 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def _umask() -> int:
    """The process's umask, read without changing it where /proc says it (Linux), else set and restored."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX; Windows cannot open a folder to fsync it)."""
    if os.name == "nt":
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot fsync a folder; the rename itself is still atomic
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def check_writable(path: Path, *, what: str, remedy: str, folder: bool) -> None:
    """Raise StorageError (naming `what`, `path` and `remedy`) unless autopar can write `path`: a folder (or,
    with `folder=False`, a file) it will create, fill or replace. A file that exists must open for writing
    (nothing is written to it); then the nearest folder of `path` that exists (or `path` itself, a folder) must
    take a new file, which is tried: a temporary file is made there (as atomic_write_text makes its own) and
    removed at once. Catches a read-only folder or mount, another user's folder, and a file in a folder's way."""
    if not folder and os.path.isfile(path):
        try:
            os.close(os.open(path, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0)))
        except OSError as exc:
            raise StorageError(f"cannot write {what} {path} ({exc.strerror}): {remedy}", path=str(path)) from None
    existing = path if folder else path.parent
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise StorageError(f"cannot make {what} {path}: {existing} is not a folder. {remedy}", path=str(path))
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".autopar-write-check-")
    except OSError as exc:
        raise StorageError(f"cannot write {what} {path} ({existing}: {exc.strerror}): {remedy}",
                           path=str(path)) from None
    os.close(fd)
    os.unlink(probe)


# ---------------------------------------------------------------------------------------------------
# The cache folder and its privacy check
# ---------------------------------------------------------------------------------------------------
class CacheWarning(UserWarning):
    """A cache skipped: the default cache folder cannot be made, or a cache file was refused while listing."""


CACHE_DIR_ENV = "AUTOPAR_CACHE_DIR"
#: Default cache folders found unusable in this process: each is warned about once, then skipped quietly.
_SKIPPED_ROOTS: set[str] = set()


def cache_root() -> Path:
    """$AUTOPAR_CACHE_DIR, else $XDG_CACHE_HOME/autopar, else ~/.cache/autopar; nothing is created. An
    AUTOPAR_CACHE_DIR that is a file is refused (CacheError)."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        if os.path.exists(explicit) and not os.path.isdir(explicit):
            raise CacheError(f"{CACHE_DIR_ENV}={explicit} is a file, not a folder: point it at a folder or unset it")
        return Path(explicit)
    return Path(os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "autopar"))


def cache_dir() -> Path:
    """`cache_root()`, created private (0700) if it does not exist; CacheError when it cannot be."""
    path = cache_root()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise CacheError(f"cannot make autopar's cache folder {path} ({exc.strerror or exc}): point "
                         f"{CACHE_DIR_ENV} at a folder you can write.") from None
    return path


def readable_cache_dir() -> Path | None:
    """`cache_dir()` for a read; None where the default folder (no AUTOPAR_CACHE_DIR) cannot be made, with one
    CacheWarning a process for that folder: nothing is cached there, and planning goes on without the caches."""
    try:
        return cache_dir()
    except CacheError as exc:
        if os.environ.get(CACHE_DIR_ENV):
            raise
        root = str(cache_root())
        if root not in _SKIPPED_ROOTS:
            _SKIPPED_ROOTS.add(root)
            warnings.warn(f"autopar: no plan or calibration cache in this process: {exc} autopar plans without them.",
                          CacheWarning, stacklevel=4)
        return None


def check_private(path: Path, st: os.stat_result, *, want_dir: bool) -> None:
    """Raise CacheError unless `st` (of `path`) is a regular file (or, with `want_dir`, a folder) that is
    not a symlink, belongs to this user and (on POSIX) cannot be written by the group or others."""
    what = "folder" if want_dir else "file"
    if stat.S_ISLNK(st.st_mode):
        raise CacheError(
            f"{path} is a symlink: autopar only reads its cache through real files and folders. Delete the "
            f"link (rm {path}); autopar writes the {what} again."
        )
    if want_dir and not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{path} should be autopar's cache folder but is not a folder: remove it.")
    if not want_dir and not stat.S_ISREG(st.st_mode):
        raise CacheError(f"{path} is not a regular file: remove it (autopar tunes again and rewrites it).")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise CacheError(
            f"{path} belongs to another user (uid {st.st_uid}): autopar only uses its own cache {what}s. "
            f"Delete it, or point AUTOPAR_CACHE_DIR at a folder of your own."
        )
    if _CHECK_MODES and st.st_mode & 0o022:
        who = "others" if st.st_mode & 0o002 else "the group"
        fix = (f"Make it private: chmod 700 {path}" if want_dir else
               f"Delete it (autopar tunes again and rewrites it), or make it private: chmod 600 {path}")
        raise CacheError(
            f"{path} can be written by {who} (mode {stat.S_IMODE(st.st_mode):o}): anyone who can change a "
            f"cached plan or calibration changes what your job runs, so autopar refuses it. {fix}."
        )


def _check_dir(path: Path, *, follow: bool) -> None:
    try:
        st = path.stat() if follow else path.lstat()
    except OSError as exc:
        raise CacheError(f"cannot inspect the cache folder {path} ({exc.strerror}).") from None
    check_private(path, st, want_dir=True)


def cache_subdir(name: str, *, directory: str | os.PathLike[str] | None = None, create: bool) -> Path | None:
    """`<root>/<name>`, checked private, where `<root>` is `directory` or else `cache_dir()` (the root is
    followed if a symlink, since users relocate caches; `<name>` must not be one). Folders made here are
    0700. None when a folder does not exist and `create` is False, or when the default root cannot be made
    for a read (warned once: `readable_cache_dir`)."""
    if directory is None:
        root = cache_dir() if create else readable_cache_dir()
        if root is None:
            return None
    else:
        root = Path(directory)
        if not root.exists():
            if not create:
                return None
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(root, 0o700)
    _check_dir(root, follow=True)
    sub = root / name
    if not os.path.lexists(sub):
        if not create:
            return None
        try:
            sub.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise CacheError(f"cannot make the cache folder {sub} ({exc.strerror or exc}): point {CACHE_DIR_ENV} at "
                             "a folder you can write.") from None
        else:
            os.chmod(sub, 0o700)
    _check_dir(sub, follow=False)
    return sub


def read_private_bytes(path: Path, *, max_bytes: int, what: str) -> bytes | None:
    """The bytes of the cache file `path` (`what` names it in messages, e.g. "plan cache file"), or None if
    it does not exist. Opened without following a symlink and checked (`check_private`) on the open
    descriptor, so nothing can swap the file between the check and the read; larger than `max_bytes`: refused."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    if not hasattr(os, "O_NOFOLLOW") and os.path.islink(path):
        check_private(path, path.lstat(), want_dir=False)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            check_private(path, path.lstat(), want_dir=False)
        raise CacheError(f"cannot read the {what} {path} ({exc.strerror}): delete it.") from None
    try:
        st = os.fstat(fd)
        check_private(path, st, want_dir=False)
        if st.st_size > max_bytes:
            raise CacheError(f"{path} is {st.st_size} bytes, too large for a {what}: delete it.")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.read(max_bytes + 1)
    finally:
        if fd >= 0:
            os.close(fd)
