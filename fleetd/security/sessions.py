"""TLS 1.3 session resumption across commands: a per-user cache of session tickets.

Each ``fleetd query`` is a new process, so without a cache every command pays a full
handshake (certificate signatures, ECDHE) per node. Python's ``ssl`` module can reuse a
session within one process, but cannot serialize one, so this module reaches OpenSSL's
own ``i2d_SSL_SESSION`` / ``d2i_SSL_SESSION`` / ``SSL_set_session`` through ctypes, on
the very libssl that the ``_ssl`` extension has mapped (read from ``/proc/self/maps``).

Getting at OpenSSL's pointers means reading CPython's private structs (``PySSLContext``
and ``PySSLSocket`` both start with their OpenSSL pointer right after the object
header). Nothing is trusted blindly: :class:`OpenSSL` checks, per object, that the
``SSL_CTX*`` it read answers ``SSL_CTX_get_options`` with the value Python reports, and
that the ``SSL*`` it read belongs to that ``SSL_CTX`` and is a client; the first
session it exports must carry the time Python reports for it. On any mismatch (another Python
build, another libssl), resumption switches itself off for the process, logged at debug
level, and every connection simply makes a full handshake.

The cache (:class:`SessionCache`): one file per fleet CA,
``$XDG_CACHE_HOME/fleetd/tls-sessions/<CA fingerprint>/sessions.json`` (or
``$FLEETD_TLS_SESSION_CACHE``, ``off`` to disable), directory 0700 and file 0600 since a
ticket is a secret (whoever holds it resumes as this client). The directories are made
and checked by :func:`fleetd.security.private_dir.private_dir` (the rule for every
directory fleetd creates in a shared place): a symlink, another owner, or group/other
access refuses the cache, which then costs a full handshake; files are opened with
``O_NOFOLLOW`` and never read when they are not regular. At most :data:`MAX_ENTRIES`
entries and :data:`MAX_BYTES` bytes, the oldest dropped first; an entry past its ticket
lifetime is dropped on reading. A corrupt file is removed and costs one full handshake
per node. Entries are keyed by node address, server name and the client's identity
(its certificate's and pin's fingerprints), so a ticket is offered only to the node and
by the identity it was issued to.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import fcntl
import logging
import os
import ssl
import stat
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from fleetd.security.private_dir import (
    DENY_ALL,
    UnsafePathError,
    open_regular,
    private_dir,
    user_cache_base,
)

log = logging.getLogger("fleetd.security.sessions")

MAX_ENTRIES = 4096
MAX_BYTES = 8 * 1024 * 1024
MAX_DER = 16 * 1024  # one serialized session; a TLS 1.3 one is about 1.5 KiB with a cert
CACHE_ENV = "FLEETD_TLS_SESSION_CACHE"
FILE_NAME = "sessions.json"
_HEAD = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)  # PyObject_HEAD


class OpenSSL:
    """The few libssl calls resumption needs, checked against Python's own view."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        vp, cp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p)
        sigs: dict[str, tuple[Any, list[Any]]] = {
            "SSL_get_SSL_CTX": (vp, [vp]), "SSL_CTX_get_options": (ctypes.c_uint64, [vp]),
            "SSL_is_server": (ctypes.c_int, [vp]), "SSL_get1_session": (vp, [vp]),
            "SSL_set_session": (ctypes.c_int, [vp, vp]), "SSL_SESSION_free": (None, [vp]),
            "SSL_SESSION_get_time": (ctypes.c_long, [vp]),
            "SSL_SESSION_get_timeout": (ctypes.c_long, [vp]),
            "SSL_SESSION_is_resumable": (ctypes.c_int, [vp]),
            "i2d_SSL_SESSION": (ctypes.c_int, [vp, cp]),
            "d2i_SSL_SESSION": (vp, [vp, cp, ctypes.c_long]),
        }
        for name, (res, args) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.lib = lib

    def ctx_ptr(self, context: ssl.SSLContext) -> int | None:
        ptr = ctypes.c_void_p.from_address(id(context) + _HEAD).value
        if not ptr or self.lib.SSL_CTX_get_options(ptr) != int(context.options):
            return None
        return ptr

    def ssl_ptr(self, obj: ssl.SSLObject, ctx_ptr: int) -> int | None:
        inner = getattr(obj, "_sslobj", None)
        if inner is None:
            return None
        # PySSLSocket: PyObject_HEAD, a weakref to the socket, then SSL *ssl.
        ptr = ctypes.c_void_p.from_address(id(inner) + _HEAD + ctypes.sizeof(
            ctypes.c_void_p)).value
        if not ptr or self.lib.SSL_get_SSL_CTX(ptr) != ctx_ptr or self.lib.SSL_is_server(ptr):
            return None
        return ptr

    def export(self, ssl_ptr: int, python_time: int | None) -> tuple[bytes, int] | None:
        """(DER, expiry as epoch seconds) of the connection's current session."""
        sess = self.lib.SSL_get1_session(ssl_ptr)
        if not sess:
            return None
        try:
            made = self.lib.SSL_SESSION_get_time(sess)
            if python_time is not None and made != python_time:
                raise _Mismatch(f"session time {made} != Python's {python_time}")
            if not self.lib.SSL_SESSION_is_resumable(sess):
                return None
            size = self.lib.i2d_SSL_SESSION(sess, None)
            if not 0 < size <= MAX_DER:
                return None
            buf = ctypes.create_string_buffer(size)
            cursor = ctypes.c_char_p(ctypes.addressof(buf))
            if self.lib.i2d_SSL_SESSION(sess, ctypes.byref(cursor)) != size:
                return None
            return buf.raw[:size], made + self.lib.SSL_SESSION_get_timeout(sess)
        finally:
            self.lib.SSL_SESSION_free(sess)

    def offer(self, ssl_ptr: int, der: bytes) -> bool:
        """Set a deserialized session on a connection before its handshake."""
        buf = ctypes.create_string_buffer(der, len(der))
        cursor = ctypes.c_char_p(ctypes.addressof(buf))
        sess = self.lib.d2i_SSL_SESSION(None, ctypes.byref(cursor), len(der))
        if not sess:
            return False
        try:
            return bool(self.lib.SSL_set_session(ssl_ptr, sess))
        finally:
            self.lib.SSL_SESSION_free(sess)  # SSL_set_session took its own reference


