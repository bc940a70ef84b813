"""Whole-model checkpoints move by key between Megatron-core 0.16.1's GPTModel (its local layer
spec, on Megatron-core's own parallel_state) and megatron_ext's GPTModel, at other (tp, pp)
layouts, in float64: a GPT (LayerNorm, GeLU, learned positions, tied output layer) and a
Llama-style model (RMSNorm, SwiGLU, rope, 2 query groups for 4 heads, no linear biases, an output
layer of its own).

At tp 2 x pp 2 both models' ``sharded_state_dict()`` name the same global tensors and objects,
with the same shapes, offsets and replicas (stacked layers, per-layer keys, and per-layer keys with
singleton local shards). Megatron-core's
checkpoint saved there by its own ``dist_checkpointing.save`` loads into megatron_ext's model at
tp 1 and tp 4, whose logits equal those of Megatron-core's model that loaded it at tp 1;
megatron_ext's training checkpoint (``save_checkpoint``) loads into Megatron-core's model at tp 1
by Megatron-core's ``dist_checkpointing.load``, whose logits equal those of megatron_ext's serial
model with the saved weights. Skipped without megatron-core."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from benchmarks.megatron_core_gpt import Run, build_model, cpu_patches, transformer_config  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.test_dist_checkpointing_api import megatron_core_save_on_cpu  # noqa: E402

pytestmark = pytest.mark.slow  # 4 ranks saving and loading 2 models with both libraries

SEED = 1234
ARCHS = ("gpt", "llama")
METADATA = (None, {"non_homogeneous_layers": True}, {"singleton_local_shards": True})


def _megatron_core_model(run: Run, seed: int) -> torch.nn.Module:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(run.tp, run.pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float64)  # the local spec's norms take the default dtype
    return build_model(run, transformer_config(run))[0]


def _megatron_ext_model(run: Run, seed: int) -> torch.nn.Module:
    from megatron_ext import parallel_state as ps
    from megatron_ext import tensor_parallel
    from megatron_ext.models import GPTModel

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=run.tp, pipeline_model_parallel_size=run.pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return GPTModel(
        transformer_config(run, "megatron_ext"), run.vocab, run.seq,
        share_embeddings_and_output_weights=run.arch == "gpt",
        position_embedding_type="rope" if run.arch == "llama" else "learned_absolute",
        parallel_output=False, init_seed=seed,
    )


def _entries(sharded_state_dict: dict, library: str) -> list[tuple]:
    """(type, key, global shape, global offset, replica id) of every tensor and object, the
    factories built by ``library``'s dist_checkpointing."""
    mapping = importlib.import_module(f"{library}.dist_checkpointing.mapping")
    dict_utils = importlib.import_module(f"{library}.dist_checkpointing.dict_utils")
    mapping.apply_factories(sharded_state_dict)
    return sorted(
        (type(sh).__name__, sh.key, tuple(sh.global_shape), tuple(sh.global_offset), sh.replica_id)
        for sh in dict_utils.nested_values(sharded_state_dict)
    )


