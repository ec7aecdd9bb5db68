"""One uptraining recipe (uptrain/train/recipe.py): the demo, the sweep and configs/demo-cpu.yaml train
with the same optimizer settings and distillation (issue 60: the demo used lr 1e-3 / 1e-4 with alpha_kd
1.0, the sweep 3e-4 with 0.9)."""

from __future__ import annotations

import argparse
from pathlib import Path

from conftest import EXAMPLE_MHA8, REPO, TRAIN_TXT, VALID_TXT
from uptrain.train.config import load_config
from uptrain.train.recipe import RECIPE, describe, recipe_overrides


def _recipe_of(config) -> dict:
    o, d = config.optim, config.distill
    return {"optim.lr": o.lr, "optim.warmup_steps": o.warmup_steps, "optim.schedule": o.schedule,
            "optim.min_lr_ratio": o.min_lr_ratio, "optim.weight_decay": o.weight_decay,
            "distill.alpha_kd": d.alpha_kd, "distill.temperature": d.temperature}


def test_the_demo_the_sweep_and_the_demo_config_train_with_the_one_recipe(tmp_path):
    from uptrain.demo.run import _parser as build_parser
    from uptrain.demo.steps import CONFIG, uptrain_overrides
    from uptrain.sweep import extras

    plain = load_config(REPO / "configs" / "demo-cpu.yaml", [f"distill.teacher={EXAMPLE_MHA8}"])
    assert {k: v for k, v in _recipe_of(plain).items() if k != "distill.alpha_kd"} == {
        k: v for k, v in RECIPE.items() if k != "distill.alpha_kd"}
    for model in ([], ["--model", str(EXAMPLE_MHA8), "--data", str(TRAIN_TXT)]):  # bundled and own model alike
        args = build_parser().parse_args(model)
        demo = load_config(CONFIG, uptrain_overrides(args, EXAMPLE_MHA8, EXAMPLE_MHA8, TRAIN_TXT, VALID_TXT, 1,
                                                     tmp_path / "demo"))
        assert _recipe_of(demo) == RECIPE and demo.distill.teacher == str(EXAMPLE_MHA8)
    sweep_args = argparse.Namespace(uptrain_config=extras.RECIPE, train_data=TRAIN_TXT, calib=None,
                                    data=Path(VALID_TXT), uptrain_tokens=40960, threads=1, uptrain_set=[],
                                    stories=None)
    sweep = load_config(extras.RECIPE, extras.uptrain_overrides(sweep_args, EXAMPLE_MHA8, EXAMPLE_MHA8,
                                                                tmp_path / "sweep"))
    assert _recipe_of(sweep) == RECIPE and sweep.distill.teacher == str(EXAMPLE_MHA8)
    assert "recipe_overrides" in extras.uptrain_settings(sweep_args)  # a changed recipe redoes the uptraining


def test_the_users_own_settings_come_after_the_recipe():
    assert recipe_overrides(None) == [f"{k}={v}" for k, v in RECIPE.items() if k.startswith("optim.")]
    assert "distill.alpha_kd=0.5" in recipe_overrides("SRC", 0.5) and recipe_overrides("SRC", 0.0) == recipe_overrides(None)
    assert "peak lr 0.0003" in describe() and "alpha_kd 1" in describe() and "no teacher" in describe(0)
