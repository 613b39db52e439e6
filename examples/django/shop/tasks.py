"""The shop's tasks, in both forms. ``keyqueue worker`` imports this module after ``django.setup()``
(DJANGO_SETTINGS_MODULE is set), so it may use the models."""

import time

try:
    from django.tasks import task  # Django >= 6.0
except ImportError:
    from django_tasks import task  # the backport, before Django 6

from mysite.kq import app
from shop.models import Order

# --- keyqueue's own API ---


@app.task(key="order-{order_id}")
def pack(order_id: int) -> str:
    """Reads what the view committed: the view enqueued it with delay_on_commit, after its commit."""
    order = Order.objects.get(pk=order_id)
    order.packed = f"packed: {order.note}"
    order.save(update_fields=["packed"])
    return order.packed


# --- Django's Tasks framework, on keyqueue ---


@task(key="order-{order_id}")
def charge(order_id: int, amount: int) -> dict:
    """A read-modify-write without a lock, safe because keyqueue runs one request of an order at a
    time (``key=``), in the order the requests were accepted."""
    order = Order.objects.get(pk=order_id)
    before = order.charged
    time.sleep(0.02)  # a window in which a second run of the same order would overlap, were that possible
    order.charged = before + amount
    order.charges = [*order.charges, before]
    order.save(update_fields=["charged", "charges"])
    return {"order": order_id, "before": before, "after": order.charged}


@task(key="order-{order_id}", max_attempts=1)
def refund(order_id: int, amount: int) -> None:
    """Always fails: its result says FAILED, with the exception's class."""
    raise ValueError(f"refunds of {amount} are closed")


@task(takes_context=True, queue_name="audit", key="order-{order_id}")
async def audit(context, order_id: int, note: str) -> dict:
    """An async task on a queue of its own, given Django's TaskContext."""
    return {"order": order_id, "note": note, "attempt": context.attempt, "id": context.task_result.id}
