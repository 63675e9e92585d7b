"""``drafttrain plan``: memory, disk and regeneration from config files alone, checked against measured runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import small_recipe

from drafttrain import DrafttrainError
from drafttrain.commands import main
from drafttrain.config import load_recipe
from drafttrain.training.cluster import Cluster
from drafttrain.training.footprint import _MetaScalars
from drafttrain.training.plan import check_fits, plan
from drafttrain.training.sizes import GIB

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "recipes" / "configs"
EAGLE3 = {"kind": "eagle3", "ttt_steps": 7}
# the engine recipes' target run in the training processes instead (online, no capture servers)
ONLINE = ["training.hidden_states=online", "capture.engine=hf", "capture.urls=[]", "capture.python=null"]
# Llama-3.3-70B: embeddings and lm_head of 128256 x 8192 and the final norm, in bf16
LLAMA70B_HEAD = (2 * 128256 * 8192 + 8192) * 2


def drafttrain(capsys, *args: str) -> str:
    """``drafttrain ARGS`` in this process (no second torch import): its standard output."""
    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr().out


def alone(*args: str) -> str:
    """``drafttrain ARGS`` in its own process, as users run it: a plan counts its process's resident memory, and a
    test worker that ran other tests first holds more than a fresh ``drafttrain plan`` does; a training's peak is
    the run's alone."""
    done = subprocess.run([sys.executable, "-m", "drafttrain", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def measured_recipe(tmp_path: Path, **training) -> Path:
    """The real target, rows cut to 128 tokens (most Alpaca answers are longer), 4 per batch, an EAGLE-3 head with
    7 unrolled steps over the full 49k vocabulary: activations are a large share of the peak."""
    path = small_recipe(tmp_path, EAGLE3, training={"batch_size": 4, "log_every": 1, "save_every": 1000,
                                                    **training},
                        eval={"every_checkpoint": False})
    recipe = yaml.safe_load(path.read_text())
    recipe["data"].update(max_length=128, num_samples=24, validation_fraction=0.1)
    recipe["data"]["sources"][0]["max_samples"] = 24
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow
def test_the_plan_matches_a_measured_cpu_run_within_20_percent(tmp_path, capsys):
    recipe = measured_recipe(tmp_path)
    drafttrain(capsys, "prepare", str(recipe), "--no-progress")
    planned = json.loads(alone("plan", str(recipe), "--json"))
    assert planned["tokens_measured"] and planned["fits"]
    alone("train", str(recipe), "--max-steps", "2")  # step 2 holds the optimizer state beside the activations
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    peak = max(r["peak_memory_mib"] for r in logged if "peak_memory_mib" in r) * 2**20
    assert planned["memory"]["activations saved for backward"] > 0.25 * planned["total"]  # not just weights
    assert abs(planned["total"] - peak) / peak < 0.20, (planned["memory"], peak / 2**20)


@pytest.mark.slow
def test_the_planned_offline_cache_matches_the_written_one(tmp_path, capsys):
    recipe = measured_recipe(tmp_path, hidden_states="offline")
    drafttrain(capsys, "prepare", str(recipe), "--no-progress")
    planned = json.loads(drafttrain(capsys, "plan", str(recipe), "--json"))
    written = sum(f.stat().st_size for f in (tmp_path / "run" / "features").iterdir())
    assert abs(planned["cache_bytes"] - written) / written < 0.20, (planned["cache_bytes"], written)
    # 4 taps (EAGLE-3's three, and the final one its logits come from) of 576 float32 values per token, and the
    # target's argmax (int32)
    assert planned["cache_bytes"] == planned["tokens"] * (4 * 576 * 4 + 4)
    fp8 = plan(load_recipe(recipe, ["training.feature_dtype=float8"]))  # 1 byte a value, a 2-byte scale a token
    assert fp8.cache_bytes == planned["tokens"] * (4 * (576 + 2) + 4) <= planned["tokens"] * (4 * 576 * 1.004 + 4)


@pytest.mark.slow
@pytest.mark.parametrize("recipe, config, nodes, target_bytes", [
    ("eagle3_llama3.1_8b.yaml", "meta-llama--Llama-3.1-8B-Instruct.json", 1, 8.03e9 * 2),  # bf16, whole
    ("medusa2_llama3.1_8b.yaml", "meta-llama--Llama-3.1-8B-Instruct.json", 1, 8.03e9 * 2),
    ("eagle_llama70b.yaml", "meta-llama--Llama-3.3-70B-Instruct.json", 1, LLAMA70B_HEAD),  # capture servers: head
    ("eagle3_gpt_oss_120b.yaml", "openai--gpt-oss-120b.json", 1, 2 * 201088 * 2880 * 2 + 2880 * 2),
    ("dflash_llama3.1_8b.yaml", "meta-llama--Llama-3.1-8B-Instruct.json", 1, 8.03e9 * 2),
    ("dflash_qwen3_8b.yaml", "Qwen--Qwen3-8B.json", 1, 8.19e9 * 2),
    ("mtp_qwen3_next_80b.yaml", "Qwen--Qwen3-Next-80B-A3B-Thinking.json", 1, 79.7e9 * 2 / 8),  # ZeRO-3: a shard
])
def test_the_cluster_recipes_fit_their_clusters(recipe, config, nodes, target_bytes):
    cluster = Cluster(gpus=8, nodes=nodes, gpu_memory=80 * GIB, disk_free=4000 * GIB)  # the 70B cache: 1.8 TiB
    result = plan(load_recipe(REPO / "recipes" / recipe), cluster, config_path=str(CONFIGS / config))
    assert result.fits, result.render()
    weights = next(v for k, v in result.memory.items() if k.startswith("target weights"))
    assert weights == pytest.approx(target_bytes, rel=0.01)
    assert "activations saved for backward" in result.memory


def test_the_70b_target_does_not_fit_one_gpu_whole():
    """What ZeRO-3 is for: the 70B recipe computed online, with the target whole on every GPU (ZeRO-2), does not
    fit; partitioned by ZeRO-3 over 2 x 8 GPUs it does."""
    online = [*ONLINE, "training.deepspeed=recipes/deepspeed/zero2.json"]
    cluster, config = Cluster(gpus=8, nodes=2, gpu_memory=80 * GIB), str(CONFIGS / "meta-llama--Llama-3.3-70B-Instruct.json")
    result = plan(load_recipe(REPO / "recipes" / "eagle_llama70b.yaml", online), cluster, config_path=config)
    assert not result.fits and result.clearly_cannot_fit
    assert result.memory["target weights"] > 130 * GIB
    zero3 = plan(load_recipe(REPO / "recipes" / "eagle_llama70b.yaml", [*ONLINE, "training.deepspeed=recipes/deepspeed/"
                                                                                  "zero3.json"]), cluster, config_path=config)
    assert zero3.fits and zero3.memory["target weights (ZeRO-3 shard)"] == pytest.approx(70.55e9 * 2 / 16, rel=0.01)


def test_zero_stages_split_what_they_shard():
    recipe = load_recipe(REPO / "recipes" / "eagle3_llama3.1_8b.yaml")
    config = str(CONFIGS / "meta-llama--Llama-3.1-8B-Instruct.json")
    one = plan(recipe, Cluster(gpus=1, gpu_memory=80 * GIB), config_path=config).memory
    eight = plan(recipe, Cluster(gpus=8, gpu_memory=80 * GIB), config_path=config).memory
    assert eight["optimizer states (AdamW)"] == pytest.approx(one["optimizer states (AdamW)"] / 8, rel=1e-3)
    assert eight["draft gradients"] == pytest.approx(one["draft gradients"] / 8, rel=1e-3)  # ZeRO-2
    assert eight["draft weights (trainable)"] == one["draft weights (trainable)"]  # whole below ZeRO-3


def test_deepspeed_gradient_buckets_count_at_their_configured_size_on_a_gpu():
    """The H100 check of 2026-11-27 measured 2 GiB above the plan under ZeRO-2: DeepSpeed's two overlap buffers of
    reduce_bucket_size (5e8) bf16 elements, allocated whole however small the draft; ZeRO-3 allocates one."""
    config = str(CONFIGS / "meta-llama--Llama-3.1-8B-Instruct.json")
    cluster = Cluster(gpus=8, gpu_memory=80 * GIB)
    path = REPO / "recipes" / "eagle3_llama3.1_8b.yaml"
    zero2 = plan(load_recipe(path), cluster, config_path=config).memory
    zero3 = plan(load_recipe(path, ["training.deepspeed=recipes/deepspeed/zero3.json"]), cluster,
                 config_path=config).memory
    plain = plan(load_recipe(path, ["training.deepspeed=null"]), cluster, config_path=config).memory
    assert zero2["DeepSpeed gradient buckets"] == 2 * int(5e8) * 2
    assert zero3["DeepSpeed gradient buckets"] == int(5e8) * 2
    assert "DeepSpeed gradient buckets" not in plain


def test_on_a_cpu_only_the_bucket_pages_a_step_writes_count(tmp_path):
    recipe = load_recipe(measured_recipe(tmp_path), ["training.deepspeed=recipes/deepspeed/zero2.json"])
    memory = plan(recipe, Cluster(gpus=1)).memory
    trainable = memory["draft weights (trainable)"] // 4  # fp32 on a CPU without mixed precision
    assert memory["DeepSpeed gradient buckets"] == 2 * trainable * 4  # two overlap buffers, fp32, draft-sized


def test_a_run_that_cannot_fit_is_refused_with_the_plan(tmp_path, monkeypatch):
    recipe = load_recipe(measured_recipe(tmp_path), ["training.batch_size=100000"])
    with pytest.raises(DrafttrainError, match="cannot fit here; the plan:(.|\\n)*activations saved for backward"):
        check_fits(recipe, "train")
    monkeypatch.setenv("DRAFTTRAIN_SKIP_PLAN", "1")
    assert check_fits(recipe, "train") is None


def test_an_offline_cache_larger_than_the_disk_is_refused_before_prepare(tmp_path, monkeypatch, capsys):
    recipe_path = measured_recipe(tmp_path, hidden_states="offline")
    assert main(["plan", str(recipe_path), "--disk", "0.000001"]) == 1
    assert "offline cache" in (out := capsys.readouterr().out) and "DOES NOT FIT" in out
    import drafttrain.training.plan as planning

    monkeypatch.setattr(planning, "_free_disk", lambda recipe: 1000)  # a nearly full disk
    with pytest.raises(DrafttrainError, match="cannot fit here(.|\\n)*offline cache"):
        check_fits(load_recipe(recipe_path), "prepare")
    assert not (tmp_path / "run").exists()  # nothing was written


def test_a_hostfile_naming_an_unknown_host_is_refused_and_a_good_one_sizes_the_cluster(tmp_path, capsys):
    from drafttrain.training.cluster import read_hostfile

    bad = tmp_path / "hostfile"
    bad.write_text("localhost slots=2\nno-such-node.invalid slots=2\n")
    with pytest.raises(DrafttrainError, match="line 2: unknown host 'no-such-node.invalid'"):
        read_hostfile(bad)
    good = tmp_path / "hostfile_ok"
    good.write_text("# two nodes\nlocalhost slots=8\n127.0.0.1 slots=8\n")
    assert read_hostfile(good) == {"localhost": 8, "127.0.0.1": 8}
    out = drafttrain(capsys, "plan", str(REPO / "recipes" / "eagle3_llama3.1_8b.yaml"), "--hostfile", str(good),
                     "--gpu-memory", "80", "--target-config", str(CONFIGS / "meta-llama--Llama-3.1-8B-Instruct.json"))
    assert "2 node(s) x 8 GPU" in out and "verdict: fits" in out


def test_the_two_node_cluster_files_agree():
    launch = yaml.safe_load((REPO / "recipes" / "accelerate" / "gpu_2x8.yaml").read_text())
    hostfile = REPO / launch["deepspeed_config"]["deepspeed_hostfile"]
    slots = [int(line.split("slots=")[1]) for line in hostfile.read_text().splitlines() if line.strip()]
    assert launch["num_machines"] == len(slots) == 2 and launch["num_processes"] == sum(slots) == 16
    assert (REPO / launch["deepspeed_config"]["deepspeed_config_file"]).is_file()


@pytest.mark.parametrize("recipe, overrides", [
    ("smollm2_eagle3_quick.yaml", []),
    ("smollm2_eagle_quick.yaml", []),
    ("smollm2_medusa1.yaml", []),
    ("smollm2_medusa2.yaml", []),
    ("smollm2_distill.yaml", []),
    ("smollm2_distill.yaml", ["draft.on_policy=1.0", "draft.divergence=tvd"]),
    ("smollm2_distill.yaml", ["draft.loss_vocab=draft", "draft.divergence=sft"]),
    ("smollm2_distill.yaml", ["draft.loss_vocab=draft"]),
    ("smollm2_dflash.yaml", []),
    ("smollm2_peagle.yaml", []),
    ("smollm2_pard.yaml", []),
    ("smollm2_dflash.yaml", ["draft.block_attention=causal", "draft.weighting=decay", "draft.sample_from_anchor=true"]),
])
def test_every_kind_is_planned(recipe, overrides, tmp_path):
    """The meta-device step runs for every kind (and on-policy distillation), so train's check never trips."""
    recipe = load_recipe(REPO / "recipes" / recipe, [f"output_dir={tmp_path}", *overrides])
    result = plan(recipe, Cluster())
    assert result.memory["activations saved for backward"] > 0 and result.fits
    assert result.memory["target weights"] == pytest.approx(134.5e6 * 4, rel=0.01)  # SmolLM2 in float32


@pytest.mark.parametrize("flag, value", [("--gpu-memory", "0"), ("--gpu-memory", "-5"), ("--gpu-memory", "nan"),
                                         ("--gpu-memory", "inf"), ("--gpus", "0"), ("--nodes", "-1"),
                                         ("--disk", "0")])
def test_a_plan_is_never_approved_on_inputs_it_ignores(flag, value, capsys):
    """0 was read as "unknown" (verdict: fits), -5 was planned, nan and inf ended in tracebacks: all refused now."""
    from drafttrain.commands import main

    with pytest.raises(SystemExit) as exit_:
        main(["plan", "recipe.yaml", flag, value])
    assert exit_.value.code == 2 and f"argument {flag}: expected" in capsys.readouterr().err


def test_the_meta_run_counts_what_a_step_holds_beside_its_saved_tensors():
    """P-EAGLE's loss holds (T + S) x vocab logits, labels and products alive at once, few of them saved: the plan
    missed 2.4 GB of an 8k-token step while it counted saved tensors alone. The meta run's peak counts every storage
    alive at once, and lets one go when its last holder, Python or autograd, does."""
    mb = 500 * 1000 * 4
    with _MetaScalars() as ops:
        weight = torch.zeros(64, 1000, device="meta", requires_grad=True)
        hidden = torch.zeros(500, 64, device="meta")
        before = ops.start_peak()
        logits = hidden @ weight  # not saved: the matmul keeps its inputs
        labels = torch.zeros(500, 1000, device="meta")
        log_probs = logits.log_softmax(-1)  # saved: log_softmax's backward reads its output
        loss = -(log_probs * labels.softmax(-1)).sum()  # the softmax saved, the product not
        assert ops.peak - before >= 5 * mb
        del logits, labels, log_probs
        assert ops.now - before == pytest.approx(2 * mb, abs=64)  # what autograd saved, and the loss
        loss.backward()


def test_regenerating_long_prompts_is_planned_and_an_uncapped_batch_refused_before_prepare(monkeypatch):
    """The hf backend holds a batch's KV cache: 64 rows of 8k-token prompts need more than this machine kind's
    24 GiB, so prepare refuses before answering anything; regenerate.max_batch_tokens (the long recipe's) fits."""
    import drafttrain.training.plan as planning

    monkeypatch.setattr(planning, "_capacity", lambda recipe, cluster: 24 * GIB)
    long = REPO / "recipes" / "smollm2_eagle3_long.yaml"
    kv_per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 key/value heads of 64, float32
    capped = plan(load_recipe(long), stage="prepare")
    assert capped.memory["KV cache (widest regen batch)"] == 32768 * kv_per_token
    assert check_fits(load_recipe(long), "prepare") is not None
    linear_weights = 30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536) + 49152 * 576  # lm_head's own copy
    assert capped.memory["packed weight copies (regen)"] == linear_weights * 4
    monkeypatch.setenv("DRAFTTRAIN_CPU_LINEAR", "default")  # PyTorch's own kernels pack nothing
    assert "packed weight copies (regen)" not in plan(load_recipe(long), stage="prepare").memory
    monkeypatch.delenv("DRAFTTRAIN_CPU_LINEAR")
    uncapped = load_recipe(long, ["regenerate.max_batch_tokens=null"])
    assert plan(uncapped, stage="prepare").memory["KV cache (widest regen batch)"] == \
        64 * (8192 + 256) * kv_per_token
    with pytest.raises(DrafttrainError, match="cannot fit here(.|\\n)*KV cache \\(widest regen batch\\)"):
        check_fits(uncapped, "prepare")
    served = load_recipe(long, ["regenerate.max_batch_tokens=null", "regenerate.backend=openai",
                                "regenerate.base_url=http://127.0.0.1:8000/v1"])
    assert "KV cache (widest regen batch)" not in plan(served, stage="prepare").memory  # the server's own


def test_a_target_config_of_another_model_is_refused(capsys, tmp_path):
    """`plan` of a Llama recipe with Qwen3-8B's config planned Qwen3's sizes and said "verdict: fits"."""
    from drafttrain.commands import main

    code = main(["plan", str(REPO / "recipes" / "eagle3_llama3.1_8b.yaml"), "--gpu-memory", "80",
                 "--target-config", str(CONFIGS / "Qwen--Qwen3-8B.json")])
    err = capsys.readouterr().err
    assert code == 2 and "describes a qwen3 model, but the recipe's target meta-llama/Llama-3.1-8B-Instruct is a " \
                          "llama model" in err
    # a target whose own config can be read here is compared size for size
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.json").write_text((CONFIGS / "meta-llama--Llama-3.2-1B-Instruct.json").read_text())
    code = main(["plan", str(REPO / "recipes" / "eagle3_llama3.1_8b.yaml"), f"target.model={own}",
                 "--target-config", str(CONFIGS / "meta-llama--Llama-3.1-8B-Instruct.json")])
    assert code == 2 and "is not the recipe's target" in capsys.readouterr().err


def test_a_prepare_only_recipe_plans_its_prepare(capsys):
    """`plan --stage prepare` refused the shipped prepare-only recipe as "nothing to plan"."""
    out = drafttrain(capsys, "plan", str(REPO / "recipes" / "smollm2_prepare_demo.yaml"), "--stage", "prepare")
    assert "target weights" in out and "verdict: fits" in out


def test_a_distilled_drafts_student_is_planned_from_its_shipped_config(capsys, monkeypatch):
    """Offline, the 70B-to-1B recipe's student cannot be fetched: the error names it as the draft model and the
    flag that takes its config; with that config the plan counts the student's weights."""
    import huggingface_hub.constants

    from drafttrain.commands import main

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    recipe = str(REPO / "recipes" / "distill_llama70b_to_1b.yaml")
    target = ["--target-config", str(CONFIGS / "meta-llama--Llama-3.3-70B-Instruct.json"), "--gpu-memory", "80"]
    capsys.readouterr()
    assert main(["plan", recipe, *target]) == 2
    err = capsys.readouterr().err
    assert "could not load draft model (draft.student) 'meta-llama/Llama-3.2-1B-Instruct'" in err
    assert "--model-config NAME=CONFIG.json" in err
    code = main(["plan", recipe, *target, "--model-config",
                 f"meta-llama/Llama-3.2-1B-Instruct={CONFIGS / 'meta-llama--Llama-3.2-1B-Instruct.json'}"])
    out = capsys.readouterr().out
    assert code in (0, 1) and "optimizer" in out and "verdict:" in out  # a plan (one GPU of 80 GiB: it does not fit)


# ------------------------------------------------------------------------------------------ capture servers

LLAMA70B = str(CONFIGS / "meta-llama--Llama-3.3-70B-Instruct.json")
GPT_OSS = str(CONFIGS / "openai--gpt-oss-120b.json")
LLAMA70B_LAYER = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192  # q, o, k, v, MLP, two norms
NODE = Cluster(gpus=8, gpu_memory=80 * GIB, disk_free=4000 * GIB)  # 8 x 80 GB a node


def engine_plan(recipe: str, overrides=(), cluster=NODE, config=None, **throughput):
    path = REPO / "recipes" / recipe
    config = config or (LLAMA70B if "llama70b" in recipe else GPT_OSS)
    return plan(load_recipe(path, list(overrides)), cluster, config_path=config, **throughput)


def test_a_trainer_fed_by_capture_servers_holds_the_targets_head_alone():
    """With capture.engine vllm a training process holds what targets/partial.py loads: the embeddings, final norm
    and lm_head (and the last layer when the draft starts from it), neither the whole target nor a ZeRO-3 shard."""
    head = engine_plan("eagle_llama70b.yaml")
    whole = engine_plan("eagle_llama70b.yaml", ONLINE)  # the same recipe, its target run in every process
    assert head.memory["target weights (head)"] == LLAMA70B_HEAD
    assert whole.memory["target weights"] == LLAMA70B_HEAD + 80 * LLAMA70B_LAYER * 2
    assert whole.total - head.total > 120 * GIB and head.fits and not whole.fits
    started = engine_plan("eagle_llama70b.yaml", ["draft.init_from_target=[layer]"])
    assert started.memory["target weights (head + last layer)"] == LLAMA70B_HEAD + LLAMA70B_LAYER * 2
    zero3 = engine_plan("eagle_llama70b.yaml", ["training.deepspeed=recipes/deepspeed/zero3.json"])
    assert zero3.memory["target weights (head)"] == LLAMA70B_HEAD
    assert not any("ZeRO-3" in part for part in zero3.memory)


def test_a_capture_server_at_tp8_fits_eight_80gb_gpus_or_is_refused():
    """Per GPU of a TP8 server: Llama-3.3-70B's bf16 weights over 8 (16.4 GiB) fit an 80 GB GPU; DeepSeek-V3 as
    published (fp8, 671B parameters) needs 78 GiB of each, more than vLLM may take of 80 GB (0.9 of it), not of an
    H200's 141 GB; a server of more GPUs than a node has is refused."""
    llama = engine_plan("eagle_llama70b.yaml", ["capture.gpu_memory_utilization=0.9"])
    assert llama.capture.memory["target weights (TP8 x PP1)"] == (LLAMA70B_HEAD + 80 * LLAMA70B_LAYER * 2) // 8
    assert llama.capture.budget == int(0.9 * 80 * GIB) and llama.capture.memory_fits and llama.fits
    deepseek = ["target.model=/models/DeepSeek-V3"]
    config = str(REPO / "tests" / "published_configs" / "deepseek_v3.json")
    too_big = engine_plan("eagle3_gpt_oss_120b.yaml", deepseek, config=config)
    assert too_big.capture.memory["target weights (TP8 x PP1)"] > 72 * GIB
    assert not too_big.capture.memory_fits and not too_big.fits and too_big.memory_fits  # the trainers fit
    assert "vLLM may use 72.00 GiB: DOES NOT FIT" in too_big.render()
    h200 = engine_plan("eagle3_gpt_oss_120b.yaml", deepseek, config=config,
                       cluster=Cluster(gpus=8, gpu_memory=141 * GIB, disk_free=4000 * GIB))
    assert h200.capture.memory_fits and h200.fits
    two_nodes = engine_plan("eagle_llama70b.yaml", ["capture.pipeline_parallel_size=2"])
    assert two_nodes.capture.memory_fits and not two_nodes.capture.gpus_fit and not two_nodes.fits
    assert "16 GPU(s) each, a node has 8: DOES NOT FIT" in two_nodes.render()


def test_expert_parallelism_splits_an_moes_experts_over_tensor_and_data_ranks():
    """gpt-oss-120b on 8 data-parallel ranks: without expert parallelism each GPU holds the whole model; with it, a
    GPU holds an eighth of the experts and the rest whole. Experts as published: MXFP4 matrices (4.25 bits a value),
    bf16 biases; everything else in bf16."""
    experts, hidden, width, layers = 128, 2880, 2880, 36
    expert_bytes = layers * experts * ((hidden * 2 * width + width * hidden) * 4.25 / 8 + (2 * width + hidden) * 2)
    attention = 4096 * hidden + 4096 + 2 * (512 * hidden + 512) + hidden * 4096 + hidden + 64  # q, k, v, o, sinks
    dense_layer = attention + 2 * hidden + 128 * hidden + 128  # two norms, the router
    dense_bytes = (layers * dense_layer + 2 * 201088 * hidden + hidden) * 2  # and embeddings, lm_head, final norm
    data_parallel = ["capture.tensor_parallel_size=1", "capture.data_parallel_size=8"]
    split = engine_plan("eagle3_gpt_oss_120b.yaml", data_parallel).capture
    whole = engine_plan("eagle3_gpt_oss_120b.yaml", [*data_parallel, "capture.expert_parallel=false"]).capture
    assert split.memory["target weights (TP1 x PP1, experts over 8)"] == pytest.approx(
        dense_bytes + expert_bytes / 8, abs=1)
    assert whole.memory["target weights (TP1 x PP1)"] == pytest.approx(dense_bytes + expert_bytes, abs=1)
    assert (dense_bytes + expert_bytes) / 2**30 == pytest.approx(60.8, abs=0.1)  # the published checkpoint's size


def test_experts_are_found_by_name_or_type_and_shared_experts_stay_dense():
    from transformers import AutoConfig, AutoModelForCausalLM

    from drafttrain.training.capture_plan import expert_parameter_names

    config = AutoConfig.from_pretrained(REPO / "tests" / "published_configs" / "deepseek_v3.json")
    config.num_hidden_layers = 4  # its first three are dense
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = expert_parameter_names(model)
    assert names == {"model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj"}


def test_a_stream_window_larger_than_its_disk_is_refused(tmp_path, monkeypatch):
    """Each of 8 processes keeps capture.window (8) micro-batches of 1 row of at most 4096 tokens on the capture
    folder's disk: EAGLE-3's 3 taps and the final state of 2880 bf16 values, and the token ids, a token."""
    small = Cluster(gpus=8, gpu_memory=80 * GIB, disk_free=GIB)
    result = engine_plan("eagle3_gpt_oss_120b.yaml", cluster=small)
    assert result.capture.window_bytes == 8 * 8 * 1 * 4096 * (4 * 2880 * 2 + 8)
    assert not result.capture.window_fits and not result.fits and result.clearly_cannot_fit
    assert "stream window: 5.63 GiB of files on the capture folder's disk (8 process(es)), 1.00 GiB free: DOES NOT " \
           "FIT" in result.render()
    import drafttrain.training.plan as planning

    target = tmp_path / "gpt-oss-120b"  # a folder with the target's config: what `train` reads before it loads
    target.mkdir()
    (target / "config.json").write_text(Path(GPT_OSS).read_text())
    recipe = load_recipe(REPO / "recipes" / "eagle3_gpt_oss_120b.yaml",
                         [f"target.model={target}", f"output_dir={tmp_path / 'run'}"])
    seen = []
    monkeypatch.setattr(planning, "_free_disk", lambda recipe, folder=None: seen.append(folder) or 100 * 2**20)
    with pytest.raises(DrafttrainError, match="cannot fit here(.|\\n)*stream window(.|\\n)*DOES NOT FIT"):
        check_fits(recipe, "train")
    assert seen == [Path("/shared/drafttrain/capture/eagle3_gpt_oss_120b")]  # capture.folder's disk
    assert not (tmp_path / "run").exists()


def test_a_stream_whose_servers_cannot_keep_up_is_refused(capsys):
    """8 processes consuming 4,000 tokens/s each need 32,000; one server delivering 20,000 leaves them waiting."""
    slow = engine_plan("eagle3_gpt_oss_120b.yaml", capture_throughput=20000, train_throughput=4000)
    assert slow.capture.needed == 32000 and slow.capture.delivered == 20000
    assert not slow.capture.keeps_up and not slow.fits and slow.capture.memory_fits
    assert ("the trainers consume 8 x 4,000 = 32,000 tokens/s, the servers deliver 1 x 20,000 = 20,000 tokens/s: "
            "CANNOT KEEP UP, 12,000 tokens/s short: the trainers would wait 38% of the time; 2 servers would keep "
            "up") in slow.render()
    two = engine_plan("eagle3_gpt_oss_120b.yaml", ["capture.urls=[http://node-1:8200, http://node-2:8200]"],
                      capture_throughput=20000, train_throughput=4000)
    assert two.capture.delivered == 40000 and two.fits
    unknown = engine_plan("eagle3_gpt_oss_120b.yaml").render()
    assert "give --train-throughput and --capture-throughput to check that they keep up" in unknown
    assert "stream/tokens_per_s_consumed" in unknown
    args = ["plan", str(REPO / "recipes" / "eagle3_gpt_oss_120b.yaml"), "--gpus", "8", "--gpu-memory", "80",
            "--disk", "100", "--capture-throughput", "20000", "--train-throughput", "4000", "--target-config", GPT_OSS]
    capsys.readouterr()
    assert main(args) == 1 and "CANNOT KEEP UP" in capsys.readouterr().out
    assert main(["plan", str(REPO / "recipes" / "eagle3_llama3.1_8b.yaml"), "--train-throughput", "4000"]) == 2
    assert "--train-throughput: for a recipe whose capture servers run the target" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["eagle_llama70b.yaml", "eagle3_gpt_oss_120b.yaml"])
def test_the_engine_recipes_pass_the_plan_their_comments_give(recipe, capsys, monkeypatch):
    """The `drafttrain plan` line each engine recipe's comments give (run offline: --target-config, the throughput
    flags) plans it as fitting, its servers and its trainers."""
    monkeypatch.chdir(REPO)  # the line's paths are the repository's
    line = next(line for line in (REPO / "recipes" / recipe).read_text().splitlines() if "drafttrain plan" in line)
    args = line.split("drafttrain plan", 1)[1].split()
    assert "--capture-throughput" in args and "--train-throughput" in args and "--target-config" in args
    out = drafttrain(capsys, "plan", *args)
    assert "capture servers: 1 x vLLM at TP8" in out and "a node has 8: fits" in out and "verdict: fits" in out
    assert "target weights (head)" in out
