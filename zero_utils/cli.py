"""Command-line flags generated from a recipe's settings dataclass: one source of truth for names and defaults.

Each dataclass field becomes `--<name>` with the field's type and default; `flag(default, help, min=, choices=)`
declares one with its help, lower bound and allowed values. Booleans become `--flag` / `--no-flag`. An unknown
flag is an error that names it (argparse's own message).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing


def flag(default, help: str, *, min=None, choices=None):
    """A settings field: its default, its help text, an optional lower bound and allowed values."""
    return dataclasses.field(default=default, metadata={"help": help, "min": min, "choices": choices})


def parse_settings(settings_cls, argv=None, description: str | None = None):
    """Parse `argv` (default: sys.argv[1:]) into an instance of the dataclass `settings_cls`.

    Values below a field's `min` metadata are rejected with a sentence naming the flag and the bound.
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    hints = typing.get_type_hints(settings_cls)
    for f in dataclasses.fields(settings_cls):
        kind = hints[f.name]
        meta = f.metadata
        help_text = meta.get("help", "")
        if kind is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_text + f" (default: {f.default})")
            continue
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind) if typing.get_args(kind) else kind
        parser.add_argument(f"--{f.name}", type=base, default=f.default, choices=meta.get("choices"),
                            help=help_text + f" (default: {f.default})")
    args = parser.parse_args(argv)
    for f in dataclasses.fields(settings_cls):
        bound = f.metadata.get("min")
        value = getattr(args, f.name)
        if bound is not None and value is not None and value < bound:
            parser.error(f"--{f.name} {value} is below its minimum {bound}; pass a value >= {bound}.")
    return settings_cls(**vars(args))


def run_recipe(main, settings_cls, description: str | None = None) -> None:
    """Parse the flags into `settings_cls`, run `main(settings)`, and turn the errors a user can act on into one
    line on stderr: `UserError` -> "error: ..." and exit 2, `TrainingStopped` -> "stopped: ..." and exit 1."""
    import sys

    from zero_utils.errors import TrainingStopped, UserError

    settings = parse_settings(settings_cls, description=description)
    try:
        main(settings)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except TrainingStopped as stopped:
        print(f"stopped: {stopped}", file=sys.stderr)
        sys.exit(1)
