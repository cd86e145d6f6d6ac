"""What starts a run: a recipe's flags from its settings dataclass (cli), `accelerate launch` command lines (launcher),
the recipes, YAMLs and presets the package ships (shipped) and the command that copies them into a project
(recipe_copy: `zero-recipes`, `python -m zero_utils`)."""
