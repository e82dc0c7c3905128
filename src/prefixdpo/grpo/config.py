"""`PrefixGRPOConfig` / `PrefixRLOOConfig`: TRL 1.16's `GRPOConfig` / `RLOOConfig` (every field, with TRL's
name, default and meaning) plus the prefix-sharing options of the log-prob passes."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig, RLOOConfig

from prefixdpo.grpo.from_core import BACKENDS, ConfigError


@dataclass
class PrefixSharingOptions:
    """How the per-token log-prob passes lay out TRL's rows (none of these changes a result)."""

    prefix_sharing: bool = field(
        default=True,
        metadata={"help": "Run each prompt once with its completions as branches after it (off: TRL's own passes)."},
    )
    packing: bool = field(
        default=True, metadata={"help": "Pack several prompts' groups into one line (each attends only to itself)."}
    )
    pack_length: str = field(
        default="auto",
        metadata={"help": "Packed line length: 'auto' (1.1 x the 95th percentile of a pass's group lengths, rounded "
                          "up to 128) or an int; a longer group gets a line of its own."},
    )
    attention: str = field(
        default="auto",
        metadata={"help": "Attention backend of the log-prob passes: auto (flex on CUDA, sdpa else), sdpa, flex, "
                          "segmented, varlen (CUDA). Generation keeps the model's stock attention path."},
    )

    def _check_prefix_options(self) -> None:
        if self.attention not in BACKENDS:
            raise ConfigError(f"attention={self.attention!r}: choose one of {', '.join(BACKENDS)}")
        if str(self.pack_length) != "auto":
            try:
                self.pack_length = int(self.pack_length)
            except ValueError:
                raise ConfigError(f"pack_length={self.pack_length!r}: expected 'auto' or a positive integer") from None
            if self.pack_length <= 0:
                raise ConfigError(f"pack_length={self.pack_length}: must be positive")


@dataclass
class PrefixGRPOConfig(PrefixSharingOptions, GRPOConfig):
    """Options of `PrefixGRPOTrainer`: TRL's `GRPOConfig` + `PrefixSharingOptions`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_prefix_options()


@dataclass
class PrefixRLOOConfig(PrefixSharingOptions, RLOOConfig):
    """Options of `PrefixRLOOTrainer`: TRL's `RLOOConfig` + `PrefixSharingOptions`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_prefix_options()
