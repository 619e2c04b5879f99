"""``kvpool-config``: check deployment configs before anything starts.

Commands:

- ``kvpool-config validate USER_CONFIG.json [MORE.json ...] [--env ENV.json] [--strict] [--json]``
  exit status 0 = clean (warnings allowed), 1 = warnings with ``--strict``, 2 = errors or an
  unreadable file.
- ``kvpool-config render USER_CONFIG.json [--out DIR] [--master-host HOST]``: the
  ``mooncake_master`` command line and the ``MOONCAKE_CONFIG_PATH`` JSON.
- ``kvpool-config schema [--out FILE]``: the JSON Schema (``config/kvpool.schema.json``).

Bad command-line input (an ``--out`` that cannot be written, a ``--master-host`` that is no host
name or IP address, a ``--block-size`` or ``--num-layers`` below 1) is one line on stderr naming
the option and the fix, exit status 2, and nothing is written.
- ``kvpool-config fingerprint MODEL_DIR [--json]``: the content fingerprint of a local
  safetensors checkpoint (``kvpool_connector.fingerprint``), what it read and how long it
  took; exit 2 with the reason when the directory cannot be fingerprinted. With
  ``--adapter``, the LoRA adapter directory's (``lora:<hex>``, what its requests' keys mix in).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvpool_agent.cli_parser import CommandParser, int_at_least
from kvpool_config._context import Options
from kvpool_config._files import FileReport, validate_files
from kvpool_config._loader import ConfigLoadError, load_json
from kvpool_config._render import (
    MASTER_CMD_NAME,
    MASTER_HOST_FIX,
    MOONCAKE_JSON_NAME,
    RenderError,
    render_mooncake,
)
from kvpool_config._schema import schema_text
from kvpool_config.rules import Finding, host_problem
from kvpool_connector.fingerprint import (
    NotFingerprintable,
    adapter_fingerprint,
    checkpoint_fingerprint,
)

__all__ = ["EXIT_CLEAN", "EXIT_ERRORS", "EXIT_WARNINGS", "exit_status", "main"]

EXIT_CLEAN = 0
EXIT_WARNINGS = 1
EXIT_ERRORS = 2

_ORDER = {"error": 0, "warning": 1, "info": 2}


def exit_status(reports: Sequence[FileReport], *, strict: bool) -> int:
    """2 when any error, 1 when warnings and ``strict``, else 0."""
    severities = {f.severity for r in reports for f in r.findings}
    if "error" in severities:
        return EXIT_ERRORS
    if strict and "warning" in severities:
        return EXIT_WARNINGS
    return EXIT_CLEAN


def _format_text(reports: Sequence[FileReport]) -> str:
    lines: list[str] = []
    for report in reports:
        counts = {s: sum(f.severity == s for f in report.findings) for s in _ORDER}
        kind = report.shape or "unreadable"
        lines.append(
            f"{report.path} ({kind}): {counts['error']} error(s), {counts['warning']} "
            f"warning(s), {counts['info']} note(s)"
        )
        for f in sorted(report.findings, key=lambda f: (_ORDER[f.severity], f.path)):
            if f.rule == "load":
                lines.append(f"  error: {f.message}")
                continue
            lines.append(f"  {f.severity:<7} {f.path}  [{f.rule}]")
            lines.append(f"          {f.message}")
            if f.fix:
                lines.append(f"          fix: {f.fix}")
    return "\n".join(lines)


def _json_report(reports: Sequence[FileReport], status: int) -> str:
    def item(report: FileReport, f: Finding) -> dict[str, str]:
        return {"file": report.path, **f.to_dict()}

    return json.dumps(
        {
            "exit_status": status,
            "files": [{"path": r.path, "shape": r.shape} for r in reports],
            "findings": [item(r, f) for r in reports for f in r.findings],
            "summary": {
                s: sum(f.severity == s for r in reports for f in r.findings) for s in _ORDER
            },
        },
        indent=2,
    )


def _cmd_validate(args: argparse.Namespace) -> int:
    target = None
    if args.target:
        try:
            target = load_json(args.target)
        except ConfigLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_ERRORS
    options = Options(
        role=args.role,
        block_size=args.block_size,
        num_layers=args.num_layers,
        hybrid={"auto": None, "yes": True, "no": False}[args.hybrid_attention],
        target=target if isinstance(target, dict) else None,
        value_bytes=args.value_bytes,
    )
    reports = validate_files(args.files, env_path=args.env, options=options)
    status = exit_status(reports, strict=args.strict)
    print(_json_report(reports, status) if args.json else _format_text(reports))
    return status


_RENDER_OUT = "a directory for mooncake_master.cmd and mooncake.json, e.g. --out ./mooncake"
_SCHEMA_OUT = "a file path in an existing directory, e.g. --out config/kvpool.schema.json"


def _write_out(out: str, content: str | dict[str, str], wanted: str) -> str | None:
    """Write ``--out``: the file ``out`` (``content`` its text), or files (name -> text) into
    the directory ``out``, created when missing. Returns ``None``, or one line naming
    ``--out``, what is wrong (a directory where the file goes, a file where the directory
    goes, a missing parent, the OS's reason) and ``wanted``."""
    path = Path(out)
    if isinstance(content, str):
        problem = ("is a directory" if path.is_dir()
                   else None if path.parent.is_dir() else f"no directory {path.parent}")
    else:
        problem = "is a file, not a directory" if path.exists() and not path.is_dir() else None
    if problem is None:
        try:
            if isinstance(content, str):
                path.write_text(content)
            else:
                path.mkdir(parents=True, exist_ok=True)
                for name, text in content.items():
                    (path / name).write_text(text)
        except OSError as exc:
            problem = f"cannot write it ({exc.strerror or exc})"
    return None if problem is None else f"--out {out}: {problem}; give {wanted}"


def _cmd_render(args: argparse.Namespace) -> int:
    try:
        rendered = render_mooncake(load_json(args.file), master_host=args.master_host)
    except (ConfigLoadError, RenderError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERRORS
    conf_text = json.dumps(rendered.mooncake_json, indent=2) + "\n"
    if args.out is None:
        print(f"# mooncake_master command line\n{rendered.master_command}\n")
        print(f"# {MOONCAKE_JSON_NAME} (export MOONCAKE_CONFIG_PATH=/path/to/{MOONCAKE_JSON_NAME})")
        print(conf_text, end="")
        return EXIT_CLEAN
    files = {MASTER_CMD_NAME: rendered.master_command + "\n", MOONCAKE_JSON_NAME: conf_text}
    problem = _write_out(args.out, files, _RENDER_OUT)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_ERRORS
    out = Path(args.out)
    print(f"wrote {out / MASTER_CMD_NAME} and {out / MOONCAKE_JSON_NAME}")
    print(f"start the master:  {rendered.master_command}")
    print(f"engines:           export MOONCAKE_CONFIG_PATH={(out / MOONCAKE_JSON_NAME).resolve()}")
    return EXIT_CLEAN


def _cmd_schema(args: argparse.Namespace) -> int:
    text = schema_text()
    if args.out is None:
        print(text, end="")
    else:
        problem = _write_out(args.out, text, _SCHEMA_OUT)
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return EXIT_ERRORS
        print(f"wrote {args.out}")
    return EXIT_CLEAN


def _cmd_fingerprint(args: argparse.Namespace) -> int:
    """The weights' content fingerprint; an engine's layout fact ``fingerprint`` adds its
    settings (``hf_overrides``, RoPE...) to it, so compare engines by that fact. With
    ``--adapter`` a LoRA adapter's, as ``fingerprint.adapter_identity`` puts it in the keys."""
    t0 = time.perf_counter()
    try:
        fp = (adapter_fingerprint if args.adapter else checkpoint_fingerprint)(args.model_dir)
    except NotFingerprintable as exc:
        fix = ("its requests share with no other engine: give vLLM a local adapter directory"
               if args.adapter else "set kv_connector_extra_config.model_fingerprint on every "
               "engine that runs these weights")
        print(f"kvpool-config fingerprint: {exc}: {fix}", file=sys.stderr)
        return EXIT_ERRORS
    ms = (time.perf_counter() - t0) * 1e3
    digest = f"lora:{fp.digest}" if args.adapter else fp.digest
    if args.json:
        print(json.dumps({"model_dir": args.model_dir, "adapter": args.adapter,
                          "weights": digest, "files": fp.files,
                          "tensors": fp.tensors, "bytes_read": fp.bytes_read,
                          "commit": fp.commit, "elapsed_ms": round(ms, 3)}))
    else:
        commit = f", hub commit {fp.commit}" if fp.commit else ""
        print(f"{digest}  {args.model_dir} ({fp.files} files, {fp.tensors} tensors, "
              f"{fp.bytes_read} bytes read in {ms:.1f} ms{commit})")
    return EXIT_CLEAN


def _positive_int(text: str) -> int:
    """``--value-bytes``: a whole number of bytes above 0 (argparse reports anything else)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def _master_host(text: str) -> str:
    """``--master-host``: validate's rule on a ``master_server_address`` host
    (:func:`~kvpool_config.rules.host_problem`), so render never writes a mooncake.json that
    validate refuses."""
    problem = host_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{problem}: {MASTER_HOST_FIX}")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="kvpool-config",
        description="Check KV-pool deployment configs (MindIE Motor user_config.json/env.json, "
        "vLLM --kv-transfer-config) against the deployment guides' rules.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    val = sub.add_parser(
        "validate", help="check config files; exit 0 clean, 1 warnings (--strict), 2 errors"
    )
    val.add_argument(
        "files",
        nargs="+",
        help="user_config.json, env.json or kv_transfer_config JSON "
        "(several plain kv_transfer_configs = instances on one host)",
    )
    val.add_argument(
        "--env", help="MindIE env.json of the deployment (ASCEND_* timeouts, FabricMem)"
    )
    val.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    val.add_argument("--json", action="store_true", help="machine-readable output for CI")
    val.add_argument(
        "--role",
        choices=("prefill", "decode", "mixed"),
        help="instance role of a plain kv_transfer_config (checks kv_role)",
    )
    val.add_argument(
        "--block-size",
        type=int_at_least(1),
        help="vLLM block size of a plain kv_transfer_config's engine (KVPoolConnector chunk_size)",
    )
    val.add_argument(
        "--num-layers",
        type=int_at_least(1),
        help="the model's layer count (prefill_pp_layer_partition)",
    )
    val.add_argument(
        "--hybrid-attention",
        choices=("auto", "yes", "no"),
        default="auto",
        help="whether the model uses hybrid attention (auto: from the model name)",
    )
    val.add_argument("--target", help="user_config.json of the service named by target_job_id")
    val.add_argument(
        "--value-bytes",
        type=_positive_int,
        help="largest value the engines save (chunk tokens x KV bytes per token), bytes: checks "
        "the SSD tier's staging buffer MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES",
    )
    val.set_defaults(func=_cmd_validate)
    ren = sub.add_parser("render", help="write the mooncake_master command and mooncake.json")
    ren.add_argument("file", help="MindIE user_config.json with kv_cache_store_config (mooncake)")
    ren.add_argument(
        "--out", help="directory for mooncake_master.cmd and mooncake.json (default: print)"
    )
    ren.add_argument(
        "--master-host",
        type=_master_host,
        default="127.0.0.1",
        help="host of mooncake_master for clients (a host name or IP address)",
    )
    ren.set_defaults(func=_cmd_render)
    sch = sub.add_parser("schema", help="print or write the JSON Schema of the KV-pool part")
    sch.add_argument("--out", help="file to write (config/kvpool.schema.json)")
    sch.set_defaults(func=_cmd_schema)
    fin = sub.add_parser("fingerprint",
                         help="the content fingerprint of a local safetensors checkpoint")
    fin.add_argument("model_dir", help="the directory vLLM loads (config.json, *.safetensors)")
    fin.add_argument("--adapter", action="store_true",
                     help="MODEL_DIR is a LoRA adapter (adapter_config.json and its weights)")
    fin.add_argument("--json", action="store_true", help="machine-readable output")
    fin.set_defaults(func=_cmd_fingerprint)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvpool-config`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        status: int = args.func(args)
    except BrokenPipeError:
        # Output piped into e.g. `head` that exited: nothing left to tell anyone.
        sys.stderr.close()
        return EXIT_ERRORS
    return status


if __name__ == "__main__":
    sys.exit(main())
