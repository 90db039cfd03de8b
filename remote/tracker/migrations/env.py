"""Alembic's entry point for the farm database: the tracker hands it an open
connection (farmdb.upgrade), so there is no alembic.ini and no URL here."""
from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None,
                  render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
