"""DPO and its family (TRL's `DPOTrainer` losses) on prefix-shared rows: options (`config.py`), the trainer, one
step read top to bottom (`step.py`) beside the loss table (`loss_table.py`, `losses.py`) and the step's coupling,
TRL's per-token weightings (`token_weights.py`: WPO, LD-DPO), and the reference model as one strategy."""
