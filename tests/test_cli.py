"""Bad input on the command line: one sentence on stderr, exit code 2, no traceback, nothing written, before any
process group exists. Every case runs the real entry point (trainer3d.train.loop.main) in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.distributed import launch_env

BASE = ["--model", "tiny", "--n-layer", "2", "--max-steps", "1", "--eval-every", "0"]


def _cases(tmp):
    a_file = tmp / "a_file"
    a_file.write_text("x")
    bad_json = tmp / "bad.json"
    bad_json.write_text("{not json")
    hellaswag = tmp / "hellaswag.jsonl"
    good_line = json.dumps({"ctx": "A man", "endings": ["runs.", "sits.", "eats.", "sleeps."], "label": 0})
    hellaswag.write_text(good_line + "\n" + good_line + "\n")
    chat = tmp / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    from helpers.chat_data import chat_tokenizer

    chat_tokenizer(tmp / "tok")
    chat_run = ["--data-format", "chat", "--data", str(chat), "--tokenizer", str(tmp / "tok")]
    bad_hellaswag = tmp / "bad_hellaswag.jsonl"
    bad_hellaswag.write_text(good_line + "\n\n" + json.dumps({"ctx": "A man", "endings": ["runs."] * 4, "label": 4}) + "\n")
    return [
        # numbers
        (["--lr", "-0.1"], "--lr must be a positive finite number (got -0.1)."),
        (["--lr", "0"], "--lr must be a positive finite number (got 0.0)."),
        (["--lr", "inf"], "--lr must be a positive finite number (got inf)."),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number (got nan)."),
        (["--grad-clip", "inf"], "--grad-clip must be a finite number (got inf)."),
        (["--objective", "dpo", "--data-format", "preference", "--data", str(a_file), "--dpo-loss", "sigmoid,kto"],
         "--dpo-loss must name one or more of sigmoid, robust, ipo, hinge, bco_pair, sppo_hard, sft, comma-separated, "
         "each once (got 'sigmoid,kto')."),
        (["--objective", "dpo", "--data-format", "preference", "--data", str(a_file), "--dpo-loss", "sigmoid,hinge",
          "--dpo-loss-weights", "0.5"],
         "--dpo-loss-weights must be 2 comma-separated numbers, one per --dpo-loss (sigmoid,hinge); got '0.5'."),
        (["--dropout", "1.5"], "--dropout must be in [0.0, 1.0) (got 1.5)."),
        (["--dropout", "-0.1"], "--dropout must be in [0.0, 1.0) (got -0.1)."),
        (["--beta1", "1.0"], "--beta1 must be in [0.0, 1.0) (got 1.0)."),
        (["--beta2", "-0.5"], "--beta2 must be in [0.0, 1.0) (got -0.5)."),
        (["--warmup-steps", "-1"], "--warmup-steps must be at least 0 (got -1)."),
        (["--grad-clip", "-1"], "--grad-clip must be at least 0.0 (got -1.0)."),
        (["--weight-decay", "-0.1"], "--weight-decay must be at least 0.0 (got -0.1)."),
        (["--eval-every", "-1"], "--eval-every must be at least 0 (got -1)."),
        (["--eval-batches", "0"], "--eval-batches must be at least 1 (got 0)."),
        (["--log-every", "0"], "--log-every must be at least 1 (got 0)."),
        (["--virtual-stages", "0"], "--virtual-stages must be at least 1 (got 0)."),
        (["--micro-batches", "0"], "--micro-batches must be at least 1 (got 0)."),
        (["--max-steps", "0"], "--max-steps must be at least 1 (got 0)."),
        (["--seq-len", "0"], "--seq-len must be at least 1 (got 0)."),
        (["--global-batch", "0"], "--global-batch must be at least 1 (got 0)."),
        (["--global-batch-tokens", "-5"], "--global-batch-tokens must be at least 1 (got -5)."),
        (["--n-layer", "0"], "--n-layer must be at least 1 (got 0)."),
        (["--n-head", "0"], "--n-head must be at least 1 (got 0)."),
        (["--vocab-size", "0"], "--vocab-size must be at least 1 (got 0)."),
        (["--save-every", "-1"], "--save-every must be at least 0 (got -1)."),
        (["--keep-last", "-2"], "--keep-last must be at least 0 (got -2)."),
        (["--seed", "-1"], f"--seed must be in [0, {2**63 - 1}] (got -1)."),
        (["--peak-tflops", "0"], "--peak-tflops must be a positive finite number (got 0.0)."),
        (["--dist-timeout", "0"], "--dist-timeout must be a positive finite number (got 0.0)."),
        (["--sample-every", "-1"], "--sample-every must be at least 0 (got -1)."),
        (["--sample-count", "0"], "--sample-count must be at least 1 (got 0)."),
        (["--sample-tokens", "0"], "--sample-tokens must be at least 1 (got 0)."),
        (["--sample-temperature", "-1"], "--sample-temperature must be at least 0.0 (got -1.0)."),
        (["--sample-top-k", "-1"], "--sample-top-k must be at least 0 (got -1)."),
        (["--hellaswag-examples", "0", "--eval-hellaswag", str(hellaswag)],
         "--hellaswag-examples must be at least 1 (got 0)."),
        # combinations
        (["--lr", "1e-3", "--min-lr", "1e-2"],
         "--min-lr 0.01 is above --lr 0.001; the cosine decays down to it: lower --min-lr."),
        (["--hellaswag-examples", "5"], "--hellaswag-examples needs --eval-hellaswag PATH, the file to take them from."),
        (["--compile-backend", "aot_eager"], "--compile-backend aot_eager is the backend of --compile; add --compile."),
        (["--global-batch", "8", "--global-batch-tokens", "1024"],
         "--global-batch and --global-batch-tokens both set the batch; pass only one of them."),
        (["--schedule", "interleaved-1f1b"],
         "--schedule interleaved-1f1b with --virtual-stages 1 is plain 1F1B with extra bookkeeping; pass "
         "--virtual-stages 2 (or more), or use --schedule 1f1b."),
        (["--virtual-stages", "2"], "--virtual-stages 2 needs a multi-stage schedule; use --schedule interleaved-1f1b."),
        (["--profile-steps", "5:3"], "--profile-steps '5:3' must satisfy 1 <= A <= B <= --max-steps (1), e.g. 3:5."),
        (["--n-head", "3"], "--n-embd 128 must be a multiple of --n-head 3."),
        (["--seq-len", "4096"], "--seq-len 4096 exceeds the model's context of 256 positions; use --seq-len 256 or less."),
        (["--global-batch", "6", "--micro-batches", "4"],
         "The global batch of 6 sequences does not split into dp=1 × 4 micro-batches; make --global-batch a "
         "multiple of 4 or change --micro-batches."),
        # layouts
        (["--tp", "3"], "World size 1 is not divisible by tp×pp = 3×1 = 3; launch a multiple of 3 processes or "
                        "change --tp/--pp."),
        (["--sequence-parallel"], "--sequence-parallel splits the sequence over the tensor-parallel ranks; it needs "
                                  "--tp 2 or more (drop the flag at --tp 1)."),
        (["--n-layer", "1", "--schedule", "zbv"],
         "2 pipeline stages (pp=1 × 2 per rank) exceed the model's 1 layers; lower --pp or --virtual-stages."),
        # --layout auto (plan/auto.py) and the stragglers
        (["--layout", "auto", "--device-memory-gib", "0.001"],
         "--layout auto finds no layout of 1 process for this 6.9M-parameter model at global batch 8 × 128 tokens in "
         "0.001 GiB per rank (8 refused because does not fit in GPU memory, e.g. dp1 tp1 pp1 m8x1 ZeRO-0: 0.2 GiB); "
         "launch more processes, lower --global-batch or --seq-len, or give --device-memory-gib if the memory read is "
         "wrong."),
        (["--layout", "auto", "--device-memory-gib", "4", "--micro-batches", "3"],
         "--layout auto finds no layout of 1 process for this 6.9M-parameter model at global batch 8 × 128 tokens in "
         "4 GiB per rank that keeps --micro-batches 3 (8 layouts fit without them); drop or change those flags."),
        (["--deepspeed_config", "auto"], "--device-memory-gib and --deepspeed_config auto feed the layout planner; add "
                                         "--layout auto or drop them."),
        (["--straggler-factor", "0.5"], "--straggler-factor must be at least 1.0 (got 0.5)."),
        (["--straggler-intervals", "0"], "--straggler-intervals must be at least 1 (got 0)."),
        (["--val-fraction", "0.5"], "--val-fraction must be in [0.0, 0.5) (got 0.5)."),
        (["--val-fraction", "0", "--eval-every", "5"], "--val-fraction 0 holds nothing out to validate on; pass "
         "--eval-every 0 too (or --val-data PATH for validation rows from elsewhere)."),
        (["--epochs", "2"], "--epochs and --max-steps both say how long to train; pass only one of them."),
        (["--adam-eps", "-1"], "--adam-eps must be at least 0.0 (got -1.0)."),
        (["--val-data", str(tmp / "nowhere.jsonl")], f"Data path '{tmp / 'nowhere.jsonl'}' does not exist; pass an "
         "existing .txt/.jsonl/.json/.parquet file, a folder of them, a save_to_disk folder, or a Hugging Face dataset "
         "name."),
        # paths
        (["--out-dir", str(a_file)], f"--out-dir {a_file} is a file; pass a directory (it is created if missing)."),
        (["--out-dir", str(a_file / "run")], f"--out-dir {a_file / 'run'} cannot be written ({a_file} is not writable); "
                                             "pick another path."),
        (["--data", "./no_such_corpus.txt"],
         "Data path './no_such_corpus.txt' does not exist; pass an existing .txt/.jsonl/.json/.parquet file, a folder "
         "of them, a save_to_disk folder, or a Hugging Face dataset name."),
        (["--tokenizer", str(tmp / "no_tokenizer") + "/"],
         f"--tokenizer {tmp / 'no_tokenizer'}/ does not exist; pass an existing path or a Hugging Face name."),
        (["--init-from-hf", str(tmp / "no_hf")], f"--init-from-hf {tmp / 'no_hf'}: {tmp / 'no_hf' / 'config.json'} "
                                                 "does not exist; pass a save_pretrained directory (GPT2LMHeadModel or "
                                                 "LlamaForCausalLM)."),
        (["--resume", str(tmp / "no_ckpt")], f"Checkpoint path {tmp / 'no_ckpt'} does not exist; pass a step_* "
                                             "directory or a run's --out-dir."),
        (["--eval-hellaswag", str(tmp / "no.jsonl")],
         f"HellaSwag file {tmp / 'no.jsonl'} does not exist; pass a jsonl file such as hellaswag_val.jsonl."),
        (["--eval-hellaswag", str(bad_hellaswag)],
         f"HellaSwag file {bad_hellaswag}, line 3 has a 'label' of 4, not an index into its 4 endings; every line must "
         'be a JSON object with "ctx" (text), "endings" (a list of texts) and "label" (the right ending\'s index).'),
        (["--eval-hellaswag", str(hellaswag), "--hellaswag-examples", "3"],
         f"--hellaswag-examples 3 exceeds the 2 examples in {hellaswag}; pass at most 2, or omit it to use them all."),
        # DeepSpeed JSONs
        (["--deepspeed_config", str(tmp / "no.json")],
         f"--deepspeed_config {tmp / 'no.json'} does not exist; pass the path of a DeepSpeed JSON (see ds_configs/)."),
        (["--deepspeed_config", os.path.join(os.path.dirname(os.path.dirname(__file__)), "ds_configs", "zero1.json"),
          "--on-nonfinite", "skip"],
         "--on-nonfinite skip cannot be kept under a DeepSpeed config (each ZeRO optimizer judges overflow from its "
         "own partition); drop it: a non-finite step then stops the run with the last finite step's checkpoints, to "
         "resume from."),
        (["--deepspeed_config", str(bad_json)],
         f"--deepspeed_config {bad_json} is not valid JSON (Expecting property name enclosed in double quotes at line 1); "
         "fix the file."),
        # chat data (supervised fine-tuning)
        (["--train-on", "all"], "--train-on applies to chat data; add --data-format chat or drop it."),
        (["--train-roles", "tool"], "--train-roles applies to chat data; add --data-format chat or drop it."),
        ([*chat_run, "--train-roles", "assistant,robot"], "--train-roles 'assistant,robot' names no role or an unknown "
         "one; give a comma-separated list of system, user, assistant, tool, developer, ipython, function."),
        ([*chat_run, "--chat-template-kwargs", "{enable_thinking: false}"], "--chat-template-kwargs is not JSON "
         "(Expecting property name enclosed in double quotes at character 1); pass an object such as "
         "'{\"enable_thinking\": false}'."),
        ([*chat_run, "--eos-token", "<|eot_id|>"], "--eos-token '<|eot_id|>' is not one token of the tokenizer's "
         "vocabulary; pass a token it holds (its end of turn, e.g. <|im_end|>, <|eot_id|> or <end_of_turn>)."),
        ([*chat_run, "--chat-template-kwargs", "[1]"], "--chat-template-kwargs must be a JSON object of the "
         "template's variables."),
        (["--data-format", "chat", "--data", str(chat), "--chat-template", str(tmp / "none.jinja")],
         f"--chat-template {tmp / 'none.jinja'} does not exist; pass a jinja file."),
        (["--data-format", "chat"], "--data-format chat reads conversations from a jsonl/json/parquet file, a folder, a "
                                    "save_to_disk directory or a Hugging Face dataset; pass one with --data."),
        (["--data-format", "chat", "--data", str(chat)],
         "The tokenizer gpt2 (bundled) has no chat template; pass --chat-template FILE, or --tokenizer (or "
         "--init-from-hf) a directory whose tokenizer_config.json or chat_template.jinja holds one."),
    ]


def test_bad_flags_get_one_sentence_and_exit_2(tmp_path, monkeypatch, capsys):
    from trainer3d.train.loop import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    out_dir = tmp_path / "out"
    cases = _cases(tmp_path)
    assert len(cases) >= 30
    for argv, sentence in cases:
        args = BASE + ["--out-dir", str(out_dir)] + argv
        rc = main(args)
        err = capsys.readouterr().err
        assert rc == 2, (argv, err)
        assert f"trainer3d: error: {sentence}\n" in err, (argv, err)
        assert "Traceback" not in err, (argv, err)
    assert not out_dir.exists()  # refused before anything was written


def _exit_code(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's errors exit from inside parse_args
        return e.code


def test_every_entry_point_says_argparse_errors_in_one_sentence(monkeypatch, capsys):
    """argparse's own errors (an unknown or misspelt flag, a bad number, a missing path) and the planner's refusals, at
    every entry point: the one prefix, one line, exit code 2, no usage block, the flag a respelling meant; and
    nothing from the other ranks of a launch."""
    from trainer3d import evaluate, export, sample
    from trainer3d.data import prepare
    from trainer3d.plan import cli as plan
    from trainer3d.train import loop
    from trainer3d.zero import __main__ as zero

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    cases = [
        (loop.main, ["--globl-batch", "8"], "unrecognized arguments: --globl-batch 8 (did you mean --global-batch?); "
                                            "see train_gpt2.py --help."),
        (loop.main, ["--bogus"], "unrecognized arguments: --bogus; see train_gpt2.py --help."),
        (loop.main, ["--tp", "abc"], "argument --tp: invalid int value: 'abc'; see train_gpt2.py --help."),
        (sample.main, ["ckpt", "--max_new_tokens", "5"], "unrecognized arguments: --max_new_tokens 5 (did you mean "
                                                         "--max-new-tokens?); see python -m trainer3d.sample --help."),
        (export.main, ["ckpt"], "the following arguments are required: out; see python -m trainer3d.export --help."),
        (evaluate.main, [], "the following arguments are required: checkpoint; see python -m trainer3d.evaluate "
                            "--help."),
        (prepare.main, ["src", "out", "--shard_tokens=5"], "unrecognized arguments: --shard_tokens=5 (did you mean "
                                                           "--shard-tokens?); see python -m trainer3d.prepare --help."),
        (plan.main, ["--model", "nope"], "unknown --model 'nope'; choose one of tiny, gpt2, "),
        (plan.main, ["--global-batch-tokens", "1000", "--seq-len", "1024"],
         "--global-batch-tokens 1000 is not a multiple of --seq-len 1024."),
        (zero.main, [], "give --build-ops or --check-config JSON; see python -m trainer3d.zero --help."),
    ]
    for main, argv, sentence in cases:
        rc = _exit_code(main, argv)
        out, err = capsys.readouterr()
        assert rc == 2, (argv, err)
        assert err.startswith(f"trainer3d: error: {sentence}") and err.count("\n") == 1 and out == "", (argv, err)
    monkeypatch.setenv("RANK", "1")
    assert _exit_code(loop.main, ["--tp", "abc"]) == 2
    assert capsys.readouterr() == ("", "")


def launched_alone(monkeypatch, world_size: int) -> None:
    """The environment a launcher gives rank 0 of `world_size`, with no peers anywhere: reaching init_process_group
    would hang, so whatever is refused must be refused before it."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", str(world_size)), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)


