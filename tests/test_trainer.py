"""The training loop on a tiny random Llama target: learning, resume reproducibility, NaN stops, the frozen-target
check, data order, logging and the CLI's up-front validation."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from trainer_helpers import (  # noqa: F401  (fresh_accelerate: an autouse fixture)
    Interrupted,
    StandInDraft,
    fresh_accelerate,
    make_trainer,
    one_step_on_unequal_rows,
    prepared_run,
    reset_accelerate,
    tiny_dataset,
    tiny_target,
)

from drafttrain import DrafttrainError
from drafttrain.config import WandbConfig, parse_recipe
from drafttrain.training.loader import BatchLayout, ResumableBatchSampler, epoch_permutation, pad_collate
from drafttrain.training.run_log import resolve_wandb_mode, simulated_tau

pytestmark = pytest.mark.usefixtures("fresh_accelerate")




def test_training_learns_and_logs_numbers_only(tmp_path):
    result = make_trainer(tmp_path, max_steps=24, log_every=4, save_every=12).train()
    losses = [result.losses[s] for s in range(1, 25)]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
    assert result.steps == 24 and result.final_loss == losses[-1]
    draft_params = sum(p.numel() for p in StandInDraft(tiny_target()).parameters())
    assert result.trainable_parameters == draft_params

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8, 12, 16, 20, 24]
    for record in records:
        assert {"step", "epoch", "loss", "lr", "grad_norm", "acc_0", "sim_tau", "tokens_per_s",
                "trainable_tokens_per_s"} <= set(record)
        assert all(isinstance(v, (int, float)) for v in record.values()), record  # never tokens or text
        assert 0 < record["trainable_tokens_per_s"] < record["tokens_per_s"]
    assert records[-1]["epoch"] == 2.0  # 48 rows / batch 4 = 12 steps per epoch
    assert records[0]["sim_tau"] == pytest.approx(1 + records[0]["acc_0"])


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path):
    # 16 rows, 2 per micro-batch, 2 micro-batches per step: 4 steps per epoch, so the resumed part crosses an
    # epoch boundary; the stand-in has dropout, so matching losses also needs the RNG state restored.
    setup = dict(dataset=tiny_dataset(16), max_steps=6, save_every=3, batch_size=2, gradient_accumulation=2)
    straight = make_trainer(tmp_path / "straight", **setup).train()

    def stop_at_3(step, checkpoint):
        if step == 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        make_trainer(tmp_path / "resumed", callbacks=[stop_at_3], **setup).train()
    reset_accelerate()
    resumed = make_trainer(tmp_path / "resumed", **setup).train(resume=True)

    assert resumed.resumed_from.name == "step-000003"
    assert sorted(resumed.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.losses[step] == pytest.approx(straight.losses[step], rel=0, abs=1e-6)
    # The final weights agree as well.
    a = StandInDraft.from_pretrained(straight.last_checkpoint, tiny_target())
    b = StandInDraft.from_pretrained(resumed.last_checkpoint, tiny_target())
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.allclose(x, y, atol=1e-6), name


def test_nan_loss_stops_naming_step_batch_and_rows_and_keeps_last_checkpoint(tmp_path):
    order = epoch_permutation(48, seed=0, epoch=0)
    poison = int(order[4 * 4 + 1])  # second row of micro-batch 4 (batch size 4) -> step 5
    trainer = make_trainer(tmp_path, dataset=tiny_dataset(48, poison_row=poison), draft_kwargs={"nan_on_poison": True},
                           max_steps=10, save_every=2, group_by_length=False)  # the plain order placed the poison
    with pytest.raises(DrafttrainError) as err:
        trainer.train()
    message = str(err.value)
    assert "non-finite loss" in message and "step 5," in message and "batch 4 of the epoch" in message
    assert "conv-poison" in message and "step-000004" in message
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-000004"
    assert not (checkpoints / "step-000005").exists() and not (checkpoints / "step-000006").exists()
    reloaded = StandInDraft.from_pretrained(checkpoints / "step-000004", tiny_target())
    assert all(torch.isfinite(p).all() for p in reloaded.parameters())


def test_weights_that_are_not_finite_are_never_saved(tmp_path):
    """The weights can go bad while the loss stays finite: the checkpoint is refused, the good one before it kept."""
    trainer = make_trainer(tmp_path, draft_kwargs={"nan_weights_at_call": 3}, max_steps=4, save_every=2)
    with pytest.raises(DrafttrainError, match="not finite .* after step 4.*not saved.*last good checkpoint is .*step-000002"):
        trainer.train()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert not (tmp_path / "checkpoints" / "step-000004").exists()
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


class RegistersTargetHead(StandInDraft):
    def __init__(self, target, **kwargs):
        super().__init__(target, **kwargs)
        self.lm_head = target.model.lm_head  # registered: its (frozen) weight becomes a draft parameter


def test_the_finite_check_reads_a_zero3_partition_without_its_padding():
    """ZeRO-3 pads a parameter of 5 elements over 2 ranks to partitions of 3; rank 1's last element is padding that
    DeepSpeed never writes (uninitialised, here NaN) and must not be read as a weight."""
    from drafttrain.training.runtime import local_part

    param = torch.nn.Parameter(torch.empty(0))
    param.ds_numel, param.ds_tensor = 5, torch.tensor([4.0, 5.0, float("nan")])
    assert local_part(param, rank=1).tolist() == [4.0, 5.0]
    assert local_part(param, rank=0).numel() == 3 and local_part(param, rank=2).numel() == 0
    plain = torch.ones(4)
    assert local_part(plain) is plain


def test_trainer_refuses_a_draft_that_registers_target_weights(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.drafter = RegistersTargetHead(trainer.target)
    with pytest.raises(DrafttrainError, match="registers target weights.*lm_head"):
        trainer.train()


def test_the_target_stays_frozen_unless_the_kind_declares_what_trains(tmp_path):
    """The one rule: a target parameter trains only when the drafter's kind declares it. One left trainable
    by accident is frozen (bit-identical after training); a declared one trains, and nothing else of the target."""
    trainer = make_trainer(tmp_path / "frozen", max_steps=3)
    norm = trainer.target.model.model.norm.weight
    norm.requires_grad_(True)  # as if some code had thawed it
    before = {n: p.clone() for n, p in trainer.target.model.named_parameters()}
    result = trainer.train()
    assert result.trainable_parameters == sum(p.numel() for p in trainer.drafter.parameters())
    assert all(torch.equal(p, before[n]) for n, p in trainer.target.model.named_parameters())

    reset_accelerate()
    trainer = make_trainer(tmp_path / "declared", max_steps=3)
    trainer.drafter.trainable_target_parameters = lambda: ["model.norm.weight"]
    before = {n: p.clone() for n, p in trainer.target.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.target.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed == ["model.norm.weight"]


def test_declaring_a_target_parameter_the_target_lacks_is_refused(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.drafter.trainable_target_parameters = lambda: ["model.nope.weight"]
    with pytest.raises(DrafttrainError, match="declares target parameters the target lacks: model.nope.weight"):
        trainer.train()


def test_fresh_run_refuses_to_overwrite_checkpoints(tmp_path):
    make_trainer(tmp_path, max_steps=2, save_every=2).train()
    reset_accelerate()
    with pytest.raises(DrafttrainError, match="already holds checkpoints.*--resume"):
        make_trainer(tmp_path, max_steps=4).train()


def test_data_order_is_seeded_resumable_and_split_across_ranks():
    layout = BatchLayout(num_rows=50, batch_size=3, world_size=2, grad_accum=2)
    assert layout.steps_per_epoch == 4 and layout.micro_batches_per_epoch == 8  # 50 // 6 = 8 global batches

    def rank_batches(rank, epoch=0, start=0, seed=7):
        return list(ResumableBatchSampler(layout, seed, epoch, rank, start))

    full = rank_batches(0)
    assert full == rank_batches(0) and full != rank_batches(0, seed=8) and full != rank_batches(0, epoch=1)
    assert rank_batches(0, start=5) == full[5:]  # resuming skips exactly the consumed micro-batches
    rows = [i for rank in (0, 1) for batch in rank_batches(rank) for i in batch]
    assert len(rows) == len(set(rows)) == 48  # ranks see disjoint rows; the uneven tail (2 rows) is dropped


def test_grouped_data_order_keeps_similar_lengths_together_and_stays_seeded_and_resumable():
    layout = BatchLayout(num_rows=203, batch_size=2, world_size=2, grad_accum=2)  # 203 // 4 = 50 global batches
    lengths = [(i * 37) % 500 + 10 for i in range(203)]

    def rank_batches(rank, epoch=0, start=0, seed=7, grouped=lengths):
        return list(ResumableBatchSampler(layout, seed, epoch, rank, start, grouped))

    full = rank_batches(0)
    assert full == rank_batches(0) and full != rank_batches(0, seed=8) and full != rank_batches(0, epoch=1)
    assert rank_batches(0, start=7) == full[7:]
    rows = [i for rank in (0, 1) for batch in rank_batches(rank) for i in batch]
    assert len(rows) == len(set(rows)) == 200

    def padding(rank_lists):  # tokens of padding when every global batch is padded to its longest row
        return sum(max(lengths[i] for i in a + b) * 4 - sum(lengths[i] for i in a + b) for a, b in zip(*rank_lists))

    grouped = padding([rank_batches(0), rank_batches(1)])
    shuffled = padding([rank_batches(0, grouped=None), rank_batches(1, grouped=None)])
    assert grouped < 0.1 * shuffled  # both ranks' shares of a global batch have similar lengths


def test_by_default_micro_batches_of_several_rows_group_rows_of_similar_length(tmp_path):
    """The default since the EAGLE-3 parity runs; one row a micro-batch has nothing to pad and keeps the plain order."""
    dataset = tiny_dataset()
    lengths = [len(ids) for ids in dataset["input_ids"]]
    assert make_trainer(tmp_path / "pairs", dataset, batch_size=2)._row_lengths() == lengths
    assert make_trainer(tmp_path / "single", dataset, batch_size=1)._row_lengths() is None
    assert make_trainer(tmp_path / "off", dataset, batch_size=2, group_by_length=False)._row_lengths() is None


def test_token_reduction_weighs_every_trained_token_of_a_step_alike(tmp_path):
    # One micro-batch of both rows is the token mean over the step; two micro-batches of one row each match it
    # under loss_reduction "token" and not under "micro_batch". The gradient norm before clipping and the weights
    # after the step compare the gradients themselves. (Across processes: tests/test_deepspeed.py.)
    runs = {}
    for name, training in {"one_micro_batch": dict(batch_size=2, gradient_accumulation=1),
                           "token": dict(batch_size=1, gradient_accumulation=2, loss_reduction="token"),
                           "micro_batch": dict(batch_size=1, gradient_accumulation=2, loss_reduction="micro_batch"),
                           }.items():
        reset_accelerate()
        runs[name] = one_step_on_unequal_rows(tmp_path / name, **training)
    reference_norm = runs["one_micro_batch"].grad_norm
    assert runs["token"].grad_norm == pytest.approx(reference_norm, rel=1e-5)
    assert runs["micro_batch"].grad_norm != pytest.approx(reference_norm, rel=1e-2)
    weights = {name: StandInDraft.from_pretrained(tmp_path / name / "checkpoints" / "step-000001", tiny_target())
               .state_dict() for name in ("one_micro_batch", "token")}
    for key, value in weights["one_micro_batch"].items():
        assert torch.allclose(weights["token"][key], value, atol=1e-6), key


def test_pad_collate_pads_right_with_masks():
    batch = pad_collate([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "row_index": 3},
                         {"input_ids": [8], "loss_mask": [1], "row_index": 9}], pad_id=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["row_index"].tolist() == [3, 9]


def test_wandb_mode_auto_is_offline_without_a_key_and_env_can_disable():
    assert resolve_wandb_mode(WandbConfig(), {}) == "offline"
    assert resolve_wandb_mode(WandbConfig(), {"WANDB_API_KEY": "x"}) == "online"
    assert resolve_wandb_mode(WandbConfig(), {"WANDB_MODE": "disabled", "WANDB_API_KEY": "x"}) == "disabled"
    assert resolve_wandb_mode(WandbConfig(enabled=False), {"WANDB_API_KEY": "x"}) == "disabled"
    assert resolve_wandb_mode(WandbConfig(mode="online"), {"WANDB_MODE": "offline"}) == "offline"
    assert simulated_tau([0.5, 0.5]) == pytest.approx(1.75)


def test_cli_validates_the_recipe_before_loading_anything(tmp_path, monkeypatch, capsys):
    import drafttrain.targets

    def must_not_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the recipe was validated")

    monkeypatch.setattr(drafttrain.targets, "load_target", must_not_load)
    from drafttrain.commands import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path}\ndraft: {{kind: eagle3}}\ntraining: {{batch_size: 0}}\n")
    assert main(["train", str(recipe)]) == 2
    assert "training.batch_size" in capsys.readouterr().err
    assert main(["train", str(recipe), "training.batch_size=2", "--max-steps", "0"]) == 2
    assert "training.max_steps" in capsys.readouterr().err
    assert main(["train", str(recipe), "training.batch_size=2"]) == 2
    assert "drafttrain prepare" in capsys.readouterr().err  # valid recipe, but no prepared data yet


def test_cli_trains_a_real_eagle3_head_and_resumes(tmp_path, monkeypatch, capsys):
    """`drafttrain train` end to end with the real EAGLE-3 head; only the target loading is swapped for the
    tiny random Llama (no tokenizer needed: the data is already tokenised)."""
    import drafttrain.targets
    from drafttrain.commands import main
    from drafttrain.drafts import load_drafter

    monkeypatch.setattr(drafttrain.targets, "load_target", lambda cfg: tiny_target())
    prepared_run(tmp_path, tiny_dataset(16))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path}\ndraft: {{kind: eagle3, ttt_steps: 2, layers: [0, 1]}}\n"
                      "training: {batch_size: 4, save_every: 2, log_every: 1}\nwandb: {enabled: false}\n"
                      "eval: {every_checkpoint: false}\n")  # no tokenizer on the tiny target to evaluate with
    assert main(["train", str(recipe), "--max-steps", "3"]) == 0
    assert "trained 3 steps" in capsys.readouterr().out
    draft = load_drafter(tmp_path / "checkpoints" / "step-000003", tiny_target())
    assert draft.kind == "eagle3" and draft.tap_layers == [0, 1]
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"acc_0", "acc_1", "loss_0", "loss_1", "sim_tau"} <= set(record)

    reset_accelerate()
    assert main(["train", str(recipe), "--max-steps", "4", "--resume"]) == 0
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000004"
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_wandb_offline_run_is_written_under_output_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.recipe = trainer.recipe.model_copy(update={"wandb": WandbConfig(enabled=True, mode="auto")})
    trainer.train()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and (tmp_path / "wandb_run_id").read_text().strip() in runs[0].name


def test_a_time_budget_stops_on_time_with_the_schedule_run_over_it(tmp_path):
    """training.time_budget_minutes: the run stops once its training time reaches the budget, saves that step,
    and the cosine schedule has decayed over the budget (whatever the speed), not over max_steps."""
    from drafttrain.training.checkpoint import TrainerState

    budget_s = 1.5
    result = make_trainer(tmp_path, max_steps=100_000, time_budget_minutes=budget_s / 60, save_every=100_000,
                          warmup_steps=0, log_every=1).train()
    state = TrainerState.read(result.last_checkpoint / "trainer_state.json")
    assert result.steps < 100_000 and result.last_checkpoint.name == f"step-{result.steps:06d}"
    step_s = state.train_seconds / result.steps
    assert budget_s <= state.train_seconds < budget_s + 3 * step_s
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lrs[0] > 0.9e-2 and lrs[-1] < 0.02e-2  # from the full rate (1e-2) to ~0 at the budget's end


def test_a_run_that_runs_out_of_steps_before_its_time_budget_still_ends_its_schedule(tmp_path):
    """The P-EAGLE parity run given 737 s ran out of epochs at 636 s with its learning rate at 5% of the peak, the
    cosine set over the budget alone: whichever limit ends the run ends the schedule."""
    make_trainer(tmp_path, max_steps=6, time_budget_minutes=60, save_every=100_000, warmup_steps=0,
                 log_every=1).train()
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lrs) == 6 and lrs == sorted(lrs, reverse=True)
    assert lrs[-1] < 0.1 * lrs[0]  # the cosine over 6 steps, not over an hour (then every step is at the full rate)


def test_under_a_time_budget_the_time_left_is_the_budgets_not_the_step_counts(tmp_path, caplog):
    from drafttrain.progress import PROGRESS_LOGGER

    with caplog.at_level(logging.INFO, logger=PROGRESS_LOGGER):
        make_trainer(tmp_path, max_steps=100_000, time_budget_minutes=1.5 / 60, save_every=100_000,
                     log_every=1).train()
    etas = [float(r.getMessage().rsplit(" eta=", 1)[1].removesuffix("min")) for r in caplog.records
            if r.name == PROGRESS_LOGGER]
    assert len(etas) > 2 and max(etas) <= 1.5 / 60 + 1e-9  # 100,000 steps at the measured rate would be hours


def test_without_a_terminal_training_writes_progress_records_with_the_total_and_time_left(tmp_path, caplog):
    """A log file, CI or nohup gets one line per log step (no bar can be drawn): step of total, loss, tokens/s,
    and an ETA from the rate so far; the quickstart shows them on such a console every 30 s at most."""
    from drafttrain.commands.quickstart import ConsoleLines
    from drafttrain.progress import PROGRESS_LOGGER

    with caplog.at_level(logging.INFO, logger=PROGRESS_LOGGER):
        make_trainer(tmp_path, max_steps=4, log_every=2).train()  # pytest's stderr is not a terminal
    lines = [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER]
    assert [line.split()[0] for line in lines] == ["step=2/4", "step=4/4"]
    assert all(" loss=" in line and " tokens_per_s=" in line and " eta=" in line for line in lines)
    assert lines[-1].endswith("eta=0.0min")

    def record(name: str, level: int, at: float) -> logging.LogRecord:
        made = logging.LogRecord(name, level, __file__, 1, "x", None, None)
        made.created = at
        return made

    every_30s = ConsoleLines(progress_every_s=30.0)
    shown = [every_30s.filter(record(PROGRESS_LOGGER, logging.INFO, t)) for t in (0.0, 10.0, 31.0, 40.0)]
    assert shown == [True, False, True, False]
    assert every_30s.filter(record("drafttrain.training", logging.WARNING, 41.0))
    assert not every_30s.filter(record("transformers", logging.WARNING, 41.0))
    on_a_terminal = ConsoleLines(progress_every_s=None)  # the progress bar shows it there
    assert not on_a_terminal.filter(record(PROGRESS_LOGGER, logging.INFO, 100.0))


def test_training_throughput_far_below_the_runs_own_rate_is_a_warning_once_per_slow_spell(caplog):
    from drafttrain.training.run_log import ThroughputWatch

    watch = ThroughputWatch()
    with caplog.at_level("INFO", logger="drafttrain.training.run_log"):
        for step, rate in enumerate([500.0, 520, 480, 510, 150, 160, 500, 505, 140], 1):
            watch.check({"step": step * 20, "tokens_per_s": rate})
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2  # at step 100 and again at 180, not at 120 (the same spell)
    assert "fell to 150 tokens/s at step 100" in warnings[0] and "30% of this run's earlier 505" in warnings[0]
    assert any("back to 500 tokens/s" in r.getMessage() for r in caplog.records)


def test_every_long_stage_writes_progress_records_where_there_is_no_terminal(caplog, monkeypatch):
    import sys

    from drafttrain.progress import progress_bar

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with caplog.at_level("INFO", logger="drafttrain.progress"):
        for _ in progress_bar(range(5), "regenerate", "conv", every_s=0):
            pass
    lines = [r.getMessage() for r in caplog.records if r.name == "drafttrain.progress"]
    assert lines and lines[-1].startswith("regenerate: 5/5 conv (100%)") and "eta=" in lines[-1]
    assert all("\r" not in line for line in lines)


def test_the_loss_mask_one_position_later_is_a_recipe_setting():
    """training.loss_mask_shift 1 trains a prediction when the token fed in is an answer token (speculators'
    alignment) instead of the token predicted: the kind's loss sees the mask moved one position later, kept inside
    each row, and nothing else changes."""
    from trainer_helpers import tiny_target

    from drafttrain.drafts import build_drafter
    from drafttrain.targets import run_target
    from drafttrain.training.trainer import TrainStep, online_outputs

    target = tiny_target()
    torch.manual_seed(0)
    drafter = build_drafter(parse_recipe({"draft": {"kind": "eagle3", "ttt_steps": 2}}).draft, target).eval()
    ids = torch.randint(0, target.vocab_size, (2, 12))
    mask = torch.zeros(2, 12)
    mask[0, 4:9], mask[1, 6:] = 1, 1
    attention = torch.ones(2, 12, dtype=torch.long)
    attention[1, 11] = 0
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": attention}
    later = torch.zeros(2, 12)
    later[0, 5:10], later[1, 7:11] = 1, 1  # one position later; the padded last position stays out
    with torch.no_grad():
        shifted = TrainStep(drafter, target, online_outputs(target, drafter), mask_shift=1)(batch).loss
        expected = drafter.training_step({**batch, "loss_mask": later}, run_target(target, batch, drafter.needs())).loss
        unshifted = TrainStep(drafter, target, online_outputs(target, drafter))(batch).loss
    assert torch.equal(shifted, expected) and not torch.equal(shifted, unshifted)
    assert parse_recipe({"training": {"loss_mask_shift": 1}}).training.loss_mask_shift == 1
