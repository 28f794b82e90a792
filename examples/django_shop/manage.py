#!/usr/bin/env python
"""Django's command-line utility for the example shop: ``python manage.py migrate``,
``python manage.py run_timer``, ``python manage.py test shop``."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
