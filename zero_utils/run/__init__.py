"""A job's start, collectives and stop, below everything else: the exceptions a recipe prints as one line
(errors), the software versions it records (versions), the engine as a value (engine), host-to-device copies
(transfer), the collectives every recipe needs (distributed), stop signals (stop_signals), reaching the Hugging Face
Hub for a model or a data set (hub), torch.compile as accelerate configures it (compiling) and the Accelerator built
for the launch (accelerator)."""
