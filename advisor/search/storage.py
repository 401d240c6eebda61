"""Where studies live: SQLite under the user's cache by default, any Optuna RDB URL, or a journal file.

The one module that knows how Optuna's storages behave under several processes:
- SQLite: every transaction is `BEGIN IMMEDIATE` (it takes the write lock first and waits up to SQLITE_TIMEOUT_S
  for it), so Optuna's read-then-update of a trial's state (popping a queued trial, finishing one) is atomic
  between processes; pysqlite's default begins a transaction only at the first write, so two processes both read
  a queued trial as WAITING and both run it. PostgreSQL locks the row (SELECT ... FOR UPDATE) by itself.
- Schema creation: two processes opening a fresh database both create Optuna's tables (`UNIQUE constraint
  failed: alembic_version`, or PostgreSQL's "already exists"); the loser opens it again, now made.
- The default cache falls back to answering without storing (an in-memory study, a note says so) when its
  directory cannot be made or written; one that is read-only but holds studies is read (the studies a run needs
  are copied into memory, so the answer it already holds comes back without a new measurement).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .._files import cache_dir
from .._versions import TRACKED as _VERSIONED
from .._versions import library_versions as _library_versions
from ..errors import UsageError

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

SQLITE_TIMEOUT_S = 120  # how long a process waits for another's SQLite transaction before "database is locked"
_SCHEMA_TRIES = 8
_DB_NAME = "studies.sqlite3"


def library_versions() -> dict[str, str]:
    return _library_versions(_VERSIONED)


def _cache_origin() -> str:
    """How the user named the cache directory: the variable they set, else the default path."""
    if os.environ.get("ADVISOR_CACHE_DIR"):
        return f"$ADVISOR_CACHE_DIR={os.environ['ADVISOR_CACHE_DIR']}"
    if os.environ.get("XDG_CACHE_HOME"):
        return f"the cache {cache_dir()} (from $XDG_CACHE_HOME)"
    return f"the cache {cache_dir()}"


@dataclass(frozen=True)
class Cache:
    """The default study cache as opened: `storage` to use, and `note` (one line) when it is not the SQLite
    file under cache_dir() that stores this run: unwritable (memory) or read-only (read, not written)."""

    storage: BaseStorage
    note: str | None = None
    writable: bool = True


def default_storage_url() -> str:
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{d / _DB_NAME}"


def open_cache() -> Cache:
    """The default cache (SQLite in cache_dir()); never an error: an unusable one is replaced by memory."""
    import optuna  # lazy: loads optuna
    from optuna.storages import InMemoryStorage  # lazy: loads optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # "A new study created in RDB..." is not for the user
    d = cache_dir()
    db = d / _DB_NAME
    origin = _cache_origin()
    fix = "set $ADVISOR_CACHE_DIR to a writable directory, or pass --no-cache"

    def memory(why: str) -> Cache:
        return Cache(InMemoryStorage(), f"{origin}: {why}; answering without storing this run's measurements "
                                        f"({fix})", writable=False)

    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return memory("is a file, not a directory")
    except NotADirectoryError:
        return memory("lies under a file, not a directory")
    except OSError as exc:
        return memory(f"cannot be created ({exc.strerror or exc})")
    if not d.is_dir():
        return memory("is not a directory")
    problem = _unwritable(d, db)
    if problem is None:
        try:
            return Cache(_rdb(f"sqlite:///{db}"))
        except Exception as exc:  # e.g. "file is not a database": the run still answers
            return memory(f"cannot be opened ({_short(exc)})")
    if db.is_file() and os.access(db, os.R_OK):
        try:
            source = _rdb(f"sqlite:///file:{db.resolve()}?mode=ro&uri=true", read_only=True)
        except Exception as exc:  # an empty or foreign file: nothing to read from it
            return memory(f"is {problem} and its {_DB_NAME} cannot be read ({_short(exc)})")
        return Cache(_read_only_copy(source), f"{origin}: is {problem}; answering from the studies stored there "
                                            f"without storing new measurements ({fix})", writable=False)
    return memory(f"is {problem}")


def _unwritable(d: Path, db: Path) -> str | None:
    """Why the cache cannot take writes (tried, not guessed from permission bits: root, read-only mounts)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".advisor-write-test-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"read-only ({exc.strerror or exc})"
    if db.exists():
        try:
            with open(db, "r+b"):
                pass
        except OSError as exc:
            return f"read-only ({_DB_NAME}: {exc.strerror or exc})"
    return None