def test_launcher_world_size_is_checked_before_any_process_group(monkeypatch, capsys):
    from trainer3d.train.loop import main

    launched_alone(monkeypatch, 4)
    assert main(BASE + ["--tp", "2", "--pp", "3"]) == 2
    assert "World size 4 is not divisible by tp×pp = 2×3 = 6" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1", "\"auto\""])
def test_deepspeed_json_contradiction_refused(tmp_path, capsys, monkeypatch, value):
    """An explicit flag and a contradicting value in the JSON: refused; "auto" takes the flag."""
    from trainer3d.train.loop import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_clipping": json.loads(value), "zero_optimization": {"stage": 1}}))
    from trainer3d.config import parse_args
    from trainer3d.train.setup import validate

    if value == "1":
        assert main(BASE + ["--grad-clip", "0.5", "--deepspeed_config", str(path), "--precision", "fp32"]) == 2
        assert ("sets gradient_clipping=1.0 but --grad-clip is 0.5; drop one of them or make them agree."
                in capsys.readouterr().err)
    else:
        setup = validate(parse_args(BASE + ["--grad-clip", "0.5", "--deepspeed_config", str(path), "--precision", "fp32"]), 1)
        assert setup.cfg.grad_clip == 0.5


def test_evaluate_bad_input_gets_one_sentence_and_exit_2(tmp_path, monkeypatch, capsys):
    """python -m trainer3d.evaluate: a path that is not a checkpoint, a malformed HellaSwag file, an --output that
    cannot be written, a checkpoint whose files are missing: one sentence, exit 2, and no --output file."""
    from trainer3d.evaluate import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    line = json.dumps({"ctx": "A man", "endings": ["runs.", "sits."], "label": 1})
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(line + "\n")
    bad.write_text(line + "\n" + line[:-1] + "\n")
    not_ckpt = tmp_path / "not_a_checkpoint"
    not_ckpt.mkdir()
    ckpt = tmp_path / "step_000001"  # a meta.json that lists no files: refused when the checkpoint is opened
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(json.dumps({
        "format": "trainer3d-checkpoint", "format_version": 1, "step": 1, "layout": {}, "files": {},
        "model": {"vocab_size": 50257, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2},
        "config": {"model": "tiny", "seq_len": 16, "seed": 1},
    }))
    output = tmp_path / "out.json"
    cases = [
        ([str(tmp_path / "nowhere"), "--hellaswag", str(good)],
         f"Checkpoint path {tmp_path / 'nowhere'} does not exist; pass a step_* directory or a run's --out-dir."),
        ([str(not_ckpt), "--hellaswag", str(good)],
         f"{not_ckpt / 'meta.json'} does not exist, so {not_ckpt} is not a complete checkpoint"),
        ([str(ckpt), "--hellaswag", str(bad)], f"HellaSwag file {bad}, line 2 is not valid JSON"),
        ([str(ckpt), "--hellaswag", str(good), "--output", str(tmp_path / "no" / "out.json")],
         f"--output {tmp_path / 'no' / 'out.json'} cannot be written ({tmp_path / 'no'} is not a writable directory)."),
        ([str(ckpt), "--hellaswag", str(good), "--tp", "3"], "World size 1 is not divisible by tp×pp = 3×1 = 3"),
        ([str(ckpt), "--hellaswag", str(good), "--output", str(output)],
         f"{ckpt} holds no tensor 'h.0.attn.c_attn.bias'; the checkpoint is incomplete."),
    ]
    for argv, sentence in cases:
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2, (argv, err)
        assert err.startswith(f"trainer3d: error: {sentence}") and err.count("\n") == 1, (argv, err)
        assert "Traceback" not in err, (argv, err)
    assert not output.exists()


