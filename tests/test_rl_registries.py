"""Tasks and losses by name: the built-in ones are registered, an unknown name fails naming the registered
ones, and a task and a loss defined in one test file each (``rl_example_task.py``, ``rl_example_loss.py``)
are picked from the command line and run by the trainer's code paths with no other file knowing them."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest
import torch

from titan_rl_ext.rl.config import RLConfig
from titan_rl_ext.rl.losses import loss_config, loss_name, loss_names
from titan_rl_ext.rl.tasks import task_named, task_names

BUILTIN_TASKS = ["math", "search", "synthetic_copy", "synthetic_sum", "terminal", "verifiers"]
BUILTIN_LOSSES = ["dapo", "dppo", "grpo"]


@dataclasses.dataclass
class _Job:
    """The ``rl`` section of a trainer config, as torchtitan's parser sees it."""

    rl: RLConfig = dataclasses.field(default_factory=RLConfig)


def _parse(args: list[str]) -> RLConfig:
    import tyro
    from torchtitan.config.manager import custom_registry

    from titan_rl_ext.rl.trainer import RLTrainer  # noqa: F401 -- importing it installs the --rl.loss rule

    return tyro.cli(_Job, args=args, default=_Job(), registry=custom_registry).rl


def test_builtins_are_registered_and_unknown_names_are_named_errors() -> None:
    assert set(BUILTIN_TASKS) <= set(task_names())
    assert set(BUILTIN_LOSSES) <= set(loss_names())
    assert loss_name(RLConfig().loss) == "dapo"  # the default
    with pytest.raises(ValueError, match=r"unknown task 'nope'; registered: math, search, synthetic_copy"):
        task_named("nope")
    with pytest.raises(ValueError, match=r"unknown loss 'nope'; registered: dapo, dppo, grpo"):
        loss_config("nope")
    with pytest.raises(ValueError, match=r"loss 'dapo' has no field 'eps'; its fields: aggregation, eps_high"):
        loss_config("dapo", eps=0.1)
    with pytest.raises(SystemExit):  # tyro reports the registry's message and exits
        _parse(["--rl.loss", "nope"])


def test_trainer_refuses_an_unknown_task_at_start_up() -> None:
    from titan_rl_ext.rl.trainer import RLTrainer

    config = RLTrainer.Config(rl=RLConfig(model_dir="unused", spawn_server=True, task="nope"))
    with pytest.raises(ValueError, match="unknown task 'nope'; registered: "):
        RLTrainer(config)


def test_loss_on_the_command_line_by_name_with_its_settings() -> None:
    rl = _parse(["--rl.loss", "dppo", "delta=0.05", "mismatch.tis=true", "ratio_cap=null", "--rl.task", "math"])
    assert rl.loss == loss_config("dppo", delta=0.05, ratio_cap=None, mismatch={"tis": True}) and rl.task == "math"
    assert _parse(["--rl.loss", "grpo"]).loss == loss_config("grpo")
    assert _parse([]).loss == loss_config("dapo")


def test_a_task_and_a_loss_in_one_file_each_are_picked_by_name() -> None:
    import rl_example_loss
    import rl_example_task
    from test_rl_rollout import CharTokenizer, ScriptedGenerator

    from titan_rl_ext.rl.advantages import broadcast_to_tokens, group_advantages
    from titan_rl_ext.rl.rollout import SamplingConfig, rollout_group
    from titan_rl_ext.rl.samples import pack_samples

    assert rl_example_task.NAME in task_names() and rl_example_loss.NAME in loss_names()
    rl = _parse(["--rl.task", rl_example_task.NAME, "--rl.loss", rl_example_loss.NAME, "scale=2", "--rl.seed", "1"])
    assert isinstance(rl.loss, rl_example_loss.ReinforceLoss.Config) and rl.loss.scale == 2

    # what the rollout service and the trainer do with the names: the stream, the episodes, the loss
    tok = CharTokenizer()
    task = task_named(rl.task)
    stream = list(itertools.islice(task.prompts(rl, tok, 0, None), 12))
    assert sorted(x.answer for x in stream[:6]) == sorted(w[::-1] for w in rl_example_task.WORDS)
    assert list(itertools.islice(task.prompts(rl, tok, 5, None), 7)) == stream[5:]  # resumable
    make_env, stop = task.env_factory(rl, tok)
    item = stream[0]
    replies = [" " + item.answer, " nope"]
    group = asyncio.run(rollout_group(ScriptedGenerator(replies), make_env, item, 2, SamplingConfig(), group_id=0))
    assert [s.reward for s in group] == [1.0, 0.0] and stop == ()
    assert len(task.eval_items(dataclasses.replace(rl, eval_items=3), tok)) == 3

    packed = pack_samples(group)
    adv_T = broadcast_to_tokens(group_advantages(packed.rewards_N, group_ids_N=packed.group_ids_N),
                                lengths=packed.lengths, mask_T=packed.loss_mask_T)
    lp_new_T = torch.where(packed.loss_mask_T, packed.gen_logprobs_T, 0.0).requires_grad_()
    loss_fn = rl.loss.build()
    loss, _ = loss_fn(lp_new_T, packed.gen_logprobs_T, adv_T, packed.loss_mask_T)
    loss.backward()
    # REINFORCE x scale: each loss token's gradient is -scale * A / (loss tokens); up for the right answer
    n = int(packed.loss_mask_T.sum())
    assert torch.allclose(lp_new_T.grad, -2.0 * adv_T / n)
    assert (lp_new_T.grad[adv_T > 0] < 0).all() and (adv_T > 0).any()
