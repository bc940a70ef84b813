"""benchmarks/gpu.py runs only where there is a GPU; its ``--device cpu`` mode runs the same code on
the CPU twins, so the script itself is checked here (its figures are not GPU figures)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_gpu_benchmark_script_on_cpu(tmp_path):
    out = tmp_path / "gpu_bench.json"
    tokens, hidden, vocab = 32, 16, 300
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu",
                    "--without-megatron-core", "--tokens", str(tokens), "--hidden", str(hidden),
                    "--vocab", str(vocab), "--reps", "2", "--json", str(out)],
                   check=True, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    shape = (result["device"], result["tokens"], result["hidden"], result["vocab"])
    assert shape == ("cpu", tokens, hidden, vocab)
    assert result["megatron_core"] is None and result["gemm"] is None  # no mixed-dtype GEMM on CPU
    rows = {r["op"]: r for r in result["rows"]}
    assert list(rows) == ["bias_gelu fwd (tanh)", "bias_gelu bwd (tanh)", "bias_gelu fwd (erf)",
                          "bias_dropout_add fwd (p 0.1)", "bias_dropout_add fwd+bwd (p 0.1)",
                          "cross_entropy fwd+bwd", "rms_norm fwd", "rms_norm bwd", "rms_norm fwd+bwd",
                          "rotary fwd", "rotary bwd", "rotary fwd+bwd", "swiglu fwd", "swiglu bwd",
                          "swiglu fwd+bwd"]
    assert list(rows["cross_entropy fwd+bwd"]["variants"]) == [
        "megatron_ext",
        "megatron_ext overwrite_logits",
        "DTensor loss_parallel",
    ]
    assert list(rows["bias_gelu fwd (erf)"]["variants"]) == ["megatron_ext", "torch F.gelu(y + b)"]
    bf16 = 2
    assert rows["bias_gelu fwd (tanh)"]["bytes"] == (2 * tokens * 4 * hidden + 4 * hidden) * bf16
    assert rows["cross_entropy fwd+bwd"]["bytes"] == 3 * tokens * vocab * bf16
    swiglu_width = 256  # 8 h / 3 rounded up to a multiple of 256
    assert rows["swiglu fwd+bwd"]["bytes"] == 8 * tokens * swiglu_width * bf16
    assert rows["rotary fwd+bwd"]["bytes"] == 4 * tokens * hidden * bf16
    assert list(rows["swiglu fwd+bwd"]["variants"]) == ["megatron_ext", "torch F.silu(gate) * up"]
    assert list(rows["rotary bwd"]["variants"]) == ["megatron_ext"]
    for r in rows.values():
        for s in r["variants"].values():
            assert 0 < s["min_ms"] <= s["median_ms"] <= s["max_ms"]
            assert abs(s["gbps"] - r["bytes"] / s["median_ms"] / 1e6) < 1e-9 * s["gbps"]
            assert s["share_of_copy_bw"] is None and s["peak_extra_mib"] is None
        diffs = [s["max_abs_diff"] for s in r["variants"].values()]
        if "dropout" in r["op"]:
            assert diffs == [None] * len(diffs)  # different random masks: not compared
        else:  # the first variant is the reference; the others agree to bf16 rounding
            assert diffs[0] == 0.0 and all(d < 0.1 for d in diffs), (r["op"], diffs)


def _run_script(name: str, *argv: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *argv], timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, f"{name} exited with {done.returncode}:\n{done.stderr[-4000:]}"


@pytest.mark.slow  # runs the benchmark script end to end
def test_pipeline_bubble_benchmark_script(tmp_path):
    # The measured step cannot beat the simulated one (the model's costs are sleeps), and the
    # simulated steps are the closed forms: 1F1B (m + p - 1) 3 L c, ZB-H1 m 3 L c + (p - 1) L c.
    out = tmp_path / "pipeline_bubble.json"
    m, layers, cost = 7, 2, 2.0
    _run_script("pipeline_bubble.py", "--without-megatron-core", "--microbatches", str(m), "--layers",
                str(layers), "--f", str(cost), "--i", str(cost), "--w", str(cost), "--reps", "1",
                "--json", str(out))
    result = json.loads(out.read_text())
    p = 4
    stage = layers * cost
    assert result["ideal_ms"] == m * 3 * stage
    sim = result["simulated_ms"]
    assert sim["megatron_ext 1f1b"] == (m + p - 1) * 3 * stage
    assert sim["megatron_ext zb-h1"] == m * 3 * stage + (p - 1) * stage
    assert sim["megatron_ext zb-v"] == m * 3 * stage + (p - 1) * stage / 2
    assert list(result["summary"]) == ["megatron_ext 1f1b", "megatron_ext zb-h1", "megatron_ext zb-v"]
    for name, s in result["summary"].items():
        assert s["min_s"] * 1e3 >= sim[name] * 0.99, name


@pytest.mark.slow  # runs the benchmark script end to end
def test_attention_benchmark_script(tmp_path):
    out = tmp_path / "attention.json"
    _run_script("attention.py", "--without-megatron-core", "--seq", "64", "128", "--heads", "2",
                "--head-dim", "8", "--reps", "1", "--json", str(out))
    summary = json.loads(out.read_text())["summary"]
    assert list(summary) == ["64", "128"]
    for rows in summary.values():
        assert list(rows) == ["megatron_ext (sdpa)", "megatron_ext unfused"]
        assert all(0 < r["min_s"] <= r["median_s"] <= r["max_s"] for r in rows.values())


@pytest.mark.slow  # runs the benchmark script end to end
def test_attention_windows_benchmark_script(tmp_path):
    out = tmp_path / "attention_windows.json"
    _run_script("attention_windows.py", "--without-megatron-core", "--seq", "64", "128", "--window", "16",
                "--full-max-seq", "64", "--packed-seq", "96", "--sequences", "3", "--heads", "2",
                "--head-dim", "8", "--reps", "1", "--json", str(out))
    result = json.loads(out.read_text())
    assert list(result["windows"]) == ["64", "128"]
    assert list(result["windows"]["64"]) == [
        "window 16 (megatron_ext)", "full causal (megatron_ext)", "sdpa band mask"
    ]
    assert list(result["windows"]["128"]) == ["window 16 (megatron_ext)"]
    assert sum(result["packed"]["96"]["lengths"]) == 96 and len(result["packed"]["96"]["lengths"]) == 3
    assert list(result["packed"]["96"]["summary"]) == [
        "packed (megatron_ext cu_seqlens)", "padded batch (sdpa causal)"
    ]
    for rows in [*result["windows"].values(), result["packed"]["96"]["summary"]]:
        assert all(0 < r["min_s"] <= r["median_s"] <= r["max_s"] for r in rows.values())


@pytest.mark.slow  # runs the benchmark script end to end
def test_moe_benchmark_script(tmp_path):
    pytest.importorskip("megatron.core")
    out = tmp_path / "moe.json"
    _run_script("moe.py", "--quick", "--json", str(out))
    result = json.loads(out.read_text())
    assert list(result["summary"]) == ["swiglu", "gpt-oss", "group-limited"]
    for variant, per_ep in result["summary"].items():
        rows = per_ep["2"]
        assert list(rows) == [
            "megatron_ext SequentialMLP allgather", "megatron_ext SequentialMLP alltoall",
            "megatron_ext GroupedMLP alltoall", "Megatron-core allgather", "Megatron-core alltoall",
        ], variant
        assert all(0 < r["min_s"] <= r["median_s"] <= r["max_s"] for r in rows.values())
        # The variants start from the same weights and inputs: the same output.
        assert max(result["max_output_difference"][variant]["2"].values()) < 1e-5, variant


@pytest.mark.slow  # runs the benchmark script end to end
def test_deepseek_layer_benchmark_script(tmp_path):
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    out = tmp_path / "deepseek_layer.json"
    _run_script("deepseek_layer.py", "--quick", "--json", str(out))
    result = json.loads(out.read_text())
    assert list(result["summary"]) == ["1", "2"]
    assert list(result["summary"]["1"]) == ["megatron_ext", "Megatron-core", "transformers"]
    assert list(result["summary"]["2"]) == ["megatron_ext", "Megatron-core"]  # transformers at ep 1 only
    for rows in result["summary"].values():
        assert all(0 < r["min_s"] <= r["median_s"] <= r["max_s"] for r in rows.values())
    # The layers start from the same weights and inputs: the same output and input gradient to
    # float32 rounding: of the values themselves (1e-5 of the largest, some 80 ulps, the residual path
    # included) plus 1e-4 of what the layer adds (its update; a wrong layer differs by that order).
    for ep, diffs in result["max_difference"].items():
        assert diffs["megatron_ext"]["output"] == diffs["megatron_ext"]["input_grad"] == 0.0
        for name, d in diffs.items():
            assert d["update_max_abs"] > 0 and d["grad_update_max_abs"] > 0, (ep, name, d)
            assert d["output"] <= 1e-4 * d["update_max_abs"] + 1e-5 * d["output_max_abs"], (ep, name, d)
            assert d["input_grad"] <= 1e-4 * d["grad_update_max_abs"] + 1e-5 * d["input_grad_max_abs"], (
                ep, name, d)


@pytest.mark.slow  # runs the benchmark script end to end
def test_llama_kernels_benchmark_script(tmp_path):
    out = tmp_path / "llama_kernels.json"
    _run_script("llama_kernels.py", "--without-megatron-core", "--dtypes", "float32", "bfloat16",
                "--seq", "8", "--batch", "2", "--hidden", "16", "--heads", "2", "--head-dim", "8",
                "--tokens", "8", "--ffn", "12", "--reps", "1", "--json", str(out))
    summary = json.loads(out.read_text())["summary"]
    shapes = (("rms_norm", [8, 2, 16]), ("rope", [8, 2, 2, 8]), ("rope interleaved", [8, 2, 2, 8]),
              ("swiglu", [8, 24]))
    assert list(summary) == [f"{op} {dtype} {shape}" for dtype in ("float32", "bfloat16")
                             for op, shape in shapes]
    variants = {op.split(" float32")[0]: list(row["results"])
                for op, row in summary.items() if "float32" in op}
    assert variants == {"rms_norm": ["megatron_ext fused_rms_norm", "torch.nn.RMSNorm"],
                        "rope": ["megatron_ext fused_apply_rotary_pos_emb"],
                        "rope interleaved": ["megatron_ext fused_apply_rotary_pos_emb"],
                        "swiglu": ["megatron_ext swiglu", "unfused F.silu(gate) * up"]}
    for op, row in summary.items():
        assert all(0 < r["min_s"] <= r["median_s"] <= r["max_s"] for r in row["results"].values())
        # float32: a few float32 roundings; bfloat16: the unfused chains round every op to bfloat16.
        bound = 1e-5 if "float32" in op else 2e-2
        diffs = row["relative_diff_vs_first"]
        assert all(d <= bound for d in diffs.values()), (op, diffs)


@pytest.mark.slow  # runs the benchmark script end to end
def test_mamba_scan_benchmark_script(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "mamba_scan.json"
    _run_script("mamba_scan.py", "--lengths", "40", "--heads", "2", "--headdim", "4", "--dstate", "4",
                "--chunk", "16", "--reps", "1", "--json", str(out))
    summary = json.loads(out.read_text())["summary"]
    assert list(summary) == ["L=40"]
    row = summary["L=40"]
    assert list(row["results"]) == ["megatron_ext", "transformers torch path"]
    assert all(0 < r["min_s"] <= r["median_s"] <= r["max_s"] for r in row["results"].values())
    # Both float32 sums of about chunk + N rounded terms per value.
    assert row["relative_diff_vs_first"]["megatron_ext"] == 0.0
    assert row["relative_diff_vs_first"]["transformers torch path"] <= 1e-5


@pytest.mark.slow  # runs the benchmark script end to end
def test_train_step_benchmark_script(tmp_path):
    """The train-step benchmark at a tiny size: every case and variant reported, and megatron_ext's
    models (plain and fused) train to Megatron-core's losses from the same weights."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("the train-step benchmark compares against megatron-core, which is not installed")
    out = tmp_path / "train_step.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "train_step.py"),
            "--hidden",
            "32",
            "--heads",
            "8",
            "--seq",
            "16",
            "--vocab",
            "64",
            "--layers",
            "2",
            "--reps",
            "1",
            "--json",
            str(out),
        ],
        check=True,
        timeout=900,
        capture_output=True,
    )
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["gpt tp2pp2", "gpt dp4", "llama tp2pp2", "llama dp4"]
    for case, variants in results.items():
        assert list(variants) == ["megatron-core", "megatron_ext", "megatron_ext fused"], case
        for name, v in variants.items():
            assert len(v["losses"]) == 3 and v["losses"][-1] < v["losses"][0], (case, name, v["losses"])
            reference = variants["megatron-core"]["losses"]
            assert v["max_loss_difference"] <= 1e-5, (case, name, v["losses"], reference)


