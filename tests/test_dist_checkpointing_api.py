"""Megatron-core's checkpointing API (``megatron_ext.dist_checkpointing.save`` / ``load`` of
sharded state dicts): what one (tp, dp) layout saves loads at others with the global tensors'
exact values (float64); bad sharding and shapes are refused on every rank; an async save
completes on ``execute_sync``; the models' ``sharded_state_dict`` stores the layout-free
checkpoints' tensors under Megatron-core's keys and reshards across (tp, pp); checkpoints move both
ways between megatron_ext and Megatron-core 0.16's own ``torch_dist`` save and load (whole GPT
models: ``test_megatron_core_checkpoint.py``)."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import torch
import torch.distributed as dist

from megatron_ext.dist_checkpointing import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
)
from tests.distributed import run_distributed

ROWS, COLS = 8, 12


def _global(name: str) -> torch.Tensor:
    """The global tensor ``name`` every layout saves parts of."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(ROWS, COLS, dtype=torch.float64, generator=g)


def test_sharded_tensor_from_rank_offsets():
    data = torch.zeros(2, 3, dtype=torch.float64)
    sh = ShardedTensor.from_rank_offsets("w", data, (0, 2, 4), (1, 1, 2), replica_id=(0, 1))
    assert (sh.global_shape, sh.global_offset, sh.axis_fragmentations) == ((8, 6), (4, 3), (4, 2))
    assert (sh.local_shape, sh.dtype, sh.replica_id) == ((2, 3), torch.float64, (0, 1))
    assert sh.global_slice() == (slice(4, 6), slice(3, 6))
    assert sh.local_chunk_offset_in_global() == (2, 1)
    stacked = ShardedTensor.from_rank_offsets("w", data, (0, 5, 7), (1, 1, 2), prepend_axis_num=1)
    assert (stacked.global_shape, stacked.global_offset) == ((7, 4, 3), (5, 2, 0))
    assert stacked.global_slice() == (5, slice(2, 4), slice(0, 3))
    assert stacked.without_data().data is None
    with pytest.raises(CheckpointingException, match="invalid rank offsets"):
        ShardedTensor.from_rank_offsets("w", data, (0, 4, 4))
    with pytest.raises(CheckpointingException, match="dtype"):
        ShardedTensor("w", data, torch.float32, (2, 3), (2, 3), (0, 0), (1, 1))
    obj = ShardedObject("rng", {"a": 1}, (2, 4), (1, 3))
    assert obj.unique_key == "rng/shard_1.3_2.4"
    again = ShardedObject.empty_from_unique_key(obj.unique_key)
    assert (again.key, again.global_shape, again.global_offset, again.data) == ("rng", (2, 4), (1, 3), None)


def test_narrow_factories_and_main_replicas():
    from megatron_ext.dist_checkpointing import ShardedTensorFactory, is_main_replica
    from megatron_ext.dist_checkpointing.mapping import apply_factories, apply_factory_merges

    sh = ShardedTensor.from_rank_offsets("k", torch.ones(1, 3, 7, 9), (0, 0, 10), (2, 3, 6))
    (narrow,) = sh.narrow(2, 3, 2)
    assert (narrow.local_shape, narrow.global_shape, narrow.global_offset) == (
        (1, 3, 2, 9),
        (10, 3, 12, 9),
        (0, 0, 6, 0),
    )
    with pytest.raises(CheckpointingException, match="local_shape"):
        sh.local_shape = (1, 2, 7, 9)
        sh.validate_metadata_integrity()

    def build(key, data, replica_id, _flat):
        return {
            "plus1": ShardedTensor.from_rank_offsets(key + ".1", data + 1),
            "plus2": ShardedTensor.from_rank_offsets(key + ".2", data + 2),
        }

    sd = {"level": ShardedTensorFactory("a", torch.arange(3.0), build, lambda d: d["plus2"] - 2)}
    apply_factories(sd)
    assert torch.equal(sd["level"]["plus1"].data, torch.tensor([1.0, 2.0, 3.0]))
    loaded = {"level": {k: v.data for k, v in sd["level"].items()}}
    template = {"level": ShardedTensorFactory("a", torch.arange(3.0), build, lambda d: d["plus2"] - 2)}
    assert torch.equal(apply_factory_merges(loaded, template)["level"], torch.arange(3.0))
    assert [is_main_replica(r) for r in (0, (0, 0), 1, (0, 1))] == [True, True, False, False]


