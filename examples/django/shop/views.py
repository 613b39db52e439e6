"""Sync views (a WSGI worker's thread) and async views, using both forms."""

import datetime as dt

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.utils import timezone

try:
    from django.tasks import default_task_backend
except ImportError:
    from django_tasks import default_task_backend

from mysite.kq import app
from shop.models import Order
from shop.tasks import audit, charge, pack, refund


def describe(result) -> dict:
    """A Django TaskResult as JSON."""
    return {
        "id": result.id,
        "status": result.status,
        "return_value": result.return_value if result.status == "SUCCESSFUL" else None,
        "attempts": result.attempts,
        "args": result.args,
        "kwargs": result.kwargs,
        "errors": [error.exception_class_path for error in result.errors],
        "enqueued_at": result.enqueued_at and result.enqueued_at.isoformat(),
        "started_at": result.started_at and result.started_at.isoformat(),
    }


# --- sync views ---


def create_order(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"id": Order.objects.create().pk})


def pack_order(request: HttpRequest, order_id: int) -> JsonResponse:
    """Changes the order and enqueues its packing in one transaction (?rollback=1: rolled back)."""
    try:
        with transaction.atomic():
            Order.objects.filter(pk=order_id).update(note=request.GET["note"])
            request_id = pack.delay_on_commit(order_id=order_id)
            before_commit = app.status_sync(request_id)  # not enqueued yet: "unknown"
            if request.GET.get("rollback"):
                raise RuntimeError("roll back")
    except RuntimeError:
        pass
    return JsonResponse({"request_id": request_id, "before_commit": before_commit})


def request_status(request: HttpRequest, request_id: str) -> JsonResponse:
    """keyqueue's view of a request (of either form); ?wait=1 waits for its result first."""
    result = None
    if request.GET.get("wait"):
        try:
            result = app.result_sync(request_id, timeout=30)
        except Exception as exc:
            result = {"error": type(exc).__name__}
    return JsonResponse({"status": app.status_sync(request_id), "result": result})


def order(request: HttpRequest, order_id: int) -> JsonResponse:
    found = Order.objects.get(pk=order_id)
    return JsonResponse({"charged": found.charged, "charges": found.charges, "packed": found.packed})


def charge_order(request: HttpRequest, order_id: int) -> JsonResponse:
    return JsonResponse(describe(charge.enqueue(order_id=order_id, amount=int(request.GET["amount"]))))


def refund_order(request: HttpRequest, order_id: int) -> JsonResponse:
    return JsonResponse(describe(refund.enqueue(order_id=order_id, amount=int(request.GET["amount"]))))


def task_result(request: HttpRequest, result_id: str) -> JsonResponse:
    return JsonResponse(describe(default_task_backend.get_result(result_id)))


def refused(request: HttpRequest) -> JsonResponse:
    """A priority keyqueue cannot honour is refused where the task is made."""
    try:
        charge.using(priority=10)
    except Exception as exc:
        return JsonResponse({"error": type(exc).__name__, "message": str(exc)})
    return JsonResponse({"error": None})


# --- async views ---


async def charge_order_async(request: HttpRequest, order_id: int) -> JsonResponse:
    return JsonResponse(describe(await charge.aenqueue(order_id=order_id, amount=int(request.GET["amount"]))))


async def audit_order_async(request: HttpRequest, order_id: int) -> JsonResponse:
    """Enqueues an audit to run no sooner than ?delay= seconds from now."""
    run_after = timezone.now() + dt.timedelta(seconds=float(request.GET.get("delay", "0")))
    result = await audit.using(run_after=run_after).aenqueue(order_id=order_id, note=request.GET["note"])
    return JsonResponse({**describe(result), "run_after": run_after.isoformat()})


async def result_async(request: HttpRequest, result_id: str) -> JsonResponse:
    return JsonResponse(describe(await default_task_backend.aget_result(result_id)))
