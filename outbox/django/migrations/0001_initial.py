"""The outbox table, created by the toolkit's own ``create_schema`` on Django's connection:
the same table, indexes and storage parameters as ``Outbox.create_schema()`` or
``outbox-relay init-db`` make, and a table one of those made first is accepted as it is
(every piece is checked before it is created)."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


def create_outbox_table(apps: Any, schema_editor: Any) -> None:
    from outbox.django.connection import engine
    from outbox.schema import build_schema, create_schema

    bind = engine(schema_editor.connection.alias)
    try:
        with bind.connect() as conn:  # one atomic() block inside the migration's
            create_schema(conn, build_schema())
            conn.commit()
    finally:
        bind.dispose()


def drop_outbox_table(apps: Any, schema_editor: Any) -> None:
    quote = schema_editor.connection.ops.quote_name
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"DROP TRIGGER IF EXISTS outbox_events_notify ON {quote('outbox_events')}"
        )
        schema_editor.execute("DROP FUNCTION IF EXISTS outbox_events_notify()")
    schema_editor.execute(f"DROP TABLE IF EXISTS {quote('outbox_events')}")


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.SeparateDatabaseAndState(
            # The table is made by create_schema, not from the model below; the model is
            # what Django knows of it (the admin, TransactionTestCase's flush between tests).
            database_operations=[migrations.RunPython(create_outbox_table, drop_outbox_table)],
            state_operations=[
                migrations.CreateModel(
                    name="OutboxEvent",
                    fields=[
                        ("seq", models.BigAutoField(primary_key=True, serialize=False)),
                        ("event_id", models.CharField(max_length=64, unique=True)),
                        ("topic", models.CharField(max_length=200)),
                        ("key", models.CharField(max_length=200)),
                        ("key_hash", models.BigIntegerField()),
                        ("tenant", models.CharField(max_length=200, null=True)),
                        ("identity", models.CharField(max_length=200)),
                        ("payload", models.JSONField()),
                        ("headers", models.JSONField(null=True)),
                        ("created_at", models.DateTimeField()),
                        ("available_at", models.DateTimeField()),
                        ("attempts", models.IntegerField()),
                        ("last_error", models.TextField(null=True)),
                        ("state", models.CharField(max_length=16)),
                        ("claimed_by", models.CharField(max_length=128, null=True)),
                        ("claim_epoch", models.BigIntegerField(null=True)),
                        ("claimed_at", models.DateTimeField(null=True)),
                        ("stream", models.CharField(max_length=512, null=True)),
                        ("stream_id", models.CharField(max_length=64, null=True)),
                        ("published_at", models.DateTimeField(null=True)),
                    ],
                    options={
                        "verbose_name": "outbox event",
                        "db_table": "outbox_events",
                        "ordering": ("seq",),
                    },
                ),
            ],
        ),
    ]
