"""Config loading: YAML + overrides into dataclasses, typos and bad values are errors naming the key."""

from dataclasses import dataclass, field

import pytest

from megatron_dynamo.config import ConfigError, apply_overrides, build, validate_tree


@dataclass(frozen=True)
class Inner:
    n_min: int = 8
    power: float = 1.0
    name: str | None = None
    on: bool = True

    def validate(self):
        if self.n_min < 1:
            raise ValueError(f"n_min must be >= 1, got {self.n_min}")


@dataclass(frozen=True)
class Outer:
    steps: int = 10
    inner: Inner = field(default_factory=Inner)
    tags: list[str] = field(default_factory=list)


def test_yaml_values_and_overrides_are_converted():
    values = apply_overrides({"steps": 3, "inner": {"power": 2}},
                             ["inner.n_min=12", "inner.on=false", "inner.name=null", "tags=[a, b]"])
    cfg = build(Outer, values)
    assert cfg == Outer(steps=3, inner=Inner(n_min=12, power=2.0, name=None, on=False), tags=["a", "b"])
    assert isinstance(cfg.inner.power, float)


@pytest.mark.parametrize("values,message", [
    ({"stpes": 3}, r"^stpes: no such key \(did you mean steps\?\); the keys at the top: steps, inner, tags$"),
    ({"inner": {"n_mni": 3}}, r"^inner.n_mni: no such key \(did you mean inner.n_min\?\); the keys of inner: "),
    ({"steps": "many"}, r"steps: expected an integer"),
    ({"steps": 2.5}, r"steps: expected an integer"),
    ({"inner": {"on": "maybe"}}, r"inner.on: expected true or false"),
    ({"inner": 5}, r"inner: expected a mapping"),
])
def test_bad_keys_and_values_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        build(Outer, values)


def test_validate_tree_names_the_section():
    cfg = build(Outer, {"inner": {"n_min": 0}})
    with pytest.raises(ConfigError, match=r"^inner.n_min: must be >= 1"):
        validate_tree(cfg)


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["steps"])


def test_every_validation_message_has_one_form():
    """The dotted key, a colon, what is wrong and what would be right, whatever the section's own wording was."""
    from megatron_dynamo.trainer.config import load_run_config

    recipe = "configs/cpu_default.yaml"
    for override, message in [
        ("trainer.steps=-1", "trainer.steps: must be >= 0, got -1"),  # was "trainer: steps must be >= 0, got -1"
        ("optim.lr=0", "optim.lr: must be > 0, got 0.0"),  # was "optim: optim.lr must be > 0, got 0.0"
        ("dynamo.allocation.n_min=30", "dynamo.allocation.n_min: must be <= n_max (12), got 30"),  # a class name
        ("data.prompts_per_step=33", "data.prompts_per_step: must be a multiple of trainer.mini_batch_prompts "
                                     "(32), got 33"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last: must be >= 1, got 0"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_run_config(recipe, [override])
        assert str(info.value) == message
    with pytest.raises(ConfigError) as info:
        load_run_config("configs/nope.yaml")  # was a raw "[Errno 2] No such file or directory: 'configs/nope.yaml'"
    assert str(info.value).startswith("configs/nope.yaml: no such file; the recipes in configs/: cpu_default.yaml, ")


def test_off_and_on_are_strings_as_in_yaml_1_2():
    """YAML 1.1 reads on/off/yes/no as booleans: dynamo.loss.engine_is=off (a choice named "off") became False."""
    from hf_reference import REPO
    from megatron_dynamo.trainer.config import load_run_config

    run = load_run_config(f"{REPO}/configs/cpu_default.yaml", ["dynamo.loss.engine_is=truncate", "dynamo.loss.engine_is=off",
                                        "logging.tensorboard=false", "logging.plot=true"])
    assert run.dynamo.loss.engine_is == "off"
    assert run.logging.tensorboard is False and run.logging.plot is True
