"""python -m trainer3d.zero --build-ops (DeepSpeed's JIT ops, once) | --check-config JSON (the JSON as a run sees it)."""

import dataclasses
import json
import sys

from trainer3d.config import parse_args
from trainer3d.errors import ArgumentParser, UsageError, report
from trainer3d.train.setup import validate
from trainer3d.zero.ops import build_ops, check_deepspeed_version


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(
        prog="python -m trainer3d.zero", description="DeepSpeed ZeRO: build the JIT ops, or resolve a DeepSpeed JSON"
    )
    p.add_argument("--build-ops", action="store_true", help="build DeepSpeed's JIT ops into $TORCH_EXTENSIONS_DIR")
    p.add_argument("--check-config", metavar="JSON", help="resolve a DeepSpeed JSON against flags (with --world-size)")
    p.add_argument("--world-size", type=int, default=1)
    args, rest = p.parse_known_args(argv)
    if args.build_ops:
        check_deepspeed_version()
        for name, state in build_ops().items():
            print(f"{name}: {state}")
        return 0
    if args.check_config:
        try:
            setup = validate(parse_args(rest + ["--deepspeed_config", args.check_config]), args.world_size)
        except UsageError as e:
            return report(e)
        print(json.dumps({"layout": str(setup.layout), "plan": dataclasses.asdict(setup.plan),
                          "deepspeed": setup.deepspeed.ds_config}, indent=2))
        return 0
    p.error("give --build-ops or --check-config JSON")


if __name__ == "__main__":
    sys.exit(main())
