"""`python -m zero_utils list | copy NAME DEST`: the `zero-recipes` command (zero_utils.launch.recipe_copy)."""

import sys

from zero_utils.launch.recipe_copy import main

sys.exit(main())
