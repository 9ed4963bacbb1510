"""The run's configuration, one dataclass a component: each field's default and its one description, which is also
its flag's --help (config/cli.py generates the parser from these). A feature adds its section here, and its field
names are the flags' (`--global-batch` is BatchConfig.global_batch); the field names are unique over all sections, so
TrainConfig also answers each by its flat name (config/train_config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer3d.config.fields import Section, flag
from trainer3d.models import FAMILIES, MODEL_PRESETS

# torch.distributed.pipelining's schedules by flag name (parallel/pipeline.py maps each to its class)
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # auto: bf16 on CUDA, fp32 on CPU (TrainConfig.resolved_precision)
RECOMPUTE_MODES = ("none", "selective", "full")  # parallel/recompute.py
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # torch.compile backends --compile-backend takes
# --mtp-loss-coef's default where the model has multi-token prediction modules: Megatron-core's
# --mtp-loss-scaling-factor default, and DeepSeek-V3's λ after its first 10T tokens (0.3 before)
MTP_LOSS_COEF = 0.1
MODEL_HELP = "a preset of one of the families: " + "; ".join(
    f"{name}: {', '.join(n for n, c in MODEL_PRESETS.items() if c.family == name)}" for name in FAMILIES)


@dataclass
class ArchConfig(Section):
    """The model: a preset of a family, the size flags that override it, or Hugging Face weights."""

    TITLE: ClassVar[str] = 'model'
    model: str = flag("tiny", MODEL_HELP, choices=tuple(MODEL_PRESETS))
    n_layer: int | None = flag(None, "override the preset's number of blocks", low=1)
    n_head: int | None = flag(None, "override the preset's attention heads", low=1)
    n_embd: int | None = flag(None, "override the preset's width", low=1)
    n_positions: int | None = flag(None, "override the preset's context", low=1)
    n_kv_heads: int | None = flag(None, 'Llama: override the key/value heads (GQA)', low=1)
    ffn_hidden: int | None = flag(None, "Llama: override SwiGLU's width (Mixtral: each expert's)", low=1)
    n_experts: int | None = flag(
        None,
        "Qwen3, Mixtral: override the experts per MoE layer (Megatron's --num-experts; on a dense Qwen3 preset it "
        'makes every block a mixture)', low=1)
    top_k: int | None = flag(
        None,
        "Qwen3, Mixtral: override the experts a token is routed to (Megatron's --moe-router-topk)", low=1)
    moe_ffn_hidden: int | None = flag(None, "Qwen3: override each expert's SwiGLU width", low=1)
    mtp_layers: int | None = flag(
        None,
        "DeepSeek-V3: override the multi-token prediction modules (D; the paper's and its preset's: 1; 0: none)", low=0)
    dropout: float = flag(0.0, "the dropout probability of the model's dropout layers; 0: none", low=0.0, high=1.0,
                          high_excluded=True)
    vocab_size: int | None = flag(None, "override the tokenizer's vocabulary size", low=1)
    init_from_hf: str | None = flag(
        None,
        'a save_pretrained directory (GPT2LMHeadModel or LlamaForCausalLM; sharded or not): its config sets the model,'
        ' its weights the start; its tokenizer is used unless --tokenizer is given')


@dataclass
class ParallelConfig(Section):
    """How the model and batch are laid over the ranks (dp is what the world leaves), and how the blocks run."""

    TITLE: ClassVar[str] = 'layout (dp is world size / (tp·cp·pp))'
    layout: str = flag(
        "manual",
        'auto: every rank runs the layout planner for this world (tp, pp, cp, ep, schedule, virtual stages, '
        'micro-batches, recomputation; ZeRO with --deepspeed_config auto); flags given explicitly are kept',
        choices=('manual', 'auto'))
    device_memory_gib: float | None = flag(
        None,
        "--layout auto: memory per rank (default: the GPU's total; CPU: host memory / ranks per node)", positive=True)
    tp: int = flag(1, 'tensor parallelism: Megatron-style column- and row-parallel linears over tp ranks')
    pp: int = flag(1, 'pipeline parallelism: the blocks split into stages over pp ranks')
    cp: int = flag(
        1,
        'context parallelism: split each sequence over cp ranks (two chunks each, balanced for the causal mask); '
        'attention all-gathers keys and values over them. For long sequences (--seq-len divisible by 2·cp)')
    ep: int = flag(
        1,
        'expert parallelism (mixture-of-experts models): split the experts over ep ranks carved from the dp×cp ranks, '
        'tokens exchanged by all-to-all; ep must divide dp×cp and the number of experts')
    schedule: str = flag(
        "1f1b",
        "the pipeline schedule (torch.distributed.pipelining's)",
        choices=SCHEDULE_NAMES)
    virtual_stages: int = flag(1, 'stages per rank (interleaved)', low=1)
    recompute: str = flag(
        "none",
        'activation recomputation: selective recomputes the attention core, full every block',
        choices=RECOMPUTE_MODES)
    sequence_parallel: bool = flag(
        False,
        "Megatron's sequence parallelism (tp > 1): LayerNorm, dropout and the residual stream on sequence shards, "
        'pipeline sends divided by tp')
    compile: bool = flag(
        False,
        'torch.compile each transformer block: ~15 s of compiling per process before the first step; on CPU inductor '
        'needs a C++ compiler (bench/compile.md)')
    compile_backend: str = flag(
        "inductor",
        "torch.compile's backend: inductor; aot_eager or eager (no kernels built) bisect a problem",
        choices=COMPILE_BACKENDS)
    fp8: str | None = flag(
        None,
        "FP8 matmuls (torchao's float8 training, dynamic scales) in the attention and MLP linears of every block but "
        'the first and last; needs a GPU of compute capability 8.9+ (docs/fp8.md)', choices=('tensorwise', 'rowwise'))
    micro_batches: int | None = flag(None, 'per step and dp rank', low=1)


@dataclass
class BatchConfig(Section):
    """What a step trains on: sequences, their length, and the documents a packed row holds."""

    TITLE: ClassVar[str] = 'batch'
    seq_len: int = flag(
        128,
        'tokens per sequence (a row holds seq_len + 1: the inputs, and the targets shifted by one)', low=1)
    global_batch: int = flag(8, 'sequences per optimizer step', low=1)
    global_batch_tokens: int | None = flag(None, 'tokens per step, e.g. 524288', low=1)
    document_mask: bool = flag(
        False,
        "packed rows hold several documents, each opened by the end-of-text token: attend only within one's own "
        'document (flex_attention on CUDA, SDPA with a mask on CPU)')
    reset_position_ids: bool = flag(False, "positions restart at each document's first token (Megatron-LM's flag)")


@dataclass
class OptimConfig(Section):
    """AdamW, its schedule, clipping, precision and the seed."""

    TITLE: ClassVar[str] = 'optimization'
    max_steps: int = flag(300, 'optimizer steps to train to', low=1)
    lr: float = flag(1e-3, "the peak learning rate: a linear warmup to it, then a cosine down to --min-lr",
                     positive=True)
    min_lr: float | None = flag(None, 'cosine floor (default lr/10)', low=0.0)
    warmup_steps: int = flag(30, 'steps of the linear warmup', low=0)
    weight_decay: float = flag(0.1, "AdamW's decoupled weight decay (matrices only)", low=0.0)
    beta1: float = flag(0.9, "AdamW's β1", low=0.0, high=1.0, high_excluded=True)
    beta2: float = flag(0.95, "AdamW's β2", low=0.0, high=1.0, high_excluded=True)
    adam_eps: float = flag(1e-8, "AdamW's epsilon", low=0.0)
    epochs: float | None = flag(
        None,
        'passes over the training rows: sets --max-steps to ceil(epochs × rows / --global-batch)', positive=True)
    grad_clip: float = flag(1.0, 'global-norm clip; 0 disables', low=0.0)
    on_nonfinite: str = flag(
        "stop",
        'a step whose loss or gradient norm is nan/inf is never applied; then stop the run with one sentence naming it'
        ' (nothing more is saved) or skip it and train on', choices=('stop', 'skip'))
    precision: str = flag("auto", 'auto: bf16 on CUDA, fp32 on CPU', choices=PRECISIONS)
    seed: int = flag(1337, 'the seed of the initial weights, the data order and dropout', low=0, high=2**63 - 1)


@dataclass
class MoEConfig(Section):
    """The balancing of a mixture of experts' routing (parallel/moe_balance.py)."""

    TITLE: ClassVar[str] = 'mixture of experts (parallel/moe_balance.py)'
    moe_aux_loss_coef: float = flag(
        0.0,
        "weight of the load-balancing loss, as transformers' router_aux_loss_coef: coef × the mean over MoE layers of "
        'E·Σ f·P, k for a balanced router (0: none; Qwen3-MoE used 0.001)', low=0.0)
    moe_aux_loss: str = flag(
        "sequence",
        "sequence: DeepSeek-V3's per-sequence loss, the same at every layout; global: the loads counted over the "
        "global batch (Qwen3's, Megatron's global_aux_loss), over the micro-batches so far with accumulation; hf: "
        "transformers' load_balancing_loss_func over a micro-batch (one stage, no tp or cp)",
        choices=('sequence', 'global', 'hf'))
    moe_z_loss_coef: float = flag(0.0, 'router z-loss weight (0: none)', low=0.0)
    moe_bias_update_rate: float = flag(
        0.0,
        "loss-free balancing (DeepSeek-V3): each step a router's selection bias moves by this times sign(mean load - "
        'load); sigmoid router scores only (DeepSeek-V3); 0: off', low=0.0)
    moe_capacity_factor: float | None = flag(
        None,
        "drop a rank's tokens beyond capacity_factor·N·k/E per expert (Megatron-core's drop policy: the highest "
        'routing weights kept); default: dropless', positive=True)


