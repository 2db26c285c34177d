# Added for kombu-pgskip: the job is written in the transaction that writes the widget.

from django.db import connection, transaction
from django.test import TestCase

from kombu_pgskip import apply_async_in

from demoapp.models import Widget
from demoapp.tasks import rename_widget


def jobs(task_id):
    with connection.cursor() as cursor:
        cursor.execute("SELECT task_name FROM pgskip.jobs WHERE task_id = %s", [task_id])
        return [row[0] for row in cursor.fetchall()]


class RenameWidgetTests(TestCase):
    def test_the_job_is_written_with_the_widget(self):
        with transaction.atomic():
            widget = Widget.objects.create(name="old")
            result = apply_async_in(connection, rename_widget, args=(widget.id, "new"))
        self.assertEqual(jobs(result.id), ["demoapp.tasks.rename_widget"])

    def test_a_rolled_back_block_takes_its_job_with_it(self):
        try:
            with transaction.atomic():
                widget = Widget.objects.create(name="old")
                result = apply_async_in(connection, rename_widget, args=(widget.id, "new"))
                raise RuntimeError("payment declined")
        except RuntimeError:
            pass
        self.assertEqual(jobs(result.id), [])
        self.assertFalse(Widget.objects.exists())