def _state_dict(tp_rank: int, tp: int, dp_rank: int, dp: int, fill: bool = True) -> dict:
    """A sharded state dict with the pieces Megatron's API offers: a tensor split over TP, one
    split over TP x DP (a 2-D grid), a replicated one, stacked layers (two shards of one key on a
    rank: layers tp_rank and tp_rank + tp of 2 tp), a factory, objects, a non-persistent object and
    common values. ``fill``: the global tensors' values, else zeros to load into."""
    from megatron_ext.dist_checkpointing import LocalNonpersistentObject, ShardedTensorFactory
    from megatron_ext.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    def part(name: str, index) -> torch.Tensor:
        t = _global(name)[index].clone()
        return t if fill else torch.zeros_like(t)

    rows, cols = ROWS // tp, COLS // dp
    layers = _global("layers").reshape(2 * tp, ROWS * COLS // (2 * tp))  # 2 tp layers
    factory_data = part("factory", (slice(tp_rank * rows, (tp_rank + 1) * rows),))

    def build(key, data, replica_id, _flat):
        halves = data.chunk(2, 1)  # stored as [all left halves | all right halves] of the rows
        return [
            ShardedTensor.from_rank_offsets(key, h, (0, tp_rank, tp), (1, k, 2), replica_id=replica_id)
            for k, h in enumerate(halves)
        ]

    return {
        "tp_split": make_tp_sharded_tensor_for_checkpoint(
            part("tp_split", slice(tp_rank * rows, (tp_rank + 1) * rows)), "tp_split"
        ),
        "grid": ShardedTensor.from_rank_offsets(
            "grid",
            part(
                "grid",
                (slice(tp_rank * rows, (tp_rank + 1) * rows), slice(dp_rank * cols, (dp_rank + 1) * cols)),
            ),
            (0, tp_rank, tp),
            (1, dp_rank, dp),
        ),
        "nested": {
            "replicated": make_sharded_tensor_for_checkpoint(part("replicated", slice(None)), "replicated")
        },
        "layers": [
            make_sharded_tensor_for_checkpoint(
                layers[layer].clone() if fill else torch.zeros_like(layers[layer]),
                "layers.weight",
                prepend_offsets=((0, layer, 2 * tp),),
                replica_id=(0, 0, dp_rank),
            )
            for layer in (tp_rank, tp_rank + tp)
        ],
        "factory": ShardedTensorFactory(
            "factory", factory_data, build, lambda halves: torch.cat(halves, 1), replica_id=(0, 0, dp_rank)
        ),
        "rng": ShardedObject(
            "rng", {"tp_rank": tp_rank} if fill else None, (tp,), (tp_rank,), replica_id=(0, dp_rank)
        ),
        "local": LocalNonpersistentObject(f"local {tp_rank}"),
        "iteration": 7,
        "common": {"lr": 0.5, "names": ["a", "b"]},
    }


def _check_loaded(loaded: dict, tp_rank: int, tp: int, dp_rank: int, dp: int) -> None:
    rows, cols = ROWS // tp, COLS // dp
    r = slice(tp_rank * rows, (tp_rank + 1) * rows)
    assert torch.equal(loaded["tp_split"], _global("tp_split")[r])
    assert torch.equal(loaded["grid"], _global("grid")[r, dp_rank * cols : (dp_rank + 1) * cols])
    assert torch.equal(loaded["nested"]["replicated"], _global("replicated"))
    assert torch.equal(loaded["factory"], _global("factory")[r])
    assert loaded["local"] == f"local {tp_rank}"
    assert (loaded["iteration"], loaded["common"]) == (7, {"lr": 0.5, "names": ["a", "b"]})


def _saved_grids_request(layout: tuple[int, int, int, int]) -> dict:
    """The request of ``_state_dict`` at ``layout``, but for the stacked layers and the objects,
    whose grids cannot change: this rank asks for layer ``rank`` of the 4 saved, and objects
    shards ``rank % 2`` of the 2 saved (ranks 0 and 1 as main replicas)."""
    request = _state_dict(*layout, fill=False)
    rank = dist.get_rank()
    request["layers"] = [
        ShardedTensor.from_rank_offsets(
            "layers.weight",
            torch.zeros(ROWS * COLS // 4, dtype=torch.float64),
            (0, rank, 4),
            prepend_axis_num=1,
        )
    ]
    request["rng"] = ShardedObject("rng", None, (2,), (rank % 2,), replica_id=rank // 2)
    return request


def _layout(tp: int) -> tuple[int, int, int, int]:
    from megatron_ext import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    return (
        ps.get_tensor_model_parallel_rank(),
        tp,
        ps.get_data_parallel_rank(),
        ps.get_data_parallel_world_size(),
    )


def _refusals(path: str) -> dict[str, str]:
    """Every refusal, caught; the messages are compared across ranks by the caller."""
    from megatron_ext import dist_checkpointing as dc

    tp_rank, tp, dp_rank, dp = _layout(2)
    out = {}
    twice = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, tp_rank, tp))
    }  # dp replicas all main
    gap = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, tp_rank, 2 * tp), replica_id=dp_rank)
    }
    for name, sd in (("twice", twice), ("gap", gap)):
        with pytest.raises(CheckpointingException, match="invalid sharding") as e:
            dc.save(sd, os.path.join(path, name))
        out[name] = str(e.value)
    shape = _state_dict(tp_rank, tp, dp_rank, dp, fill=False)
    shape["tp_split"] = ShardedTensor.from_rank_offsets(
        "tp_split", torch.zeros(3, COLS, dtype=torch.float64), (0, tp_rank, tp), replica_id=dp_rank
    )
    with pytest.raises(CheckpointingException, match=r"Global shape mismatch .* key tp_split") as e:
        dc.load(shape, os.path.join(path, "saved"))
    out["shape"] = str(e.value)
    missing = {
        "nope": ShardedTensor.from_rank_offsets("nope", torch.zeros(2), (0, tp_rank, tp), replica_id=dp_rank)
    }
    with pytest.raises(CheckpointingException, match="tensor nope is not in the checkpoint") as e:
        dc.load(missing, os.path.join(path, "saved"))
    out["missing"] = str(e.value)
    # only rank 0 asks for a key the checkpoint lacks: every rank raises, none waits for the others
    request = _state_dict(tp_rank, tp, dp_rank, dp, fill=False)
    if dist.get_rank() == 0:
        request["extra"] = ShardedTensor.from_rank_offsets("extra", torch.zeros(2))
    unexpected = r"requested keys not in the checkpoint: \['extra'\]"
    with pytest.raises(CheckpointingException, match=unexpected) as e:
        dc.load(request, os.path.join(path, "saved"), strict="raise_unexpected")
    out["unexpected"] = str(e.value)
    with pytest.raises(CheckpointingException, match="is not a distributed checkpoint"):
        dc.load({}, path)
    return out


