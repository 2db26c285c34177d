"""``pgskip doctor``: checks of an installed schema, one line each, for CI and deploy checks.

Each check says ``ok`` or ``FAIL`` with what it found and what to run; the command exits
non-zero when one fails. The checks look for what would let a role other than the schema's
owner destroy messages or run code as the owner (docs/security.md):

* a function or procedure of the schema executable by PUBLIC (a trigger function attached to
  a table of the caller's own runs as its owner);
* a function without the search path ``<schema>, pg_catalog, pg_temp`` (a closer match for a
  built-in, created by another role in a schema on the path, would run in its place);
* a ``SECURITY DEFINER`` function (none of ours runs as its owner: grants do the job);
* a type of the schema usable by PUBLIC (an operator over it could be defined elsewhere);
* a role other than the owner that may create objects in the schema, or in a schema on a
  function's path, or in a schema on a broker role's own default search path;
* a role with more privileges than ``pgskip grant`` gives a worker or a publisher, PUBLIC with
  any, or an object of the schema owned by another role.

Run it as the schema's owner (or a superuser): the catalogs it reads are readable by every
role, but only the owner sees the schema as the checks assume.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from . import exceptions
from .grants import PUBLISHER_PRIVILEGES, WORKER_FUNCTIONS, WORKER_PRIVILEGES, Privilege
from .sql import queries_in, quote_ident
from .urls import Connection, connect, mask_url

#: Procedures commit between batches, which a SET clause forbids: their bodies qualify every
#: name and operator instead.
QUALIFIED_PROCEDURES = frozenset({"prune_in_batches"})


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


def split_search_path(value: str) -> list[str]:
    """A ``search_path`` setting's schema names, unquoted (``"a b", public`` -> a b, public)."""
    names: list[str] = []
    current: list[str] = []
    quoted = False
    i = 0
    while i < len(value):
        ch = value[i]
        if quoted:
            if ch == '"' and value[i + 1 : i + 2] == '"':
                current.append('"')
                i += 1
            elif ch == '"':
                quoted = False
            else:
                current.append(ch)
        elif ch == '"':
            quoted = True
        elif ch == ",":
            names.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
        i += 1
    last = "".join(current).strip()
    if last or names:
        names.append(last)
    return [n for n in names if n]


def expected_privileges(privileges: Iterable[Privilege]) -> set[tuple[str, str, str | None]]:
    """(table, privilege, column or None) for every privilege of a ``grants`` list."""
    return {
        (table, privilege.strip(), column)
        for table, listed, columns in privileges
        for privilege in listed.split(",")
        for column in (columns or (None,))
    }


