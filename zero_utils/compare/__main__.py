"""`python -m zero_utils.compare ...`: engines compared side by side (zero_utils.compare.runner)."""

import sys

from zero_utils.compare.runner import main

sys.exit(main())