def _save_and_reshard_worker(path: str) -> dict[str, str]:
    from megatron_ext import dist_checkpointing as dc

    saved = os.path.join(path, "saved")
    dc.save(_state_dict(*_layout(2)), saved)  # tp 2 x dp 2
    with open(os.path.join(saved, "metadata.json")) as f:
        assert json.load(f) == {
            "sharded_backend": "torch_dist",
            "sharded_backend_version": 1,
            "common_backend": "torch",
            "common_backend_version": 1,
        }
    assert dc.load_common_state_dict(saved) == {"iteration": 7, "common": {"lr": 0.5, "names": ["a", "b"]}}
    stored = dc.load_tensors_metadata(saved)
    assert {k: v.global_shape for k, v in stored.items()} == {
        "tp_split": (ROWS, COLS),
        "grid": (ROWS, COLS),
        "replicated": (ROWS, COLS),
        "layers.weight": (4, ROWS * COLS // 4),
        "factory": (ROWS, COLS),
    }
    plain = dc.load_plain_tensors(saved)
    assert torch.equal(plain["factory"], _global("factory")) and torch.equal(plain["grid"], _global("grid"))
    assert torch.equal(plain["layers.weight"], _global("layers").reshape(4, -1))

    for tp in (4, 1):  # tp 4 x dp 1 and tp 1 x dp 4
        layout = _layout(tp)
        loaded = dc.load(_saved_grids_request(layout), saved)
        _check_loaded(loaded, *layout)
        assert torch.equal(loaded["layers"][0], _global("layers").reshape(4, -1)[dist.get_rank()])
        assert loaded["rng"] == {"tp_rank": dist.get_rank() % 2}

    layout = _layout(2)  # the saved layout: everything as saved
    loaded = dc.load(_state_dict(*layout, fill=False), saved)
    _check_loaded(loaded, *layout)
    layers = _global("layers").reshape(4, -1)
    assert torch.equal(loaded["layers"][0], layers[layout[0]]) and torch.equal(
        loaded["layers"][1], layers[layout[0] + 2]
    )
    assert loaded["rng"] == {"tp_rank": layout[0]}
    missing, unexpected = dc.load(
        {
            "tp_split": _state_dict(*layout, fill=False)["tp_split"],
            "x": ShardedTensor.from_rank_offsets("x", torch.zeros(1)),
        },
        saved,
        validate_access_integrity=False,
        strict="return_all",
    )[1:]
    assert (missing, unexpected) == ({"grid", "replicated", "layers.weight", "factory", "rng"}, {"x"})
    return _refusals(path)


@pytest.mark.slow
def test_save_reshard_and_refusals(tmp_path):
    refusals = run_distributed(4, _save_and_reshard_worker, str(tmp_path))
    assert all(r == refusals[0] for r in refusals)  # every rank raised the same error
    assert refusals[0]["twice"].endswith(
        "invalid sharding: w: of its 2 chunks (grid (2,)), 0 have no main replica and 2 have several"
    )
    assert refusals[0]["gap"].endswith(
        "invalid sharding: w: of its 4 chunks (grid (4,)), 2 have no main replica and 0 have several"
    )


def _async_worker(path: str) -> None:
    from megatron_ext import dist_checkpointing as dc

    layout = _layout(2)
    sd = _state_dict(*layout)
    tp_split = sd["tp_split"].data
    request = dc.save(sd, path, async_sharded_save=True)
    assert isinstance(request, dc.AsyncRequest)
    tp_split.add_(1.0)  # training goes on: the checkpoint holds the values at save()
    request.execute_sync()
    assert os.path.isfile(os.path.join(path, "metadata.json"))
    loaded = dc.load(_state_dict(*layout, fill=False), path)
    _check_loaded(loaded, *layout)


@pytest.mark.slow
def test_async_save(tmp_path):
    run_distributed(4, _async_worker, str(tmp_path / "async"))


VOCAB, SEQ, SEED = 64, 8, 7


def _gpt(tp: int, pp: int = 1, seed: int = SEED):
    from megatron_ext import tensor_parallel
    from megatron_ext.models import GPTModel
    from megatron_ext.transformer import TransformerConfig

    config = TransformerConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers=4,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=32,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float64,
        pipeline_dtype=torch.float64,
        use_cpu_initialization=True,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, init_seed=seed)