@dataclass
class LossConfig(Section):
    """What is optimized: the next-token loss (with DeepSeek-V3's multi-token prediction) or DPO (train/dpo.py)."""

    TITLE: ClassVar[str] = 'objective'
    mtp_loss_coef: float | None = flag(
        None,
        "multi-token prediction (DeepSeek-V3): the weight λ of the MTP loss, λ/D·Σ_k L_k added to the loss "
        f"(Megatron's --mtp-loss-scaling-factor); default {MTP_LOSS_COEF} where the model has MTP modules; 0: none are "
        "built", low=0.0)
    dsa_stage: str = flag(
        "sparse",
        "DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): warmup: dense attention, only the indexers train, towards "
        "the main attention's distribution (everything else frozen); sparse: each query attends to the top-k keys its "
        "indexer selects, everything trains (docs/models.md)", choices=('warmup', 'sparse'))
    dsa_loss_coef: float = flag(
        1.0, "DeepSeek Sparse Attention: the weight of the indexers' KL loss (its mean over queries and indexers)",
        low=0.0)
    objective: str = flag(
        "lm",
        'lm: the next-token loss (pre-training, SFT); dpo: direct preference optimization over --data-format '
        'preference pairs against the initial weights (docs/post_training.md)', choices=('lm', 'dpo'))
    dpo_beta: float = flag(0.1, 'dpo: β, the weight of the log-ratio margins', positive=True)
    dpo_loss: str = flag(
        "sigmoid",
        "dpo: the paper's sigmoid loss (TRL's default; with --dpo-label-smoothing: cDPO), robust, ipo, hinge, "
        "bco_pair, sppo_hard or sft (TRL's names), or a comma-separated mix of them (MPO: sigmoid,bco_pair,sft)")
    dpo_loss_weights: str | None = flag(
        None, "dpo: a weight per --dpo-loss, comma-separated (TRL's loss_weights; default 1 each)", metavar="W,W,...")
    dpo_label_smoothing: float = flag(
        0.0, "dpo, sigmoid and robust: the share ε of pairs taken as mislabelled; 0: off", low=0.0, high=0.5,
        high_excluded=True)
    ref_model: str | None = flag(
        None,
        "dpo: the reference model, a Hugging Face directory of the policy's architecture (default: the initial "
        "weights, as TRL's ref_model=None)", metavar='DIR')
    dpo_padding_free: bool = flag(
        False, "dpo: several pairs a row, each side a document of its own (TRL's padding_free; implies --document-mask "
        "and --reset-position-ids); --global-batch then counts rows of pairs")


