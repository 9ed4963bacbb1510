"""Typed run configuration and the command line that fills it: dataclasses and argparse, nothing else.

Flag names are stable (scripts depend on them). Every check of the values is made before any process group, in
train/setup.py's `validate`, which raises one sentence naming the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from trainer3d.errors import ArgumentParser
from trainer3d.models import FAMILIES, MODEL_PRESETS

# torch.distributed.pipelining's schedules by flag name (parallel/pipeline.py maps each to its class)
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # auto: bf16 on CUDA, fp32 on CPU (TrainConfig.resolved_precision)
RECOMPUTE_MODES = ("none", "selective", "full")  # parallel/recompute.py
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # torch.compile backends --compile-backend takes
# --mtp-loss-coef's default where the model has multi-token prediction modules: Megatron-core's
# --mtp-loss-scaling-factor default, and DeepSeek-V3's λ after its first 10T tokens (0.3 before)
MTP_LOSS_COEF = 0.1


@dataclass
class TrainConfig:
    # model
    model: str = "tiny"
    n_layer: int | None = None  # overrides of the preset's sizes
    n_head: int | None = None
    n_embd: int | None = None
    n_positions: int | None = None  # the context; default: the preset's
    n_kv_heads: int | None = None  # Llama family: key/value heads (grouped-query attention)
    ffn_hidden: int | None = None  # Llama family: SwiGLU's width (Mixtral: each expert's)
    n_experts: int | None = None  # mixtures of experts (qwen3, mixtral): experts per MoE layer
    top_k: int | None = None  # ... experts each token is routed to
    moe_ffn_hidden: int | None = None  # Qwen3-MoE: each expert's SwiGLU width
    mtp_layers: int | None = None  # DeepSeek-V3: multi-token prediction modules (D); default: the preset's
    dropout: float = 0.0
    vocab_size: int | None = None  # default: the tokenizer's
    init_from_hf: str | None = None
    # layout
    layout: str = "manual"  # "auto": the planner picks what the flags below leave open (plan/auto.py)
    device_memory_gib: float | None = None  # --layout auto: memory per rank (default: the device's, or host / ranks)
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: each sequence split over cp ranks (parallel/context_parallel.py)
    ep: int = 1  # expert parallelism: a mixture of experts' experts split over ep of the dp×cp ranks
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"  # activation recomputation: none, selective (attention core) or full (every block)
    sequence_parallel: bool = False  # LayerNorm, dropout, residual on sequence shards over tp (Megatron's)
    compile: bool = False  # torch.compile each transformer block (parallel/compile.py)
    compile_backend: str = "inductor"  # torch.compile's backend; aot_eager and eager bisect a compile problem
    fp8: str | None = None  # FP8 matmuls in the block linears: "tensorwise" or "rowwise" (parallel/fp8.py)
    micro_batches: int | None = None  # per optimizer step and dp rank; default pp (2·pp for multi-stage), 1 at pp=1
    # batch
    seq_len: int = 128
    global_batch: int = 8  # sequences per optimizer step, over all dp ranks and micro-batches
    global_batch_tokens: int | None = None  # alternative to --global-batch: tokens per step (GPT-2: 524288)
    document_mask: bool = False  # tokens attend only within their own document of a packed row
    reset_position_ids: bool = False  # positions restart at each document of a packed row
    # optimizer and schedule
    max_steps: int = 300
    lr: float = 1e-3
    min_lr: float | None = None  # default lr / 10
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    adam_eps: float = 1e-8  # AdamW's epsilon (HF Trainer's and TRL's default 1e-8)
    epochs: float | None = None  # passes over the training rows; sets max_steps (train/setup.py)
    # mixtures of experts (parallel/moe_balance.py): balancing losses, loss-free balancing, token dropping
    moe_aux_loss_coef: float = 0.0  # the balance loss's weight, as transformers' router_aux_loss_coef (Qwen3: 0.001)
    # what the balance loss counts over (parallel/moe_balance.py): "sequence" (DeepSeek-V3's: each sequence), "global"
    # (Qwen3's: the global batch's loads), "hf" (transformers': a rank's micro-batch)
    moe_aux_loss: str = "sequence"
    moe_z_loss_coef: float = 0.0  # the router z-loss's weight (ST-MoE: 0.001)
    moe_bias_update_rate: float = 0.0  # DeepSeek-V3's loss-free balancing: the selection bias's step (γ, ~1e-3)
    moe_capacity_factor: float | None = None  # None: dropless; else each expert takes ≤ factor·N·k/E tokens a rank
    # multi-token prediction (DeepSeek-V3): the MTP loss's weight λ (None: MTP_LOSS_COEF where the model has MTP
    # modules; 0: none built, the model trains without them)
    mtp_loss_coef: float | None = None
    objective: str = "lm"  # "dpo": direct preference optimization over --data-format preference pairs (train/dpo.py)
    dpo_beta: float = 0.1  # DPO's β: how far the policy may move from the reference
    dpo_loss: str = "sigmoid"  # DPO's loss: "sigmoid" (the paper's, TRL's default), "robust" or "ipo"
    dpo_label_smoothing: float = 0.0  # sigmoid: the share of pairs assumed mislabelled (cDPO / robust DPO)
    ref_model: str | None = None  # DPO's reference: a Hugging Face directory (default: the initial weights)
    # a step whose loss or gradient norm is not finite: stop the run naming it, or skip its update and go on (fp16's
    # loss scale skips such steps whatever this says: they are how it finds its scale)
    on_nonfinite: str = "stop"
    precision: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    seed: int = 1337
    # data
    data: str | None = None
    data_mixture: str | None = None  # a JSON list of {"source", "weight", ...}: a weighted mixture (data/mixture.py)
    data_config: str | None = None
    data_split: str = "train"
    text_field: str = "text"
    data_format: str = "text"  # "chat": conversations rendered by the tokenizer's chat template (data/chat.py)
    messages_field: str = "messages"  # chat: the column of {role, content} lists
    train_on: str = "assistant"  # chat: the supervised targets, the assistant turns', the "last" one's, or "all"
    train_roles: str | None = None  # chat: the roles whose turns are supervised, comma-separated (default assistant)
    on_bad_row: str = "drop"  # chat: a row with nothing to learn or no derivable mask is dropped (counted) or an error
    chat_template: str | None = None  # chat: a jinja file replacing the tokenizer's template (for training and export)
    chat_template_kwargs: str | None = None  # chat: a JSON object passed to the template (e.g. {"enable_thinking": false})
    eos_token: str | None = None  # the token that ends a reply (default: the template's end of turn; export, sample)
    val_data: str | None = None  # validation from another file, folder or dataset split instead of the tail
    overlong: str = "truncate"  # chat: a conversation longer than a row is truncated or dropped
    pack: bool = True  # chat: conversations packed into rows (attention and positions per conversation)
    tokenizer: str | None = None
    eval_every: int = 100
    eval_batches: int = 4
    val_fraction: float = 0.01  # the corpus's tail held out for validation (at least 128 blocks, at most 10%)
    # downstream (train/downstream.py): HellaSwag at every evaluation, text samples
    eval_hellaswag: str | None = None  # a HellaSwag jsonl (ctx, endings, label), e.g. hellaswag_val.jsonl
    hellaswag_examples: int | None = None  # its first N examples; default all
    sample_every: int = 0  # steps between samples; 0: none
    sample_count: int = 2
    sample_tokens: int = 32
    sample_prompt: str = ""  # after the end-of-text token every sample starts from
    sample_temperature: float = 1.0  # 0: the likeliest token
    sample_top_k: int = 50  # 0: the whole vocabulary
    # output
    out_dir: str = "runs/default"
    # checkpoints (trainer3d/checkpoint/)
    save_every: int = 0  # steps between checkpoints under <out-dir>/checkpoints; 0: none on the way
    final_save: bool = True  # a checkpoint at max_steps, so that sample/export/--resume have something to read
    keep_last: int = 0  # complete checkpoints to keep (older ones pruned after each save); 0: all
    on_save_error: str = "continue"  # a save that fails (e.g. a full disk): keep training, or stop the run
    async_save: bool = False  # write periodic checkpoints in the background while training goes on
    resume: str | None = None  # "latest" (the newest in --out-dir; fresh start if none) or a checkpoint path
    overwrite: bool = False  # --out-dir holds an earlier run: replace it (its metrics.jsonl and checkpoints)
    log_every: int = 25
    straggler_factor: float = 1.2  # a rank slower than this × the median step time ...
    straggler_intervals: int = 3  # ... for this many consecutive logging intervals is named (train/stragglers.py)
    peak_tflops: float | None = None  # per device, for MFU; known GPUs are recognised
    verbose: bool = False
    profile_steps: str | None = None  # "A:B": torch.profiler trace of steps A..B under <out-dir>/profile/
    wandb_project: str | None = None  # W&B is off unless a project (or --wandb-mode) is given
    wandb_run_name: str | None = None
    wandb_mode: str | None = None  # online | offline | disabled; default: WANDB_MODE, else online
    # distributed
    dist_timeout: float = 300.0  # seconds a collective may wait for a peer before the job fails
    # DeepSpeed (owns batch sizes, ZeRO, offload and precision when given): a JSON path, or a dict (tests)
    deepspeed_config: str | dict | None = None
    # flags typed on the command line (parse_args); None for programmatic configs, where a value that differs
    # from its default counts as given. The DeepSpeed JSON may not contradict a given flag (zero/config.py).
    explicit_flags: tuple[str, ...] | None = None
    # --layout auto's pick, runner-up and why (plan/auto.py): set by train/setup.py, recorded in meta.json and W&B
    layout_choice: dict | None = None

    def given(self, name: str) -> bool:
        """Did the user set this flag? From the command line: it was typed. Programmatic configs: it differs from
        its default."""
        if self.explicit_flags is not None:
            return name in self.explicit_flags
        default = {f.name: f.default for f in dataclasses.fields(self)}[name]
        return getattr(self, name) != default

    @property
    def compiled_backend(self) -> str | None:  # the blocks' torch.compile backend; None without --compile
        return self.compile_backend if self.compile else None

    @property
    def uses_documents(self) -> bool:
        """The run needs each token's document (--document-mask or --reset-position-ids)."""
        return self.document_mask or self.reset_position_ids

    def resolved_precision(self, device_type: str) -> str:
        if self.precision == "auto":
            return "bf16" if device_type == "cuda" else "fp32"
        return self.precision

    def model_config(self, vocab_size: int, base=None):
        """The model's config (its family's): the preset (or `base`, the config of weights being loaded, with their own
        vocabulary) with the size flags applied. A size flag the family has no field for is left to
        train/setup.py, which refuses it."""
        if base is not None:
            vocab_size = base.vocab_size
        else:
            base = MODEL_PRESETS[self.model]
        fields = {f.name for f in dataclasses.fields(base)}
        sizes = {k: getattr(self, k) for k in SIZE_FLAGS if getattr(self, k) and k in fields}
        if "mtp_layers" in fields and (self.mtp_layers == 0 or self.mtp_loss_coef == 0):
            sizes["mtp_layers"] = 0  # multi-token prediction off: its modules are not built
        return dataclasses.replace(base, vocab_size=self.vocab_size or vocab_size, dropout=self.dropout, **sizes)


