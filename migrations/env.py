"""Alembic environment: the URL comes from the caller (api.migrate), the metadata from api.models and the
Tinker surface's tables (api.tinker.models)."""

from alembic import context
from sqlalchemy import pool

import api.tinker.models  # noqa: F401 (registers its tables on Base.metadata)
from api.db import make_engine
from api.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    if engine.dialect.name == "sqlite":
        engine = make_engine_plain(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


def make_engine_plain(url: str):  # type: ignore[no-untyped-def]
    # DDL on SQLite runs with the driver's default transaction handling, not BEGIN IMMEDIATE.
    from sqlalchemy import create_engine

    return create_engine(url, poolclass=pool.NullPool)


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