@dataclass
class LoRAConfig(Section):
    """Low-rank adapters beside a frozen base (parallel/lora.py), PEFT's LoraConfig by our flags."""

    TITLE: ClassVar[str] = 'LoRA (parallel/lora.py)'
    lora_rank: int = flag(0, "LoRA: the adapters' rank r (PEFT's r); 0: no adapters, every weight trains", low=0)
    lora_alpha: float = flag(16.0, "LoRA: α; the adapters' product is scaled by α/r (PEFT's lora_alpha)",
                             positive=True)
    lora_dropout: float = flag(0.0, "LoRA: dropout on the adapters' input (PEFT's lora_dropout)", low=0.0, high=1.0,
                               high_excluded=True)
    lora_targets: str = flag(
        "all-linear",
        "LoRA: the linears that get adapters: all-linear (every linear of the blocks, as PEFT's; not the output head), "
        "or comma-separated names, Hugging Face's module names (as PEFT's target_modules) or the family's (qkv_proj)",
        metavar='NAMES')
    lora_rslora: bool = flag(False, "LoRA: scale by α/√r (rank-stabilized LoRA, PEFT's use_rslora)")
    lora_from: str | None = flag(
        None, "LoRA: start the adapters from a PEFT adapter directory (adapter_config.json, "
        "adapter_model.safetensors) over --init-from-hf's base; its rank, α and targets are the run's",
        metavar='DIR')


