from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.CharField(max_length=64, primary_key=True, serialize=False)),
                ("status", models.CharField(default="unpaid", max_length=16)),
            ],
        ),
    ]
