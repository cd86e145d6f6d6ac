"""Engines compared side by side on one model (`python -m zero_utils.compare ...`): the runs, one config after the
other (runner), and their table, charts and W&B summary run (report)."""
