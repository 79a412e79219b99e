"""The `draftsmith` command: one dispatcher over the pipeline stages and the asset cache.

`draftsmith <stage> [hydra overrides]` runs a stage as a Hydra app over `conf/draftsmith.yaml`
(so `-m` multirun sweeps work); `draftsmith assets list|fetch NAME|all` manages the cache.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# stage -> "module:function" taking a typed Config. Only implemented stages are listed.
STAGES: dict[str, str] = {
    "prepare": "draftsmith.train.prepare:run",
    "preview": "draftsmith.train.preview:run",
    "collect": "draftsmith.train.collect:run",
    "train": "draftsmith.train.launch:run",
    "eval": "draftsmith.inference.eval:run",
    "export": "draftsmith.export:run",
    "run": "draftsmith.pipeline:run",
    "generate": "draftsmith.inference.generate:run",
}

USAGE = """usage: draftsmith <command> [overrides...]

commands:
{stages}  assets list            show embedded assets and whether they are cached
  assets fetch NAME|all  download, verify and cache assets

Overrides are Hydra's: key=value, group=option, -m for sweeps, --cfg job to print the config.
"""


def _usage() -> str:
    lines = "".join(f"  {name:<22} {_doc(name)}\n" for name in STAGES)
    return USAGE.format(stages=lines)


def _doc(stage: str) -> str:
    module = STAGES[stage].split(":")[0]
    doc = (importlib.import_module(module).__doc__ or "").strip().splitlines()
    return doc[0] if doc else ""


def _load(stage: str) -> Callable:
    module, func = STAGES[stage].split(":")
    return getattr(importlib.import_module(module), func)


def _is_override(arg: str) -> bool:
    """`key=value` (Hydra's positionals), not a flag (`-m`) or a flag's value (`--cfg job`)."""
    return "=" in arg and not arg.startswith("-")


def run_stage(stage: str, overrides: list[str]) -> None:
    """Run one stage as a Hydra app with the given command-line overrides."""
    import hydra

    from draftsmith.allocator import reuse_freed_memory
    from draftsmith.conf import CONF_DIR
    from draftsmith.config import CONFIG_NAME, register_schemas, to_typed
    from draftsmith.errors import InputError

    # every stage repeats the same big allocations (EAGLE-3 training on 512-token rows 1.5x
    # faster, collection 1.1x; see draftsmith.allocator)
    reuse_freed_memory()
    register_schemas()
    fn = _load(stage)

    @hydra.main(config_path=CONF_DIR, config_name=CONFIG_NAME, version_base="1.3")
    def app(dict_cfg) -> None:
        try:
            fn(to_typed(dict_cfg))
        except InputError as err:  # its message says what to mend; Hydra would bury it in frames
            raise SystemExit(f"draftsmith {stage}: {err}") from None

    # Hydra's argparse takes its overrides (positionals) in one run, so `a=1 -m b=1,2` would
    # leave b=1,2 unrecognised: every override goes first, stage= with them, then the flags
    # (-m, --cfg job, ...) in the order given
    keys = [a for a in overrides if _is_override(a)]
    flags = [a for a in overrides if not _is_override(a)]
    sys.argv = [f"draftsmith {stage}", f"stage={stage}", *keys, *flags]
    app()


def assets_main(args: list[str]) -> int:
    from draftsmith import assets

    if not args or args[0] not in ("list", "fetch"):
        print("usage: draftsmith assets list | fetch NAME|all [--force]", file=sys.stderr)
        return 2
    if args[0] == "list":
        rows = assets.listing()
        print(f"cache: {assets.cache_root()}")
        print(f"{'name':<24}{'kind':<8}{'source':<34}{'cached':<8}description")
        for r in rows:
            print(
                f"{r['name']:<24}{r['kind']:<8}{r['source']:<34}"
                f"{'yes' if r['cached'] else 'no':<8}{r['description']}"
            )
        return 0
    names = [a for a in args[1:] if not a.startswith("--")]
    if not names:
        print("usage: draftsmith assets fetch NAME|all", file=sys.stderr)
        return 2
    if names == ["all"]:
        names = list(assets.ASSETS)
    for name in names:
        try:
            path = assets.fetch(name, force="--force" in args)
        except assets.AssetError as err:  # what went wrong is the message, not a traceback
            print(f"draftsmith assets: {err}", file=sys.stderr)
            return 1
        print(f"{name}: {path}")
    return 0


# what an interrupted stage keeps, which the same command goes on from (every stage writes its
# outputs atomically; a Ctrl-C otherwise ends in a traceback of Hydra's and DeepSpeed's frames)
KEPT = {
    "prepare": "regenerated answers are kept in chunks",
    "collect": "finished shards are kept",
    "train": "its last checkpoint is kept (every train.save_every steps)",
    "run": "finished stages, collected shards and training checkpoints are kept",
}


def interrupted(command: str) -> int:
    """Say what an interrupted `command` kept; the shell's exit status for SIGINT."""
    kept = KEPT.get(command, "nothing partial was written")
    print(
        f"\ndraftsmith {command}: interrupted; {kept}, and the same command goes on from there",
        file=sys.stderr,
    )
    return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # a usage error, as a script calling it without a command would want to know
        print(_usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "assets":
        return assets_main(rest)
    if command not in STAGES:
        print(f"draftsmith: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        run_stage(command, rest)
    except KeyboardInterrupt:
        return interrupted(command)
    return 0


def entry() -> int:
    """The `draftsmith` command: `main` under tcmalloc where it is installed (long stages run
    faster; draftsmith.allocator)."""
    from draftsmith.allocator import exec_under_tcmalloc

    exec_under_tcmalloc()
    return main()


if __name__ == "__main__":
    sys.exit(main())
