"""What a benchmark's regression gate found: the comparison with its baseline
(`tether bench --baseline` or `--baseline-module`), and with a baseline module
timed in the same rounds, that module's samples too.

Revision ID: 0003
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade():
    op.add_column("benchmarks", sa.Column("comparison", sa.Text))   # JSON, or NULL: no gate


def downgrade():
    with op.batch_alter_table("benchmarks") as batch:
        batch.drop_column("comparison")
