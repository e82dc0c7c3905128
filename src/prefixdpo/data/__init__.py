"""From user records to packed prefix-shared batches."""
