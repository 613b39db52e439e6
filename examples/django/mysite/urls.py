from django.urls import path

from shop import views

urlpatterns = [
    path("orders", views.create_order),
    path("orders/<int:order_id>/pack", views.pack_order),
    path("orders/<int:order_id>/charge", views.charge_order),
    path("orders/<int:order_id>/refund", views.refund_order),
    path("orders/<int:order_id>", views.order),
    path("requests/<str:request_id>", views.request_status),
    path("results/<str:result_id>", views.task_result),
    path("refused", views.refused),
    path("async/orders/<int:order_id>/charge", views.charge_order_async),
    path("async/orders/<int:order_id>/audit", views.audit_order_async),
    path("async/results/<str:result_id>", views.result_async),
]