class _Mismatch(Exception):
    """What ctypes read is not what Python reports: stop using it."""


_LOCK = threading.Lock()
_OPENSSL: list[OpenSSL | None] = []


def openssl() -> OpenSSL | None:
    """The libssl ``_ssl`` uses, loaded once; None when it cannot be found or loaded."""
    with _LOCK:
        if not _OPENSSL:
            _OPENSSL.append(_load())
        return _OPENSSL[0]


def _load() -> OpenSSL | None:
    # The struct offsets assume CPython's release-build object header; a debug build
    # (Py_TRACE_REFS) or another interpreter lays objects out differently.
    if (sys.implementation.name != "cpython" or hasattr(sys, "gettotalrefcount")
            or ssl.OPENSSL_VERSION_INFO < (1, 1, 1)):
        log.debug("TLS resumption off: not a release CPython with OpenSSL 1.1.1+")
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            paths = {line.split()[-1] for line in fh if "/libssl.so" in line}
    except OSError:
        paths = set()
    if len(paths) != 1:
        log.debug("TLS resumption off: libssl mapped %d times (%s)", len(paths), paths)
        return None
    try:
        return OpenSSL(paths.pop())
    except (OSError, AttributeError) as exc:
        log.debug("TLS resumption off: %s", exc)
        return None


def disable(why: str) -> None:
    """Switch resumption off for this process (a check failed)."""
    log.debug("TLS resumption off: %s", why)
    with _LOCK:
        _OPENSSL[:] = [None]


# ---- the cache ------------------------------------------------------------------------


@dataclass(slots=True)
class Entry:
    der: bytes
    expires: int  # epoch seconds
    saved: float  # epoch seconds, for evicting the oldest


