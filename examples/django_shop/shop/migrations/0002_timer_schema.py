"""Timer's tables (timers, tombstones, schema version) in the shop's database, made by
Timer's own migrations when Django migrates: ``python manage.py migrate`` brings them up to
date as it does the shop's, and a newer Timer adds its steps in a migration like this one."""

from django.db import migrations

from shop.timers import migrate_timer_schema


def create_timer_schema(apps: object, schema_editor: object) -> None:
    migrate_timer_schema(schema_editor.connection)  # type: ignore[attr-defined]


class Migration(migrations.Migration):
    # Timer migrates in a transaction of its own (on SQLite, on a connection of its own):
    # outside Django's, which would otherwise hold the database's write lock.
    atomic = False
    dependencies = [("shop", "0001_initial")]
    operations = [
        # Going back leaves Timer's tables: dropping them would lose every pending timer.
        migrations.RunPython(create_timer_schema, migrations.RunPython.noop),
    ]
