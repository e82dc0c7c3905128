"""Shared fixtures: tiny randomly initialised decoder-only models built from configs (no downloads)."""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

# `make test` runs two pytest-xdist workers on the 2-core CI machine: one thread each keeps them from fighting
# over the cores (tiny models gain little from a second thread); a plain `pytest` keeps two.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


class _NoDeepSpeedShmBuild:
    """An import hook: `deepspeed.comm.torch` loads with its `build_shm_op` returning None.

    On its CPU accelerator DeepSpeed JIT-builds a shared-memory all-reduce op (g++ and ninja, on every fresh
    machine) when its comm backend starts: test_deepspeed's ZeRO test alone took 69 s with the build and 32 s
    without it on 2 cores. The op serves `inference_all_reduce` only; training's collectives (all_reduce,
    all_gather, reduce_scatter) are torch.distributed's over gloo with or without it, so the ZeRO tests compute the
    same either way. Every rank script imports this module first."""

    target = "deepspeed.comm.torch"

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def run_without_shm_build(module) -> None:
            run_module(module)
            module.build_shm_op = lambda: None

        spec.loader.exec_module = run_without_shm_build
        return spec


sys.meta_path.insert(0, _NoDeepSpeedShmBuild())


@pytest.fixture(autouse=True)
def _keep_process_state():
    """What one test changes process-wide must not reach the tests after it: a command run in-process sets its
    own thread count (`prefixdpo bench`), and accelerate writes `ACCELERATE_USE_FSDP` (and friends) into
    os.environ for any Accelerator given an FSDP plugin."""
    import os

    threads = torch.get_num_threads()
    environ = dict(os.environ)
    yield
    torch.set_num_threads(threads)
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update(environ)


@functools.cache
def cpu_half_dtype() -> torch.dtype:
    """The half precision the tests' CPU passes load models in: bfloat16, or float16 where this torch cannot run
    bfloat16 attention on this CPU.

    torch 2.13's CPU flash attention packs bfloat16 blocks for AMX / AVX-512-BF16 hardware and then refuses them
    when ATEN_CPU_CAPABILITY is forced below AVX-512 on such a machine ("pack_vnni2 is only supported when avx512 is
    supported", five lines of plain SDPA show it): an artifact of the forced setting, which no CPU has (a real AVX2
    CPU does not pack). The tests that load a model in half precision check where the option lands, not bf16's
    numbers, so float16 keeps their point there."""
    q = torch.zeros(1, 1, 256, 64, dtype=torch.bfloat16)  # long enough a row for the kernel to pack its blocks
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as err:
        if "pack_vnni2" not in str(err):
            raise
        return torch.float16
    return torch.bfloat16


TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=512,
)


@pytest.fixture
def no_progress_bars():
    """transformers' progress bars off for a test (a command's stderr then holds exactly what it writes)."""
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    yield
    if was_on:
        logging.enable_progress_bar()


def preempt_after(process, line_prefix: str, lines: int, sig=None, said: str = "preempted at step ") \
        -> tuple[str, str, int]:
    """Send `sig` (default SIGTERM) to `process` (a run with text stdout/stderr pipes) once its stdout has shown
    `lines` lines starting with `line_prefix`; -> (stdout, stderr, the step its error says it stopped at: the
    number after `said`). It must exit non-zero."""
    import signal

    seen = 0
    for line in process.stdout:
        seen += line.startswith(line_prefix)
        if seen == lines:
            process.send_signal(signal.SIGTERM if sig is None else sig)
            break
    out, err = process.communicate(timeout=300)
    assert process.returncode != 0
    assert said in err, err[-3000:]
    return out, err, int(err.split(said)[1].split()[0])


# how a faulty run of the survival drivers ends, by its fault point (any other point is a SIGKILL)
FAULT_EXIT_CODES = {"sigterm": 75, "sigusr1": 75, "sigint": 130, "sigint_twice": 130}


