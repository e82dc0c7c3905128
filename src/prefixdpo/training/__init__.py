"""What every prefixdpo trainer shares, whatever it trains: the `transformers.Trainer` base over micro-batches
of prefix-shared lines, the run's callback, checkpoints that are complete or invisible, the non-finite guard,
metric sums reduced over ranks, model set-up (PEFT, dropout, attention), and the config turned into the frozen
settings `data/` and `core/` read (`settings.py`); the versions it was tested with (`versions.py`) and the private
names of transformers / TRL / accelerate it relies on (`internals.py`)."""
