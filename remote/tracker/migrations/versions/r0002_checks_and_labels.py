"""Accuracy checks (`tether check`) and the labels a run carries (--label k=v).

Revision ID: 0002
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        "checks",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("recorded_at", sa.Float, nullable=False),
        sa.Column("created", sa.String(40)),
        sa.Column("model_name", sa.String(255), nullable=False),
        sa.Column("model_sha256", sa.String(64)),
        sa.Column("module_sha256", sa.String(64)),
        sa.Column("target", sa.Text),
        sa.Column("compiler_version", sa.String(100)),
        sa.Column("device_id", sa.String(255)),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("device", sa.Text),
        sa.Column("reference", sa.String(255)),                # what the board was compared with
        sa.Column("inputs", sa.Text),                          # JSON: count, source, digests
        sa.Column("tolerances", sa.Text),                      # JSON
        sa.Column("outputs", sa.Text),                         # JSON: per output, the measures
        sa.Column("passed", sa.Boolean, nullable=False),
        sa.Column("holder", sa.String(255)),
    )
    op.create_index("checks_by_model_key", "checks", ["model_name", "key", "recorded_at"])
    op.create_table(
        "labels",
        sa.Column("kind", sa.String(16), nullable=False),      # "bench" or "check"
        sa.Column("record_id", sa.Integer, nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("value", sa.String(1000), nullable=False),
        sa.PrimaryKeyConstraint("kind", "record_id", "name"),
    )
    op.create_index("labels_by_value", "labels", ["name", "value"])


def downgrade():
    op.drop_index("labels_by_value", "labels")
    op.drop_table("labels")
    op.drop_index("checks_by_model_key", "checks")
    op.drop_table("checks")