def run_fault_trials(driver: str, workdir, trials: list[dict], env: dict, *driver_args: str) -> tuple[dict, str]:
    """Run a survival driver (tests/survival_driver.py, tests/grpo_survival_driver.py) over `trials` and check every
    trial: the faulty run ended as its fault does, left the checkpoint `expect` complete and none newer, the resume
    with `latest` chose it and ended on the uninterrupted run's weights (within K_FORWARD eps of the weights' scale,
    `tolerances.weights_scale`: the same arithmetic replayed, so the difference is 0 unless a step was lost or
    replayed differently). -> (the driver's result, its stderr)."""
    import json
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tolerances import K_FORWARD, assert_small

    here = Path(__file__).resolve().parent
    (Path(workdir) / "trials.json").write_text(json.dumps(trials))
    result = Path(workdir) / "result.json"
    proc = subprocess.run([sys.executable, str(here / driver), str(workdir), str(Path(workdir) / "trials.json"),
                           str(result), *driver_args], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    outcome = json.loads(result.read_text())
    assert outcome["reference_moved"] > 1e-3  # training moved the weights: equal end weights mean something
    rows = outcome["trials"]
    assert len(rows) == len(trials)
    for row in rows:
        assert row["faulty_code"] == FAULT_EXIT_CODES.get(row["point"], -signal.SIGKILL), row
        assert f"checkpoint-{row['expect']}" in row["complete_after_fault"], row
        assert all(int(c.split("-")[1]) <= row["expect"] for c in row["complete_after_fault"]), row
        assert row["chosen"] == f"checkpoint-{row['expect']}", row
        assert row["resume_code"] == 0, row
        # the same steps replayed from a complete checkpoint: a few ulps of the weights' scale at most
        assert_small(row["max_weight_diff"], outcome["weights_scale"], k=K_FORWARD, what=str(row))
    return outcome, proc.stderr


# The engines of the distributed test scripts (`run_processes`), as TrainingArguments keywords / a DeepSpeed config.
FSDP2 = dict(fsdp="full_shard auto_wrap",
             fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
         # every parameter partitioned (the default keeps parameters under 1e5 elements whole)
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                               "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}


def rank_script_start(argv: list[str]) -> tuple[str, str, int, int, str]:
    """(out_dir, engine, world, rank, init) of a script run as `script OUT ENGINE` by `run_processes`: the
    one-process run (engine "none") writes the tiny Llama's starting weights to OUT/../init, which every run loads."""
    out_dir, engine = argv[1], argv[2]
    init = os.path.join(out_dir, "..", "init")
    if engine == "none":
        tiny_model("llama").save_pretrained(init)
    return out_dir, engine, int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")), init


def run_rank_script(tmp_path, script: str, engine: str, timeout: int = 900) -> dict:
    """What a rank script (`script OUT ENGINE`, `rank_script_start`) wrote to result.json, run as one process
    (engine "none") or as 2 gloo ranks, DeepSpeed on its CPU accelerator; `script` is formatted with `tests`."""
    import json

    path = tmp_path / f"{engine}_script.py"
    path.write_text(script.format(tests=os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / engine
    out.mkdir()
    run_processes(1 if engine == "none" else 2, str(path), str(out), engine, timeout=timeout,
                  env={"DS_ACCELERATOR": "cpu"})
    return json.loads((out / "result.json").read_text())


def finish_ranks(rank: int, out_dir: str, results) -> None:
    """The end of a script run by `run_processes`: rank 0 writes `results` to out_dir/result.json, then every rank
    leaves (`leave_ranks`)."""
    import json
    import os

    if rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as fh:
            json.dump(results, fh)
    leave_ranks(0)


def leave_ranks(code: int = 0) -> None:
    """The last act of a rank script: every rank leaves the process group together, then the process ends with
    `code` without the interpreter's finalization.

    Why both. A rank that leaves early aborts the others (its peers' gloo threads lose their pair). And after a clean
    destroy_process_group, a gloo worker thread can still be dropping its last reference to a tensor a Python object
    owns; that needs the GIL, and a thread taking the GIL while the interpreter finalizes is ended by pthread_exit,
    which C++ turns into std::terminate ("terminate called without an active exception", SIGABRT: rare, seen under
    load; pytorch/pytorch PR 179291 describes it). `os._exit` after flushing ends the process before finalization."""
    import os
    import sys

    import torch

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def tiny_model(arch: str, **overrides):
    """A tiny fp32 model of the named architecture (llama, qwen2 (GQA), qwen3, mistral, ...)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(TINY)
    if arch in ("qwen2", "qwen3", "mistral", "llama"):
        kwargs["num_key_value_heads"] = 2  # GQA
    if arch == "qwen3":
        kwargs["head_dim"] = 8
    kwargs.update(overrides)
    cfg = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Larger-than-default init so a wrong layout shows up clearly in log-probs.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.train(False)


def random_examples(seed: int = 0, vocab: int = 96, shapes=((7, (5, 3)), (4, (6, 2, 3, 4)), (9, (2, 8)))):
    """Examples from (prompt length, response lengths); K = len(response lengths)."""
    from prefixdpo.data.example import Example

    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    out = []
    for i, (p, rs) in enumerate(shapes):
        pairs = [(0, k) for k in range(1, len(rs))]
        out.append(Example(ids(p), [ids(r) for r in rs], pairs=pairs, source_index=i))
    return out


def make_examples(n: int, seed: int = 0, ks=(2,)):
    """n Examples with prompts of 4-13 tokens and K = ks[i % len(ks)] responses of 2-8 tokens each."""
    import random

    from prefixdpo.data.example import Example

    g = random.Random(seed)
    out = []
    for i in range(n):
        k = ks[i % len(ks)]
        prompt = [g.randrange(3, 96) for _ in range(g.randrange(4, 14))]
        responses = [[g.randrange(3, 96) for _ in range(g.randrange(2, 9))] for _ in range(k)]
        out.append(Example(prompt, responses, pairs=[(0, j) for j in range(1, k)], source_index=i))
    return out


@pytest.fixture
def examples():
    return random_examples()


def free_port() -> str:
    """A TCP port free right now, for `torchrun --master_port` (a fixed number collides when two pytest-xdist workers,
    or two checkouts' suites, launch at once)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def run_processes(nproc: int, *args: str, cwd=None, timeout: int = 900, env: dict | None = None):
    """Run `python *args` as one process, or under `torchrun --standalone` as `nproc` gloo processes (CPU, one
    thread each; `env` added to the environment). Asserts it succeeded, showing the ranks' own tracebacks and the
    rest of stderr (with Python's fault handler on, a rank that dies of a signal prints its Python stack there: a
    2-rank FSDP2 run once lost rank 0 to a SIGSEGV under a loaded CI, with nothing else to read); returns the
    CompletedProcess."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONFAULTHANDLER": "1",
           **(env or {})}
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    proc = subprocess.run([sys.executable, *launcher, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
    lines = proc.stderr.splitlines()
    ranks = "\n".join(line for line in lines if line.startswith("[rank"))[-4000:]
    rest = "\n".join(line for line in lines if not line.startswith("[rank"))[-4000:]
    assert proc.returncode == 0, f"{ranks}\n--- the rest of stderr ---\n{rest or proc.stdout[-2000:]}"
    return proc


def pytest_collection_finish(session):
    """Once every test module is imported (torch, transformers, TRL: millions of objects that live as long as the
    process), move them out of the cyclic garbage collector's sight. transformers' Trainer calls `gc.collect()` at
    the start and end of every `train()` and evaluation, and each full collection walked all of them: measured, it
    was half the time of a worker running test_user_errors + test_trainer + test_grpo_logps (22 s -> 11 s). Objects
    made later are collected as before; nothing a test checks depends on when a collection runs."""
    import gc

    gc.collect()
    gc.freeze()