def _init(tp: int, pp: int) -> None:
    from megatron_ext import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def _gpt_worker(path: str) -> None:
    """Saves a tp 2 x pp 2 GPT's sharded_state_dict (stacked layers and per-layer keys) and loads
    it into models of other seeds at tp 1 x pp 1 (dp 4), tp 4 and tp 1 x pp 4: every tensor
    equals that of the model built at the loading layout with the saved model's seed."""
    from megatron_ext import dist_checkpointing as dc
    from megatron_ext.training.checkpointing import save_checkpoint
    from megatron_ext.transformer.transformer_layer import megatron_core_name

    _init(1, 1)
    serial = _gpt(1)
    stacked, per_layer = (
        serial.sharded_state_dict(),
        serial.sharded_state_dict(metadata={"singleton_local_shards": True}),
    )
    # The dict's keys: state-dict names, and the linears' empty _extra_state objects.
    extra = {k for k, v in per_layer.items() if isinstance(v, dc.ShardedObject)}
    linears = {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}
    assert {k.rsplit(".", 2)[-2] for k in extra} == linears
    assert len(extra) == 4 * 4 and all(k.endswith("._extra_state") for k in extra)
    assert set(stacked) == set(per_layer) == set(serial.state_dict()) | extra
    # Per-layer keys are the serial model's names as Megatron-core names them.
    assert {v.key for k, v in per_layer.items() if k not in extra} == {
        megatron_core_name(k) for k in serial.state_dict()
    }
    qkv = stacked["decoder.layers.2.self_attention.query_key_value.weight"]
    assert (qkv.key, qkv.global_shape, qkv.global_offset) == (
        "decoder.layers.self_attention.linear_qkv.weight",
        (4, 48, 16),
        (2, 0, 0),
    )
    norm = stacked["decoder.layers.1.post_attention_layernorm.weight"]
    assert (norm.key, norm.global_shape) == ("decoder.layers.mlp.linear_fc1.layer_norm_weight", (4, 16))
    fc1 = per_layer["decoder.layers.3.mlp.dense_h_to_4h.weight"]
    assert isinstance(fc1, dc.ShardedTensorFactory) and fc1.key == "decoder.layers.3.mlp.linear_fc1.weight"
    state = stacked["decoder.layers.0.self_attention.dense._extra_state"]
    assert (state.key, state.global_shape, state.global_offset, state.data) == (
        "decoder.layers.self_attention.linear_proj._extra_state", (4,), (0,), None
    )

    for name, metadata in (("stacked", None), ("per_layer", {"non_homogeneous_layers": True})):
        save_dir = os.path.join(path, name)
        _init(2, 2)
        model = _gpt(2, 2)
        sd = model.sharded_state_dict(metadata=metadata)
        if dist.get_rank() == 3:  # last stage: the tied output weight is the embedding's replica
            tied = sd["output_layer.weight"]
            assert (tied.key, tied.replica_id) == ("embedding.word_embeddings.weight", (1, 0, 0))
        dc.save(sd, save_dir)
        if not metadata:  # save_checkpoint stores these very tensors (and its optimizer, rng state)
            save_checkpoint(os.path.join(path, "layout_free"), 1, model)
            plain = dc.load_plain_tensors(save_dir)
            if dist.get_rank() == 0:
                from megatron_ext.training.convert import to_torch

                whole = to_torch(
                    os.path.join(path, "layout_free", "iter_0000001"), os.path.join(path, "whole.pt")
                )["model"]
                assert sorted(plain) == sorted(whole)
                assert all(torch.equal(plain[k], whole[k]) for k in plain)
        for tp, pp in ((1, 1), (4, 1), (1, 4)):
            _init(tp, pp)
            expected = _gpt(tp, pp).state_dict()
            model = _gpt(tp, pp, seed=SEED + 1)
            assert not all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
            loaded = dc.load(model.sharded_state_dict(metadata=metadata), save_dir)
            model.load_state_dict(loaded)
            for k, v in model.state_dict().items():
                assert torch.equal(v, expected[k]), (name, tp, pp, k)


