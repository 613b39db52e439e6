from django.db import models


class Order(models.Model):
    note = models.CharField(max_length=100, default="")
    charged = models.IntegerField(default=0)
    charges = models.JSONField(default=list)
    """The total each charge saw before it added its amount, in the order the charges ran."""
    packed = models.CharField(max_length=100, default="")