def _logits(model: torch.nn.Module, run: Run) -> torch.Tensor:
    """The logits [b, s, vocab] of a one-stage model on a fixed batch."""
    tokens = torch.randint(0, run.vocab, (2, run.seq), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(run.seq).expand(2, run.seq)
    model.eval()
    with torch.no_grad():
        if type(model).__module__.startswith("megatron.core"):
            causal = torch.ones(run.seq, run.seq, dtype=torch.bool).triu(1).view(1, 1, run.seq, run.seq)
            return model(tokens, positions, causal)
        return model(tokens, positions)


def _worker(path: str) -> dict:
    """Per architecture: the sharded-state-dict entries of both libraries' models at tp 2 x pp 2,
    and the logits after each load (numpy arrays, compared by the test)."""
    import megatron.core.dist_checkpointing as mdc

    from megatron_ext import dist_checkpointing as dc
    from megatron_ext.training.checkpointing import save_checkpoint

    cpu_patches(full=False)
    megatron_core_save_on_cpu()
    out = {}
    for arch in ARCHS:
        saved = Run(arch=arch, tp=2, pp=2)
        mcore_dir, ext_dir = (os.path.join(path, arch, name) for name in ("megatron_core", "megatron_ext"))
        if dist.get_rank() == 0:
            os.makedirs(mcore_dir)
        dist.barrier()
        mcore = _megatron_core_model(saved, SEED)
        for i, metadata in enumerate(METADATA):
            sd = mcore.sharded_state_dict(metadata=metadata)
            out[arch, "entries", i, "megatron_core"] = _entries(sd, "megatron.core")
        mdc.save(mcore.sharded_state_dict(), mcore_dir)
        ext = _megatron_ext_model(saved, SEED + 1)
        for i, metadata in enumerate(METADATA):
            sd = ext.sharded_state_dict(metadata=metadata)
            out[arch, "entries", i, "megatron_ext"] = _entries(sd, "megatron_ext")
        save_checkpoint(ext_dir, 1, ext)  # a training checkpoint: dc.save of the model's and RNG state

        # Megatron-core's checkpoint, loaded by Megatron-core at tp 1 and by megatron_ext at tp 1 and 4.
        serial = Run(arch=arch)
        model = _megatron_core_model(serial, SEED + 2)
        model.load_state_dict(mdc.load(model.sharded_state_dict(), mcore_dir))
        out[arch, "megatron_core checkpoint", "megatron_core tp1"] = _logits(model, serial).numpy()
        for tp in (1, 4):
            run = Run(arch=arch, tp=tp)
            model = _megatron_ext_model(run, SEED + 3)
            model.load_state_dict(dc.load(model.sharded_state_dict(), mcore_dir))
            out[arch, "megatron_core checkpoint", f"megatron_ext tp{tp}"] = _logits(model, run).numpy()

        # megatron_ext's checkpoint, loaded by Megatron-core at tp 1; its serial model has the
        # saved weights (every layout draws the serial model's).
        out[arch, "megatron_ext checkpoint", "megatron_ext built tp1"] = _logits(
            _megatron_ext_model(serial, SEED + 1), serial
        ).numpy()
        model = _megatron_core_model(serial, SEED + 4)
        model.load_state_dict(mdc.load(model.sharded_state_dict(), os.path.join(ext_dir, "iter_0000001")))
        out[arch, "megatron_ext checkpoint", "megatron_core tp1"] = _logits(model, serial).numpy()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return out


def test_gpt_checkpoints_move_between_megatron_core_and_megatron_ext(tmp_path):
    results = run_distributed(4, _worker, str(tmp_path), timeout=600)
    for rank, out in enumerate(results):
        for arch in ARCHS:
            for i in range(len(METADATA)):
                mcore, ext = out[arch, "entries", i, "megatron_core"], out[arch, "entries", i, "megatron_ext"]
                assert mcore == ext, (rank, arch, METADATA[i], sorted(set(mcore) ^ set(ext), key=repr))
                keys = {entry[1] for entry in ext}
                stage = "decoder.layers." if i == 0 else f"decoder.layers.{2 * (rank // 2)}."
                qkv = f"{stage}self_attention.linear_qkv."
                assert {f"{qkv}weight", f"{qkv}_extra_state"} <= keys
                assert f"{stage}mlp.linear_fc1.layer_norm_weight" in keys
                if arch == "llama" and i == 2:  # the gated fc1's halves as two tensors
                    assert {f"{stage}mlp.linear_fc1.weight_w", f"{stage}mlp.linear_fc1.weight_v"} <= keys
            for checkpoint, reference in (
                ("megatron_core checkpoint", "megatron_core tp1"),
                ("megatron_ext checkpoint", "megatron_ext built tp1"),
            ):
                expected = torch.from_numpy(out[arch, checkpoint, reference])
                loaded = [k for k in out if k[:2] == (arch, checkpoint) and k[2] != reference]
                assert len(loaded) == (2 if checkpoint.startswith("megatron_core") else 1)
                for key in loaded:
                    logits = torch.from_numpy(out[key])
                    assert logits.shape == (2, 16, 64)
                    assert (logits - expected).abs().max().item() <= 1e-12, (rank, key)
