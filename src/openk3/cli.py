"""The ``openk3`` command line."""

from __future__ import annotations

import argparse
import json
import sys

from openk3.accounting import accounting_report
from openk3.config import load_config
from openk3.presets import PRESETS, get_preset


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _print_info(report: dict) -> None:
    print(f"model_type: {report['model_type']}")
    print("parameters:")
    for name, value in report["components"].items():
        print(f"  {name:<28} {value:>22,}")
    print(f"  {'total':<28} {report['total_params']:>22,}")
    print(f"  {'active (no input embedding)':<28} {report['active_params']:>22,}")
    print("cache per request:")
    print(f"  KDA layers / MLA layers      {report['kda_layers']} / {report['mla_layers']}")
    print(f"  KDA state, bf16 (with conv)  {report['kda_state_bytes_bf16']:,} B ({_mib(report['kda_state_bytes_bf16'])})")
    print(f"  KDA state, fp32 state        {report['kda_state_bytes_fp32']:,} B ({_mib(report['kda_state_bytes_fp32'])})")
    print(f"  MLA latent, bf16             {report['mla_bytes_per_token_bf16']:,} B/token "
          f"({report['mla_numbers_per_token_per_layer']} numbers/token/layer)")
    print(f"  crossover vs all-MLA         {report['crossover_tokens_vs_all_mla']:,} tokens")


def cmd_info(args: argparse.Namespace) -> int:
    config = load_config(args.config) if args.config else get_preset(args.preset)
    report = accounting_report(config)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_info(report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openk3", description="Kimi K3 family: models, accounting, tools")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="parameter counts and cache sizes of a preset or config.json")
    src = info.add_mutually_exclusive_group()
    src.add_argument("--preset", default="kimi-k3", choices=sorted(PRESETS), help="preset name (default kimi-k3)")
    src.add_argument("--config", help="path to a config.json or a model folder")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"openk3: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
