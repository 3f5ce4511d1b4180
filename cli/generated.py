"""Files generated from one source, kept in the repository and checked by `make lint`: the CRD and its field
reference (from the API models, `tailor.operator.crd`), the CLI reference (from this command's parser) and the
chart values reference (from the chart's `values.yaml` and `values.schema.json`)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tailor.operator import crd

CHART = crd.ROOT / "charts" / "tailor"
CLI_FILE = crd.ROOT / "docs" / "reference" / "cli.md"
VALUES_FILE = crd.ROOT / "docs" / "reference" / "chart-values.md"
PERMISSIONS_FILE = crd.ROOT / "docs" / "reference" / "permissions.md"
# Where each rule of templates/rbac.yaml applies, by the line that opens its role
RBAC_SCOPES = (('define "tailor.namespacedRules"', "each watched namespace (one ClusterRole with `clusterWide`)"),
               ("name: {{ $fullname }}-nodes", "the cluster"),
               ("name: {{ $fullname }}-gpu-pods", "each of `serving.heldGpuNamespaces`"))
HELP_WIDTH = "100"  # the columns argparse wraps help to, so the page does not depend on the terminal


def _commands(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command under `parser`, depth first, with its full name."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb, child in action.choices.items():
                yield from _commands(child, f"{name} {verb}")


def render_cli(parser: argparse.ArgumentParser) -> str:
    """The `tailor` CLI reference: each command's `--help`, as the command prints it."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        commands = list(_commands(parser, parser.prog))
        lines = ["<!-- Generated from the `tailor` parser by `tailor docs generate`; do not edit by hand. -->",
                 "# The `tailor` CLI", "",
                 "Every command prints data on stdout and progress and errors on stderr. `tailor COMMAND --help` "
                 "prints what is below.", ""]
        lines += [f"- [`{name}`](#{name.replace(' ', '-')})" for name, _ in commands[1:]]
        for name, command in commands:
            lines += ["", f"## {name}", "", "```text",
                      command.format_help().rstrip(), "```"]
        return "\n".join(lines) + "\n"
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def _comments(values_yaml: str) -> dict[str, str]:
    """The comment above each key of values.yaml, by dotted path (`# -- ` marks a section's comment)."""
    found: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in values_yaml.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip().removeprefix("-- "))
            continue
        if not stripped:
            pending = []  # a blank line ends a comment that belongs to no key
            continue
        if stripped.startswith("- ") or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = stripped.split(":", 1)[0].strip('"')
        stack.append((indent, key))
        if pending:
            found[".".join(k for _, k in stack)] = " ".join(pending)
        pending = []
    return found


