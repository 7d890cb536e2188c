"""The ``single_turn`` rollout driver (the default): P stream prompts, G samples each, scored."""

from __future__ import annotations

from posttrain.produce.batch import Batch
from posttrain.produce.drivers.registry import ProduceContext, draw_prompts, register, sample_and_score


@register("single_turn")
def single_turn(ctx: ProduceContext, state: object, step: int, batch: int, cursor: int) -> tuple[Batch, object]:
    """P stream prompts, G samples each, scored. Stateless."""
    P = ctx.settings.rollout.prompts_per_step
    examples = draw_prompts(ctx.task, P, ctx.settings.seed, cursor)
    return sample_and_score(ctx, examples, [""] * P, step, batch, consumed=P), state
