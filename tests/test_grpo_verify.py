"""`prefixdpo verify --task grpo`: the prefix-shared pass against TRL 1.16's `GRPOTrainer` pass on a saved model.

Asserted: the group batch has what the check is about (several prompts of different lengths, left-padded; G
completions each, of very different lengths, some ending at EOS, some cut at the maximum length; rows shuffled);
the command exits 0 with every case within fp32 tolerance on tiny Llama and Qwen2 (sdpa, segmented, auto) and on
the embedded default; it exits 1 with FAIL when the shared pass is broken on purpose (positions that run on
through the line instead of TRL's, or completions that see each other). About 25 s on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from grpo_common import tiny_causal_lm, tokenizer

from prefixdpo.cli import main
from prefixdpo.grpo.verify import DEFAULT_GROUPS, group_rows

@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)  # tiny models; a second thread only waits on a busy machine (conftest restores it)


CASES = ("packed lines, one forward", "one line per prompt", "TRL's chunks of 4 rows per forward",
         "cut completions masked (TRL option)")


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    paths = {}
    for arch in ("llama", "qwen2"):
        path = tmp_path_factory.mktemp(arch)
        tiny_causal_lm(arch).save_pretrained(path)
        tokenizer().save_pretrained(path)
        paths[arch] = str(path)
    return paths


def test_the_group_batch_has_what_the_check_is_about():
    rows = group_rows(tokenizer(), DEFAULT_GROUPS)
    K = rows.logits_to_keep
    prompt_lengths = rows.attention_mask[:, :-K].sum(1)
    completion_lengths = rows.attention_mask[:, -K:].sum(1)
    assert rows.groups == 3 and rows.num_rows == 12
    assert len(set(prompt_lengths.tolist())) == 3 and (rows.attention_mask[:, 0] == 0).any()  # left padding
    assert completion_lengths.max() >= 5 * completion_lengths.min()
    assert 0 < int(rows.ends_at_eos.sum()) < rows.num_rows
    eos = tokenizer().eos_token_id
    last = rows.input_ids[torch.arange(rows.num_rows), -K + completion_lengths - 1]
    assert torch.equal(last == eos, rows.ends_at_eos)  # EOS ends exactly the completions that end
    assert (completion_lengths[~rows.ends_at_eos] == K).all()  # the others are cut at the maximum length
    # shuffled: the rows of a prompt are not all adjacent
    prompts = [tuple(r[:-K][m[:-K].bool()].tolist()) for r, m in zip(rows.input_ids, rows.attention_mask)]
    runs = sum(1 for i in range(1, len(prompts)) if prompts[i] != prompts[i - 1]) + 1
    assert runs > rows.groups


def _case_lines(out: str) -> dict[str, list[str]]:
    return {case: next(line for line in out.splitlines() if line.startswith(case)).split() for case in CASES}


@pytest.mark.parametrize("arch,attention", [("llama", "sdpa"), ("qwen2", "segmented"), ("qwen2", "auto")])
def test_verify_grpo_passes(saved_models, arch, attention, capsys):
    assert main(["verify", "--task", "grpo", "--model", saved_models[arch], "--attention", attention]) == 0
    out = capsys.readouterr().out
    assert "the prefix-shared pass matches TRL's" in out and "GRPOTrainer._get_per_token_logps_and_entropies" in out
    for case, fields in _case_lines(out).items():
        assert fields[-1] == "ok", (case, fields)
        logp, entropy, grad = (float(x) for x in fields[-5:-2])
        assert logp <= 1e-5 and entropy <= 1e-5 and grad < 1e-3, (case, fields)
        shared, trl = (int(x) for x in fields[-2].split("/"))
        assert shared < trl  # each prompt ran once


def test_verify_grpo_on_the_embedded_default(capsys):
    assert main(["verify", "--task", "grpo"]) == 0
    out = capsys.readouterr().out
    assert "the embedded default of prefixdpo grpo" in out and "matches TRL's" in out


def _positions_running_on(lines):
    """The mistake PAPER.md warns about: positions counted through the line, not TRL's columns."""
    S = lines.input_ids.shape[1]
    lines.position_ids = torch.arange(S).expand_as(lines.input_ids).clone()
    return lines


def _completions_see_each_other(lines):
    """Every completion's subtree runs to its group's end, as if each group were one causal sequence."""
    tin, tout = lines.spans[..., 0], lines.spans[..., 1]
    group_end = torch.where(tin >= 0, tout, 0).cummax(dim=1).values  # the group's end, for slots after its prompt
    lines.spans = torch.stack([tin, torch.where(tin >= 0, group_end, tout)], dim=-1)
    return lines


@pytest.mark.parametrize("fault", [_positions_running_on, _completions_see_each_other])
def test_verify_grpo_fails_when_the_shared_pass_is_broken(saved_models, fault, monkeypatch, capsys):
    import prefixdpo.grpo.passes as passes_module

    layout = passes_module.layout_groups
    monkeypatch.setattr(passes_module, "layout_groups", lambda *a, **kw: fault(layout(*a, **kw)))
    assert main(["verify", "--task", "grpo", "--model", saved_models["llama"]]) == 1
    out = capsys.readouterr().out
    assert "FAIL: the prefix-shared pass does not match TRL's" in out
    assert all(fields[-1] == "FAIL" for fields in _case_lines(out).values())
