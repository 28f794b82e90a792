"""A Django project's app that keeps orders and schedules their payment timeouts with them."""