class Doctor:
    """The checks of one schema through one connection (its owner's)."""

    def __init__(self, conn: Connection, schema: str) -> None:
        self.conn = conn
        self.schema = schema
        self.q = queries_in("doctor.sql", schema)

    def rows(self, query: str, **params: Any) -> list[tuple[Any, ...]]:
        return self.conn.execute(self.q[query], {"schema": self.schema, **params}).fetchall()

    def run(self) -> list[Check]:
        owner = self.rows("schema_owner")
        if not owner:
            return [
                Check(
                    "schema",
                    False,
                    f"schema {self.schema!r} not installed: run `celery -A proj pgskip migrate`",
                )
            ]
        checks = [Check("schema", True, f"{self.schema!r}, owned by {owner[0][0]}")]
        routines = self.rows("routines")
        for check in (
            self.public_routines,
            self.search_paths,
            self.security_definer,
        ):
            checks.append(check(routines))
        checks.append(self.public_types())
        checks.append(self.creators_in_schema())
        checks.append(self.creators_on_function_paths(routines))
        checks.append(self.foreign_owners())
        checks.append(self.public_privileges())
        for role, worker in self.rows("broker_roles"):
            checks.append(self.role_privileges(str(role), bool(worker)))
            checks.append(self.role_search_path(str(role)))
        return checks

    # -- routines ---------------------------------------------------------------------------------

    @staticmethod
    def _names(items: Sequence[str]) -> str:
        return ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")

    def public_routines(self, routines: list[tuple[Any, ...]]) -> Check:
        name = "routines not executable by PUBLIC"
        bad = [str(r[0]) for r in routines if r[4]]
        if not bad:
            return Check(name, True, f"{len(routines)} routines")
        fix = f"REVOKE ALL ON ALL ROUTINES IN SCHEMA {self._ident()} FROM PUBLIC"
        return Check(name, False, f"{self._names(bad)}: run `{fix};` as the owner")

    def search_paths(self, routines: list[tuple[Any, ...]]) -> Check:
        name = "functions pin a safe search_path"
        safe = [self.schema, "pg_catalog", "pg_temp"]
        bad = []
        for signature, kind, _definer, path, _public in routines:
            if kind == "p" and str(signature).split("(")[0] in QUALIFIED_PROCEDURES:
                continue
            if path is None or split_search_path(str(path)) != safe:
                bad.append(f"{signature} ({'no search_path' if path is None else path})")
        if not bad:
            return Check(name, True, f"{self._ident()}, pg_catalog, pg_temp")
        return Check(
            name,
            False,
            f"{self._names(bad)}: run `celery -A proj pgskip migrate` (migration 0012 sets "
            f"SET search_path = {self._ident()}, pg_catalog, pg_temp on each)",
        )

    def security_definer(self, routines: list[tuple[Any, ...]]) -> Check:
        name = "no SECURITY DEFINER function"
        bad = [str(r[0]) for r in routines if r[2]]
        if not bad:
            return Check(name, True, "none runs as its owner")
        return Check(
            name,
            False,
            f"{self._names(bad)} run as their owner: ALTER FUNCTION ... SECURITY INVOKER, "
            "and grant the roles that call them what they need",
        )

    def public_types(self) -> Check:
        name = "types not usable by PUBLIC"
        bad = [str(r[0]) for r in self.rows("public_types")]
        if not bad:
            return Check(name, True, "none")
        return Check(
            name,
            False,
            f"{self._names(bad)}: another role can define operators over them; run "
            f"`REVOKE USAGE ON TYPE {bad[0]} FROM PUBLIC;` (each) as the owner",
        )

    # -- who can create what where ---------------------------------------------------------------

    def _creators(self, schema: str) -> list[str]:
        return [str(r[0]) for r in self.rows("creators", name=schema)]

    def creators_in_schema(self) -> Check:
        name = "no other role creates in the schema"
        bad = self._creators(self.schema)
        if not bad:
            return Check(name, True, "only the owner")
        return Check(
            name,
            False,
            f"{self._names(bad)} may create objects in {self._ident()}: run "
            f"`REVOKE CREATE ON SCHEMA {self._ident()} FROM {bad[0]};` as the owner",
        )

    def creators_on_function_paths(self, routines: list[tuple[Any, ...]]) -> Check:
        name = "no other role creates in a schema on a function's search_path"
        schemas = sorted(
            {
                s
                for r in routines
                if r[3] is not None
                for s in split_search_path(str(r[3]))
                if s not in (self.schema, "pg_catalog", "pg_temp")
            }
        )
        bad = [f"{role} in {s}" for s in schemas for role in self._creators(s)]
        if not bad:
            return Check(name, True, "none")
        return Check(
            name,
            False,
            f"{self._names(bad)}: a function they create there can run as the owner; run "
            "`celery -A proj pgskip migrate` (every function's path becomes the schema and "
            "pg_catalog only)",
        )

    def role_search_path(self, role: str) -> Check:
        name = f"role {role}: default search_path"
        row = self.rows("role_search_path", role=role)
        setting = next((v for v in (row[0] if row else ()) if v is not None), None)
        path = split_search_path(setting if setting is not None else '"$user", public')
        schemas = [role if s == "$user" else s for s in path]
        bad = [
            f"{creator} in {s}"
            for s in schemas
            if s not in ("pg_catalog", "pg_temp")
            for creator in self._creators(s)
            if creator != role
        ]
        shown = setting if setting is not None else '"$user", public (the default)'
        if not bad:
            return Check(name, True, shown)
        return Check(
            name,
            False,
            f"{shown}, where {self._names(bad)} may create objects: a function or operator "
            f"they create there can run with {role}'s privileges in its sessions that do not "
            "set their own path (kombu-pgskip's own do, unless listen=False for PgBouncer); "
            f"run `ALTER ROLE {role} SET search_path = pg_catalog, pg_temp;` as a superuser, "
            "or revoke CREATE on those schemas",
        )

    # -- privileges ---------------------------------------------------------------------------

    def foreign_owners(self) -> Check:
        name = "every object owned by the schema's owner"
        bad = [f"{obj} ({owner})" for obj, owner in self.rows("foreign_owners")]
        if not bad:
            return Check(name, True, "yes")
        return Check(
            name,
            False,
            f"{self._names(bad)} belong to another role, which may change or drop them: "
            "ALTER ... OWNER TO the schema's owner",
        )

    def _held(self, role: str) -> set[tuple[str, str, str | None]]:
        return {(str(r[0]), str(r[1]), r[2]) for r in self.rows("privileges", role=role)}

    def public_privileges(self) -> Check:
        name = "PUBLIC has no privilege on the schema"
        # (EXECUTE: the routines check above)
        held = {p for p in self._held("public") if p[1] != "EXECUTE"}
        bad = sorted(self._describe(held))
        if not bad:
            return Check(name, True, "none")
        return Check(
            name,
            False,
            f"PUBLIC (every role) holds {self._names(bad)}: REVOKE them as the owner",
        )

    def role_privileges(self, role: str, worker: bool) -> Check:
        what = "worker" if worker else "publisher"
        name = f"role {role}: privileges of a {what}"
        expected = expected_privileges(WORKER_PRIVILEGES if worker else PUBLISHER_PRIVILEGES)
        if worker:
            expected |= {(f, "EXECUTE", None) for f in WORKER_FUNCTIONS}
        held = self._held(role)
        extra = held - expected
        # A column privilege is covered by the same privilege on the whole table.
        extra = {e for e in extra if not (e[2] is not None and (e[0], e[1], None) in expected)}
        if not extra:
            return Check(name, True, f"as `pgskip grant --{what}` gives")
        return Check(
            name,
            False,
            f"more than `pgskip grant --{what}` gives: {self._names(sorted(self._describe(extra)))}"
            f"; REVOKE them as the owner (a role's privileges through membership and PUBLIC "
            "count too)",
        )

    @staticmethod
    def _describe(privileges: Iterable[tuple[str, str, str | None]]) -> list[str]:
        return [
            f"{priv} on {table}" + (f"({column})" if column else "")
            for table, priv, column in privileges
        ]

    def _ident(self) -> str:
        return quote_ident(self.schema)


def run_doctor(url: str, schema: str) -> list[Check]:
    """Every check of ``schema`` at ``url``."""
    with exceptions.translating(url_for_messages=mask_url(url)), connect(url) as conn:
        return Doctor(conn, schema).run()


__all__ = ["Check", "Doctor", "run_doctor", "split_search_path"]
