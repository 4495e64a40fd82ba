#!/usr/bin/env python
"""The example's manage.py (``python manage.py migrate``, ``runserver``, ``outbox_relay``...)."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_quotes.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
