"""gpu-check's sequence-parallel section (`core.sequence_parallel`).

- "heads <backend>": on one device, the identity sequence parallelism rests on: prefixdpo's attention over head
  shards of the whole line (what each rank runs between the all-to-alls) equals the attention over all heads,
  with the line's own mask object (flex's BlockMask, varlen's plan, the dense mask). Tiny Llama layer, GQA (8 query,
  4 key/value heads, halves of each), a packed 1,024-token line; fp32 (varlen: bf16). Within 8 eps of the output's
  scale.
- "2 ranks <backend>": with 2 CUDA devices, `torchrun --nproc_per_node 2` (NCCL, DeepSpeed's all-to-all) runs a
  policy pass and its backward over one 4,096-token row held by both ranks, against this process on the same row
  (`tools.bench.sequence_parallel.measure_row`): log-prob sums within 8 eps of their scale, and each rank's
  activations kept for backward and `max_memory_allocated` per rank over one process's (reported). With one
  device: n/a, said in one line (NCCL puts one rank per device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch

from prefixdpo_tools.gpu_check.results import CheckResult

__all__ = ["ROW", "head_shard_check", "planned", "section", "two_rank_check"]

ROW = (3584, (256, 256))  # the 2-rank check's row: prompt, response lengths (4,096 tokens)
TOL_EPS = 8


def planned(backends: list[str]) -> list[tuple[str, str]]:
    return [("sequence parallel", f"heads {b}") for b in backends] + [("sequence parallel", f"2 ranks {backends[0]}")]


def _layer_and_line(device, dtype):
    """(a tiny Llama attention module with 8 query / 4 key-value heads, the spans of one packed line of 1,024)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from prefixdpo.core.attention.backends import ATTENTION_NAME
    from prefixdpo.data.batch import build_batch
    from prefixdpo_tools.bench.sequence_parallel import long_row

    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    cfg._attn_implementation = ATTENTION_NAME
    model = AutoModelForCausalLM.from_config(cfg).to(device, dtype).eval()
    rows = [long_row(300, (100, 80, 60), 96, seed=1), long_row(200, (150, 134), 96, seed=2)]
    batch = build_batch(rows, packs=[[0, 1]], length=1024)
    return model.model.layers[0].self_attn, batch.spans.to(device)


def head_shard_check(backend: str, device: str) -> CheckResult:
    """See the module docstring ("heads <backend>")."""
    from prefixdpo.core.attention.backends import _line_attention
    from prefixdpo.core.attention.pass_plan import plan_pass

    dtype = torch.bfloat16 if backend == "varlen" else torch.float32
    module, spans = _layer_and_line(device, dtype)
    plan = plan_pass(spans, backend)
    g = torch.Generator(device=device).manual_seed(0)
    L, D = spans.shape[1], module.head_dim
    q, k, v = (torch.randn(1, h, L, D, generator=g, device=device, dtype=dtype) for h in (8, 4, 4))
    scaling = module.scaling
    with torch.no_grad():
        whole, _ = _line_attention(module, q, k, v, plan, scaling=scaling, dropout=0.0)  # [1, L, 8, D]
        halves = [_line_attention(module, q[:, s * 4:(s + 1) * 4], k[:, s * 2:(s + 1) * 2], v[:, s * 2:(s + 1) * 2],
                                  plan, scaling=scaling, dropout=0.0)[0] for s in (0, 1)]
    sharded = torch.cat(halves, dim=2)
    diff = float((sharded.float() - whole.float()).abs().max())
    bound = TOL_EPS * torch.finfo(dtype).eps * max(float(whole.float().abs().max()), 1.0)
    status = "ok" if diff <= bound else "FAIL"
    return CheckResult("sequence parallel", f"heads {backend}", status,
                       f"{dtype} max diff {diff:.3g} (bound {bound:.3g}) over a {L}-token packed line",
                       {"max_diff": diff, "bound": bound})


def two_rank_check(backend: str, device: str) -> CheckResult:
    """See the module docstring ("2 ranks <backend>")."""
    name = f"2 ranks {backend}"
    if torch.cuda.device_count() < 2:
        return CheckResult("sequence parallel", name, "n/a",
                           f"needs 2 CUDA devices (NCCL puts one rank on each); this machine has "
                           f"{torch.cuda.device_count()}")
    from prefixdpo_tools.bench.sequence_parallel import long_row, measure_row

    one = measure_row(_model(device), long_row(ROW[0], ROW[1], 96), backend, device).as_dict()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "-m", "prefixdpo_tools.gpu_check.sequence_parallel", out, backend],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            return CheckResult("sequence parallel", name, "error", (proc.stderr or proc.stdout)[-300:])
        with open(out, encoding="utf-8") as fh:
            ranks = json.load(fh)
    scale = max(abs(s) for s in one["sums"])
    diff = max(abs(a - b) for rank in ranks for a, b in zip(rank["sums"], one["sums"]))
    bound = TOL_EPS * torch.finfo(torch.float32).eps * scale
    shares = [rank["saved_bytes"] / one["saved_bytes"] for rank in ranks]
    peaks = [rank["peak_bytes"] / max(one["peak_bytes"], 1) for rank in ranks]
    return CheckResult("sequence parallel", name, "ok" if diff <= bound else "FAIL",
                       f"sums max diff {diff:.3g} (bound {bound:.3g}); per rank, of one process's: activations "
                       f"{', '.join(f'{s:.3f}' for s in shares)}, max allocated {', '.join(f'{p:.3f}' for p in peaks)}",
                       {"max_diff": diff, "activation_shares": shares, "peak_shares": peaks})


def _model(device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from prefixdpo.core.attention.backends import ATTENTION_NAME

    cfg = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)
    cfg._attn_implementation = ATTENTION_NAME
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(device).train(False)


def section(backends: list[str], device: str, log=print) -> list[CheckResult]:
    from prefixdpo_tools.gpu_check.results import guarded

    results = []
    for b in backends:
        results.append(guarded("sequence parallel", f"heads {b}", head_shard_check, b, device))
        log(f"  sequence parallel {results[-1].name}: {results[-1].status} {results[-1].detail}")
    results.append(guarded("sequence parallel", f"2 ranks {backends[0]}", two_rank_check, backends[0], device))
    log(f"  sequence parallel {results[-1].name}: {results[-1].status} {results[-1].detail}")
    return results


def _rank_main(out: str, backend: str) -> None:
    """One rank of `two_rank_check`: its measurement, every rank's written by rank 0."""
    from prefixdpo.core.sequence_parallel import new_sequence_parallel
    from prefixdpo_tools.bench.sequence_parallel import long_row, measure_row

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local))
    sp = new_sequence_parallel(torch.distributed.get_world_size())
    result = measure_row(_model("cuda"), long_row(ROW[0], ROW[1], 96), backend, "cuda", sp).as_dict()
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, result)
    if torch.distributed.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(everyone, fh)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
