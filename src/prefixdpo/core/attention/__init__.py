"""The prefix-sharing attention rule and the backends that realise it."""
