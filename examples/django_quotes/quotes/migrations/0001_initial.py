from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Quote",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("customer", models.CharField(max_length=100)),
                ("email", models.EmailField(max_length=254)),
                ("total", models.DecimalField(decimal_places=2, max_digits=10)),
                ("state", models.CharField(default="draft", max_length=20)),
                ("mail_queued", models.BooleanField(default=False)),
            ],
        ),
    ]
