"""The one uptraining recipe: what `uptrain.demo` and `uptrain.sweep --uptrain-tokens` train with.

Before, the demo trained at peak lr 1e-3 (the bundled model) or 1e-4 (a model of yours) with
alpha_kd 1.0, and the sweep at 3e-4 with alpha_kd 0.9: on one model loss preferred one and KL the
other. Measured (scripts/studies/one_recipe.py, results/one-recipe.md): both from the quality-path
start at 2 K/V heads, 400K tokens, on stories260K-mha8 and the paper-reproduction reference model:

- **peak lr 3e-4**: never the worst on either model, within 6% (stories) and 17% (reference) of the
  best KL; 1e-3 is best on stories but costs the reference model 2.6x its best KL (and makes it worse
  than its start), 1e-4 the reverse (+16% KL on stories). Mean-pooled starts, the sweep's default,
  want more than fitted ones (results/recipe-study.md), which also speaks against 1e-4.
- **alpha_kd 1.0** (pure distillation): lower KL than 0.9 on both models at every lr tried (at 0.9 the
  reference model's loss falls below its source's, by up to 0.019 nats, while its KL rises: it moves
  toward the training text, away from the source); fidelity to the source is what a conversion is for.
- **no warm-up, cosine to 1/10, no weight decay**: warm-up 10 steps + no decay and no warm-up + decay
  0.1 ended equal within 0.0003 nats on stories; the recipe study found warm-up a loss in short runs.

The pre-training peak of your model is the better anchor when you know it: 1/3 of it
(`optim.lr=...`, docs/uptrain.md). configs/demo-cpu.yaml carries the same values (a test keeps them
equal), so `python -m uptrain.train configs/demo-cpu.yaml` trains with this recipe too.
"""

from __future__ import annotations

RECIPE: dict[str, float | int | str] = {
    "optim.lr": 3e-4,
    "optim.warmup_steps": 0,
    "optim.schedule": "cosine",
    "optim.min_lr_ratio": 0.1,
    "optim.weight_decay": 0.0,
    "distill.alpha_kd": 1.0,
    "distill.temperature": 1.0,
}


def recipe_overrides(teacher: str | None = None, alpha_kd: float | None = None) -> list[str]:
    """The recipe as `key=value` overrides of a trainer config (the user's own go after them).
    `teacher`: the source to distil from (None: the recipe's optim keys only); `alpha_kd`: the
    distillation share instead of the recipe's (0: no teacher)."""
    alpha = RECIPE["distill.alpha_kd"] if alpha_kd is None else alpha_kd
    optim = [f"{k}={v}" for k, v in RECIPE.items() if k.startswith("optim.")]
    if teacher is None or alpha <= 0:
        return optim
    return [*optim, f"distill.teacher={teacher}", f"distill.alpha_kd={alpha}",
            f"distill.temperature={RECIPE['distill.temperature']}"]


def describe(alpha_kd: float | None = None) -> str:
    """One line for the plan: which recipe, from where."""
    alpha = RECIPE["distill.alpha_kd"] if alpha_kd is None else alpha_kd
    kd = f"distilled from the source, alpha_kd {alpha:g}" if alpha > 0 else "no teacher"
    warm = "no warm-up" if not RECIPE["optim.warmup_steps"] else f"{RECIPE['optim.warmup_steps']} warm-up steps"
    return (f"recipe: peak lr {RECIPE['optim.lr']:g}, {warm}, cosine to 1/10, {kd} "
            "(uptrain/train/recipe.py; results/one-recipe.md)")