def _short(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _is_schema_race(exc: BaseException) -> bool:
    """Another process is creating Optuna's tables right now (or holds the lock while it does)."""
    text = str(exc).lower()
    return any(s in text for s in ("already exists", "unique constraint", "duplicate key", "database is locked",
                                   "uniqueviolation", "duplicatetable", "duplicateobject"))


def _rdb(url: str, *, read_only: bool = False) -> BaseStorage:
    """An RDBStorage that several processes can share; retries while another process creates the schema."""
    from optuna.storages import RDBStorage  # lazy: loads optuna
    from sqlalchemy import exc as sa_exc  # lazy: loads sqlalchemy

    url = _with_driver(url)
    sqlite = url.startswith("sqlite")
    kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if sqlite else {}
    if not sqlite:
        kwargs["pool_pre_ping"] = True  # a server restart or idle timeout drops pooled connections
    for attempt in range(_SCHEMA_TRIES):
        try:
            storage = RDBStorage(url, engine_kwargs=kwargs, skip_table_creation=read_only)
            break
        except (sa_exc.IntegrityError, sa_exc.OperationalError, sa_exc.ProgrammingError) as exc:
            if attempt + 1 == _SCHEMA_TRIES or not _is_schema_race(exc):
                raise
            time.sleep(0.05 * 2**attempt)
    if sqlite and not read_only:
        _immediate_transactions(storage)
    return storage


def _with_driver(url: str) -> str:
    """postgresql:// (or postgres://) with the driver that is installed: SQLAlchemy's default is psycopg2, the
    `postgres` extra installs psycopg 3."""
    scheme, sep, rest = url.partition("://")
    if scheme in ("postgresql", "postgres") and importlib.util.find_spec("psycopg2") is None \
            and importlib.util.find_spec("psycopg") is not None:
        return f"postgresql+psycopg{sep}{rest}"
    return "postgresql" + sep + rest if scheme == "postgres" else url


def _immediate_transactions(storage: BaseStorage) -> None:
    """SQLAlchemy's recipe for SQLite transactions that lock at BEGIN (the driver's own BEGIN is turned off)."""
    from sqlalchemy import event  # lazy: loads sqlalchemy

    engine = storage.engine  # type: ignore[attr-defined]

    @event.listens_for(engine, "connect")
    def _no_driver_begin(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection) -> None:  # type: ignore[no-untyped-def]
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections made while Optuna checked the schema predate the listeners


_COPY_CLASS: list[type] = []


def _read_only_copy(source: BaseStorage) -> BaseStorage:
    """Memory, plus the studies of the read-only `source`, copied in when a run first names them."""
    if not _COPY_CLASS:  # made on first use: optuna is imported lazily
        from optuna.storages import InMemoryStorage  # lazy: loads optuna

        class ReadOnlyCopy(InMemoryStorage):
            def __init__(self, source: BaseStorage):
                super().__init__()
                self.source = source
                self.copied: set[str] = set()

        _COPY_CLASS.append(ReadOnlyCopy)
    return _COPY_CLASS[0](source)


def is_storage_failure(exc: BaseException) -> bool:
    """A storage that stopped taking writes in the middle of a run (a full disk, a database gone read-only, an
    I/O error), not a bug of the search: Optuna's StorageInternalError, SQLAlchemy's or sqlite3's OperationalError,
    a journal file's OSError."""
    from optuna.exceptions import StorageInternalError  # lazy: loads optuna
    from sqlalchemy.exc import OperationalError  # lazy: loads sqlalchemy

    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)
    return isinstance(exc, (StorageInternalError, OperationalError, sqlite3.OperationalError))


