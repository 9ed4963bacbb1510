"""Loss-free balancing's learned selection bias is never silently lost (issue 42): the flag is refused where the
router's scores are softmax (Qwen3-MoE, Mixtral: Megatron-core refuses it there, and their Hugging Face format has no
place for it), and a checkpoint's bias (a model table: CausalLM.state_tables) is what `trainer3d.evaluate` and
`trainer3d.sample` route with, not zeros."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers.distributed import launch_env, run_world
from test_cli import BASE, launched_alone

ROOT = Path(__file__).resolve().parent.parent
BIAS = torch.tensor([0.9, 0.9, 0.0, 0.0, -0.4, 0.0, 0.0, 0.0])  # experts 0 and 1 win every token's selection
PROMPT = "The king"


@pytest.mark.parametrize("model", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_bias_on_softmax_scores_is_refused_before_any_process_group(model, monkeypatch, capsys):
    """Guards: --moe-bias-update-rate on a softmax-scored router is one sentence and exit 2, before any process group
    (a rank launched alone would hang in init_process_group); before, it trained a bias the export then dropped."""
    from trainer3d.train.loop import main

    launched_alone(monkeypatch, 2)
    assert main(BASE + ["--model", model, "--ep", "2", "--moe-bias-update-rate", "1e-3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert ("trainer3d: error: --moe-bias-update-rate trains a selection bias for sigmoid router scores (DeepSeek-V3's "
            "loss-free balancing), and this model's router scores are softmax") in err, err


def test_bias_on_sigmoid_scores_is_kept():
    """Guards: the refusal is about the scores, not the flag: a sigmoid-scored family (DeepSeek-V3) keeps it."""
    from trainer3d.config import TrainConfig
    from trainer3d.models import MODEL_PRESETS
    from trainer3d.train.setup import validate

    if "deepseek-v3-tiny" not in MODEL_PRESETS:
        pytest.skip("the DeepSeek-V3 family is not in this tree")
    setup = validate(TrainConfig(model="deepseek-v3-tiny", moe_bias_update_rate=1e-3, seq_len=32), 1, 300)
    assert setup.cfg.moe_bias_update_rate == 1e-3


def _set_table(step_dir: Path, name: str, value: torch.Tensor) -> None:
    """Write `value` over the saved table `name` in place (its bytes in the safetensors file), and the file's new
    size and sha256 into meta.json, as a run that had learned it would have saved them."""
    from trainer3d.checkpoint.format import sha256_of

    meta = json.loads((step_dir / "meta.json").read_text())
    for file, info in meta["files"].items():
        key = next((t for t in info["tensors"] if t.startswith(f"table/{name}@")), None)
        if key is None:
            continue
        path = step_dir / file
        with open(path, "r+b") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            entry = json.loads(f.read(header_len))[key]
            assert entry["dtype"] == "F32" and entry["shape"] == list(value.shape)
            f.seek(8 + header_len + entry["data_offsets"][0])
            f.write(value.float().numpy().tobytes())
        info.update(bytes=path.stat().st_size, sha256=sha256_of(path))
        (step_dir / "meta.json").write_text(json.dumps(meta, indent=1))
        return
    raise AssertionError(f"{step_dir} saved no table {name}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A 2-step qwen3-moe-tiny run's checkpoint (its bias zeros: the flag is refused on softmax scores), and a copy
    whose saved bias is BIAS."""
    tmp = tmp_path_factory.mktemp("moe_bias")
    cmd = [sys.executable, str(ROOT / "launch" / "train_gpt2.py"), "--model", "qwen3-moe-tiny", "--n-layer", "2",
           "--seq-len", "32", "--global-batch", "4", "--max-steps", "2", "--save-every", "2", "--eval-every", "0",
           "--out-dir", str(tmp / "run")]
    p = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    zero = tmp / "run" / "checkpoints" / "step_000002"
    biased = tmp / "biased"
    shutil.copytree(zero, biased)
    _set_table(biased, "layers.1.mlp.gate.expert_bias", BIAS)
    data = tmp / "held_out.jsonl"
    lines = [f"Line {i}: the king rode to the castle and the queen wrote {i * 7} letters to the north." for i in
             range(24)]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return zero, biased, data