def _fresh_process(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    """trainer3d's main in a new interpreter: what it prints there includes every import's own notices."""
    code = "import sys; from trainer3d.train.loop import main; sys.exit(main(sys.argv[1:]))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", code, *BASE, *argv], env=env, cwd=root, capture_output=True,
                          text=True, timeout=120)


def test_compile_without_a_compiler_gets_one_sentence(tmp_path):
    """--compile on a host where inductor finds no C++ compiler: refused before training. Simulated with $CXX naming a
    program that does not exist (inductor reads $CXX into torch._inductor.config.cpp.cxx when it is imported, hence a
    fresh process), which is what inductor itself would try and fail to run."""
    env = launch_env()
    env.pop("TORCH_INDUCTOR_INSTALL_GXX", None)
    env["CXX"] = str(tmp_path / "no-such-c++")
    out_dir = tmp_path / "out"
    proc = _fresh_process(["--compile", "--out-dir", str(out_dir)], env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        "trainer3d: error: --compile needs a C++ compiler for inductor's CPU kernels and none works "
        f"(tried {env['CXX']}); install g++ (e.g. apt-get install g++) or point CXX at one, or drop --compile.\n"
    ), proc.stderr
    assert not out_dir.exists()


def test_fp8_without_a_gpu_gets_one_sentence_and_nothing_else(tmp_path):
    """--fp8 on this GPU-less host, in a fresh process (launch_env drops the tests' TRAINER3D_ emulation switch): the
    refusal is all of stderr, with none of the notices importing torchao logs (parallel/fp8.QUIET_ON_IMPORT)."""
    from trainer3d.parallel.fp8 import EMULATE_ENV

    env = launch_env()
    assert EMULATE_ENV not in env
    out_dir = tmp_path / "out"
    proc = _fresh_process(["--fp8", "rowwise", "--precision", "bf16", "--out-dir", str(out_dir)], env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("trainer3d: error: --fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability "
                           "8.9+: L40S, H100, H200, B200); this machine has no GPU.\n"), proc.stderr
    assert not out_dir.exists()


def test_sequence_parallel_needs_a_sequence_tp_divides(monkeypatch, capsys):
    from trainer3d.train.loop import main

    launched_alone(monkeypatch, 2)
    assert main(BASE + ["--tp", "2", "--sequence-parallel", "--seq-len", "63"]) == 2
    err = capsys.readouterr().err
    assert "trainer3d: error: --sequence-parallel splits --seq-len 63 over --tp 2 ranks; pick a --seq-len divisible " \
           "by 2.\n" in err, err
    assert "Traceback" not in err


def test_a_used_out_dir_is_kept_unless_resumed_or_overwritten(tmp_path, monkeypatch, capsys):
    """An --out-dir holding an earlier run (its metrics.jsonl, a checkpoint) is refused with one sentence naming
    --resume and --overwrite, and left as it was; --resume there without a checkpoint is refused too (it would
    restart the metrics); --overwrite replaces the earlier run."""
    from trainer3d.train.loop import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "run"
    (out / "checkpoints" / "step_000002").mkdir(parents=True)
    (out / "checkpoints" / "step_000002" / "meta.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')

    def run(*flags: str) -> tuple[int, str]:
        rc = main(BASE + ["--out-dir", str(out), *flags])
        return rc, capsys.readouterr().err

    rc, err = run()
    assert rc == 2 and (f"trainer3d: error: --out-dir {out} holds an earlier run (metrics.jsonl, checkpoints); pass "
                        "--resume to continue it, --overwrite to start over in its place, or another --out-dir.\n"
                        ) in err, err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    rc, err = run("--resume", "--overwrite")
    assert rc == 2 and "--overwrite deletes the run that --resume would continue" in err, err
    (out / "checkpoints" / "step_000002" / "meta.json").unlink()  # metrics only: --resume has nothing to resume
    rc, err = run("--resume")
    assert rc == 2 and f"--resume finds no checkpoint in {out / 'checkpoints'}, but --out-dir holds an earlier" in err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    rc, err = run("--overwrite")
    assert rc == 0, err
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001"]


def _tokenizer_with_code(directory) -> None:
    """A tokenizer that ships its own class (tokenization_custom.py, named by tokenizer_config.json's auto_map), as
    Kimi K2's and Moonlight's do: a byte-level BPE of a few hundred tokens under another class name."""
    from test_llama_hf import bpe_tokenizer

    bpe_tokenizer(directory)
    (directory / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass CustomTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="CustomTokenizer",
                  auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]})
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_a_tokenizer_with_code_runs_only_with_trust_remote_code(tmp_path):
    """A tokenizer that ships code is refused with one sentence naming --trust-remote-code, exit 2 and nothing
    written (before, transformers' own error came through as 'could not load tokenizer'); with the flag the run trains,
    records it, and trainer3d.sample on its checkpoint follows the run's choice without being told."""
    from trainer3d.data.tokenizer import load_tokenizer
    from trainer3d.errors import DataError

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    _tokenizer_with_code(tok_dir)
    with pytest.raises(DataError, match=r"runs code of its own .* pass --trust-remote-code if you trust that code"):
        load_tokenizer(str(tok_dir))
    assert type(load_tokenizer(str(tok_dir), trust_remote_code=True)).__name__ == "CustomTokenizer"
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"the king and queen walked {i} times in gardens"}) + "\n"
                            for i in range(200)))
    cmd = [sys.executable, "launch/train.py", "--tokenizer", str(tok_dir), "--data", str(data), "--seq-len", "32",
           "--global-batch", "4", "--max-steps", "1", "--val-fraction", "0", "--eval-every", "0"]
    refused = subprocess.run(cmd + ["--out-dir", str(tmp_path / "no")], env=launch_env(), capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr[-2000:]
    assert "pass --trust-remote-code" in refused.stderr and not (tmp_path / "no" / "metrics.jsonl").exists()
    trained = subprocess.run(cmd + ["--out-dir", str(tmp_path / "yes"), "--trust-remote-code"], env=launch_env(),
                             capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    sampled = subprocess.run([sys.executable, "-m", "trainer3d.sample", str(tmp_path / "yes"), "--prompt", "the king",
                              "--max-new-tokens", "4"], env=launch_env(), capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0 and sampled.stdout.strip(), sampled.stderr[-2000:]