def after_failure(storage: BaseStorage, url: str | None, exc: BaseException) -> Cache:
    """What a run goes on with when `storage` failed mid-run: memory, with the studies still readable there
    copied in when a run names them (what was stored stays an answer), and the one line that says so."""
    cause = exc.__cause__ or exc.__context__ or exc
    why = _short(cause) if not isinstance(cause, OSError) else (cause.strerror or str(cause))
    where = f"--storage {url}" if url else _cache_origin()
    fix = "free space there, or pass --no-cache" if not url else "free space there, or choose another --storage"
    return Cache(_read_only_copy(storage), f"{where}: cannot store any more ({why}); answering without storing "
                                           f"this run's measurements ({fix})", writable=False)


def prepare_study(storage: BaseStorage, name: str) -> None:
    """Before a study is created or loaded in `storage`: copy it in from a read-only cache that holds it."""
    source = getattr(storage, "source", None)
    copied = getattr(storage, "copied", None)
    if source is None or copied is None or name in copied:
        return
    copied.add(name)
    import optuna  # lazy: loads optuna

    try:
        optuna.copy_study(from_study_name=name, from_storage=source, to_storage=storage)
    except KeyError:  # not stored there: the run starts it in memory
        pass


def _sqlite_file(url: str) -> Path | None:
    """The database file of a sqlite:/// URL (None for memory, URI-mode names or other schemes)."""
    if not url.startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url  # lazy: loads sqlalchemy

    try:
        db = make_url(url).database
    except Exception:
        return None
    return Path(db) if db and db != ":memory:" and not db.startswith("file:") else None


def open_given(url: str) -> Cache:
    """`--storage URL` for a search: as open_storage, except that an existing SQLite file this process cannot
    write is read (its studies copied into memory, a note says so) instead of failing at the first write."""
    db = _sqlite_file(url) if "://" in url else None
    if db is not None and db.is_file():
        problem = _unwritable(db.parent, db)
        if problem is not None:
            open_storage(url)  # the same checks and messages as any --storage (e.g. not a database)
            source = _rdb(f"sqlite:///file:{db.resolve()}?mode=ro&uri=true", read_only=True)
            return Cache(_read_only_copy(source), f"--storage {url}: is {problem}; answering from the studies "
                                                  "stored there without storing new measurements", writable=False)
    return Cache(open_storage(url))


def open_storage(url: str | None) -> BaseStorage:
    """None -> in memory; 'scheme://...' -> RDB storage; anything else is a journal file path (--storage)."""
    import optuna  # lazy: loads optuna
    from optuna.storages import InMemoryStorage, JournalStorage  # lazy: loads optuna
    from optuna.storages.journal import JournalFileBackend  # lazy: loads optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if url is None:
        return InMemoryStorage()
    if "://" in url:
        try:
            return _rdb(url)
        except ImportError as exc:  # the URL's driver is not installed
            extra = " (pip install 'advisor[postgres]')" if url.startswith("postgres") else ""
            raise UsageError(f"--storage {url!r}: its database driver is not installed ({exc.__cause__ or exc})"
                             f"{extra}") from None
        except Exception as exc:  # sqlalchemy raises many kinds for a bad URL or driver
            raise UsageError(f"--storage {url!r}: cannot open ({_short(exc)}); use sqlite:///FILE, "
                             "postgresql://USER@HOST/DB or a journal file path") from None
    path = Path(url).expanduser()
    fix = "choose a writable file path, e.g. ./advisor-journal.log, or an RDB URL such as sqlite:///studies.db"
    _check_journal(url, path)
    if not path.parent.exists():
        raise UsageError(f"--storage {url!r}: directory {path.parent} does not exist; create it or {fix}")
    if path.is_dir():
        raise UsageError(f"--storage {url!r}: is a directory; {fix}")
    try:
        return JournalStorage(JournalFileBackend(str(path)))
    except OSError as exc:  # /proc, a read-only mount, no permission
        raise UsageError(f"--storage {url!r}: cannot create or open the journal file "
                         f"({exc.strerror or exc}); {fix}") from None


