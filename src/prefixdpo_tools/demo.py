"""The embedded default: a tiny model, tokenizer and preference dataset built locally, no downloads.

`prefixdpo train` with no model and no dataset trains on this, and `prefixdpo reward` trains a reward model on
it (the same model loaded as a one-label sequence classifier, a new score head; held-out pairwise accuracy
0.98 with `commands/reward.DEMO_DEFAULTS`). The task is chosen so that DPO from a
randomly initialised Llama-shaped model learns it on two CPU cores in a few minutes, and so that a
held-out reward accuracy well above chance means something:

- every prompt holds a long-ish note (filler sentences) and asks for a few words to be repeated in a
  letter case it names ("UPPERCASE", "small letters", ...);
- the chosen response repeats the words in the case asked for, the rejected one in the other case;
- the case asked for is a fair coin per record, so no constant preference (always upper, always
  shorter, ...) beats chance: the policy has to read the instruction in the prompt.

Prompts (~60-110 tokens) are long next to responses (~5-20 tokens), the shape where prefix sharing pays.
Everything is a pure function of its seed, so the artifacts are identical run to run.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from prefixdpo.atomic_io import TMP_MARK, atomic_write_json, replace_folder
from prefixdpo.errors import UserError

BUILD_FILE = "build.json"  # written last into a build: which build it is (see `build_demo_for_run`)

# Lower-case content words; each also appears upper-cased in responses.
WORDS = (
    "apple river stone cloud tiger piano garden window silver candle forest rocket pepper marble "
    "yellow dragon button harbor lemon castle orange meadow violin basket winter summer planet "
    "pencil bridge ladder mirror thunder pillow falcon copper velvet cactus anchor lantern "
    "walnut island rabbit saddle tunnel wizard jacket kettle pocket bottle"
).split()

UPPER_PHRASES = ("UPPERCASE", "capital letters", "upper case", "ALL CAPS")
LOWER_PHRASES = ("lowercase", "small letters", "lower case", "no capitals")
INCREASING_PHRASES = ("increasing", "ascending", "smallest-first")
DECREASING_PHRASES = ("decreasing", "descending", "largest-first")

_SUBJECTS = ("the farmer", "my neighbour", "a sailor", "the teacher", "our guide", "the old cat", "a child")
_VERBS = ("found", "painted", "carried", "forgot", "counted", "sold", "borrowed", "hid")
_PLACES = ("near the gate", "by the sea", "in the attic", "after lunch", "at the market", "under the bridge")


@dataclass(frozen=True)
class DemoSpec:
    """Sizes and seeds of the embedded default (the defaults are what `make demo` runs)."""

    num_train: int = 2000
    num_eval: int = 200
    data_seed: int = 0
    model_seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    max_position_embeddings: int = 512


def filler_note(rng: random.Random) -> str:
    """Two to four filler sentences: the part of the prompt prefix sharing computes once."""
    sentences = []
    for _ in range(rng.randint(2, 4)):
        a, b = rng.sample(WORDS, 2)
        sentences.append(
            f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} a {a} and a {b} {rng.choice(_PLACES)}."
        )
    return " ".join(sentences)


def _record(rng: random.Random, task: str, wanted: str, other: str) -> dict:
    """A record whose prompt holds a filler note and asks for `task`; chosen = `wanted`, rejected = `other`."""
    return {"prompt": f"Note: {filler_note(rng)}\nTask: {task}.\nAnswer:", "chosen": wanted, "rejected": other}


def _case_record(rng: random.Random) -> dict:
    """Repeat words in the letter case the prompt asks for; rejected = the other case."""
    words = rng.sample(WORDS, rng.randint(2, 4))
    upper = rng.random() < 0.5
    phrase = rng.choice(UPPER_PHRASES if upper else LOWER_PHRASES)
    upper_text = " " + " ".join(w.upper() for w in words)
    lower_text = " " + " ".join(words)
    return _record(rng, f"repeat the words {' '.join(words)} in {phrase}",
                   *((upper_text, lower_text) if upper else (lower_text, upper_text)))


def _order_record(rng: random.Random) -> dict:
    """Sort digits in the direction the prompt asks for; rejected = the opposite direction."""
    digits = rng.sample(range(10), rng.randint(3, 5))
    increasing = rng.random() < 0.5
    phrase = rng.choice(INCREASING_PHRASES if increasing else DECREASING_PHRASES)
    up = " " + " ".join(map(str, sorted(digits)))
    down = " " + " ".join(map(str, sorted(digits, reverse=True)))
    return _record(rng, f"write the numbers {' '.join(map(str, digits))} in {phrase} order",
                   *((up, down) if increasing else (down, up)))


def make_record(rng: random.Random) -> dict:
    """One record in TRL's standard format: {"prompt", "chosen", "rejected"} strings (either task, 50/50)."""
    return _case_record(rng) if rng.random() < 0.5 else _order_record(rng)


def make_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_record(rng) for _ in range(n)]


