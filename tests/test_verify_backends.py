"""`prefixdpo verify --attention X` for every backend name and every task: the command line takes all of them
(`attention.backends.BACKENDS`); on CPU, flex (no backward) and varlen (CUDA + FlashAttention) are refused in one
line, exit 2, before any model is loaded; the others run. About 10 s on 2 cores."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from prefixdpo.core.attention.backends import BACKENDS
from prefixdpo.cli import build_parser, main
from prefixdpo.commands.verify import ATTENTION_BACKENDS, TREE_CASE

@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)  # tiny models; a second thread only waits on a busy machine (conftest restores it)


TASKS = ("dpo", "reward", "grpo")
REFUSED_ON_CPU = {"flex": "FlexAttention has no backward", "varlen": "needs a CUDA device"}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from prefixdpo.commands.verify import DEFAULT_PROMPTS, DEFAULT_RESPONSES
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = build_tiny_tokenizer(DEFAULT_PROMPTS + DEFAULT_RESPONSES)
    tokenizer.save_pretrained(path)
    tiny_model("qwen2", vocab_size=len(tokenizer)).save_pretrained(path)
    return str(path)


def test_the_command_line_offers_every_backend_and_dtype():
    from prefixdpo.commands.verify import DTYPES
    from prefixdpo.core.verify import DTYPE_TOLERANCES

    assert ATTENTION_BACKENDS == BACKENDS
    assert DTYPES == tuple(sorted(DTYPE_TOLERANCES))
    for task in TASKS:
        for backend in BACKENDS:
            args = build_parser().parse_args(["verify", "--task", task, "--attention", backend])
            assert (args.task, args.attention) == (task, backend)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("backend", sorted(REFUSED_ON_CPU))
def test_backends_that_cannot_run_on_cpu_are_refused_in_one_line_before_loading(tmp_path, task, backend, capsys):
    missing = str(tmp_path / "no-such-model")  # were the model loaded first, the error would name it
    assert main(["verify", "--task", task, "--model", missing, "--attention", backend]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prefixdpo verify: error: --attention")
    assert REFUSED_ON_CPU[backend] in err[0] and "no-such-model" not in err[0]
    assert "Traceback" not in captured.out + captured.err


def test_cuda_requested_without_cuda_is_one_line(saved_model, capsys):
    assert main(["verify", "--model", saved_model, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["prefixdpo verify: error: --device cuda: no CUDA device is available"]


@pytest.mark.parametrize("task,backend", [("dpo", "segmented"), ("reward", "auto"), ("reward", "segmented"),
                                          ("dpo", "sdpa")])
def test_backends_that_run_on_cpu_verify(saved_model, task, backend, capsys):
    """(grpo on every CPU backend: tests/test_grpo_verify.py.)"""
    assert main(["verify", "--task", task, "--model", saved_model, "--attention", backend]) == 0
    out = capsys.readouterr().out
    resolved = "sdpa" if backend == "auto" else backend
    assert f"attention={backend if backend == resolved else 'auto -> sdpa'}," in out
    assert "matches separate passes" in out
    tree_row = next(x for x in out.splitlines() if x.startswith(TREE_CASE))
    assert tree_row.endswith("ok")  # the tree case runs for every task and backend


def test_dpo_and_reward_need_a_model(capsys):
    assert main(["verify", "--task", "reward"]) == 2
    assert capsys.readouterr().err.strip() == (
        "prefixdpo verify: error: --task reward needs --model (only --task grpo has an embedded default)")
