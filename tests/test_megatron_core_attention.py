"""Megatron-core 0.16.1's own ``DotProductAttention`` (its unfused attention with the sliding-window
mask of ``window_size`` on the layers ``window_attn_skip_freq`` picks, and its ``softmax_type``
"off-by-one" / "learnable" softmax with the extra column) against megatron_ext's
``ContextParallelDotProductAttention`` built from the same config: same outputs and gradients in
float64, the learnable ``softmax_offset`` under the same state-dict key with the same shape. It
pins Megatron-core's window convention (query i sees keys i - left .. i) and sink semantics.
The CUDA calls Megatron-core makes on a CPU are patched as ``benchmarks/megatron_core_gpt.py``
lists, in a process of its own. Skipped when megatron-core is not installed."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
import torch.distributed as dist

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.conftest import TIGHT, Comparisons, assert_comparisons  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

# (window_size, window_attn_skip_freq, softmax_type)
CASES = [
    ((3, 0), None, "vanilla"),
    ((0, 0), None, "vanilla"),  # the query alone
    ((5, 0), 2, "learnable"),  # the window on odd layers only
    ((5, 0), [0, 1], "off-by-one"),
    (None, None, "learnable"),
]


def _worker() -> list:
    from benchmarks.megatron_core_gpt import cpu_patches

    cpu_patches(full=True)  # this process is retired after: the default group is destroyed below
    from megatron.core import parallel_state as mcore_ps
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.transformer.context_parallel import ContextParallelDotProductAttention

    mcore_ps.initialize_model_parallel(1, 1)
    # Its attention-dropout fork needs the tracker; the inference one runs on the CPU generator.
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    groups = types.SimpleNamespace(tp=mcore_ps.get_tensor_model_parallel_group(), cp=None)
    cmp = Comparisons()
    g = torch.Generator().manual_seed(0)
    s, b = 12, 2
    for window_size, skip_freq, softmax_type in CASES:
        config = TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, window_size=window_size,
            window_attn_skip_freq=skip_freq, softmax_type=softmax_type, attention_dropout=0.0,
            params_dtype=torch.float64, use_cpu_initialization=True,
        )
        for layer in (1, 2):
            label = f"window_size={window_size} skip={skip_freq} {softmax_type} layer {layer}"
            theirs = DotProductAttention(config, layer, AttnMaskType.causal, "self")
            ours = ContextParallelDotProductAttention(config, layer, AttnMaskType.causal, "self",
                                                      pg_collection=groups)
            assert sorted(theirs.state_dict()) == sorted(ours.state_dict()), label
            if softmax_type == "learnable":
                ours.load_state_dict(theirs.state_dict())
            q = torch.randn(s, b, 4, 8, generator=g, dtype=torch.float64)
            k, v = (torch.randn(s, b, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
            grad = torch.randn(s, b, 32, generator=g, dtype=torch.float64)
            results = []
            for module in (theirs, ours):
                leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
                out = module(*leaves, attention_mask=None, attn_mask_type=AttnMaskType.causal)
                out.backward(grad)
                offset = [] if softmax_type != "learnable" else [module.softmax_offset.grad]
                results.append([out, *(t.grad for t in leaves), *offset])
            for name, got, want in zip("out dq dk dv dsinks".split(), results[1], results[0]):
                cmp.close(got, want, f"{label} {name}", **TIGHT)
    mcore_ps.destroy_model_parallel()
    dist.destroy_process_group()  # the process does not serve another test
    return cmp.made


@pytest.mark.slow  # a process of its own importing megatron-core
def test_windows_and_sinks_as_megatron_core_dot_product_attention():
    (made,) = run_distributed(1, _worker)
    assert_comparisons(made)
    assert len(made) == 4 * 2 * 2 + 2 * 5 * 2 + 2 * 4


# Packed rows: Megatron-core's GPTModel (local spec, megatron_ext's ContextParallelDotProductAttention as
# its core_attention; its own DotProductAttention asserts packed_seq_params is None) on megatron_ext, fed
# one row of four sequences with Megatron-core's PackedSeqParams (thd: cu_seqlens over the row, batch 1),
# against megatron_ext's GPTModel with the same weights, and against each sequence run alone.
BOUNDS = [0, 8, 12, 24, 32]  # each sequence a multiple of 2 x cp = 4 tokens


def _packed_worker(archs: list[str]) -> list:
    from benchmarks.megatron_core_gpt import (
        Run, build_model, copy_weights, cpu_patches, megatron_ext_name, transformer_config, use_megatron_ext,
    )

    use_megatron_ext()
    cpu_patches(full=False)
    from megatron.core.packed_seq_params import PackedSeqParams as CorePackedSeqParams

    from megatron_ext import parallel_state as ps
    from megatron_ext import tensor_parallel
    from megatron_ext.packed_seq_params import PackedSeqParams
    from megatron_ext.utils import get_thd_batch_on_this_cp_rank, thd_partitioned_indices

    cmp = Comparisons()
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(5)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    lengths = (cu[1:] - cu[:-1]).tolist()
    longest = max(lengths)
    s = BOUNDS[-1]

    def params_of(cls, cu_seqlens):
        return cls(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                   cu_seqlens_q_padded=cu_seqlens, cu_seqlens_kv_padded=cu_seqlens, max_seqlen_q=longest,
                   max_seqlen_kv=longest)

    def grads(model) -> dict:
        return {megatron_ext_name(n): p.grad.clone() for n, p in model.named_parameters()}

    def per_token_loss(model, batch, params):
        """Megatron-core's GPTModel takes the attention mask third (None: its causal mask type)."""
        mask = (None,) if type(model).__module__.startswith("megatron.core") else ()
        return model(batch["tokens"], batch["position_ids"], *mask, labels=batch["labels"],
                     packed_seq_params=params)

    def models(run):
        tensor_parallel.model_parallel_cuda_manual_seed(run.seed, force_reset_rng=True)
        torch.manual_seed(run.seed)
        core = build_model(run, transformer_config(run))[0]
        ours = build_model(run, transformer_config(run, "megatron_ext"), "megatron_ext")[0]
        return core, ours

    for arch in archs:
        tokens, labels = (torch.randint(0, 64, (1, s), generator=g) for _ in range(2))
        positions = torch.cat([torch.arange(n) for n in lengths]).view(1, s)
        weights = torch.rand(1, s, generator=g, dtype=torch.float64)  # d loss / d per-token loss
        row = {"tokens": tokens, "labels": labels, "position_ids": positions, "weights": weights}
        ps.initialize_model_parallel()  # cp 1 (dp 2: each rank the whole row)
        run = Run(arch=arch, layers=2, seq=s, packed=True)
        core, ours = models(run)
        copy_weights(core, ours)
        state = {k: v.clone() for k, v in core.state_dict().items()}
        at_cp1 = {}
        for name, model, cls in (("megatron-core", core, CorePackedSeqParams),
                                 ("megatron_ext", ours, PackedSeqParams)):
            loss = per_token_loss(model, row, params_of(cls, cu))
            (loss * weights).sum().backward()
            at_cp1[name] = (loss.detach(), grads(model))
        cmp.close(at_cp1["megatron_ext"][0], at_cp1["megatron-core"][0], f"{arch} cp 1 loss", **TIGHT)
        for p, grad in at_cp1["megatron-core"][1].items():
            cmp.close(at_cp1["megatron_ext"][1][p], grad, f"{arch} cp 1 grad {p}", **TIGHT)
        # each sequence alone (no PackedSeqParams, positions from 0): the packed row's losses and, summed,
        # its gradients
        core.zero_grad(set_to_none=True)
        alone = []
        for a, b in zip(BOUNDS[:-1], BOUNDS[1:]):
            sequence = {"tokens": tokens[:, a:b], "labels": labels[:, a:b], "position_ids": positions[:, a:b]}
            loss = per_token_loss(core, sequence, None)
            (loss * weights[:, a:b]).sum().backward()
            alone.append(loss.detach())
        cmp.close(torch.cat(alone, 1), at_cp1["megatron-core"][0], f"{arch} each sequence alone: loss",
                  **TIGHT)
        for p, grad in grads(core).items():
            cmp.close(grad, at_cp1["megatron-core"][1][p], f"{arch} each sequence alone: grad {p}", **TIGHT)
        ps.destroy_model_parallel()

        # cp 2: the row split per sequence (rank r: chunks r and 3 - r of each); gathered, the cp 1 losses;
        # gradients summed over cp, the cp 1 gradients
        for comm in ("p2p", "a2a"):
            ps.initialize_model_parallel(context_parallel_size=2)
            cp_group = ps.get_context_parallel_group()
            run = Run(arch=arch, layers=2, seq=s, packed=True, cp=2, cp_comm_type=comm)
            core, ours = models(run)
            core.load_state_dict(state)
            copy_weights(core, ours)
            batch, ext_params = get_thd_batch_on_this_cp_rank(dict(row), cu, cu, torch.tensor([longest]))
            results = {}
            for name, model, params in (("megatron-core", core, params_of(CorePackedSeqParams, cu)),
                                        ("megatron_ext", ours, ext_params)):
                loss = per_token_loss(model, batch, params)
                (loss * batch["weights"]).sum().backward()
                results[name] = (loss.detach(), grads(model))
            label = f"{arch} cp 2 {comm}"
            cmp.close(results["megatron_ext"][0], results["megatron-core"][0], f"{label} loss", **TIGHT)
            shards = [torch.empty_like(results["megatron-core"][0]) for _ in range(2)]
            dist.all_gather(shards, results["megatron-core"][0], group=cp_group)
            gathered = torch.empty(1, s)
            for rank, shard in enumerate(shards):
                gathered[:, thd_partitioned_indices(cu, s, 2, rank)] = shard
            cmp.close(gathered, at_cp1["megatron-core"][0], f"{label} loss gathered over cp", **TIGHT)
            for p, grad in results["megatron-core"][1].items():
                cmp.close(results["megatron_ext"][1][p], grad, f"{label} grad {p}", **TIGHT)
                dist.all_reduce(grad, group=cp_group)
                cmp.close(grad, at_cp1["megatron-core"][1][p], f"{label} grad {p} summed over cp", **TIGHT)
            ps.destroy_model_parallel()
    dist.destroy_process_group()  # megatron.core resolved to megatron_ext: the process serves no other test
    return cmp.made


@pytest.mark.slow  # two processes of their own importing megatron-core
def test_megatron_core_gpt_model_on_packed_rows_as_megatron_ext_and_each_sequence_alone():
    made = run_distributed(2, _packed_worker, ["gpt", "llama"])
    for rank_made in made:
        assert_comparisons(rank_made)
    assert len(made[0]) == len(made[1]) > 100
