"""``pgskip://`` resolves in every process of an environment where kombu-pgskip is installed,
not only under the ``celery`` command: ``kombu_pgskip.pth`` registers the scheme when
``kombu.transport`` is first imported. Each test runs a fresh interpreter of this test run's
environment (an editable install) or of a virtualenv with the wheel installed, and nothing in
it imports ``kombu_pgskip`` by hand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import psycopg
import pytest

import _kombu_pgskip_alias
import kombu_pgskip
from tests.helpers import REPO_ROOT, build_wheel

pytestmark = pytest.mark.acceptance

RESOLVE = textwrap.dedent(
    """
    import sys
    assert not [m for m in sys.modules if m.startswith("kombu")], sorted(sys.modules)
    from kombu import Connection
    from kombu.transport import get_transport_cls
    conn = Connection("pgskip://u@127.0.0.1:1/db")
    cls = get_transport_cls(conn.transport_cls)
    assert conn.transport.driver_type == "pgskip"
    print(f"{cls.__module__}:{cls.__qualname__}")
    print(sys.modules[cls.__module__].__file__)
    """
)


def clean_env() -> dict[str, str]:
    """This process's environment without what makes Python import modules by itself."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}


def fresh_python(
    code: str, python: str = sys.executable, options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``python [options] -c code`` in a new interpreter, run from ``/`` (not the repo)."""
    return subprocess.run(
        [python, *options, "-c", code],
        cwd="/", env=clean_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_fresh_interpreter_resolves_pgskip_with_nothing_imported_by_hand() -> None:
    result = fresh_python(RESOLVE)
    assert result.returncode == 0, result.stderr
    path, module_file = result.stdout.split()
    assert path == "kombu_pgskip.transport:Transport"
    assert Path(module_file) == REPO_ROOT / "kombu_pgskip" / "transport.py"


def test_a_process_that_never_imports_kombu_does_not_import_it_because_of_the_hook() -> None:
    result = fresh_python(
        textwrap.dedent(
            """
            import sys
            import json, email.mime.text, http.client, logging.handlers, importlib.util
            importlib.util.find_spec("kombu")
            hook = sys.modules["_kombu_pgskip_alias"]  # run by kombu_pgskip.pth
            assert hook.installed(), sys.meta_path
            loaded = sorted(m for m in sys.modules if m.split(".")[0] in (
                "kombu", "kombu_pgskip", "celery", "amqp", "vine", "psycopg", "billiard"))
            assert not loaded, loaded
            """
        )
    )
    assert result.returncode == 0, result.stderr


def test_the_hook_imports_nothing_at_start_up() -> None:
    result = fresh_python("pass", options=("-X", "importtime"))
    assert result.returncode == 0, result.stderr
    # "import time: self [us] | cumulative | name": a module that imports nothing has both equal.
    (line,) = [line for line in result.stderr.splitlines() if line.endswith("_kombu_pgskip_alias")]
    self_us, cumulative_us = (int(n) for n in re.findall(r"\d+", line.split(":", 1)[1])[:2])
    assert self_us == cumulative_us, line


def test_after_kombu_transport_is_imported_the_hook_is_gone_and_the_module_is_untouched() -> None:
    result = fresh_python(
        textwrap.dedent(
            """
            import importlib.machinery, importlib.util, sys
            hook = sys.modules["_kombu_pgskip_alias"]
            # Looking the module up without importing it leaves the hook waiting.
            importlib.util.find_spec("kombu.transport")
            assert hook.installed() and "kombu.transport" not in sys.modules
            import kombu.transport
            assert not hook.installed(), sys.meta_path
            assert kombu.transport.TRANSPORT_ALIASES["pgskip"] == "kombu_pgskip.transport:Transport"
            loader = importlib.machinery.SourceFileLoader
            assert type(kombu.transport.__loader__) is loader, kombu.transport.__loader__
            assert type(kombu.transport.__spec__.loader) is loader
            assert "kombu_pgskip" not in sys.modules
            # An alias the application sets afterwards is kept; install() again changes nothing.
            kombu.transport.TRANSPORT_ALIASES["pgskip"] = "myapp.transport:Transport"
            hook.install()
            assert kombu.transport.TRANSPORT_ALIASES["pgskip"] == "myapp.transport:Transport"
            assert not hook.installed()
            """
        )
    )
    assert result.returncode == 0, result.stderr


def test_the_hook_and_the_package_register_the_same_transport() -> None:
    assert _kombu_pgskip_alias.TRANSPORT_PATH == kombu_pgskip.TRANSPORT_PATH
    assert _kombu_pgskip_alias.ALIAS == "pgskip"


def test_a_plain_script_delay_enqueues_into_pgskip_jobs(db_url: str, tmp_path: Path) -> None:
    assert db_url.startswith("postgresql://"), db_url
    broker = db_url.replace("postgresql://", "pgskip://", 1)
    script = tmp_path / "enqueue.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            from celery import Celery

            app = Celery("plain", broker=sys.argv[1])

            @app.task(name="plain.add")
            def add(x, y):
                return x + y

            result = add.delay(2, 3)
            assert "kombu_pgskip" in sys.modules  # imported by kombu, through the alias
            print(result.id)
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script), broker],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    task_id = result.stdout.strip()
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT queue, task_name, task_id FROM pgskip.jobs").fetchall()
    assert rows == [("celery", "plain.add", task_id)]


def test_the_wheel_installed_in_a_fresh_virtualenv_resolves_pgskip(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert {"kombu_pgskip.pth", "_kombu_pgskip_alias.py"} <= set(names)

    # The wheel alone in the virtualenv's site-packages; its dependencies from this test run's
    # site-packages, appended to sys.path as a plain directory (whose .pth files do not run).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = fresh_python("import sysconfig; print(sysconfig.get_paths()['purelib'])", python)
    site_packages = Path(site.stdout.strip())
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--target", str(site_packages), str(wheel)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert (site_packages / "kombu_pgskip.pth").is_file()
    (site_packages / "zz_test_run_site_packages.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )

    result = fresh_python(RESOLVE, python)
    assert result.returncode == 0, result.stderr
    path, module_file = result.stdout.split()
    assert path == "kombu_pgskip.transport:Transport"
    assert Path(module_file).is_relative_to(site_packages), module_file

    bare = fresh_python(
        "import sys; assert 'kombu' not in sys.modules; "
        "assert sys.modules['_kombu_pgskip_alias'].installed()",
        python,
    )
    assert bare.returncode == 0, bare.stderr
