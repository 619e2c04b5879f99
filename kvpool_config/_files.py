"""Validate files: load each, detect its shape, run its checks; plain kv_transfer_configs given
together are instances on one host and must not share ports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool_config import rules as R
from kvpool_config._context import Options
from kvpool_config._kv_transfer_config import host_ports
from kvpool_config._loader import ConfigLoadError, load_json
from kvpool_config._registry import Shape, detect_shape, validate_document
from kvpool_config.rules import Finding

__all__ = ["FileReport", "validate_files"]


@dataclass
class FileReport:
    """Findings of one input file (``shape`` is None when it could not be read)."""

    path: str
    shape: Shape | None
    findings: list[Finding] = field(default_factory=list)


def validate_files(
    paths: Sequence[str | Path],
    *,
    env_path: str | Path | None = None,
    options: Options | None = None,
) -> list[FileReport]:
    """Load and validate files; a file that cannot be read yields one ``load`` error finding.

    Plain kv_transfer_config files given together are instances on one host: their
    ``lookup_rpc_port`` values (vllm-ascend kv_pool.md: "Each Instance Requires a Unique Port")
    and ``kv_port`` values must all differ.

    Returns:
        One report per file, the env.json's first when ``env_path`` is given.
    """
    opts = options or Options()
    reports: list[FileReport] = []
    env_doc: dict[str, Any] | None = None
    if env_path is not None:
        env_report, env_doc = _load_env(env_path, opts)
        reports.append(env_report)
    plain: list[tuple[FileReport, dict[str, Any]]] = []
    for path in paths:
        report = FileReport(str(path), None)
        reports.append(report)
        try:
            doc = load_json(path)
            report.shape = detect_shape(doc, str(path))
        except ConfigLoadError as exc:
            report.findings = [Finding("error", "load", "$", str(exc))]
            continue
        report.findings = validate_document(doc, report.shape, env=env_doc, options=opts)
        if report.shape == "kv_transfer_config":
            plain.append((report, doc))
    if len(plain) > 1:
        _check_one_host(plain, opts)
    return reports


def _load_env(env_path: str | Path, options: Options) -> tuple[FileReport, dict[str, Any] | None]:
    """The ``--env`` file's report, and its document when it is a readable env.json."""
    report = FileReport(str(env_path), None)
    try:
        loaded = load_json(env_path)
        shape = detect_shape(loaded, str(env_path))
        if shape != "env":
            raise ConfigLoadError(
                str(env_path), f"--env expects a MindIE env.json, got a {shape}", 1, 1
            )
    except ConfigLoadError as exc:
        report.findings = [Finding("error", "load", "$", str(exc))]
        return report, None
    report.shape = "env"
    report.findings = validate_document(loaded, "env", options=options)
    return report, loaded


def _check_one_host(plain: list[tuple[FileReport, dict[str, Any]]], options: Options) -> None:
    """Port clashes between plain kv_transfer_configs, reported on the later file."""
    ports: list[tuple[int, str, str]] = []
    lookup: list[tuple[int, str, str]] = []
    for report, doc in plain:
        inst_ports, inst_lookup = host_ports(doc, options)
        ports += [(p, f"{report.path}: {jp}", w) for p, jp, w in inst_ports]
        lookup += [(p, f"{report.path}: {jp}", "lookup_rpc_port") for p, jp in inst_lookup]
    clashes = [(f, "port-conflict") for f in R.check_duplicate_ports(ports)]
    clashes += [(f, "lookup-rpc-port") for f in R.check_duplicate_ports(lookup)]
    for finding, rule in clashes:
        file_name, _, jp = finding.path.partition(": ")
        target = next(r for r, _doc in plain if r.path == file_name)
        fix = (
            "give every instance on the host its own lookup_rpc_port"
            if rule == "lookup-rpc-port"
            else finding.fix
        )
        target.findings.append(
            Finding(finding.severity, rule, jp, f"{finding.message} on the same host", fix)
        )
