"""`python -m zero_utils.memory ...`: the memory estimator's command line (zero_utils.memory.command)."""

import sys

from zero_utils.memory.command import main

sys.exit(main())
