"""The farm database's schema versions (Alembic): remote/tracker/farmdb.py runs
them when the tracker opens its database, so an upgraded tracker opens an old one."""