@dataclass
class DatasetConfig(Section):
    """The training data: its source, tokenizer, format, and a chat format's rules (data/)."""

    TITLE: ClassVar[str] = 'data'
    data: str | None = flag(
        None,
        'file, folder, save_to_disk dir, HF dataset name, or a python -m trainer3d.prepare directory')
    data_mixture: str | None = flag(
        None,
        'a weighted mixture instead of --data: a JSON list of {"source": ..., "weight": ...} objects (optional '
        '"format", "text_field", "data_config"); weights are shares of the rows drawn', metavar='FILE.json')
    data_config: str | None = flag(None, 'HF dataset config name')
    data_split: str = flag("train", 'the split of a dataset (HF name or save_to_disk directory)')
    text_field: str = flag("text", 'text data: the column holding the text')
    tokenizer: str | None = flag(None, 'HF tokenizer name or path (default: bundled GPT-2 BPE)')
    trust_remote_code: bool = flag(
        False, "run the code a tokenizer ships (its tokenizer_config.json's auto_map: Kimi K2's, Moonlight's); without "
        "it such a tokenizer is refused with one sentence. The run records it: sample, export and evaluate follow")
    data_format: str = flag(
        "text",
        "chat: rows of {role, content} messages (or prompt/completion columns; ShareGPT's {from, value} rows are "
        'recognised), rendered by the chat template, the loss on the assistant turns (supervised fine-tuning); '
        "sharegpt: chat whose rows are ShareGPT's; preference: prompt/chosen/rejected rows for --objective dpo",
        choices=('text', 'chat', 'sharegpt', 'preference'))
    messages_field: str = flag("messages", 'chat: the column holding the messages (ShareGPT: conversations)')
    train_on: str = flag(
        "assistant",
        'chat: the targets in the loss: every turn of --train-roles, only the last one, or all tokens',
        choices=('assistant', 'last', 'all'))
    train_roles: str | None = flag(
        None,
        'chat: the roles whose turns are supervised (default: assistant)', metavar='ROLE[,ROLE]')
    on_bad_row: str = flag(
        "drop",
        'chat: a row with no derivable mask, an unknown role or no supervised token left is dropped (counted, the '
        'first few named) or stops the run', choices=('drop', 'error'))
    chat_template: str | None = flag(
        None,
        "chat: a jinja chat template replacing the tokenizer's (TRL's *_training.jinja, ...); the export carries it",
        metavar='FILE')
    chat_template_kwargs: str | None = flag(
        None,
        'chat: variables for the template, e.g. \'{"enable_thinking": false}\'', metavar='JSON')
    eos_token: str | None = flag(
        None,
        "the token that ends a reply, for the export's generation config and sample (default: the chat template's end "
        "of turn, else the tokenizer's eos)")
    overlong: str = flag(
        "truncate",
        'chat: a conversation longer than --seq-len + 1 tokens keeps its head, or is left out',
        choices=('truncate', 'drop'))
    truncation_mode: str = flag(
        "keep_start",
        "preference pairs under --overlong truncate: each side keeps its first --seq-len + 1 tokens (TRL's default; a "
        "pair whose prompt fills a row is dropped), its last ones (keep_end), or its prompt loses its head and the "
        "completions stay whole (keep_completions)", choices=('keep_start', 'keep_end', 'keep_completions'))
    pack: bool = flag(
        True,
        'chat: one conversation per row, padded (default: packed best-fit-decreasing, attention per conversation)',
        flags=('--no-pack',), action="store_false")


