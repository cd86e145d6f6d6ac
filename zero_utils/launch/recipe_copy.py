"""`zero-recipes`: the recipes the installed package ships, listed, and copied into a project of your own.

    zero-recipes list                              # each recipe, one line
    zero-recipes copy llama_zero3 my_project/      # the recipe, the accelerate YAMLs and presets it is run with
    python -m zero_utils copy llama_lora . --force # the same command; --force overwrites files that exist

A copy writes into DEST: `<name>.py`, the recipe, whose first docstring line names the zero-recipes version it came
from and whose commands are rewritten to run from DEST; `accelerate_configs/<engine>.yaml` for every YAML the
recipe's docstring launches it with; `presets/<preset>.yaml` for every preset made for it (its first line
`# recipe: recipes/<name>.py`). It prints the `accelerate launch` line to run from DEST. The recipe is then yours to
edit; zero_utils stays an installed, versioned library. Nothing is overwritten unless --force (a file already there
with the same contents, such as a YAML two recipes share, is fine); a name it does not know, or a file already there
with other contents, is one sentence and exit code 2.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from zero_utils import __version__
from zero_utils.launch.shipped import recipe_names, shipped
from zero_utils.run.errors import UserError


def summary_line(recipe: Path) -> str:
    """The first line of a recipe's docstring."""
    return (ast.get_docstring(ast.parse(recipe.read_text())) or "").splitlines()[0]


def files_to_copy(name: str) -> dict[Path, str]:
    """{path relative to DEST: text} of a copy of recipe `name`. `UserError` naming the recipes for another name."""
    if name not in recipe_names():
        raise UserError(f"no recipe named {name!r}; the recipes are: {', '.join(recipe_names())} "
                        "(zero-recipes list says what each does).")
    source = shipped("recipes") / f"{name}.py"
    text = source.read_text()
    docstring = ast.get_docstring(ast.parse(text)) or ""
    in_dest = {f"recipes/{name}.py": f"{name}.py"}  # the recipe sits in DEST itself; YAMLs and presets below it

    def rewritten(body: str) -> str:
        for old, new in in_dest.items():
            body = body.replace(old, new)
        return body

    first = text.index('"""') + 3
    end_of_line = text.index("\n", first)
    files = {Path(f"{name}.py"): rewritten(text[:end_of_line] + f" (copied from zero-recipes {__version__})"
                                           + text[end_of_line:])}
    for yaml in sorted(set(re.findall(r"--config_file accelerate_configs/([\w.-]+\.yaml)", docstring))):
        files[Path("accelerate_configs") / yaml] = (shipped("accelerate_configs") / yaml).read_text()
    for preset in sorted(shipped("presets").glob("*.yaml")):
        preset_text = preset.read_text()
        if preset_text.splitlines()[0].strip() == f"# recipe: recipes/{name}.py":
            files[Path("presets") / preset.name] = rewritten(preset_text)
    return files


def copy_recipe(name: str, dest: Path, force: bool = False) -> list[Path]:
    """Write a copy of recipe `name` into `dest` (`files_to_copy`); returns its files. `UserError` when a file is
    already there with other contents, unless `force` (a YAML two copied recipes share is the same file)."""
    files = {dest / relative: text for relative, text in files_to_copy(name).items()}
    there = [path for path, text in files.items() if path.exists() and path.read_text() != text]  # same: kept
    if there and not force:
        more = f" (and {len(there) - 1} more)" if len(there) > 1 else ""
        raise UserError(f"{there[0]} already exists{more}; pass --force to overwrite, or copy into another folder.")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(files)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero-recipes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the recipes, one line each")
    copy = commands.add_parser("copy", help="copy a recipe, its accelerate YAMLs and presets into DEST")
    copy.add_argument("name", help="a recipe (zero-recipes list)")
    copy.add_argument("dest", type=Path, help="the folder to copy into (made if missing)")
    copy.add_argument("--force", action="store_true", help="overwrite files that are already there")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `zero-recipes` command (and `python -m zero_utils`); a user error prints one line and returns 2."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "list":
            for name in recipe_names():
                print(f"{name:<14} {summary_line(shipped('recipes') / f'{name}.py')}")
            return 0
        written = copy_recipe(args.name, args.dest, args.force)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"zero-recipes {__version__}: wrote {len(written)} files into {args.dest}:")
    for path in written:
        print(f"  {path}")
    print(f"run it from {args.dest} (on a CPU-only machine, add --num_processes 2):\n"
          f"  cd {args.dest} && accelerate launch --config_file accelerate_configs/fsdp2.yaml {args.name}.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
