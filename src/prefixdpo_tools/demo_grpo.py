"""The embedded default of `prefixdpo grpo` / `prefixdpo rloo`: a tiny model, prompts and a reward, built locally.

- prompts: a long instruction every prompt shares (~40 tokens), a note of filler sentences and a short task:
  ~100 tokens, against completions of at most 16. Each prompt runs once per pass instead of G = 8 times: the
  shape where prefix sharing pays;
- model: the DPO demo's randomly initialised Llama-shaped model (`prefixdpo_tools.demo.build_model`) over a byte-level
  BPE trained on these prompts;
- reward: `vowel_share`, the share of a completion's non-space characters that are vowels. A random-init policy
  scores about 0.3; GRPO moves it toward completions made of vowel-heavy tokens without having to read the
  prompt, so the reward rises within the run's 40 steps (about 20 s on 2 CPU cores).

Everything is a pure function of its seed; the folder is written whole or not at all.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from prefixdpo.atomic_io import TMP_MARK, replace_folder

from prefixdpo_tools.demo import WORDS, DemoSpec, filler_note
from prefixdpo_tools.demo import build_model as build_demo_model

from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer

INSTRUCTION = (
    "System: you are a calm and careful assistant. Read the note below, then reply with a few plain words. "
    "Write every word in small letters, with no digits, no capitals and no punctuation at all.\n"
)


def vowel_share(completions, **kwargs) -> list[float]:
    """The demo's reward: vowels / non-space characters of each completion (0.0 for an empty one).
    completions: texts (or, for conversational prompts, lists with one assistant message)."""
    out = []
    for completion in completions:
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        chars = [c for c in text if not c.isspace()]
        out.append(sum(c in "aeiou" for c in chars) / len(chars) if chars else 0.0)
    return out


def make_prompts(n: int, seed: int = 0) -> list[dict]:
    """`n` prompt-only records {"prompt": text}: the shared instruction, a note, a task naming a word."""
    rng = random.Random(seed)
    return [{"prompt": f"{INSTRUCTION}Note: {filler_note(rng)}\nTask: say something about the "
                       f"{rng.choice(WORDS)}.\nAnswer:"} for _ in range(n)]


@dataclass(frozen=True)
class GroupDemo:
    """Paths of the saved default: `model_dir` (weights + tokenizer) and `prompts_file` (JSON Lines)."""

    model_dir: Path
    prompts_file: Path


def group_demo_paths(output_dir: str | Path) -> GroupDemo:
    out = Path(output_dir)
    return GroupDemo(out / "model", out / "prompts.jsonl")


def build_group_demo(output_dir: str | Path, num_prompts: int = 512, seed: int = 0) -> GroupDemo:
    """Build and save the default under `output_dir` (replaced whole, never left half-written)."""
    final = group_demo_paths(output_dir)
    staging = Path(f"{Path(output_dir)}{TMP_MARK}{os.getpid()}")  # the name readers of a killed build ignore
    shutil.rmtree(staging, ignore_errors=True)
    paths = group_demo_paths(staging)
    paths.model_dir.mkdir(parents=True, exist_ok=True)
    records = make_prompts(num_prompts, seed)
    spec = DemoSpec(model_seed=seed)
    tokenizer = build_tiny_tokenizer([r["prompt"] for r in records], vocab_size=spec.vocab_size)
    build_demo_model(tokenizer, spec).save_pretrained(paths.model_dir, safe_serialization=True)
    tokenizer.save_pretrained(paths.model_dir)
    paths.prompts_file.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    replace_folder(str(staging), str(output_dir))
    return final


def build_group_demo_for_run(output_dir: str | Path, training_args) -> GroupDemo:
    """The default for a run of one or several processes: the first process of each machine builds it while the
    others wait, then all read the same files."""
    with training_args.main_process_first(local=True, desc="building the embedded default"):
        if training_args.local_process_index == 0:
            return build_group_demo(output_dir)
        return group_demo_paths(output_dir)