@dataclass
class EvalConfig(Section):
    """Validation, HellaSwag and text samples during training (train/downstream.py)."""

    TITLE: ClassVar[str] = 'validation, HellaSwag and samples'
    eval_every: int = flag(100, 'steps between validations; 0: only at end', low=0)
    eval_batches: int = flag(4, 'global batches in each validation', low=1)
    val_fraction: float = flag(
        0.01,
        "the share of each corpus's rows held out for validation, from its end (text: at least 128 blocks, at most "
        '10%%); 0: no validation (then --eval-every 0)', low=0.0, high=0.5, high_excluded=True)
    val_data: str | None = flag(
        None,
        'validation rows from this file, folder or dataset (its --data-split) instead of the tail', metavar='PATH')
    eval_hellaswag: str | None = flag(
        None,
        'HellaSwag jsonl (ctx, endings, label; e.g. hellaswag_val.jsonl): at every evaluation, the share of examples '
        'whose right ending has the lowest mean token loss (hellaswag_acc) and summed loss (hellaswag_acc_sum); costs '
        'a forward pass over one row per ending (4 per example), --global-batch rows a pass', metavar='PATH')
    hellaswag_examples: int | None = flag(
        None,
        'use the first N examples (default: all; the validation file has 10042)', metavar='N', low=1)
    sample_every: int = flag(
        0,
        'print (and log to W&B as a table) text samples every N steps and at the last; 0: off. Each new token is one '
        'forward pass over a global batch, so a round of samples costs about --sample-tokens/3 training steps',
        metavar='N', low=0)
    sample_count: int = flag(2, 'samples each time', low=1)
    sample_tokens: int = flag(32, 'new tokens per sample', low=1)
    sample_prompt: str = flag("", 'text the samples continue (after an end-of-text token); default: none')
    sample_temperature: float = flag(1.0, '0: the likeliest token', low=0.0)
    sample_top_k: int = flag(50, 'sample among the K likeliest; 0: all', low=0)


@dataclass
class CheckpointConfig(Section):
    """The run's directory and its checkpoints (checkpoint/)."""

    TITLE: ClassVar[str] = 'output and checkpoints'
    out_dir: str = flag("runs/default", "the run's directory: metrics.jsonl, checkpoints/, the W&B and profiler files")
    save_every: int = flag(0, 'checkpoint every N steps; 0: none on the way', low=0)
    final_save: bool = flag(
        True,
        'no checkpoint at the end of the run (by default the last step is saved)',
        flags=('--no-final-save',), action="store_false")
    keep_last: int = flag(0, 'keep the newest K checkpoints; 0: all', low=0)
    async_save: bool = flag(
        False,
        'write --save-every checkpoints in the background: a step waits only while the state is copied to host memory')
    on_save_error: str = flag(
        "continue",
        'a failed save (e.g. a full disk) leaves the previous checkpoint intact; then keep training or stop',
        choices=('continue', 'stop'))
    resume: str | None = flag(
        None,
        'resume: alone, from the newest checkpoint in --out-dir (fresh start if none); or from PATH',
        metavar='PATH', nargs='?', const='latest')
    overwrite: bool = flag(
        False,
        '--out-dir holds an earlier run: delete its metrics.jsonl and checkpoints and start over there (without this '
        'flag or --resume such a run is refused, so that nothing of it is lost)')


@dataclass
class LoggingConfig(Section):
    """What the run reports: console, stragglers, the profiler, W&B."""

    TITLE: ClassVar[str] = 'logging'
    log_every: int = flag(25, 'steps between console lines (metrics.jsonl gets every step)', low=1)
    peak_tflops: float | None = flag(None, 'device peak for MFU (and --layout auto)', positive=True)
    straggler_factor: float = flag(1.2, 'name a rank whose step time is above this × the median ...', low=1.0)
    straggler_intervals: int = flag(
        3,
        '... for this many consecutive logging intervals (log line, W&B stragglers/rank<R>)', low=1)
    verbose: bool = flag(False, 'let every rank print')
    profile_steps: str | None = flag(None, 'torch.profiler trace of steps A..B', metavar='A:B')
    wandb_project: str | None = flag(None, 'log to this W&B project (also WANDB_PROJECT)')
    wandb_run_name: str | None = flag(None, "the W&B run's name (default: W&B's)")
    wandb_mode: str | None = flag(None, 'default: WANDB_MODE, else online', choices=('online', 'offline', 'disabled'))


@dataclass
class RuntimeConfig(Section):
    """The distributed runtime: collectives' patience and DeepSpeed."""

    TITLE: ClassVar[str] = 'deepspeed and collectives'
    dist_timeout: float = flag(300.0, 'seconds a collective waits for a peer before failing', positive=True)
    deepspeed_config: str | dict | None = flag(
        None,
        'a DeepSpeed JSON; with --layout auto also `auto` (the planner picks ZeRO stage and offload) or a JSON whose '
        '"zero_optimization" is "auto"', flags=('--deepspeed_config', '--deepspeed-config', '--deepspeed'))
