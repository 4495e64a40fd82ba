"""A Django process on MariaDB for tests/test_django_mysql.py: configures Django from
``OUTBOX_TEST_DJANGO_MYSQL`` (``host:port/name``), runs the outbox app's migration, then
writes events through ``outbox.django`` in ``transaction.atomic()`` (one block committed, one
rolled back) and prints the committed event id as JSON."""

from __future__ import annotations

import json
import os
import sys

import pymysql

pymysql.install_as_MySQLdb()  # Django's MySQL backend imports MySQLdb: PyMySQL stands in

import django  # noqa: E402
from django.conf import settings  # noqa: E402


def main() -> int:
    hostport, name = os.environ["OUTBOX_TEST_DJANGO_MYSQL"].split("/", 1)
    host, port = hostport.split(":")
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.mysql",
                "NAME": name,
                "USER": "root",
                "HOST": host,
                "PORT": int(port),
            }
        },
        INSTALLED_APPS=["outbox.django"],
        USE_TZ=True,
    )
    django.setup()
    from django.core.management import call_command
    from django.db import transaction

    import outbox.django as outbox_django

    call_command("migrate", "outbox", verbosity=0)
    with transaction.atomic():
        kept = outbox_django.emit("quote.approved", key="quote-1", payload={"n": 1})
    try:
        with transaction.atomic():
            outbox_django.emit("quote.approved", key="quote-2", payload={"n": 2})
            raise RuntimeError("the domain failed")
    except RuntimeError:
        pass
    refused = ""
    try:
        outbox_django.emit("quote.approved", key="quote-3", payload={})
    except outbox_django.NoTransaction as exc:
        refused = type(exc).__name__
    json.dump({"kept": kept, "refused": refused, "url": outbox_django.database_url()}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
