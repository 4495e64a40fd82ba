from django.db import models


class Quote(models.Model):
    customer = models.CharField(max_length=100)
    email = models.EmailField()
    total = models.DecimalField(max_digits=10, decimal_places=2)
    state = models.CharField(max_length=20, default="draft")
    mail_queued = models.BooleanField(default=False)  # set by the consumer, with its inbox row
