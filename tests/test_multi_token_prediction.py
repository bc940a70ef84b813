"""Multi-token prediction (``transformer.multi_token_prediction``, ``GPTModel`` with
``config.mtp_num_layers``): the losses logged and the gradients equal those of the objective written
out by hand from the model's own modules (Megatron-core's formula: depth k embeds the tokens k places
ahead, normalises and projects them with the previous depth's hidden states, runs its layer and the
output layer, and is scored on the labels k places ahead, the last k positions masked); the
schedules set ``MTPLossAutoScaler``'s scale; ``roll_tensor`` over context-parallel chunks and packed
rows equals rolling the whole sequence; the refusals of layouts that cannot hold the depths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.models import GPTModel
from megatron_ext.packed_seq_params import PackedSeqParams
from megatron_ext.pipeline_parallel.aux_loss import set_aux_loss_scale
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.context_parallel import get_pos_emb_on_this_cp_rank
from megatron_ext.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    MTPLossLoggingHelper,
    roll_tensor,
)
from megatron_ext.utils import thd_partitioned_indices
from tests.distributed import run_distributed

VOCAB, SEQ, BATCH = 32, 8, 2


def _config(**overrides) -> TransformerConfig:
    fields = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24,
                  normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                  params_dtype=torch.float64, pipeline_dtype=torch.float64, use_cpu_initialization=True,
                  mtp_num_layers=2,
                  mtp_loss_scaling_factor=0.3)
    return TransformerConfig(**{**fields, **overrides})


def _by_hand(model: GPTModel, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The main loss's mean plus mtp_loss_scaling_factor x the mean over the depths of each depth's
    loss, and each depth's loss, from the model's modules and torch.roll."""
    config = model.config
    rotary = model.rotary_pos_emb(SEQ)
    hidden = model.decoder(model.embedding(tokens, None), None, rotary)
    weight = model.output_layer.weight

    def loss(h, target):
        logits = (h @ weight.T).flatten(0, 1)
        return F.cross_entropy(logits, target.transpose(0, 1).flatten(), reduction="none")

    main = loss(hidden, labels).mean()
    depths, ids, target, h = [], tokens, labels, hidden
    mask = torch.ones(BATCH, SEQ, dtype=torch.float64)
    for layer in model.mtp.layers:
        ids, target, mask = (torch.roll(t, -1, dims=-1) for t in (ids, target, mask))
        mask[:, -1] = 0
        e = model.embedding(ids, None)
        h, _ = layer.eh_proj(torch.cat((layer.enorm(e), layer.hnorm(h)), dim=-1))
        h = layer.final_layernorm(layer.transformer_layer(h, None, rotary))
        depths.append((loss(h, target) * mask.transpose(0, 1).flatten()).sum() / mask.sum())
    return main + config.mtp_loss_scaling_factor * sum(depths) / len(depths), depths


