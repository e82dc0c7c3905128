"""Checkpoints that are complete or invisible, and that belong to one run.

A run is identified by its fingerprint: the starting model (config, parameter names and shapes, a sample of
every tensor's values; LoRA adapters left out, they are restored from the checkpoint), the training data (every
example's tokens and pairs; for GRPO/RLOO every prompt record and the reward functions' names) and every option that shapes the trajectory. Options a user may change on resume
(how long to train, logging, saving, evaluation, reporting, data-loader workers) do not count: `VOLATILE_OPTIONS`.

A checkpoint is staged in a hidden folder (`.checkpoint-N.staging/checkpoint-N`, which neither Trainer nor we
read), and renamed to `checkpoint-N` only when every rank has written its files and our state file — the last
file, holding the fingerprint, a manifest of every file's size and content digest (`checkpoint_integrity`) and
whether the weights were finite — is on disk. So a `checkpoint-N` folder is whole; a folder without our state
file, or whose files differ from its manifest (size or digest) or do not load, was written, torn or corrupted by
something else and is never resumed from: `latest` passes over it, naming it and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass

import torch

from prefixdpo.atomic_io import atomic_write_json, replace_folder
from prefixdpo.errors import UserError
from prefixdpo.training import checkpoint_integrity

STATE_FILE = "prefixdpo_state.json"  # our state in each checkpoint: written last, the mark of a complete one
RUN_FILE = "prefixdpo_run.json"  # beside an exported model: the fingerprint of the run that wrote it
STATE_FORMAT = "prefixdpo-checkpoint-v1"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")

# Options that may change between a run and its resume without making it another run.
VOLATILE_OPTIONS = frozenset({
    "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "max_steps", "num_train_epochs",
    "logging_dir", "logging_strategy", "logging_steps", "logging_first_step", "logging_nan_inf_filter",
    "log_level", "log_level_replica", "log_on_each_node", "report_to", "run_name", "project", "trackio_space_id",
    "disable_tqdm", "save_strategy", "save_steps", "save_total_limit", "save_on_each_node", "save_only_model",
    "save_safetensors", "enable_jit_checkpoint", "eval_strategy", "eval_steps", "eval_delay", "eval_on_start",
    "eval_accumulation_steps", "eval_do_concat_batches", "per_device_eval_batch_size", "batch_eval_metrics",
    "prediction_loss_only", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "push_to_hub", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
    "dataloader_prefetch_factor", "ref_cache_dir", "precompute_ref_batch_size", "nonfinite",
    "nonfinite_max_consecutive", "skip_memory_metrics", "include_num_input_tokens_seen",
    "include_tokens_per_second", "ddp_timeout", "local_rank", "debug", "restore_callback_states_from_checkpoint",
    "use_cpu", "tf32", "torch_compile", "torch_compile_backend", "torch_compile_mode", "deepspeed", "fsdp",
    "fsdp_config", "accelerator_config",
    # GRPO/RLOO: what is printed or logged of the completions, and where a vLLM server listens
    "log_completions", "log_multimodal", "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
})
VOLATILE_PREFIXES = ("hub_", "logging_", "trackio_")


# ---- fingerprints ------------------------------------------------------------------------------


def _sample(t: torch.Tensor, n: int = 64) -> bytes:
    """Up to `n` evenly spaced values of `t`'s local data, as bytes (cheap, and different for other weights)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:  # a ZeRO-3 partitioned parameter: its values are elsewhere
        return b""
    step = max(1, flat.numel() // n)
    return flat[::step][:n].float().cpu().numpy().tobytes()


def model_fingerprint(model) -> str:
    """sha256 of the model's config, its parameter names, shapes and dtypes, and a sample of each tensor's
    values; LoRA parameters are left out (a resumed run restores them from the checkpoint)."""
    from prefixdpo.core.model_checks import unwrap
    from prefixdpo.core.fingerprints import config_fingerprint

    h = hashlib.sha256(config_fingerprint(model).encode())
    inner = unwrap(model)
    for name, t in [*inner.named_parameters(), *inner.named_buffers()]:
        if "lora_" in name:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 shard: never gathered here
        shape = tuple(getattr(t, "ds_shape", t.shape))  # ZeRO-3 keeps the real shape in ds_shape
        h.update(f"{name}|{shape}|{t.dtype}|".encode())
        h.update(_sample(local) if getattr(t, "ds_shape", None) is None else b"")
    return h.hexdigest()


def trajectory_options(args) -> dict:
    """The options that shape the run (every field but `VOLATILE_OPTIONS`), as JSON-able values."""
    values = json.loads(json.dumps(args.to_dict(), default=str))
    return {k: v for k, v in values.items() if k not in VOLATILE_OPTIONS and not k.startswith(VOLATILE_PREFIXES)}


def run_fingerprint(model, data: str, args, method: str) -> dict:
    """What identifies a run: {'method', 'model', 'data', 'options'} (see the module docstring); `data` is the
    trainer's digest of its training data (`core.fingerprints.data_fingerprint` of Examples, or
    `records_fingerprint` of prompt records)."""
    return {"method": method, "model": model_fingerprint(model), "data": data, "options": trajectory_options(args)}


def fingerprint_difference(stored: dict | None, current: dict) -> str | None:
    """Why `stored` is another run than `current` (one phrase), or None when it is the same run.

    Options present in only one of the two (a field a newer transformers added) are not compared."""
    if not isinstance(stored, dict):
        return "it holds no prefixdpo run fingerprint"
    for part, what in (("method", "trainer"), ("model", "starting model"), ("data", "training data")):
        if stored.get(part) != current[part]:
            return f"another {what}"
    old = stored.get("options") if isinstance(stored.get("options"), dict) else {}
    changed = [k for k in sorted(set(old) & set(current["options"])) if old[k] != current["options"][k]]
    if changed:
        shown = ", ".join(f"{k} {old[k]!r} -> {current['options'][k]!r}" for k in changed[:3])
        return f"other options ({shown}{', ...' if len(changed) > 3 else ''})"
    return None


# ---- reading checkpoints ---------------------------------------------------------------------------


def checkpoint_folders(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every `checkpoint-N` folder in `output_dir`, newest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), os.path.join(output_dir, name))
             for name in os.listdir(output_dir) if (m := CHECKPOINT_NAME.match(name))
             and os.path.isdir(os.path.join(output_dir, name))]
    return sorted(found, reverse=True)


