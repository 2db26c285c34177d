"""The PEP 517 build backend: setuptools' ``build_meta``, plus ``kombu_pgskip.pth`` at the top
of every wheel it builds.

Python's :mod:`site` runs the ``import`` lines of the ``.pth`` files at the top of
site-packages at start-up; ``kombu_pgskip.pth`` is how ``pgskip://`` resolves in every process
of an environment with kombu-pgskip installed (see ``_kombu_pgskip_alias.py``). setuptools has
no setting that installs a file there, so :func:`build_wheel` and :func:`build_editable`
(``pip install -e``) add it, with its RECORD line, to the wheel setuptools built. The other
hooks are setuptools' own.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from collections.abc import Mapping

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

PTH_NAME = "kombu_pgskip.pth"
PTH_CONTENT = b"import _kombu_pgskip_alias; _kombu_pgskip_alias.install()\n"

ConfigSettings = Mapping[str, "str | list[str] | None"]


def build_wheel(
    wheel_directory: str,
    config_settings: ConfigSettings | None = None,
    metadata_directory: str | None = None,
) -> str:
    name: str = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_pth(os.path.join(wheel_directory, name))
    return name


def build_editable(
    wheel_directory: str,
    config_settings: ConfigSettings | None = None,
    metadata_directory: str | None = None,
) -> str:
    name: str = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    add_pth(os.path.join(wheel_directory, name))
    return name


def add_pth(wheel: str) -> None:
    """Rewrite the wheel at ``wheel`` with :data:`PTH_NAME` at its top, written before the
    ``.dist-info`` directory, and listed in its RECORD."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(PTH_CONTENT).digest()).rstrip(b"=")
    record_line = f"{PTH_NAME},sha256={digest.decode()},{len(PTH_CONTENT)}\n".encode()
    rewritten = wheel + ".pth-tmp"
    with zipfile.ZipFile(wheel) as src:
        infos = src.infolist()
        if PTH_NAME in src.namelist():
            raise RuntimeError(f"{wheel} already has {PTH_NAME}")
        (record,) = [i for i in infos if _is_record(i.filename)]
        dist_info = record.filename.split("/")[0] + "/"
        pth = zipfile.ZipInfo(PTH_NAME, date_time=record.date_time)
        pth.external_attr = 0o644 << 16
        pth.compress_type = zipfile.ZIP_DEFLATED
        written = False
        with zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in infos:
                if not written and info.filename.startswith(dist_info):
                    dst.writestr(pth, PTH_CONTENT)
                    written = True
                data = src.read(info)
                if info is record:
                    data = data if data.endswith(b"\n") else data + b"\n"
                    data += record_line
                dst.writestr(info, data)
    os.replace(rewritten, wheel)


def _is_record(name: str) -> bool:
    return name.count("/") == 1 and name.endswith(".dist-info/RECORD")
