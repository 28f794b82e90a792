"""The shop's one model: an order, unpaid until paid, expired when its payment timeout fires."""

from django.db import models


class Order(models.Model):
    """An order row; its payment timeout is a timer keyed by the order's id."""

    id = models.CharField(primary_key=True, max_length=64)
    status = models.CharField(max_length=16, default="unpaid")
