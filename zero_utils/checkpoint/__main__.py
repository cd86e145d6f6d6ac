"""`python -m zero_utils.checkpoint export <checkpoint> <out_dir> ...`: a checkpoint as a Hugging Face folder
(zero_utils.checkpoint.export)."""

import sys

from zero_utils.checkpoint.export import main

sys.exit(main())
