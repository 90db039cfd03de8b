"""The first schema: posted benchmarks (one row per board) and ended sessions.

Revision ID: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        "benchmarks",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("recorded_at", sa.Float, nullable=False),    # Unix time at the tracker
        sa.Column("created", sa.String(40)),                   # when the run ended (UTC, ISO)
        sa.Column("model_name", sa.String(255), nullable=False),
        sa.Column("model_sha256", sa.String(64)),
        sa.Column("module_sha256", sa.String(64)),
        sa.Column("target", sa.Text),                          # JSON: name, triple, cpu, features
        sa.Column("compiler_version", sa.String(100)),
        sa.Column("device_id", sa.String(255)),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("device", sa.Text),                          # JSON: what the board reported
        sa.Column("conditions", sa.Text),                      # JSON: number, repeat, threads...
        sa.Column("samples_s", sa.Text, nullable=False),       # JSON list: one per repeat
        sa.Column("median_s", sa.Float),
        sa.Column("holder", sa.String(255)),
    )
    op.create_index("benchmarks_by_model_key", "benchmarks", ["model_name", "key", "recorded_at"])
    op.create_table(
        "sessions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("device_id", sa.String(255), nullable=False),
        sa.Column("holder", sa.String(255)),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("ended_at", sa.Float, nullable=False),
        sa.Column("how", sa.String(255)),
    )


def downgrade():
    op.drop_table("sessions")
    op.drop_index("benchmarks_by_model_key", "benchmarks")
    op.drop_table("benchmarks")