@pytest.mark.slow  # runs the benchmark script end to end
def test_fsdp_benchmark_script(tmp_path):
    """benchmarks/fsdp.py at a tiny size: every variant reported, all training alike from the same
    weights on the same batch, and each strategy holding what it shards between steps."""
    out = tmp_path / "fsdp.json"
    layers, hidden, vocab, seq = 2, 32, 64, 16
    _run_script("fsdp.py", "--layers", str(layers), "--hidden", str(hidden), "--heads", "4", "--seq",
                str(seq), "--vocab", str(vocab), "--reps", "1", "--json", str(out))
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert list(summary) == ["distopt", "fsdp optim", "fsdp optim_grads", "fsdp optim_grads_params",
                             "fsdp ogp no reshard", "torch fully_shard"]
    # GPT: per layer QKV, projection and the two MLP matrices (12 h^2) with their biases (9 h) and two
    # LayerNorms (4 h); word and position embeddings (the output layer tied), the final LayerNorm.
    per_layer = 12 * hidden * hidden + 13 * hidden
    assert result["parameters"] == layers * per_layer + (vocab + seq) * hidden + 2 * hidden
    reference = summary["distopt"]["losses"]
    for name, s in summary.items():
        assert 0 < s["min_s"] <= s["median_s"] <= s["max_s"], name
        assert len(s["losses"]) == 2 and s["losses"][1] < s["losses"][0], (name, s["losses"])
        # Two float32 steps of the same computation in another order: rounding (some ulps of the loss).
        assert s["max_loss_difference"] <= 1e-5 * reference[0], (name, s["losses"], reference)
    # State per rank in units of the float32 parameters: what a strategy keeps whole (parameters,
    # gradients) counts 1, each shard (its parameters, gradients, Adam's two moments) 1/4 at dp 4;
    # FSDP2 frees its sharded gradients at zero_grad. Above that only padding (every parameter
    # starts at a multiple of 64 elements: under a tenth at this size) and the step's small tensors.
    state = {name: s["state_mib"] * 2**20 / (4 * result["parameters"]) for name, s in summary.items()}
    expected = {"distopt": 2.5, "fsdp optim": 2.5, "fsdp optim_grads": 1.75, "fsdp optim_grads_params": 1.0,
                "fsdp ogp no reshard": 1.0, "torch fully_shard": 0.75}
    for name, ratio in expected.items():
        assert ratio <= state[name] <= ratio * 1.25, (name, state[name], ratio)