def make_splits(spec: DemoSpec = DemoSpec()) -> tuple[list[dict], list[dict]]:
    """(train, eval) records; the eval split comes from its own seed stream, so it is held out."""
    train = make_records(spec.num_train, seed=2 * spec.data_seed)
    held_out = make_records(spec.num_eval, seed=2 * spec.data_seed + 1)
    return train, held_out


def build_tokenizer(records: list[dict], spec: DemoSpec = DemoSpec()):
    """Byte-level BPE trained on the records (deterministic), with BOS/EOS/pad and a chat template."""
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer

    texts = [r["prompt"] + r["chosen"] + "\n" + r["rejected"] for r in records]
    return build_tiny_tokenizer(texts, vocab_size=spec.vocab_size, chat_template=True)


def build_model(tokenizer, spec: DemoSpec = DemoSpec()):
    """A randomly initialised Llama-shaped causal LM (fp32), seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.model_seed)
    return LlamaForCausalLM(config)


def write_jsonl(records: list[dict], path: Path) -> None:
    """One JSON record a line. Not atomic by itself: `build_demo` writes it into a folder that appears whole."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


@dataclass(frozen=True)
class DemoArtifacts:
    """Paths of the saved default: `model_dir` (safetensors + tokenizer), `train_file`, `eval_file` (jsonl)."""

    model_dir: Path
    train_file: Path
    eval_file: Path


def demo_artifacts(output_dir: str | Path) -> DemoArtifacts:
    """Where `build_demo(output_dir)` saves the embedded default."""
    out = Path(output_dir)
    return DemoArtifacts(out / "model", out / "train.jsonl", out / "eval.jsonl")


def _write_demo(paths: DemoArtifacts, spec: DemoSpec) -> None:
    """Write the embedded default's model, tokenizer and data at `paths` (all fresh)."""
    paths.model_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = make_splits(spec)
    tokenizer = build_tokenizer(train, spec)
    model = build_model(tokenizer, spec)
    # transformers writes nothing on a rank other than 0 once a process group is up (it assumes a sharded model
    # that rank 0 gathers); this model is whole here, and this rank may be the only builder of its disk
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    model.save_pretrained(paths.model_dir, safe_serialization=True)
    tokenizer.save_pretrained(paths.model_dir)
    write_jsonl(train, paths.train_file)
    write_jsonl(held_out, paths.eval_file)


def build_demo(output_dir: str | Path, spec: DemoSpec = DemoSpec(), build_id: str | None = None) -> DemoArtifacts:
    """Build and save the embedded default as the folder `output_dir` (real HF artifacts, reloadable by path).

    It is built in a temporary folder beside `output_dir` and renamed over it whole (an old `output_dir` is
    replaced), so a kill mid-build leaves the old folder or none, never a half one: at most a `*.tmp-*`
    folder that nothing reads. `build_id` (default: a fresh one) is stored in its `BUILD_FILE`.
    """
    final = Path(output_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}{TMP_MARK}", dir=final.parent))
    try:
        _write_demo(demo_artifacts(tmp), spec)
        atomic_write_json(str(tmp / BUILD_FILE), {"build": build_id or uuid.uuid4().hex, "spec": asdict(spec)})
        replace_folder(str(tmp), str(final))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return demo_artifacts(final)


def holds_build(output_dir: str | Path, build_id: str) -> bool:
    """Whether `output_dir` is the complete build `build_id` (its `BUILD_FILE`, written last, names it)."""
    try:
        return json.loads((Path(output_dir) / BUILD_FILE).read_text(encoding="utf-8")).get("build") == build_id
    except (OSError, ValueError, AttributeError):
        return False


def build_demo_for_run(output_dir: str | Path, training_args, spec: DemoSpec = DemoSpec()) -> DemoArtifacts:
    """The embedded default for a run of one or several processes: one builder per filesystem, and every
    process then reads the same complete files.

    In rounds: every rank says whether it sees this run's build in `output_dir` (rank 0 names the build);
    the lowest rank that does not builds it (`build_demo`: atomically), until every rank sees it. A folder
    every rank shares is one round, built by rank 0; node-local folders (each machine its own disk) get
    one builder each, one after another. Every rank takes each round's decision from the same gathered
    answers, so no two processes write one folder at once and none reads a half-written model.
    """
    from prefixdpo.core.rank_decisions import from_rank0, gather, rank_and_world, wait_for_all

    _ = training_args.device  # brings up the process group of a distributed run
    rank, _ = rank_and_world()
    build_id = from_rank0(uuid.uuid4().hex)
    builders: set[int] = set()
    while True:
        missing = [r for r, sees in enumerate(gather(holds_build(output_dir, build_id))) if not sees]
        if not missing:
            return demo_artifacts(output_dir)
        builder = missing[0]
        if builder in builders:  # its own rename is invisible to it: no round can help
            raise UserError(f"rank {builder} built the embedded default in {output_dir} but cannot read it back")
        builders.add(builder)
        if rank == builder:
            build_demo(output_dir, spec, build_id=build_id)
        wait_for_all()  # the next round's answers are read after this round's build