def _formula_worker() -> dict:
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = GPTModel(_config(), VOCAB, SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    g = torch.Generator().manual_seed(2)
    tokens, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
    model(tokens, None, labels=labels).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    logged = MTPLossLoggingHelper.tracker["values"].clone()
    model.zero_grad()
    objective, depths = _by_hand(model, tokens, labels)
    objective.backward()
    # Logged in torch's default dtype (float32), as Megatron-core's tracker: the float64 losses rounded.
    out = {"logged": (logged.dtype, torch.equal(logged, torch.stack(depths).detach().float())), "grads": 0.0,
           "mtp grads nonzero": all(p.grad.abs().sum() > 0 for n, p in model.named_parameters()
                                    if "mtp" in n)}
    for name, p in model.named_parameters():
        out["grads"] = max(out["grads"], ((grads[name] - p.grad).abs().max() / p.grad.abs().max()).item())
    return out


def test_mtp_losses_and_gradients_follow_megatron_core_formula():
    (out,) = run_distributed(1, _formula_worker)
    assert out["mtp grads nonzero"], out
    assert out["logged"] == (torch.float32, True) and out["grads"] < 1e-12, out


def test_schedules_set_the_mtp_loss_scale():
    config = _config()
    set_aux_loss_scale(config, num_microbatches=4, cp_group_size=2)
    assert MTPLossAutoScaler.main_loss_backward_scale.item() == 0.25  # 1 / micro-batches, not times cp
    loss = torch.tensor(3.0, requires_grad=True)
    out = MTPLossAutoScaler.apply(torch.ones(2, requires_grad=True), loss)
    out.sum().backward()
    assert loss.grad.item() == 0.25


def _roll_worker() -> list[float]:
    """Differences between rolling this cp rank's chunks and the chunks of the rolled sequence:
    a plain batch [b, s] and a packed row of three sequences."""
    cp = torch.distributed.get_world_size()
    ps.initialize_model_parallel(context_parallel_size=cp)
    group = ps.get_context_parallel_group()
    full = torch.arange(1, 2 * 4 * cp + 1).view(2, -1).float()  # [2, 8 cp]
    expected = torch.roll(full, -1, -1)
    expected[:, -1] = 0
    mine, total = roll_tensor(get_pos_emb_on_this_cp_rank(full, 1, group), -1, -1, group)
    diffs = [(mine - get_pos_emb_on_this_cp_rank(expected, 1, group)).abs().max().item(), total.item()]
    bounds = torch.tensor([0, 4 * cp, 6 * cp, 10 * cp])  # sequences of 4 cp, 2 cp and 4 cp tokens
    row = torch.arange(1, 10 * cp + 1).float()[None]
    rolled = torch.cat([torch.cat((part[:, 1:], torch.zeros(1, 1)), dim=1)
                        for part in row.split((bounds[1:] - bounds[:-1]).tolist(), dim=1)], dim=1)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds)
    index = thd_partitioned_indices(bounds, int(bounds[-1]), cp, ps.get_context_parallel_rank())
    local = roll_tensor(row[:, index], -1, -1, group, params)[0]
    diffs.append((local - rolled[:, index]).abs().max().item())
    return diffs


def test_roll_tensor_over_context_parallel_chunks_and_packed_rows():
    results = run_distributed(2, _roll_worker)
    # The rolled batch: rows 2 .. 8 and 10 .. 16, each ending with 0.
    assert sum(r[1] for r in results) == sum(range(2, 9)) + sum(range(10, 17))
    for diffs in results:
        assert diffs[0] == 0 and diffs[2] == 0, diffs


def _layout_worker() -> list[str]:
    errors = []
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    for kwargs in (dict(position_embedding_type="learned_absolute"), dict(mtp_block_spec="a layer spec")):
        try:
            GPTModel(_config(pipeline_model_parallel_size=2), VOCAB, SEQ, **kwargs)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, get_embedding_ranks=lambda ranks: [ranks[0]])
    try:
        GPTModel(_config(pipeline_model_parallel_size=2), VOCAB, SEQ, position_embedding_type="rope")
    except RuntimeError as e:
        errors.append(str(e))
    return errors


def test_layouts_that_cannot_hold_mtp_raise_on_every_rank():
    first, second = run_distributed(2, _layout_worker)
    assert first == second and len(first) == 3, first
    assert "learned absolute positions needs the position embedding on the last pipeline stage" in first[0]
    assert "module specs are not supported" in first[1]
    assert "not in the embedding group" in first[2]


@pytest.mark.parametrize(("overrides", "match"), [
    (dict(mtp_num_layers=0), "mtp_num_layers must be a positive integer"),
    (dict(mtp_loss_scaling_factor=-1.0), "mtp_loss_scaling_factor must be a finite number >= 0"),
    (dict(window_size=(3, 0), window_attn_skip_freq=[1, 0]), "per-layer list has no entry"),
])
def test_bad_mtp_configs_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(**overrides)