@pytest.mark.slow
def test_gpt_sharded_state_dict_reshards(tmp_path):
    run_distributed(4, _gpt_worker, str(tmp_path))


def _megatron_state_dict(mapping, tp_rank: int, tp: int, dp_rank: int, dp: int, fill: bool = True) -> dict:
    """A sharded state dict built with the given module's ShardedTensor / ShardedObject (Megatron-
    core's or ours): a tensor split over TP, one over TP x DP, a replicated one, an object per TP
    rank, a common value."""
    rows, cols = ROWS // tp, COLS // dp
    r, c = slice(tp_rank * rows, (tp_rank + 1) * rows), slice(dp_rank * cols, (dp_rank + 1) * cols)

    def part(name: str, index) -> torch.Tensor:
        t = _global(name)[index].clone()
        return t if fill else torch.zeros_like(t)

    return {
        "tp_split": mapping.ShardedTensor.from_rank_offsets(
            "tp_split", part("tp_split", r), (0, tp_rank, tp), replica_id=(0, 0, dp_rank)
        ),
        "grid": mapping.ShardedTensor.from_rank_offsets(
            "grid", part("grid", (r, c)), (0, tp_rank, tp), (1, dp_rank, dp)
        ),
        "replicated": mapping.ShardedTensor.from_rank_offsets(
            "replicated", part("replicated", slice(None)), replica_id=(0, tp_rank, dp_rank)
        ),
        "iteration": 7,
    }


