"""Settings of the example: one database (``DATABASE_URL``, a SQLite file by default), Redis
(``REDIS_URL``), and e-mails written as files to ``EMAIL_FILE_PATH`` (so you can count them).

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/app python manage.py migrate
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "outbox.django",  # the outbox table (migrations), emit, the outbox_* commands, the admin
    "quotes",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "django_quotes.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def database(url: str) -> dict[str, Any]:
    """``postgresql://user:password@host:port/name?options=...`` or ``sqlite:///path``."""
    parts = urlsplit(url)
    if parts.scheme.startswith("sqlite"):
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": unquote(parts.path[1:])}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path[1:]),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        "OPTIONS": dict(parse_qsl(parts.query)),  # e.g. options=-csearch_path=...
    }


DATABASES = {"default": database(os.environ.get("DATABASE_URL", f"sqlite:///{BASE_DIR}/quotes.db"))}
if os.environ.get("TEST_DATABASE_NAME"):  # the tests' own test database, per run
    DATABASES["default"]["TEST"] = {"NAME": os.environ["TEST_DATABASE_NAME"]}

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
OUTBOX_STREAM = os.environ.get("OUTBOX_STREAM", "outbox.{topic}")

EMAIL_BACKEND = "django.core.mail.backends.filebased.EmailBackend"
EMAIL_FILE_PATH = os.environ.get("EMAIL_FILE_PATH", str(BASE_DIR / "sent-mail"))
DEFAULT_FROM_EMAIL = "quotes@example.com"

LOGGING = {"version": 1, "disable_existing_loggers": False}