def default_dir() -> Path | None:
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "no") else Path(env)
    return user_cache_base() / "fleetd" / "tls-sessions"


def default_base(directory: Path) -> Path:
    """The directory the user owns that a cache ``directory`` goes under: the per-user
    cache (for the default), the parent of ``$FLEETD_TLS_SESSION_CACHE``, else the
    directory's parent."""
    cache = user_cache_base()
    if directory.is_relative_to(cache / "fleetd"):
        return cache
    env = default_dir()
    if env is not None and directory.is_relative_to(env) and directory != env:
        return env.parent
    return directory.parent


def _private(st: os.stat_result, *, directory: bool) -> bool:
    """Ours and neither readable nor writable by anyone else."""
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    mode = stat.S_IMODE(st.st_mode)
    return kind_ok and st.st_uid == os.geteuid() and not mode & DENY_ALL


def _private_dir(path: Path) -> bool:
    try:
        return _private(path.lstat(), directory=True)  # lstat: a symlink is not private
    except OSError:
        return False


class SessionCache:
    """One fleet CA's tickets on disk, keyed by :func:`key`. ``base``: the directory
    the user owns that the cache goes under (default: the parent of ``directory``)."""

    def __init__(self, directory: Path, base: Path | None = None) -> None:
        self.dir = directory
        self.base = base if base is not None else default_base(directory)
        self.file = directory / FILE_NAME

    def load(self) -> dict[str, Entry]:
        refused = ("not using TLS session cache %s: %s (it must be this user's own regular "
                   "file in a directory of this user's; chmod 700 the directory, 600 the "
                   "file)")
        try:
            fd, st = open_regular(self.file)  # never through a link, never a FIFO
        except FileNotFoundError:
            return {}
        except UnsafePathError as exc:
            log.warning(refused, self.file, exc.message)
            return {}
        except OSError as exc:
            log.warning(refused, self.file, exc.strerror or exc)
            return {}
        try:
            with open(fd, "rb") as fh:
                if not (_private_dir(self.dir) and _private(st, directory=False)):
                    log.warning(refused, self.file, "others may read or write it")
                    return {}
                raw = fh.read(MAX_BYTES + 1)
            return _parse(raw, time.time())
        except (OSError, ValueError, TypeError, KeyError, orjson.JSONDecodeError) as exc:
            log.debug("removing corrupt TLS session cache %s: %s", self.file, exc)
            with contextlib.suppress(OSError):
                self.file.unlink()
            return {}

    def store(self, fresh: dict[str, Entry]) -> None:
        """Merge ``fresh`` into the file (under a lock: commands may run side by side)."""
        if not fresh:
            return
        try:
            private_dir(self.dir, base=self.base, deny=DENY_ALL, what="TLS session cache")
        except UnsafePathError as exc:
            log.warning("not writing the TLS session cache: %s", exc.message)
            return
        try:
            lock = os.open(self.dir / ".lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND
                           | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                merged = {**self.load(), **fresh}
                self._write(_bounded(merged))
            finally:
                os.close(lock)
        except OSError as exc:
            log.debug("cannot write TLS session cache %s: %s", self.file, exc)

    def _write(self, entries: dict[str, Entry]) -> None:
        doc = {k: {"der": base64.b64encode(e.der).decode(), "expires": e.expires,
                   "saved": e.saved} for k, e in entries.items()}
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".sessions-")  # created 0600
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(orjson.dumps(doc))
            os.replace(tmp, self.file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _parse(raw: bytes, now: float) -> dict[str, Entry]:
    if len(raw) > MAX_BYTES:
        raise ValueError(f"over {MAX_BYTES} bytes")
    doc = orjson.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    out: dict[str, Entry] = {}
    for k, v in doc.items():
        der = base64.b64decode(v["der"], validate=True)
        expires, saved = v["expires"], v["saved"]
        if not (isinstance(expires, int) and isinstance(saved, int | float)
                and 0 < len(der) <= MAX_DER):
            raise ValueError(f"bad entry {k[:80]!r}")
        if expires > now:
            out[k] = Entry(der, expires, float(saved))
    return out


def _bounded(entries: dict[str, Entry]) -> dict[str, Entry]:
    """The newest entries within MAX_ENTRIES and MAX_BYTES (base64 and keys counted)."""
    out: dict[str, Entry] = {}
    used = 0
    for k, e in sorted(entries.items(), key=lambda kv: kv[1].saved, reverse=True):
        size = len(k) + len(e.der) * 4 // 3 + 64
        if len(out) >= MAX_ENTRIES or used + size > MAX_BYTES // 2:
            break
        out[k] = e
        used += size
    return out


def _time_of(obj: ssl.SSLObject) -> int | None:
    session = obj.session
    return session.time if session is not None else None


def key(host: str, port: int, server_name: str | None, identity: str) -> str:
    return f"{identity}|{host}|{port}|{server_name or ''}"


class Sessions:
    """The tickets one client context offers and learns: in memory for the process (a
    long-running client reconnecting), on disk across commands when a cache is given.

    ``identity`` says who the tickets belong to (client certificate and pin); the cache
    directory already says which fleet CA.
    """

    def __init__(self, identity: str, cache: SessionCache | None) -> None:
        self.identity = identity
        self.cache = cache
        self._known: dict[str, Entry] | None = None
        self._fresh: dict[str, Entry] = {}
        # Connections made since the last flush, whose tickets flush() collects.
        self._live: list[tuple[str, weakref.ref[ssl.SSLObject]]] = []
        self.offered = 0
        self.saved = 0
        self._checked = False  # a session's time compared with Python's (once)

    def _entries(self) -> dict[str, Entry]:
        if self._known is None:
            self._known = self.cache.load() if self.cache is not None else {}
        return self._known

    def prepare(self, context: ssl.SSLContext, obj: ssl.SSLObject, dial_key: str) -> None:
        """Before ``obj``'s handshake: offer the ticket we hold for ``dial_key``, and
        remember the connection so that its own ticket can be kept afterwards."""
        lib = openssl()
        if lib is None:
            return
        ctx_ptr = lib.ctx_ptr(context)
        ssl_ptr = lib.ssl_ptr(obj, ctx_ptr) if ctx_ptr else None
        if ssl_ptr is None:
            disable("the SSL_CTX/SSL pointers read from Python's objects do not check out")
            return
        self._live.append((dial_key, weakref.ref(obj)))
        entry = self._entries().get(dial_key)
        if entry is None or entry.expires <= time.time():
            return
        if lib.offer(ssl_ptr, entry.der):
            self.offered += 1
        else:
            log.debug("stored TLS session for %s is not usable; full handshake", dial_key)
            self._entries().pop(dial_key, None)

    def collect(self) -> None:
        """Keep the current ticket of every connection made since the last call."""
        lib = openssl()
        live, self._live = self._live, []
        if lib is None:
            return
        for dial_key, ref in live:
            obj = ref()
            if obj is None:
                continue
            try:
                got = self._export(lib, obj)
            except _Mismatch as exc:
                disable(str(exc))
                return
            if got is not None:
                entry = Entry(got[0], got[1], time.time())
                self._entries()[dial_key] = entry
                self._fresh[dial_key] = entry

    def _export(self, lib: OpenSSL, obj: ssl.SSLObject) -> tuple[bytes, int] | None:
        ctx_ptr = lib.ctx_ptr(obj.context)
        ssl_ptr = lib.ssl_ptr(obj, ctx_ptr) if ctx_ptr else None
        if ssl_ptr is None:
            return None
        # Python's view of the session (obj.session) builds a new object per call; it is
        # compared once per process, the checks above hold for every connection.
        python_time = None if self._checked else _time_of(obj)
        self._checked = True
        return lib.export(ssl_ptr, python_time)

    def flush(self) -> None:
        """Collect tickets and write the new ones to the cache (once per command)."""
        self.collect()
        fresh, self._fresh = self._fresh, {}
        if self.cache is not None and fresh:
            self.cache.store(fresh)
            self.saved += len(fresh)