def _type(node: Mapping[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    kind = node.get("type", "any")
    return " or ".join(kind) if isinstance(kind, list) else str(kind)


def _checks(node: Mapping[str, Any]) -> str:
    checks = [f"{word} {node[key]}" for key, word in
              (("minimum", ">="), ("maximum", "<="), ("minLength", "length >="), ("maxLength", "length <="),
               ("minItems", "items >="), ("maxItems", "items <=")) if key in node]
    if "pattern" in node:
        checks.append(f"matches `{node['pattern']}`")
    return "; ".join(checks).replace("|", "\\|")


def _value_rows(node: Mapping[str, Any], default: Any, path: str, comments: Mapping[str, str]) -> Iterator[str]:
    children = node.get("properties") or {}
    if children and isinstance(default, dict):
        if path in comments:
            yield f"| `{path}` | object | | {comments[path]} | |"
        for name, child in children.items():
            yield from _value_rows(child, default.get(name), f"{path}.{name}" if path else name, comments)
        return
    shown = f"`{json.dumps(default)}`" if default is not None else ""
    yield f"| `{path}` | {_type(node)} | {shown} | {comments.get(path, '')} | {_checks(node)} |"


def render_values() -> str:
    """The chart values reference: every value's type and default, the comment values.yaml gives it, and what
    values.schema.json checks."""
    import yaml

    text = (CHART / "values.yaml").read_text()
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = ["<!-- Generated from charts/tailor/values.yaml and values.schema.json by `tailor docs generate`; do not "
             "edit by hand. -->", "# Chart values", "",
             "Every value of `charts/tailor`, with its default, the comment `values.yaml` gives it and what "
             "`values.schema.json` checks (`helm install` refuses a value that fails, naming it).", "",
             "| value | type | default | meaning | checked |", "| --- | --- | --- | --- | --- |"]
    lines += _value_rows(schema, yaml.safe_load(text), "", _comments(text))
    return "\n".join(lines) + "\n"


def rbac_rules(rbac_yaml: str) -> Iterator[tuple[str, str, str, str, str]]:
    """(where, API group, resources, verbs, why) of every rule in templates/rbac.yaml: why is the comment above the
    rule, or the one before it where a rule shares it."""
    scope, why = "", ""
    pending: list[str] = []
    rule: dict[str, str] = {}
    for line in rbac_yaml.splitlines():
        stripped = line.strip()
        if (opened := next((where for marker, where in RBAC_SCOPES if marker in stripped), None)) is not None:
            scope, why = opened, ""  # a rule shares the comment of one before it in the same role only
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
        elif stripped.startswith("- apiGroups:") or (rule and stripped.split(":", 1)[0] in ("resources", "verbs")):
            key, _, value = stripped.removeprefix("- ").partition(":")
            rule[key] = value.strip().strip("[]").replace('""', "core") or "core"
            if key == "verbs":
                why, pending = " ".join(pending) or why, []
                yield scope, rule["apiGroups"], rule["resources"], rule["verbs"], why
                rule = {}
        elif not stripped.startswith("{{"):
            pending = []  # a comment on something other than a rule


def render_permissions() -> str:
    """What the operator may do, each right with where it holds and why (from templates/rbac.yaml's comments)."""
    lines = ["<!-- Generated from charts/tailor/templates/rbac.yaml by `tailor docs generate`; do not edit by "
             "hand. -->", "# The operator's permissions", "",
             "Every right the chart grants the operator's ServiceAccount, where it holds and why, as "
             "`templates/rbac.yaml` says. Not granted: Secrets (credentials reach stage pods through "
             "`secretKeyRef`), `pods/exec`, updates of Jobs or Deployments in place, anything on Nodes beyond "
             "`list`, CRDs. RBAC cannot narrow a right by label: `pods/log`, Service patches and claim deletes "
             "hold for every such object in a watched namespace, and the operator itself checks that each object "
             "it reads a log of, patches or deletes is its own (owner reference or its model's uid label) and "
             "leaves another's alone (`operator/kube.py`). The uninstall hook and `helm test` have roles of their "
             "own (`templates/release-hook.yaml`, `templates/tests/`).", "",
             "| where | API group | resources | verbs | why |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {where} | {group} | {resources} | {verbs} | {why} |"
              for where, group, resources, verbs, why in rbac_rules((CHART / "templates" / "rbac.yaml").read_text())]
    return "\n".join(lines) + "\n"


def docs(parser: argparse.ArgumentParser) -> dict[Path, str]:
    """The generated reference pages besides the CRD's (`tailor docs generate`), and their text."""
    return {CLI_FILE: render_cli(parser), VALUES_FILE: render_values(), PERMISSIONS_FILE: render_permissions()}


def stale(generated: Mapping[Path, str]) -> list[Path]:
    """The generated files that differ from their sources."""
    return [path for path, text in generated.items() if not path.exists() or path.read_text() != text]


def write(generated: Mapping[Path, str]) -> list[Path]:
    """Write each generated file atomically (a temporary file, then a rename); the paths written."""
    for path, text in generated.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(text)
        temporary.replace(path)
    return list(generated)