def _reference(step_dir: Path, bias: torch.Tensor):
    """The checkpoint's weights in the plain model, the bias written into its router by hand (not by the code under
    test), and its tokenizer."""
    from trainer3d.checkpoint.format import Checkpoint
    from trainer3d.data import load_tokenizer
    from trainer3d.models import plain_model

    ckpt = Checkpoint(step_dir)
    state = {name: ckpt.model_tensor(name) for name in ckpt.shapes}
    model = plain_model(ckpt.model_config, state, torch.device("cpu"), torch.float32)
    tables = model.state_tables()
    assert list(tables) == ["layers.1.mlp.gate.expert_bias"], list(tables)
    tables["layers.1.mlp.gate.expert_bias"].copy_(bias)
    return model, load_tokenizer(ckpt.meta["config"].get("tokenizer"))


@torch.no_grad()
def _reference_loss(model, data: Path) -> float:
    """The mean cross-entropy over every target of --data's rows, as trainer3d.evaluate defines it."""
    from trainer3d.data import build_rows
    from trainer3d.data.sources import DataConfig

    rows = torch.from_numpy(build_rows(DataConfig(data=str(data), val_fraction=0.0), 32).train.astype("int64"))
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), rows[:, 1:].reshape(-1)).item()


def _evaluate(rank: int, world_size: int, argvs: list) -> list:
    from trainer3d.evaluate import main

    return [main(argv) for argv in argvs]


def test_evaluate_routes_with_the_checkpoints_bias(checkpoints, tmp_path):
    """Guards: trainer3d.evaluate's loss is the reference forward's with the checkpoint's bias, and not the zero
    bias's (before, evaluate never restored the table: it printed the zero bias's loss for the biased checkpoint)."""
    zero, biased, data = checkpoints
    outs = [tmp_path / "zero.json", tmp_path / "biased.json"]
    argvs = [[str(d), "--data", str(data), "--output", str(o)] for d, o in zip((zero, biased), outs)]
    assert run_world(1, _evaluate, argvs, timeout=300) == [[0, 0]]
    got_zero, got_biased = (json.loads(o.read_text())["loss"] for o in outs)
    ref_zero = _reference_loss(_reference(zero, torch.zeros(8))[0], data)
    ref_biased = _reference_loss(_reference(biased, BIAS)[0], data)
    print(f"\nevaluate: zero bias {got_zero:.6f} (reference {ref_zero:.6f}), BIAS {got_biased:.6f} "
          f"(reference {ref_biased:.6f})")
    assert abs(ref_biased - ref_zero) > 1e-3  # the bias changes the loss well beyond the bound below
    assert got_zero == pytest.approx(ref_zero, abs=1e-5)
    assert got_biased == pytest.approx(ref_biased, abs=1e-5)


def test_sample_routes_with_the_checkpoints_bias(checkpoints, capsys):
    """Guards: trainer3d.sample's greedy text is the reference's greedy decoding with the checkpoint's bias, and not
    the zero bias's (before, sample built the model with its bias at zero)."""
    from trainer3d.generate import generate
    from trainer3d.sample import main

    _, biased, _ = checkpoints
    texts = {}
    for name, bias in (("biased", BIAS), ("zero", torch.zeros(8))):
        model, tok = _reference(biased, bias)
        ids = tok.encode(PROMPT)
        with torch.no_grad():
            out = generate(model, torch.tensor([ids]), 12, temperature=0, eos_id=tok.eos_token_id)[0, len(ids):]
        row = out.tolist()
        row = row[: next((k for k, t in enumerate(row) if t == tok.eos_token_id), len(row))]
        texts[name] = tok.decode(ids + row)
    assert texts["biased"] != texts["zero"], texts
    capsys.readouterr()
    assert main([str(biased), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "12",
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out.split("\n", 1)[1].rstrip("\n")
    print(f"\nsample: {printed!r}; reference with BIAS {texts['biased']!r}, with zeros {texts['zero']!r}")
    assert printed == texts["biased"]


def test_export_refuses_a_bias_its_format_cannot_hold(checkpoints, tmp_path, capsys):
    """A learned bias on a softmax router (a Qwen3-MoE checkpoint: its Hugging Face format has no place for it) is
    refused at export with one sentence and exit 2, nothing written (before, it was dropped silently and the exported
    model routed otherwise); the zero bias of an ordinary run exports."""
    from trainer3d.export import main

    zero, biased, _ = checkpoints
    assert main([str(biased), str(tmp_path / "biased")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds a learned layers.1.mlp.gate.expert_bias (a router's selection bias, " \
        "nonzero) that the qwen3 Hugging Face format has no place for" in err, err
    assert not (tmp_path / "biased").exists()
    assert main([str(zero), str(tmp_path / "zero")]) == 0 and (tmp_path / "zero" / "config.json").is_file()
