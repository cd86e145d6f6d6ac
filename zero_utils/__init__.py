"""zero-recipes' library: what the recipes (recipes/, shipped inside the package as zero_utils.recipes) call, in
folders by concern, in tiers: a folder imports only folders of lower tiers, never a sibling (the table in
docs/ARCHITECTURE.md, read by tests/test_configs.py):

    0  run/         a job's start, collectives and stop: errors, versions, the engine, the Hub, the Accelerator
       assets/      the bundled model, SFT data and preference pairs, and their paths
    1  checkpoint/  the checkpoint policy, its storage and its export    (python -m zero_utils.checkpoint export ...)
       formulas/    what the ZeRO math predicts, pure arithmetic
       data/        from a data set to the rows a rank trains on        (python -m zero_utils.data cache ...)
    2  launch/      a recipe's flags, accelerate launch lines, the shipped files and the copy command
       model/       loading a model, and parallelism applied to it from outside (FSDP2, DeepSpeed, offloading)
    3  train/       the optimizer, the loss, what a run measures and records
       memory/      the memory estimate and the fit check                (python -m zero_utils.memory ...)
    4  preference/  DPO, IPO and SimPO: pairs, losses, the reference model
       compare/     engines compared side by side                        (python -m zero_utils.compare ...)

Names of 0.1 (one flat folder) and 0.2 map to their modules now in docs/ARCHITECTURE.md's rename table."""

__version__ = "0.4.0"
