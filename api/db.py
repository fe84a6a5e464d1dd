"""Engine and sessions. SQLite gets WAL and `BEGIN IMMEDIATE` so concurrent claims are serialised."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pydantic_core
from sqlalchemy import ColumnElement, Engine, any_, bindparam, create_engine, event
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker


def _to_json(value: object) -> str:
    return pydantic_core.to_json(value).decode()  # rollout token lists are large: 3-5x faster than json


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        return _sqlite_engine(url)
    # As many connections as request threads (anyio's default 40), so none is opened per request.
    return create_engine(url, pool_size=40, max_overflow=10, pool_pre_ping=True, json_serializer=_to_json)


def _sqlite_engine(url: str) -> Engine:
    path = url.split("///", 1)[-1]
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    # One connection: SQLite has one writer anyway, and request threads queue for it in-process
    # (woken at once) instead of sleeping in SQLite's busy handler with back-off.
    engine = create_engine(url, pool_size=1, max_overflow=0, pool_timeout=120, json_serializer=_to_json,
                           connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # type: ignore[no-untyped-def]
        # Autocommit at the driver level so SQLAlchemy's "begin" below decides how transactions start.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # type: ignore[no-untyped-def]
        # Take the write lock up front: SQLite's equivalent of SELECT ... FOR UPDATE SKIP LOCKED is
        # to serialise writers, so two claimers never read the same free rows.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


# The lock a transaction takes on a job's or a Tinker model's row to serialise its writers: PostgreSQL's FOR NO KEY
# UPDATE. FOR UPDATE would also conflict with every transaction inserting a row that names it (a prompt, lease or
# rollout naming its job, a request naming its model: each takes a key-share lock on the row), so lock orders that
# never cross on the rows themselves deadlocked through those keys (a Tinker sample holding its model and adding a
# prompt to the fleet job, a lease waiting for the job, a fleet submission holding a key share of the job and
# waiting for the model). SQLite serialises writers and takes neither.
WRITER_LOCK: dict[str, Any] = {"key_share": True}


def insert_skipping_conflicts(db: Session, entity: Any) -> Any:
    """INSERT ... ON CONFLICT DO NOTHING on the session's database (PostgreSQL or SQLite): rows another
    transaction inserted first are left as they are."""
    insert = pg_insert if db.get_bind().dialect.name == "postgresql" else sqlite_insert
    return insert(entity).on_conflict_do_nothing()


def among(db: Session, column: ColumnElement[Any], values: Collection[Any]) -> ColumnElement[bool]:
    """`column IN values`; on PostgreSQL `column = ANY(:array)`, one statement text whatever the number of values,
    which psycopg prepares once, where IN's text (a placeholder a value) differs with each count and is parsed and
    planned anew: for the queries of a heartbeat batch, whose size varies batch to batch."""
    if db.get_bind().dialect.name != "postgresql":
        return column.in_(values)
    return column == any_(bindparam(None, list(values), type_=ARRAY(column.type)))


class Database:
    """The engine plus a session factory; one per process."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def is_postgres(self) -> bool:
        return self.engine.dialect.name == "postgresql"

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.sessions() as s:
            try:
                yield s
            except BaseException:
                s.rollback()
                raise

    def dispose(self) -> None:
        self.engine.dispose()