def test_gpu_step_time_categories():
    """The profile's categories of kernel names as an H200 profile of a step names them."""
    from benchmarks.gpu_step import time_category

    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "gemm",
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128": "attention",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float, float>": "attention",
        "void at::native::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor<float, 4>>": "optimizer",
        "void megatron_ext::(anonymous namespace)::rotary_pack_kernel<c10::BFloat16, float>": "rotary",
        "void megatron_ext::(anonymous namespace)::swiglu_backward_kernel<c10::BFloat16, float>": "swiglu",
        "void megatron_ext::(anonymous namespace)::rms_norm_weight_grad_kernel<c10::BFloat16, float>": "norm",
        "void megatron_ext::(anonymous namespace)::row_stats_kernel<c10::BFloat16, float>": "cross-entropy",
        "void megatron_ext::(anonymous namespace)::grad_kernel<c10::BFloat16, float>": "cross-entropy",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<double, at::native::NormTwoOps>>":
            "reductions",
        "void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>": "copies and fills",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>":
            "copies and fills",
        "triton_poi_fused_add_mul_0": "other",
        "aten::mm": "gemm",
        "megatron_ext::rotary_pos_emb_forward": "rotary",
    }
    assert {name: time_category(name) for name in names} == names


@pytest.mark.slow  # runs the benchmark script end to end
def test_gpu_step_benchmark_script_on_cpu(tmp_path):
    """benchmarks/gpu_step.py at its tiny CPU size: every figure reported and consistent; with
    megatron-core installed both stacks train from the same weights to the same losses (bf16)."""
    import importlib.util

    with_core = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")
    out = tmp_path / "gpu_step.json"
    _run_script("gpu_step.py", "--device", "cpu", "--reps", "2", "--recompute", "none", "selective-all",
                "full", "--recompute-reps", "1", "--peak-tflops", "1.0", "--json", str(out),
                *([] if with_core else ["--without-megatron-core"]))
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["peak_tflops"] == 1.0 and list(result["shapes"]) == ["tiny"]
    tiny = result["shapes"]["tiny"]
    stacks = tiny["stacks"]
    assert list(stacks) == (["megatron-core", "megatron_ext"] if with_core else ["megatron_ext"])
    layers, hidden, seq, vocab, ffn, groups, heads = 2, 64, 32, 128, 128, 2, 4
    head_dim = hidden // heads
    per_layer = (hidden * (heads + 2 * groups) * head_dim + hidden * hidden + 3 * hidden * ffn + 2 * hidden)
    params = layers * per_layer + hidden + vocab * hidden  # final norm, output layer (no input embedding)
    assert tiny["tokens_per_step"] == 2 * 4 * seq
    for name, s in stacks.items():
        assert s["flops_per_token"] == 6 * params + 12 * layers * hidden * seq, name
        t = s["step_s"]
        assert 0 < t["min"] <= t["median"] <= t["max"]
        assert s["tokens_per_s"] == pytest.approx(tiny["tokens_per_step"] / t["median"])
        assert s["tflops"] == pytest.approx(s["flops_per_token"] * s["tokens_per_s"] / 1e12)
        assert s["mfu"] == pytest.approx(s["tflops"] / 1.0)
        assert len(s["losses"]) == 1 + 1 + 2  # the setup step, the warm-up, 2 repetitions
        # bf16 parameters, float32 gradient buffer and main copies, Adam: 18 bytes a parameter
        # (the input embedding included), plus the step's small tensors.
        total = params + vocab * hidden
        per_param = s["state_gib"] * 2**30 / total
        assert 18 <= per_param < 18 * 1.1, (name, per_param)
    if with_core:
        assert stacks["megatron_ext"]["max_loss_difference"] < 0.05
        assert stacks["megatron-core"]["max_loss_difference"] == 0.0
    for name, prof in tiny["profile"].items():  # the CPU operators' self time by category
        ms = prof["ms_per_step"]
        assert prof["total_ms"] == pytest.approx(sum(ms.values())) and prof["host_waits_per_step"] == 0
        kinds = ["gemm", "optimizer"] + (["rotary", "swiglu", "norm"] if name == "megatron_ext" else [])
        assert all(ms[kind] > 0 for kind in kinds), (name, ms)
    assert list(tiny["profile"]) == list(stacks)
    table = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--markdown", str(out)],
                           check=True, capture_output=True, text=True, timeout=120).stdout.splitlines()
    assert table[0].startswith(f"cpu, torch {result['torch']}") and f"measured {result['date']}" in table[0]
    ext_ms = 1e3 * stacks["megatron_ext"]["step_s"]["median"]
    assert table[-1].startswith(f"| tiny, {tiny['tokens_per_step']} tokens | {ext_ms:.0f} ms (")
    assert len(table) == 5 and table[-1].count("|") == 8
    assert list(tiny["recompute"]) == ["none", "selective-all", "full"]
    assert all(m["step_s"] > 0 and m["peak_extra_gib"] >= 0 for m in tiny["recompute"].values())


