"""The configuration's tree of sections (trainer3d/config/): every flag a script may type keeps its name and default
(the contract below is the parser of 2026-12-06, before the sections), every field is the same whether built by its
flat name (`TrainConfig(tp=2)`, as trainer3d.engine users write it) or parsed from its flag, one parse records which
flags were typed, and a config never shares a section with another."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest

from trainer3d.config import SECTIONS, TrainConfig, build_parser, parse_args

# Every option of `launch/train_gpt2.py --help` on 2026-12-06 (its first spelling) and its default: what scripts type.
CONTRACT = {
    "--model": "tiny", "--n-layer": None, "--n-head": None, "--n-embd": None, "--n-positions": None,
    "--n-kv-heads": None, "--ffn-hidden": None, "--n-experts": None, "--top-k": None, "--moe-ffn-hidden": None,
    "--mtp-layers": None, "--dropout": 0.0, "--vocab-size": None, "--init-from-hf": None, "--layout": "manual",
    "--device-memory-gib": None, "--tp": 1, "--pp": 1, "--cp": 1, "--ep": 1, "--schedule": "1f1b",
    "--virtual-stages": 1, "--recompute": "none", "--sequence-parallel": False, "--compile": False,
    "--compile-backend": "inductor", "--fp8": None, "--micro-batches": None, "--seq-len": 128, "--global-batch": 8,
    "--global-batch-tokens": None, "--document-mask": False, "--reset-position-ids": False, "--max-steps": 300,
    "--lr": 1e-3, "--min-lr": None, "--warmup-steps": 30, "--weight-decay": 0.1, "--beta1": 0.9, "--beta2": 0.95,
    "--adam-eps": 1e-8, "--epochs": None, "--grad-clip": 1.0, "--on-nonfinite": "stop", "--precision": "auto",
    "--moe-aux-loss-coef": 0.0, "--moe-aux-loss": "sequence", "--moe-z-loss-coef": 0.0,
    "--moe-bias-update-rate": 0.0, "--moe-capacity-factor": None, "--mtp-loss-coef": None, "--objective": "lm",
    "--dpo-beta": 0.1, "--dpo-loss": "sigmoid", "--dpo-label-smoothing": 0.0, "--ref-model": None, "--seed": 1337,
    "--data": None, "--data-mixture": None, "--data-config": None, "--data-split": "train", "--text-field": "text",
    "--tokenizer": None, "--data-format": "text", "--messages-field": "messages", "--train-on": "assistant",
    "--train-roles": None, "--on-bad-row": "drop", "--chat-template": None, "--chat-template-kwargs": None,
    "--eos-token": None, "--overlong": "truncate", "--no-pack": True, "--eval-every": 100, "--eval-batches": 4,
    "--val-fraction": 0.01, "--val-data": None, "--eval-hellaswag": None, "--hellaswag-examples": None,
    "--sample-every": 0, "--sample-count": 2, "--sample-tokens": 32, "--sample-prompt": "",
    "--sample-temperature": 1.0, "--sample-top-k": 50, "--out-dir": "runs/default", "--save-every": 0,
    "--no-final-save": True, "--keep-last": 0, "--async-save": False, "--on-save-error": "continue", "--resume": None,
    "--overwrite": False, "--log-every": 25, "--peak-tflops": None, "--straggler-factor": 1.2,
    "--straggler-intervals": 3, "--verbose": False, "--profile-steps": None, "--wandb-project": None,
    "--wandb-run-name": None, "--wandb-mode": None, "--dist-timeout": 300.0, "--deepspeed_config": None,
}


def _actions() -> dict:
    return {s: a for a in build_parser()._actions for s in a.option_strings}


def test_every_flag_keeps_its_name_and_default():
    actions = _actions()
    fields = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    assert {a.dest for a in actions.values()} - {"help", "local_rank"} == fields  # one flag a field, no other
    assert set(CONTRACT) <= {option for option, a in actions.items() if option == a.option_strings[0]}
    for option, default in CONTRACT.items():
        assert option in actions, option
        assert actions[option].default == default, (option, actions[option].default, default)
    assert {"--deepspeed", "--deepspeed-config", "--local-rank"} <= set(actions)  # the launchers' spellings
    out = subprocess.run([sys.executable, "launch/train_gpt2.py", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and all(option in out.stdout for option in CONTRACT), out.stderr[-2000:]


def _other_value(action):
    """A value of the flag's field other than its default, and the command line that types it."""
    option = action.option_strings[0]
    if action.nargs == 0:  # a switch: store_true or store_false
        return not action.default, [option]
    if action.choices:
        value = next(c for c in action.choices if c != action.default)
    elif action.type is int:
        value = (action.default or 0) + 3
    elif action.type is float:
        value = 0.37
    else:
        value = "x.json"
    return value, [option, str(value)]


@pytest.mark.parametrize("name", sorted(f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)))
def test_a_field_is_the_same_by_flat_name_and_by_flag(name):
    """TrainConfig(**{name: v}) (trainer3d.engine's way) and the command line typing v give the same config; the value
    lands in the field's one section; the parse records that flag, and only it, as typed."""
    action = next(a for a in build_parser()._actions if a.dest == name)
    value, argv = _other_value(action)
    built, parsed = TrainConfig(**{name: value}), parse_args(argv)
    section = next(s for s, cls in SECTIONS.items() if name in {f.name for f in dataclasses.fields(cls)})
    assert getattr(built, name) == value == getattr(getattr(built, section), name)
    assert parsed.explicit_flags == (name,) and built.explicit_flags is None
    assert parsed.flat() == dict(built.flat(), explicit_flags=(name,))
    assert built.given(name) and not TrainConfig().given(name)


def test_configs_share_no_section_and_survive_replace_and_pickle():
    a = TrainConfig(tp=2, lr=1e-4, data="d")
    b = dataclasses.replace(a, tp=4)
    b.seq_len = 64
    assert (a.tp, a.seq_len, b.tp, b.seq_len, b.lr, b.data) == (2, 128, 4, 64, 1e-4, "d")
    assert all(getattr(a, s) is not getattr(b, s) for s in SECTIONS)
    assert TrainConfig(parallel=a.parallel, tp=8).tp == 8 and a.tp == 2  # a flat name over a section passed beside it
    assert pickle.loads(pickle.dumps(b)) == b
    with pytest.raises(TypeError, match="'tpp'"):
        TrainConfig(tpp=2)
    with pytest.raises(AttributeError, match="'tpp'"):
        a.tpp = 2