# The flags that size a model: every family has the first four; the rest name fields of some families only.
SIZE_FLAGS = ("n_layer", "n_head", "n_embd", "n_positions", "n_kv_heads", "ffn_hidden", "n_experts", "top_k",
              "moe_ffn_hidden", "mtp_layers")


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = ArgumentParser(
        prog="train_gpt2.py",
        description="Train a GPT-2 or Llama model at any data × tensor × pipeline layout (python, torchrun, deepspeed "
                    "or srun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", default=d.model, choices=list(MODEL_PRESETS),
                   help="a preset of one of the families: " + "; ".join(
                       f"{name}: {', '.join(n for n, c in MODEL_PRESETS.items() if c.family == name)}" for name in FAMILIES))
    m.add_argument("--n-layer", type=int, default=None, help="override the preset's number of blocks")
    m.add_argument("--n-head", type=int, default=None, help="override the preset's attention heads")
    m.add_argument("--n-embd", type=int, default=None, help="override the preset's width")
    m.add_argument("--n-positions", type=int, default=None, help="override the preset's context")
    m.add_argument("--n-kv-heads", type=int, default=None, help="Llama: override the key/value heads (GQA)")
    m.add_argument("--ffn-hidden", type=int, default=None, help="Llama: override SwiGLU's width (Mixtral: each "
                   "expert's)")
    m.add_argument("--n-experts", type=int, default=None, help="Qwen3, Mixtral: override the experts per MoE layer "
                   "(Megatron's --num-experts; on a dense Qwen3 preset it makes every block a mixture)")
    m.add_argument("--top-k", type=int, default=None, help="Qwen3, Mixtral: override the experts a token is routed to "
                   "(Megatron's --moe-router-topk)")
    m.add_argument("--moe-ffn-hidden", type=int, default=None, help="Qwen3: override each expert's SwiGLU width")
    m.add_argument("--mtp-layers", type=int, default=None,
                   help="DeepSeek-V3: override the multi-token prediction modules (D; the paper's and its preset's: "
                        "1; 0: none)")
    m.add_argument("--dropout", type=float, default=d.dropout)
    m.add_argument("--vocab-size", type=int, default=None, help="override the tokenizer's vocabulary size")
    m.add_argument("--init-from-hf", default=None,
                   help="a save_pretrained directory (GPT2LMHeadModel or LlamaForCausalLM; sharded or not): its config "
                   "sets the model, its weights the start; its tokenizer is used unless --tokenizer is given")
    lay = p.add_argument_group("layout (dp is world size / (tp·cp·pp))")
    lay.add_argument(
        "--layout", default=d.layout, choices=("manual", "auto"),
        help="auto: every rank runs the layout planner for this world (tp, pp, cp, ep, schedule, virtual stages, "
        "micro-batches, recomputation; ZeRO with --deepspeed_config auto); flags given explicitly are kept",
    )
    lay.add_argument("--device-memory-gib", type=float, default=None,
                     help="--layout auto: memory per rank (default: the GPU's total; CPU: host memory / ranks per node)")
    lay.add_argument("--tp", type=int, default=d.tp)
    lay.add_argument("--pp", type=int, default=d.pp)
    lay.add_argument(
        "--cp", type=int, default=d.cp,
        help="context parallelism: split each sequence over cp ranks (two chunks each, balanced for the causal mask); "
        "attention all-gathers keys and values over them. For long sequences (--seq-len divisible by 2·cp)",
    )
    lay.add_argument(
        "--ep", type=int, default=d.ep,
        help="expert parallelism (mixture-of-experts models): split the experts over ep ranks carved from the "
        "dp×cp ranks, tokens exchanged by all-to-all; ep must divide dp×cp and the number of experts",
    )
    lay.add_argument("--schedule", default=d.schedule, choices=SCHEDULE_NAMES)
    lay.add_argument("--virtual-stages", type=int, default=d.virtual_stages, help="stages per rank (interleaved)")
    lay.add_argument(
        "--recompute", default=d.recompute, choices=RECOMPUTE_MODES,
        help="activation recomputation: selective recomputes the attention core, full every block",
    )
    lay.add_argument(
        "--sequence-parallel", action="store_true",
        help="Megatron's sequence parallelism (tp > 1): LayerNorm, dropout and the residual stream on sequence "
        "shards, pipeline sends divided by tp",
    )
    lay.add_argument("--compile", action="store_true", help="torch.compile each transformer block: ~15 s of compiling "
                     "per process before the first step; on CPU inductor needs a C++ compiler (bench/compile.md)")
    lay.add_argument("--compile-backend", choices=COMPILE_BACKENDS, default=d.compile_backend,
                     help="torch.compile's backend: inductor; aot_eager or eager (no kernels built) bisect a problem")
    lay.add_argument(
        "--fp8", choices=("tensorwise", "rowwise"), default=None,
        help="FP8 matmuls (torchao's float8 training, dynamic scales) in the attention and MLP linears of every "
        "block but the first and last; needs a GPU of compute capability 8.9+ (docs/fp8.md)",
    )
    lay.add_argument("--micro-batches", type=int, default=None, help="per step and dp rank")
    b = p.add_argument_group("batch")
    b.add_argument("--seq-len", type=int, default=d.seq_len)
    b.add_argument("--global-batch", type=int, default=d.global_batch, help="sequences per optimizer step")
    b.add_argument("--global-batch-tokens", type=int, default=None, help="tokens per step, e.g. 524288")
    b.add_argument(
        "--document-mask", action="store_true",
        help="packed rows hold several documents, each opened by the end-of-text token: attend only within one's own "
        "document (flex_attention on CUDA, SDPA with a mask on CPU)",
    )
    b.add_argument("--reset-position-ids", action="store_true",
                   help="positions restart at each document's first token (Megatron-LM's flag)")
    o = p.add_argument_group("optimization")
    o.add_argument("--max-steps", type=int, default=d.max_steps)
    o.add_argument("--lr", type=float, default=d.lr)
    o.add_argument("--min-lr", type=float, default=None, help="cosine floor (default lr/10)")
    o.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    o.add_argument("--weight-decay", type=float, default=d.weight_decay)
    o.add_argument("--beta1", type=float, default=d.beta1)
    o.add_argument("--beta2", type=float, default=d.beta2)
    o.add_argument("--adam-eps", type=float, default=d.adam_eps, help="AdamW's epsilon")
    o.add_argument("--epochs", type=float, default=None,
                   help="passes over the training rows: sets --max-steps to ceil(epochs × rows / --global-batch)")
    o.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global-norm clip; 0 disables")
    o.add_argument(
        "--on-nonfinite", default=d.on_nonfinite, choices=["stop", "skip"],
        help="a step whose loss or gradient norm is nan/inf is never applied; then stop the run with one sentence "
             "naming it (nothing more is saved) or skip it and train on",
    )
    o.add_argument("--precision", default=d.precision, choices=PRECISIONS)
    moe = p.add_argument_group("mixture of experts (parallel/moe_balance.py)")
    moe.add_argument("--moe-aux-loss-coef", type=float, default=d.moe_aux_loss_coef,
                     help="weight of the load-balancing loss, as transformers' router_aux_loss_coef: coef × the mean "
                          "over MoE layers of E·Σ f·P, k for a balanced router (0: none; Qwen3-MoE used 0.001)")
    moe.add_argument("--moe-aux-loss", default=d.moe_aux_loss, choices=["sequence", "global", "hf"],
                     help="sequence: DeepSeek-V3's per-sequence loss, the same at every layout; global: the loads "
                          "counted over the global batch (Qwen3's, Megatron's global_aux_loss), over the micro-batches "
                          "so far with accumulation; hf: transformers' load_balancing_loss_func over a micro-batch "
                          "(one stage, no tp or cp)")
    moe.add_argument("--moe-z-loss-coef", type=float, default=d.moe_z_loss_coef, help="router z-loss weight (0: none)")
    moe.add_argument("--moe-bias-update-rate", type=float, default=d.moe_bias_update_rate,
                     help="loss-free balancing (DeepSeek-V3): each step a router's selection bias moves by this times "
                          "sign(mean load - load); sigmoid router scores only (DeepSeek-V3); 0: off")
    moe.add_argument("--moe-capacity-factor", type=float, default=None,
                     help="drop a rank's tokens beyond capacity_factor·N·k/E per expert (Megatron-core's drop "
                          "policy: the highest routing weights kept); default: dropless")
    o.add_argument("--mtp-loss-coef", type=float, default=None,
                   help=f"multi-token prediction (DeepSeek-V3): the weight λ of the MTP loss, λ/D·Σ_k L_k added to the "
                        f"loss (Megatron's --mtp-loss-scaling-factor); default {MTP_LOSS_COEF} where the model has MTP "
                        "modules; 0: none are built")
    o.add_argument("--objective", default=d.objective, choices=("lm", "dpo"),
                   help="lm: the next-token loss (pre-training, SFT); dpo: direct preference optimization over "
                        "--data-format preference pairs against the initial weights (docs/post_training.md)")
    o.add_argument("--dpo-beta", type=float, default=d.dpo_beta, help="dpo: β, the weight of the log-ratio margins")
    o.add_argument("--dpo-loss", default=d.dpo_loss, choices=("sigmoid", "robust", "ipo"),
                   help="dpo: the paper's sigmoid loss (TRL's default; with --dpo-label-smoothing: cDPO), robust DPO "
                        "(TRL's robust) or IPO's squared one")
    o.add_argument("--dpo-label-smoothing", type=float, default=d.dpo_label_smoothing,
                   help="dpo, sigmoid and robust: the share ε of pairs taken as mislabelled; 0: off")
    o.add_argument("--ref-model", default=None, metavar="DIR",
                   help="dpo: the reference model, a Hugging Face directory of the policy's architecture (default: "
                        "the initial weights, as TRL's ref_model=None)")
    o.add_argument("--seed", type=int, default=d.seed)
    da = p.add_argument_group("data")
    da.add_argument("--data", default=None,
                    help="file, folder, save_to_disk dir, HF dataset name, or a python -m trainer3d.prepare directory")
    da.add_argument("--data-mixture", default=None, metavar="FILE.json",
                    help='a weighted mixture instead of --data: a JSON list of {"source": ..., "weight": ...} objects '
                         '(optional "format", "text_field", "data_config"); weights are shares of the rows drawn')
    da.add_argument("--data-config", default=None, help="HF dataset config name")
    da.add_argument("--data-split", default=d.data_split)
    da.add_argument("--text-field", default=d.text_field)
    da.add_argument("--tokenizer", default=None, help="HF tokenizer name or path (default: bundled GPT-2 BPE)")
    da.add_argument("--data-format", default=d.data_format, choices=("text", "chat", "sharegpt", "preference"),
                    help="chat: rows of {role, content} messages (or prompt/completion columns; ShareGPT's "
                         "{from, value} rows are recognised), rendered by the chat template, the loss on the assistant "
                         "turns (supervised fine-tuning); sharegpt: chat whose rows are ShareGPT's; preference: "
                         "prompt/chosen/rejected rows for --objective dpo")
    da.add_argument("--messages-field", default=d.messages_field,
                    help="chat: the column holding the messages (ShareGPT: conversations)")
    da.add_argument("--train-on", default=d.train_on, choices=("assistant", "last", "all"),
                    help="chat: the targets in the loss: every turn of --train-roles, only the last one, or all tokens")
    da.add_argument("--train-roles", default=None, metavar="ROLE[,ROLE]",
                    help="chat: the roles whose turns are supervised (default: assistant)")
    da.add_argument("--on-bad-row", default=d.on_bad_row, choices=("drop", "error"),
                    help="chat: a row with no derivable mask, an unknown role or no supervised token left is dropped "
                         "(counted, the first few named) or stops the run")
    da.add_argument("--chat-template", default=None, metavar="FILE",
                    help="chat: a jinja chat template replacing the tokenizer's (TRL's *_training.jinja, ...); the "
                         "export carries it")
    da.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                    help='chat: variables for the template, e.g. \'{"enable_thinking": false}\'')
    da.add_argument("--eos-token", default=None,
                    help="the token that ends a reply, for the export's generation config and sample (default: the "
                         "chat template's end of turn, else the tokenizer's eos)")
    da.add_argument("--overlong", default=d.overlong, choices=("truncate", "drop"),
                    help="chat: a conversation longer than --seq-len + 1 tokens keeps its head, or is left out")
    da.add_argument("--no-pack", dest="pack", action="store_false",
                    help="chat: one conversation per row, padded (default: packed best-fit-decreasing, attention per "
                         "conversation)")
    da.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between validations; 0: only at end")
    da.add_argument("--eval-batches", type=int, default=d.eval_batches)
    da.add_argument("--val-fraction", type=float, default=d.val_fraction,
                    help="the share of each corpus's rows held out for validation, from its end (text: at least 128 "
                         "blocks, at most 10%%); 0: no validation (then --eval-every 0)")
    da.add_argument("--val-data", default=None, metavar="PATH",
                    help="validation rows from this file, folder or dataset (its --data-split) instead of the tail")
    ds_ = p.add_argument_group("downstream: HellaSwag and samples")
    ds_.add_argument(
        "--eval-hellaswag", default=None, metavar="PATH",
        help="HellaSwag jsonl (ctx, endings, label; e.g. hellaswag_val.jsonl): at every evaluation, the share of "
        "examples whose right ending has the lowest mean token loss (hellaswag_acc) and summed loss "
        "(hellaswag_acc_sum); costs a forward pass over one row per ending (4 per example), --global-batch rows a pass",
    )
    ds_.add_argument("--hellaswag-examples", type=int, default=None, metavar="N",
                     help="use the first N examples (default: all; the validation file has 10042)")
    ds_.add_argument(
        "--sample-every", type=int, default=d.sample_every, metavar="N",
        help="print (and log to W&B as a table) text samples every N steps and at the last; 0: off. Each new token "
        "is one forward pass over a global batch, so a round of samples costs about --sample-tokens/3 training steps",
    )
    ds_.add_argument("--sample-count", type=int, default=d.sample_count, help="samples each time")
    ds_.add_argument("--sample-tokens", type=int, default=d.sample_tokens, help="new tokens per sample")
    ds_.add_argument("--sample-prompt", default=d.sample_prompt,
                     help="text the samples continue (after an end-of-text token); default: none")
    ds_.add_argument("--sample-temperature", type=float, default=d.sample_temperature, help="0: the likeliest token")
    ds_.add_argument("--sample-top-k", type=int, default=d.sample_top_k, help="sample among the K likeliest; 0: all")
    out = p.add_argument_group("output")
    out.add_argument("--out-dir", default=d.out_dir)
    out.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps; 0: none on the way")
    out.add_argument("--no-final-save", dest="final_save", action="store_false",
                     help="no checkpoint at the end of the run (by default the last step is saved)")
    out.add_argument("--keep-last", type=int, default=d.keep_last, help="keep the newest K checkpoints; 0: all")
    out.add_argument("--async-save", action="store_true",
                     help="write --save-every checkpoints in the background: a step waits only while the state is "
                          "copied to host memory")
    out.add_argument(
        "--on-save-error", default=d.on_save_error, choices=["continue", "stop"],
        help="a failed save (e.g. a full disk) leaves the previous checkpoint intact; then keep training or stop",
    )
    out.add_argument(
        "--resume", nargs="?", const="latest", default=None, metavar="PATH",
        help="resume: alone, from the newest checkpoint in --out-dir (fresh start if none); or from PATH",
    )
    out.add_argument(
        "--overwrite", action="store_true",
        help="--out-dir holds an earlier run: delete its metrics.jsonl and checkpoints and start over there (without "
             "this flag or --resume such a run is refused, so that nothing of it is lost)",
    )
    out.add_argument("--log-every", type=int, default=d.log_every)
    out.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (and --layout auto)")
    out.add_argument("--straggler-factor", type=float, default=d.straggler_factor,
                     help="name a rank whose step time is above this × the median ...")
    out.add_argument("--straggler-intervals", type=int, default=d.straggler_intervals,
                     help="... for this many consecutive logging intervals (log line, W&B stragglers/rank<R>)")
    out.add_argument("--verbose", action="store_true", help="let every rank print")
    out.add_argument("--profile-steps", default=None, metavar="A:B", help="torch.profiler trace of steps A..B")
    out.add_argument("--wandb-project", default=None, help="log to this W&B project (also WANDB_PROJECT)")
    out.add_argument("--wandb-run-name", default=None)
    out.add_argument(
        "--wandb-mode", default=None, choices=["online", "offline", "disabled"], help="default: WANDB_MODE, else online"
    )
    out.add_argument(
        "--dist-timeout", type=float, default=d.dist_timeout, help="seconds a collective waits for a peer before failing"
    )
    ds = p.add_argument_group("deepspeed")
    ds.add_argument("--deepspeed_config", "--deepspeed-config", "--deepspeed", dest="deepspeed_config", default=None,
                    help="a DeepSpeed JSON; with --layout auto also `auto` (the planner picks ZeRO stage and offload) "
                         "or a JSON whose \"zero_optimization\" is \"auto\"")
    ds.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    ns = vars(build_parser().parse_args(argv))
    ns.pop("local_rank")  # the launcher also sets LOCAL_RANK, which is what we read
    probe = build_parser()  # the same flags with no defaults: what remains was typed
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    ns["explicit_flags"] = tuple(sorted(set(vars(probe.parse_args(argv))) - {"local_rank", "help"}))
    return TrainConfig(**ns)