_SQLITE_MAGIC = b"SQLite format 3\x00"


def _check_journal(url: str, path: Path) -> None:
    """A --storage without a scheme is an Optuna journal file: an existing file that is a SQLite database, or not
    a journal at all, is named as such (Optuna would fail reading it with a UnicodeDecodeError / JSONDecodeError)."""
    if not path.is_file():
        return
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return  # open_storage's own checks say why it cannot be opened
    if head.startswith(_SQLITE_MAGIC):
        raise UsageError(f"--storage {url}: is a SQLite database, not a journal file; write --storage "
                         f"sqlite:///{path.resolve()} (a path without a scheme is read as an Optuna journal file)")
    first = head.split(b"\n", 1)[0].strip()
    if not first:
        return  # empty: a new journal
    try:
        json.loads(first.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        raise UsageError(f"--storage {url}: is not an Optuna journal file (its first line is not a journal "
                         "record); give a new file name, a journal a previous run wrote, or an RDB URL such as "
                         "sqlite:///studies.db") from None


def open_for_reading(url: str | None) -> BaseStorage:
    """The store of a read-only command (`advisor studies`, `advisor report`): never creates a database or a
    journal (a typo is an error naming it, not a new empty file), reads a SQLite file read-only, and says so when
    the file cannot be read instead of calling it empty. None: the study cache (nothing stored yet: empty)."""
    import optuna  # lazy: loads optuna
    from optuna.storages import InMemoryStorage, JournalStorage  # lazy: loads optuna
    from optuna.storages.journal import JournalFileBackend  # lazy: loads optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if url is None:
        db = cache_dir() / _DB_NAME
        if not db.exists():
            return InMemoryStorage()  # no search stored yet
        return _read_sqlite(db, f"{_cache_origin()}: {_DB_NAME}",
                            "move it aside (the next `advisor suggest` starts a new cache) or set $ADVISOR_CACHE_DIR")
    if "://" in url:
        db = _sqlite_file(url)
        if db is not None:
            if not db.is_file():
                raise UsageError(f"--storage {url}: no such database file {db}; check the path (`advisor suggest "
                                 "--storage` makes one)")
            return _read_sqlite(db, f"--storage {url}", "check the path")
        try:
            return _rdb(url, read_only=True)
        except Exception as exc:
            raise UsageError(f"--storage {url!r}: cannot open ({_short(exc)}); check the URL") from None
    path = Path(url).expanduser()
    if not path.is_file():
        raise UsageError(f"--storage {url}: no such journal file; check the path (`advisor suggest --storage` "
                         "makes one)")
    _check_journal(url, path)
    try:
        return JournalStorage(JournalFileBackend(str(path)))
    except Exception as exc:  # a journal that cannot be replayed
        raise UsageError(f"--storage {url}: cannot be read as an Optuna journal ({_short(exc)})") from None


def _read_sqlite(db: Path, label: str, fix: str) -> BaseStorage:
    """A SQLite file opened read-only, checked by reading it (a corrupt or foreign file is an error, not empty)."""
    import optuna  # lazy: loads optuna

    try:
        with open(db, "rb") as fh:
            head = fh.read(len(_SQLITE_MAGIC))
        if head and head != _SQLITE_MAGIC:
            raise ValueError("file is not a database")
        store = _rdb(f"sqlite:///file:{db.resolve()}?mode=ro&uri=true", read_only=True)
        optuna.get_all_study_summaries(store, include_best_trial=False)
    except Exception as exc:
        raise UsageError(f"{label}: cannot be read ({_short(exc)}); {fix}") from None
    return store
