"""zero-recipes' library: what the recipes (recipes/, shipped inside the package as zero_utils.recipes) call."""

__version__ = "0.1.0"