def read_state(checkpoint: str) -> dict | None:
    """Our state file of `checkpoint`, or None when it is missing or unreadable."""
    try:
        with open(os.path.join(checkpoint, STATE_FILE), encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("format") == STATE_FORMAT else None


def file_manifest(folder: str) -> dict[str, int]:
    """{relative path: size in bytes} of every file under `folder` but our state file."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel != STATE_FILE:
                out[rel] = os.path.getsize(path)
    return out


def checkpoint_problem(checkpoint: str, fingerprint: dict | None, *,
                       verify_content: bool = True) -> tuple[str, str] | None:
    """None if `checkpoint` is complete, of this run and finite; else (kind, why) with kind 'foreign' (written
    by another run) or 'unusable' (incomplete, torn, corrupted, not loadable, or non-finite weights).

    `verify_content` reads every file back: its digest against the one written at save, and whether it loads
    (`checkpoint_integrity`); without it only sizes are compared (to name a checkpoint in a message, cheaply)."""
    state = read_state(checkpoint)
    if state is None:
        return "unusable", f"no readable {STATE_FILE} (incomplete, or not written by this version of prefixdpo)"
    if fingerprint is not None and (why := fingerprint_difference(state.get("run"), fingerprint)):
        return "foreign", why
    manifest = state.get("files") or {}
    on_disk = file_manifest(checkpoint)
    missing = sorted(set(manifest) - set(on_disk))
    if missing:
        return "unusable", f"missing file {missing[0]}"
    torn = sorted(f for f in manifest if on_disk[f] != manifest[f])
    if torn:
        return "unusable", f"{torn[0]} holds {on_disk[torn[0]]} bytes, {manifest[torn[0]]} when saved"
    if not state.get("weights_finite", False):
        return "unusable", "its weights hold NaN/inf"
    if verify_content:
        digests = state.get("digests")
        why = checkpoint_integrity.digest_problem(checkpoint, digests) if isinstance(digests, dict) else None
        why = why or checkpoint_integrity.load_problem(checkpoint, manifest, check_crc=not isinstance(digests, dict))
        if why:
            return "unusable", why
    return None


def unproven_note(checkpoint: str) -> str | None:
    """A note when `checkpoint` was sealed without content digests (by a prefixdpo before them), else None."""
    state = read_state(checkpoint)
    if state is None or isinstance(state.get("digests"), dict):
        return None
    return (f"{os.path.basename(checkpoint)} was saved without content digests (an older prefixdpo): its sizes, "
            "structure and stored CRCs were checked, not every byte")


@dataclass
class ResumePoint:
    """The checkpoint `resume_from_checkpoint='latest'` chose, and the newer ones it passed over (path, why)."""

    path: str
    skipped: list[tuple[str, str]]

    def notes(self) -> list[str]:
        """One line per checkpoint passed over, naming it, why, and the one resumed instead."""
        chosen = os.path.basename(self.path)
        return [f"skipped {path}: {why}; resuming from {chosen} instead" for path, why in self.skipped]


def choose_latest(output_dir: str, fingerprint: dict) -> ResumePoint:
    """The newest complete checkpoint of this run in `output_dir`; a UserError when there is none, or when the
    newest one worth resuming was written by another run."""
    skipped: list[tuple[str, str]] = []
    for _, path in checkpoint_folders(output_dir):
        problem = checkpoint_problem(path, fingerprint)
        if problem is None:
            return ResumePoint(path, skipped)
        kind, why = problem
        if kind == "foreign":
            raise UserError(f"resume_from_checkpoint='latest': {path} was written by another run ({why}); resume "
                            "with the options of that run, or start anew in another output_dir")
        skipped.append((path, why))
    if not skipped:
        raise UserError(f"resume_from_checkpoint='latest': no checkpoint-* folder in {output_dir}")
    listed = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in skipped)
    raise UserError(f"resume_from_checkpoint='latest': no complete, valid checkpoint in {output_dir} ({listed}); "
                    "run without --resume_from_checkpoint to start again from step 0")


def check_resume_path(path: str, fingerprint: dict) -> None:
    """A UserError unless the named checkpoint is complete, of this run and finite."""
    if not os.path.isdir(path):
        raise UserError(f"resume_from_checkpoint={path}: no such folder")
    problem = checkpoint_problem(path, fingerprint)
    if problem is not None:
        kind, why = problem
        what = "was written by another run" if kind == "foreign" else "cannot be resumed"
        raise UserError(f"resume_from_checkpoint={path} {what}: {why}")


def last_good_checkpoint(output_dir: str, fingerprint: dict | None = None) -> str | None:
    """The newest complete checkpoint of this run with finite weights (None if there is none), to name in a
    message (a run stopped, a save failed): its sizes are checked, not its bytes, so naming it never reads
    gigabytes back (from a failing disk, perhaps); a resume checks every byte (`choose_latest`)."""
    for _, path in checkpoint_folders(output_dir):
        if checkpoint_problem(path, fingerprint, verify_content=False) is None:
            return path
    return None


# ---- another run in output_dir -------------------------------------------------------------------

MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "adapter_config.json",
               "pytorch_model.bin")


def other_run_in(output_dir: str, fingerprint: dict) -> str | None:
    """Why `output_dir` holds another run (a checkpoint or an exported model with another or no fingerprint),
    or None when it is empty, missing, or holds only this run's."""
    for _, path in checkpoint_folders(output_dir):
        state = read_state(path)
        if state is None:
            return f"{os.path.basename(path)} has no readable {STATE_FILE}"
        if why := fingerprint_difference(state.get("run"), fingerprint):
            return f"{os.path.basename(path)}: {why}"
    if any(os.path.isfile(os.path.join(output_dir, f)) for f in MODEL_FILES):
        try:
            with open(os.path.join(output_dir, RUN_FILE), encoding="utf-8") as fh:
                stored = json.load(fh).get("run")
        except (OSError, ValueError, AttributeError):
            stored = None
        if why := fingerprint_difference(stored, fingerprint):
            return f"a saved model: {why}"
    return None


def clear_other_run(output_dir: str) -> list[str]:
    """Delete every checkpoint folder and the run file in `output_dir` (--overwrite_output_dir); the names."""
    removed = []
    for _, path in checkpoint_folders(output_dir):
        _delete_checkpoint(path)
        removed.append(os.path.basename(path))
    run_file = os.path.join(output_dir, RUN_FILE)
    if os.path.isfile(run_file):
        os.remove(run_file)
    return removed


# ---- writing ---------------------------------------------------------------------------------------


def staging_root(output_dir: str, step: int) -> str:
    """The hidden folder a checkpoint of `step` is written into before it is renamed into view."""
    return os.path.join(output_dir, f".checkpoint-{step}.staging")


def seal_checkpoint(staged: str, final: str, state: dict) -> None:
    """Write our state (with the manifest of what is on disk: each file's size and content digest) into the
    staged checkpoint, last, then rename it to `final` in one step."""
    files = file_manifest(staged)
    state = {"format": STATE_FORMAT, **state, "files": files,
             "digests": checkpoint_integrity.folder_digests(staged, files)}
    atomic_write_json(os.path.join(staged, STATE_FILE), state)
    replace_folder(staged, final)


def _delete_checkpoint(path: str) -> None:
    """Rename `path` out of view, then delete it: a kill mid-delete leaves no half checkpoint in view."""
    trash = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.deleting")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def rotate_checkpoints(output_dir: str, keep: int | None, protect: str | None = None) -> None:
    """Delete the oldest checkpoints beyond `keep`, as Trainer's `save_total_limit` (the newest one and
    `protect`, the best model's, always stay)."""
    folders = checkpoint_folders(output_dir)  # newest first
    if not keep or keep <= 0 or len(folders) <= keep:
        return
    protected = {os.path.abspath(folders[0][1])} | ({os.path.abspath(protect)} if protect else set())
    remaining = len(folders)
    for _, path in reversed(folders):  # oldest first
        if remaining <= max(keep, len(protected)):
            break
        if os.path.abspath(path) not in protected:
            _delete_checkpoint(path)
            remaining -= 1


def remove_leftovers(output_dir: str) -> None:
    """Delete staging and half-deleted folders a killed run left in `output_dir` (hidden, never read)."""
    if not os.path.isdir(output_dir):
        return
    for name in os.listdir(output_dir):
        if name.startswith(".checkpoint-") and name.endswith((".staging", ".deleting")):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
