from django.contrib import admin
from django.urls import path
from quotes import views

urlpatterns = [
    path("admin/", admin.site.urls),  # the outbox's backlog and quarantine, read-only
    path("quotes/<int:quote_id>/approve", views.approve),
    path("quotes/<int:quote_id>", views.show),
]