def _stacked_layers(mapping, tp_rank: int, tp: int, dp_rank: int, fill: bool) -> list:
    """Layers stacked along a prepended axis, as Megatron-core's GPTModel saves them by default:
    4 layers, layer i on TP rank i % tp (as a pipeline stage holds some of the layers)."""
    layers = _global("layers").reshape(4, -1)
    return [
        mapping.ShardedTensor.from_rank_offsets(
            "layers.weight",
            layers[i].clone() if fill else torch.zeros_like(layers[i]),
            (0, i, 4),
            replica_id=(0, 0, dp_rank),
            prepend_axis_num=1,
        )
        for i in range(tp_rank, 4, tp)
    ]


def megatron_core_save_on_cpu() -> None:
    """Lets Megatron-core 0.16's torch_dist save run in a CPU-only rank of run_distributed."""
    # Megatron-core's torch_dist save needs CUDA in two calls on CPU tensors: it stages them
    # through FileSystemWriterAsync.preload_tensors, which ends with torch.cuda.synchronize(),
    # and save_state_dict_async_finalize broadcasts its failure flag as a tensor on
    # torch.cuda.current_device(). Without a GPU: no synchronisation, the flag on the CPU.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    # Its writer also starts processes (a multiprocessing Manager, forked writers), which a
    # daemonic process may not: run_distributed's ranks are daemonic so they die with the test.
    multiprocessing.current_process()._config["daemon"] = False
    # Those forked writers log their memory through psutil; without psutil installed they die
    # before signalling the parent, which then waits forever.
    try:
        import psutil  # noqa: F401
    except ImportError:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        filesystem_async._process_memory = lambda: 0


def _interop_worker(path: str) -> None:
    """Megatron-core 0.16's save writes at tp 2 x dp 2, megatron_ext loads at tp 4 and tp 1; and
    megatron_ext's save at tp 2 x dp 2 loads in Megatron-core at tp 4 and tp 1."""
    import megatron.core.dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import mapping as mcore_mapping

    from megatron_ext import dist_checkpointing as dc
    from megatron_ext.dist_checkpointing import mapping as ext_mapping

    megatron_core_save_on_cpu()

    def check(loaded: dict, tp_rank: int, tp: int, dp_rank: int, dp: int, objects: bool) -> None:
        rows, cols = ROWS // tp, COLS // dp
        r = slice(tp_rank * rows, (tp_rank + 1) * rows)
        assert torch.equal(loaded["tp_split"], _global("tp_split")[r])
        assert torch.equal(loaded["grid"], _global("grid")[r, dp_rank * cols : (dp_rank + 1) * cols])
        assert torch.equal(loaded["replicated"], _global("replicated")) and loaded["iteration"] == 7
        if objects:
            assert loaded["rng"] == {"saved_by": dist.get_rank() % 2}

    for writer, reader in ((mdc, dc), (dc, mdc)):
        save_dir = os.path.join(path, writer.__name__)
        layout = _layout(2)
        write_mapping = mcore_mapping if writer is mdc else ext_mapping
        read_mapping = ext_mapping if writer is mdc else mcore_mapping
        sd = _megatron_state_dict(write_mapping, *layout)
        sd["layers"] = _stacked_layers(write_mapping, layout[0], layout[1], layout[2], fill=True)
        sd["rng"] = write_mapping.ShardedObject(
            "rng", {"saved_by": layout[0]}, (2,), (layout[0],), replica_id=(0, layout[2])
        )
        if dist.get_rank() == 0:
            os.makedirs(save_dir)  # Megatron-core's save expects the directory
        dist.barrier()
        writer.save(sd, save_dir)
        for tp in (4, 1):
            layout = _layout(tp)
            request = _megatron_state_dict(read_mapping, *layout, fill=False)
            rank = dist.get_rank()
            request["rng"] = read_mapping.ShardedObject("rng", None, (2,), (rank % 2,), replica_id=rank // 2)
            request["layers"] = _stacked_layers(read_mapping, layout[0], layout[1], layout[2], fill=False)
            loaded = reader.load(request, save_dir)
            check(loaded, *layout, objects=True)
            layers = _global("layers").reshape(4, -1)
            assert all(
                torch.equal(t, layers[i])
                for t, i in zip(loaded["layers"], range(layout[0], 4, tp), strict=True)
            )


@pytest.mark.slow
def test_checkpoints_move_between_megatron_core_and_megatron_ext(tmp_path):
    pytest.importorskip("megatron.core")
    run_distributed(4, _interop_worker, str(tmp_path), timeout=600)
