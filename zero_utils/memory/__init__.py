"""Will it fit: the memory estimator (estimate: every engine's bytes per GPU for a model, a cluster and a run's shape,
from zero_utils.formulas), the check every recipe makes before it builds the model (fit_check) and the estimator's
command line (command: `python -m zero_utils.memory ...`)."""
