"""DPO and its family (TRL's `DPOTrainer` losses) on prefix-shared rows: options, trainer, losses and their
table, the step's objective, and the reference model as one strategy."""