@pytest.mark.slow  # runs the benchmark script end to end
def test_datasets_benchmark_script(tmp_path):
    pytest.importorskip("tokenizers")
    out = tmp_path / "datasets.json"
    _run_script("datasets.py", "--without-megatron-core", "--tokens", "300000", "--seq-len", "128",
                "--documents", "60", "--workers", "1", "--reps", "1", "--dir", str(tmp_path / "data"),
                "--json", str(out))
    result = json.loads(out.read_text())
    assert result["corpus"]["tokens"] == 300000 and result["corpus"]["bytes"] >= 2 * 300000
    for phase in ("build_cold", "build_warm"):
        assert list(result[phase]) == ["megatron_ext"]
        s = result[phase]["megatron_ext"]
        assert 0 < s["min_s"] <= s["median_s"] <= s["max_s"]
    pre = result["preprocess"]
    assert list(pre["variants"]) == ["megatron_ext 1 worker"] and pre["tokens"] > 60
    s = pre["variants"]["megatron_ext 1 worker"]
    assert abs(s["tokens_per_s"] - pre["tokens"] / s["median_s"]) < 1e-6 * s["tokens_per_s"]
    assert not (tmp_path / "data").exists()  # the corpora are removed


@pytest.mark.slow  # runs the benchmark script end to end
def test_gated_delta_rule_benchmark_script(tmp_path):
    out = tmp_path / "gated_delta_rule.json"
    _run_script("gated_delta_rule.py", "--lengths", "70", "--heads", "2", "--head-dim", "8", "--reps", "1",
                "--json", str(out))
    summary = json.loads(out.read_text())["summary"]
    assert list(summary) == ["T=70"]
    row = summary["T=70"]
    assert list(row["results"]) == ["megatron_ext chunk_gated_delta_rule",
                                    "transformers torch_chunk_gated_delta_rule"]
    assert all(0 < r["min_s"] <= r["median_s"] <= r["max_s"] for r in row["results"].values())
    # Both float32 computations of the same values (tests/test_gated_delta_rule.py bounds them).
    assert row["relative_diff_vs_last"]["megatron_ext chunk_gated_delta_rule"] < 1e-4
