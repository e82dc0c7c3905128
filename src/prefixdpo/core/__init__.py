"""The shared core: prefix-shared lines -> attention (the rule, per backend) -> the model's forward through the
engine that wraps it -> per-token / per-response log-probs; model loading and checks; engines (FSDP2, ZeRO).
It knows no training method."""
